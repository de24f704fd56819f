"""`budgetgate meter dcgm`: scrape NVIDIA DCGM exporters, turn the GPUs each run holds into
cumulative GPU- and node-seconds (budgetgate/platforms/dcgm.py), and publish them as metering
samples, to Kafka (default) or over HTTP to metering-ingest.

One meter must scrape every node a run can use (--url once per exporter, or --discover to find
them through the Kubernetes API), since a sample carries the run's whole total. Samples are
cumulative, so a scrape or a publish that fails loses nothing: the next one carries the total.
An exporter that fails does not stop the others: the runs on the exporters that answered are
published, and a failing exporter's runs keep their last holdings, charged for its node once it
answers again within --max-gap (the rule is dcgm.py's). Every failing exporter is logged with its
URL and reason at each scrape; a scrape in which all fail is skipped.

With --kubernetes (implied by --discover), every pod holding a GPU is looked up through the API
at each scrape (budgetgate/adapters/dcgm_discovery.py): a hashed run label is resolved through
the pod's annotation, a time-sliced GPU's pods (whose labels the exporter does not write) are
named, and a pod that ended is charged up to its end. Should the API fail, the scrape is
skipped: its interval is counted when the API answers again within --max-gap.

The totals are kept across restarts in the state file (--state, by default in
$XDG_STATE_HOME/budgetgate/): a meter restarted without them would count from zero, and
metering-ingest would reject its samples as counter regressions until they passed the old
totals (charging the run nothing meanwhile).
"""

from __future__ import annotations

import asyncio
import json
import os
import tempfile
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import click
import httpx

from budgetgate.platforms.dcgm import (
    DEFAULT_RUN_ID_LABEL,
    DEFAULT_RUN_ID_TEMPLATE,
    EVERY_EXPORTER,
    Claim,
    Holdings,
    Meter,
    ScrapeError,
    Usage,
    claims,
    holdings_of,
    pods_named,
    sample_id,
)

DEFAULT_SELECTOR = "app.kubernetes.io/name=dcgm-exporter"


def default_state(exporter: str) -> Path:
    """Where the meter keeps its state unless told: $XDG_STATE_HOME (else ~/.local/state)/budgetgate/."""
    root = Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state")
    return root / "budgetgate" / f"meter-dcgm-{exporter}.json"


def _mig_slices(values: tuple[str, ...]) -> dict[str, int]:
    table: dict[str, int] = {}
    for value in values:
        model, sep, slices = value.partition("=")
        if not sep or not model.strip() or not slices.strip().isdigit() or int(slices) < 1:
            raise click.BadParameter(f"{value!r} is not MODEL=N (N compute slices, at least 1)", param_hint="--mig-slices")
        table[model.strip()] = int(slices)
    return table


@click.group()
def meter() -> None:
    """Meter GPU usage from node exporters and publish it as samples."""


