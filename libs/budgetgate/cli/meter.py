"""`budgetgate meter dcgm`: scrape NVIDIA DCGM exporters, turn the GPUs each run holds into
cumulative GPU- and node-seconds (budgetgate/platforms/dcgm.py), and publish them as metering
samples, to Kafka (default) or over HTTP to metering-ingest.

One meter must scrape every node a run can use (give --url once per exporter), since a sample
carries the run's whole total. Samples are cumulative, so a scrape or a publish that fails loses
nothing: the next one carries the total. An exporter that fails does not stop the others: the runs
on the exporters that answered are published, and a failing exporter's runs keep their last
holdings, charged for its node once it answers again within --max-gap (the rule is dcgm.py's).
Every failing exporter is logged with its URL and reason at each scrape; a scrape in which all
fail is skipped. With --state, the totals survive a restart.
"""

from __future__ import annotations

import asyncio
import json
import os
import tempfile
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import click
import httpx

from budgetgate.platforms.dcgm import DEFAULT_RUN_ID_LABEL, DEFAULT_RUN_ID_TEMPLATE, Holdings, Meter, ScrapeError, Usage, holdings, sample_id


@click.group()
def meter() -> None:
    """Meter GPU usage from node exporters and publish it as samples."""


@meter.command()
@click.option("--url", "urls", multiple=True, required=True, help="A DCGM exporter's metrics URL, e.g. http://node:9400/metrics (repeat for every node).")
@click.option("--interval", default=15.0, show_default=True, type=click.FloatRange(min=0.01), help="Seconds between scrapes.")
@click.option("--count", type=click.IntRange(1), default=None, help="Stop after this many scrapes (default: run until stopped).")
@click.option("--run-id-label", default=DEFAULT_RUN_ID_LABEL, show_default=True, help="Metric label whose value is the run id, when present.")
@click.option(
    "--run-id-template", default=DEFAULT_RUN_ID_TEMPLATE, show_default=True, help="Run id of a GPU without that label, from {namespace}, {pod} and {container}."
)
@click.option("--labelled-only", is_flag=True, help="Meter only GPUs whose metrics carry the run-id label (skip other pods).")
@click.option("--exporter", default="dcgm", show_default=True, help="Name of this meter in the samples it sends.")
@click.option("--state", "state_file", type=click.Path(path_type=Path, dir_okay=False), default=None, help="File keeping the totals across restarts.")
@click.option(
    "--max-gap", default=300.0, show_default=True, type=click.FloatRange(min=0), help="Seconds between scrapes beyond which the interval is not counted."
)
@click.option(
    "--via", type=click.Choice(["kafka", "http"]), default="kafka", show_default=True, help="Publish to metering.samples.v1, or POST to metering-ingest."
)
@click.option("--metering-url", default=None, help="metering-ingest's URL for --via http (default: BUDGETGATE_METERING_URL, else the local stack's).")
def dcgm(
    urls: tuple[str, ...], interval: float, count: int | None, run_id_label: str, run_id_template: str, labelled_only: bool,
    exporter: str, state_file: Path | None, max_gap: float, via: str, metering_url: str | None,
) -> None:  # fmt: skip
    """Scrape DCGM exporters' DCGM_FI_DEV_GPU_UTIL and publish each run's cumulative GPU-seconds."""
    urls = tuple(dict.fromkeys(urls))  # an exporter given twice is one exporter
    gap = timedelta(seconds=max_gap)
    meter_ = Meter.restored(json.loads(state_file.read_text()), max_gap=gap) if state_file and state_file.exists() else Meter(max_gap=gap)

    def read(text: str) -> Holdings:
        return holdings([text], run_id_label=run_id_label, run_id_template=None if labelled_only else run_id_template)

    async def loop(publish) -> None:  # type: ignore[no-untyped-def]
        scrapes = 0
        async with httpx.AsyncClient(timeout=max(5.0, interval)) as http:
            while count is None or scrapes < count:
                started = asyncio.get_running_loop().time()
                pages = _read(read, await _scrape(http, urls))
                answered = [held for held in pages.values() if held is not None]
                if answered:
                    at = datetime.now(UTC)
                    usages = [u for u in meter_.observe(at, pages) if u.gpu_seconds or u.node_seconds]
                    sent = await _publish(publish, usages, exporter=exporter, at=at)
                    if state_file is not None:
                        _save(state_file, meter_.state())
                    idle, unmapped = sum(held.idle for held in answered), sorted({pod for held in answered for pod in held.unmapped})
                    without_run_id = f"; {len(unmapped)} pod(s) holding GPUs without a run id: {', '.join(unmapped)}" if unmapped else ""
                    click.echo(
                        f"{at.isoformat()} {len(meter_.last)} run(s) holding GPUs, {idle} GPU(s) with no pod{without_run_id}; "
                        f"{len(pages) - len(answered)} of {len(pages)} exporter(s) failed; {sent} sample(s) published",
                        err=True,
                    )
                scrapes += 1
                if count is None or scrapes < count:
                    await asyncio.sleep(max(0.0, interval - (asyncio.get_running_loop().time() - started)))

    asyncio.run(_with_publisher(via, metering_url, loop))


async def _with_publisher(via: str, metering_url: str | None, loop) -> None:  # type: ignore[no-untyped-def]
    from budgetgate.client import AsyncClient, KafkaFeed

    if via == "http":
        async with AsyncClient(metering_url=metering_url) as client:
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


def _read(read, answers: dict[str, str | _Failed]) -> dict[str, Holdings | None]:  # type: ignore[no-untyped-def]
    """What each exporter's page holds, None for an exporter that failed: it gave no page, or one
    that cannot say which runs hold its GPUs (read as "no GPU held", it would end every run on that
    node). Each failure is logged once, with the exporter's URL and why."""
    pages: dict[str, Holdings | None] = {}
    failures: dict[str, str] = {}
    for url, answer in answers.items():
        pages[url] = None
        if isinstance(answer, _Failed):
            failures[url] = answer.why
            continue
        try:
            pages[url] = read(answer)
        except ScrapeError as exc:
            failures[url] = str(exc)
    then = "skipping this scrape" if len(failures) == len(answers) else "its runs keep their last holdings, charged for its node when it answers again"
    for url, why in failures.items():
        click.echo(f"scrape of {url} failed ({why}); {then}", err=True)
    return pages


async def _scrape(http: httpx.AsyncClient, urls: tuple[str, ...]) -> dict[str, str | _Failed]:
    """Every exporter's page, or why it gave none."""
    answers = await asyncio.gather(*(http.get(url) for url in urls), return_exceptions=True)
    pages: dict[str, str | _Failed] = {}
    for url, answer in zip(urls, answers, strict=True):
        if isinstance(answer, BaseException):
            pages[url] = _Failed(f"{type(answer).__name__}: {answer}")
        elif answer.status_code != 200:
            pages[url] = _Failed(f"HTTP {answer.status_code}")
        else:
            pages[url] = answer.text
    return pages


async def _publish(publish, usages: list[Usage], *, exporter: str, at: datetime) -> int:  # type: ignore[no-untyped-def]
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