@meter.command()
@click.option("--url", "urls", multiple=True, help="A DCGM exporter's metrics URL, e.g. http://node:9400/metrics (repeat for every node).")
@click.option("--discover", "discover_namespace", default=None, help="Find the exporters through the Kubernetes API: the namespace of their pods.")
@click.option("--selector", default=DEFAULT_SELECTOR, show_default=True, help="Label selector of the exporter pods (with --discover).")
@click.option("--exporter-port", default=9400, show_default=True, type=click.IntRange(1, 65535), help="Their port when no container port is named 'metrics'.")
@click.option("--discover-every", default=60.0, show_default=True, type=click.FloatRange(min=0.1), help="Seconds between two listings of the exporter pods.")
@click.option("--kubernetes", "use_kubernetes", is_flag=True, help="Look each pod holding a GPU up through the Kubernetes API (implied by --discover).")
@click.option("--kubeconfig", default=None, type=click.Path(exists=True, dir_okay=False), help="A kubeconfig (default: in-cluster, else KUBECONFIG).")
@click.option("--interval", default=15.0, show_default=True, type=click.FloatRange(min=0.01), help="Seconds between scrapes.")
@click.option("--count", type=click.IntRange(1), default=None, help="Stop after this many scrapes (default: run until stopped).")
@click.option("--run-id-label", default=DEFAULT_RUN_ID_LABEL, show_default=True, help="Metric label whose value is the run id, when present.")
@click.option(
    "--run-id-template", default=DEFAULT_RUN_ID_TEMPLATE, show_default=True, help="Run id of a GPU without that label, from {namespace}, {pod} and {container}."
)
@click.option("--labelled-only", is_flag=True, help="Meter only GPUs whose metrics carry the run-id label (skip other pods).")
@click.option("--mig-slices", "mig_slices", multiple=True, help="MODEL=N: a GPU model's MIG compute slices, beside the known ones (repeat).")
@click.option("--exporter", default="dcgm", show_default=True, help="Name of this meter in the samples it sends.")
@click.option(
    "--state",
    "state_file",
    type=click.Path(path_type=Path, dir_okay=False),
    default=None,
    help="File keeping the totals across restarts [default: $XDG_STATE_HOME/budgetgate/meter-dcgm-<exporter>.json].",
)
@click.option("--no-state", is_flag=True, help="Keep no state: a restart counts from zero (its samples are rejected until they pass the old totals).")
@click.option(
    "--max-gap", default=300.0, show_default=True, type=click.FloatRange(min=0), help="Seconds between scrapes beyond which the interval is not counted."
)
@click.option(
    "--via", type=click.Choice(["kafka", "http"]), default="kafka", show_default=True, help="Publish to metering.samples.v1, or POST to metering-ingest."
)
@click.option("--metering-url", default=None, help="metering-ingest's URL for --via http (default: BUDGETGATE_METERING_URL, else the local stack's).")
@click.option(
    "--token",
    default=None,
    help="API token of an exporter for --via http (default: BUDGETGATE_TOKEN, else the local stack's exporter token); shown nowhere.",
)
def dcgm(
    urls: tuple[str, ...], discover_namespace: str | None, selector: str, exporter_port: int, discover_every: float, use_kubernetes: bool,
    kubeconfig: str | None, interval: float, count: int | None, run_id_label: str, run_id_template: str, labelled_only: bool,
    mig_slices: tuple[str, ...], exporter: str, state_file: Path | None, no_state: bool, max_gap: float, via: str, metering_url: str | None,
    token: str | None,
) -> None:  # fmt: skip
    """Scrape DCGM exporters and publish each run's cumulative GPU-seconds."""
    if not urls and discover_namespace is None:
        raise click.UsageError("give the exporters: --url for each, or --discover NAMESPACE to find them through the Kubernetes API")
    if no_state and state_file is not None:
        raise click.UsageError("--state and --no-state together")
    slices = _mig_slices(mig_slices)
    if discover_namespace is not None:
        from budgetgate.adapters.dcgm_discovery import label_selector

        try:
            label_selector(selector)
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--selector") from None
    state = None if no_state else (state_file or default_state(exporter))
    gap = timedelta(seconds=max_gap)
    meter_ = _restored(state, gap)
    run = _Run(
        static={url: url for url in dict.fromkeys(urls)},  # an exporter given twice is one exporter
        discover=(discover_namespace, selector, exporter_port) if discover_namespace is not None else None,
        discover_every=discover_every,
        kubernetes=use_kubernetes or discover_namespace is not None,
        kubeconfig=kubeconfig,
        read=lambda found, pods: holdings_of(found, run_id_label=run_id_label, run_id_template=None if labelled_only else run_id_template, pods=pods),
        mig_slices=slices,
        meter=meter_,
        state=state,
        exporter=exporter,
        interval=interval,
        count=count,
    )
    asyncio.run(_with_publisher(via, metering_url, run.loop, token=token))


def _restored(state: Path | None, gap: timedelta) -> Meter:
    if state is None or not state.exists():
        return Meter(max_gap=gap)
    try:
        return Meter.restored(json.loads(state.read_text()), max_gap=gap)
    except (ValueError, KeyError, TypeError) as exc:
        raise click.ClickException(f"the state file {state} cannot be read ({type(exc).__name__}: {exc}); move it away to start from zero") from exc


@dataclass
class _Run:
    static: dict[str, str]
    discover: tuple[str, str, int] | None
    discover_every: float
    kubernetes: bool
    kubeconfig: str | None
    read: Callable[[list[Claim], Mapping[tuple[str, str], Any] | None], Holdings]
    mig_slices: dict[str, int]
    meter: Meter
    state: Path | None
    exporter: str
    interval: float
    count: int | None

    async def loop(self, publish: Callable[..., Awaitable[Any]]) -> None:
        kube = None
        if self.kubernetes:
            from lightkube import AsyncClient as KubeClient
            from lightkube import KubeConfig

            kube = KubeClient(KubeConfig.from_file(self.kubeconfig) if self.kubeconfig else None, field_manager="budgetgate-meter")
        discovered: dict[str, str] = {}
        listed_at: float | None = None
        scrapes = 0
        clock = asyncio.get_running_loop().time
        try:
            async with httpx.AsyncClient(timeout=max(5.0, self.interval)) as http:
                while self.count is None or scrapes < self.count:
                    started = clock()
                    if self.discover is not None and (listed_at is None or started - listed_at >= self.discover_every):
                        discovered = await self._discover(kube, discovered)
                        listed_at = started
                    await self._scrape(http, kube, {**self.static, **discovered}, publish)
                    scrapes += 1
                    if self.count is None or scrapes < self.count:
                        await asyncio.sleep(max(0.0, self.interval - (clock() - started)))
        finally:
            if kube is not None:
                await kube.close()

    async def _discover(self, kube: Any, known: dict[str, str]) -> dict[str, str]:
        from budgetgate.adapters.dcgm_discovery import discover_exporters

        assert self.discover is not None
        namespace, selector, port = self.discover
        try:
            found = await discover_exporters(kube, namespace=namespace, selector=selector, port=port)
        except Exception as exc:  # noqa: BLE001 - the exporters found before are scraped meanwhile
            click.echo(f"listing the exporter pods ({selector} in {namespace}) failed ({type(exc).__name__}: {exc}); scraping the {len(known)} known", err=True)
            return known
        if found.keys() != known.keys():
            click.echo(f"{len(found)} exporter(s) found in {namespace} ({selector}): {', '.join(f'{n} at {u}' for n, u in found.items()) or 'none'}", err=True)
        return found

    async def _scrape(self, http: httpx.AsyncClient, kube: Any, targets: dict[str, str], publish: Callable[..., Awaitable[Any]]) -> None:
        answers = await _fetch(http, targets)
        # An exporter the meter has a page of but no longer finds (its node gone, its pod not
        # running) is a failing one: its runs keep their last holdings until --max-gap.
        for name in self.meter.pages:
            if name not in answers and name != EVERY_EXPORTER:
                answers[name] = _Failed("no longer found among the exporters")
        found = _claims(answers, targets, self.mig_slices)
        pods = None
        if kube is not None and any(page is not None for page in found.values()):
            from budgetgate.adapters.dcgm_discovery import look_up_pods

            named = {key for page in found.values() if page is not None for key in pods_named(page)}
            try:
                pods = await look_up_pods(kube, named)
            except Exception as exc:  # noqa: BLE001 - the interval is counted when the API answers again
                click.echo(f"looking up {len(named)} pod(s) through the Kubernetes API failed ({type(exc).__name__}: {exc}); skipping this scrape", err=True)
                return
        pages = {name: None if page is None else self.read(page, pods) for name, page in found.items()}
        answered = [held for held in pages.values() if held is not None]
        if not answered:
            return
        at = datetime.now(UTC)
        usages = [u for u in self.meter.observe(at, pages) if u.gpu_seconds or u.node_seconds]
        sent = await _publish(publish, usages, exporter=self.exporter, at=at)
        if self.state is not None:
            _save(self.state, self.meter.state())
        idle, unmapped = sum(held.idle for held in answered), sorted({pod for held in answered for pod in held.unmapped})
        why = {pod: reason for held in answered for pod, reason in held.why.items()}
        ended = sorted({pod for held in answered for pod in held.gone})
        notes = "".join(
            [
                f"; {len(unmapped)} pod(s) holding GPUs without a run id: {', '.join(unmapped)}" if unmapped else "",
                f"; {len(why)} pod(s) whose run label is not resolved: {', '.join(f'{p} ({r})' for p, r in sorted(why.items()))}" if why else "",
                f"; {len(ended)} pod(s) ended or deleted, no longer charged: {', '.join(ended)}" if ended else "",
            ]
        )
        click.echo(
            f"{at.isoformat()} {len(self.meter.last)} run(s) holding GPUs, {idle} GPU(s) with no pod{notes}; "
            f"{len(pages) - len(answered)} of {len(pages)} exporter(s) failed; {sent} sample(s) published",
            err=True,
        )


async def _with_publisher(
    via: str, metering_url: str | None, loop: Callable[[Callable[..., Awaitable[Any]]], Awaitable[None]], *, token: str | None = None
) -> None:
    from budgetgate.client import AsyncClient, KafkaFeed
    from budgetgate.runtime.settings import dev_token

    if via == "http":
        # The exporter's own token: --token, else BUDGETGATE_TOKEN, else the local stack's.
        async with AsyncClient(metering_url=metering_url, token=token or dev_token("exporter")) as client:
            if client.metering_url is None:
                raise click.ClickException("no metering-ingest URL: pass --metering-url or set BUDGETGATE_METERING_URL")
            await loop(client.publish_metering)
        return
    from budgetgate.cli import backend

    settings = backend.stack_settings(needs="kafka")
    backend.kafka(settings.kafka_bootstrap)
    async with KafkaFeed(settings.kafka_bootstrap, topic_prefix=settings.topic_prefix, client_id="budgetgate-meter-dcgm") as feed:
        await loop(feed.send_metering)


@dataclass(frozen=True)
class _Failed:
    """Why an exporter gave no page."""

    why: str


def _claims(answers: dict[str, str | _Failed], targets: Mapping[str, str], mig_slices: Mapping[str, int]) -> dict[str, list[Claim] | None]:
    """The claims on each exporter's page, None for an exporter that failed: it gave no page, or
    one that cannot say which runs hold its GPUs (read as "no GPU held", it would end every run on
    that node). Each failure is logged once, with the exporter's name (its URL) and why."""
    pages: dict[str, list[Claim] | None] = {}
    failures: dict[str, str] = {}
    for name, answer in answers.items():
        pages[name] = None
        if isinstance(answer, _Failed):
            failures[name] = answer.why
            continue
        try:
            pages[name] = claims(answer, mig_slices=mig_slices)
        except ScrapeError as exc:
            failures[name] = str(exc)
    then = "skipping this scrape" if len(failures) == len(answers) else "its runs keep their last holdings, charged for its node when it answers again"
    for name, why in failures.items():
        where = name if targets.get(name, name) == name else f"{name} ({targets[name]})"
        click.echo(f"scrape of {where} failed ({why}); {then}", err=True)
    return pages


async def _fetch(http: httpx.AsyncClient, targets: Mapping[str, str]) -> dict[str, str | _Failed]:
    """Every exporter's page, or why it gave none."""
    names = list(targets)
    answers = await asyncio.gather(*(http.get(targets[name]) for name in names), return_exceptions=True)
    pages: dict[str, str | _Failed] = {}
    for name, answer in zip(names, answers, strict=True):
        if isinstance(answer, BaseException):
            pages[name] = _Failed(f"{type(answer).__name__}: {answer}")
        elif answer.status_code != 200:
            pages[name] = _Failed(f"HTTP {answer.status_code}")
        else:
            pages[name] = answer.text
    return pages


async def _publish(publish: Callable[..., Awaitable[Any]], usages: list[Usage], *, exporter: str, at: datetime) -> int:
    from budgetgate.client import metering_sample

    samples = [
        metering_sample(
            u.run_id, sample_id=sample_id(exporter, at), gpu_seconds=u.gpu_seconds, node_seconds=u.node_seconds, observed_at=u.observed_at, exporter=exporter
        )
        for u in usages
    ]
    if not samples:
        return 0
    try:
        await publish(*samples)
    except Exception as exc:  # noqa: BLE001 - the next scrape's samples carry the totals
        click.echo(f"publishing {len(samples)} sample(s) failed ({type(exc).__name__}: {exc}); the next scrape carries the totals", err=True)
        return 0
    return len(samples)


def _save(path: Path, state: dict[str, object]) -> None:
    """Write the state atomically: a meter killed mid-write keeps the previous state."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=f".{path.name}.", delete=False) as out:
        json.dump(state, out)
    os.replace(out.name, path)
