"""`budgetgate demo`: the example policies and a realistic mix of submissions on the local stack."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import click

from budgetgate.client import AsyncClient, NotFound
from budgetgate.core.loader import LoadedPolicies
from budgetgate.runtime.settings import DEV_STATE_FILE

# The example policy repository, shipped in the package (a checkout's examples/policies links
# here), so `budgetgate demo` works from an installed wheel too.
EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "policies"
DEMO_USAGE_SLACK_SECONDS = 2 * 86400
VISION = {"cost-center": "1042", "team": "vision", "environment": "prod"}
NLP = {"team": "nlp", "environment": "dev"}


@dataclass(frozen=True)
class Workload:
    what: str
    run: str
    namespace: str
    labels: dict[str, str]
    gpus: int
    hours: float
    flavor: str = "h100"
    region: str | None = None
    attempt: int = 1


MIX = [
    Workload("vision training", "vision/train-resnet", "vision-prod", VISION, 8, 6.0),
    Workload("platform retry, same run", "vision/train-resnet", "vision-prod", VISION, 8, 6.0),
    Workload("vision fine-tune in EU", "vision/finetune", "vision-prod", VISION, 8, 4.0, region="eu-west-1"),
    Workload("vision giant sweep", "vision/sweep", "vision-prod", VISION, 64, 8.0),
    Workload("vision job, no cost-center", "vision/unlabelled", "vision-prod", {"team": "vision"}, 2, 1.0),
    Workload("research experiment 1", "vision/research-1", "vision-research", {"team": "vision", "environment": "dev"}, 4, 20.0),
    Workload("research experiment 2", "vision/research-2", "vision-research", {"team": "vision", "environment": "dev"}, 4, 12.0),
    Workload("research experiment 2, resubmitted smaller", "vision/research-2", "vision-research", {"team": "vision", "environment": "dev"}, 2, 4.0, attempt=2),
    Workload("nlp pretraining", "nlp/pretrain", "nlp-prod", {"team": "nlp", "environment": "prod"}, 16, 24.0),
    Workload("nlp eval on a100", "nlp/eval", "nlp-dev", NLP, 4, 3.0, flavor="a100"),
    Workload("nlp job, no environment", "nlp/adhoc", "nlp-dev", {"team": "nlp"}, 1, 1.0, flavor="l4"),
    Workload("sandbox notebook", "sandbox/notebook", "sandbox", {}, 1, 2.0, flavor="l4"),
]


def _dev(root: Path, *args: str) -> None:
    env = {**os.environ, "BUDGETGATE_HOME": str(root)}
    subprocess.run([sys.executable, "-m", "budgetgate.cli.main", "dev", *args], check=True, env=env, stdout=subprocess.DEVNULL)


@click.command()
@click.option("--keep", is_flag=True, help="leave the demo's stack running afterwards (its folder is printed)")
@click.option("--policies", type=click.Path(path_type=Path), default=None, help="a policy directory  [default: the example policies shipped with budgetgate]")
def demo(keep: bool, policies: Path | None) -> None:
    """Apply the example policies, submit a mix of workloads, print decisions and budgets.

    The demo runs on a stack of its own, in a fresh folder, so it never replaces the bundle of a
    stack someone else runs, and a run prints the same as the one before."""
    loaded = load_policies(policies)
    root = Path(tempfile.mkdtemp(prefix="budgetgate-demo-"))
    click.echo(f"starting a stack of the demo's own in {root} …", err=True)
    os.environ["BUDGETGATE_HOME"] = str(root)  # every connection below names the demo's stack
    # The demo tells hours of running in seconds: its runs report usage from before they were
    # decided, which metering-ingest refuses as impossible unless its usage slack covers them
    # (the longest run, 20 h at 1.25 times its projection). Only the demo's own stack gets it.
    os.environ.setdefault("BUDGETGATE_METERING_USAGE_SLACK_SECONDS", str(DEMO_USAGE_SLACK_SECONDS))
    try:
        _dev(root, "up", "--detach")
        stack = json.loads((root / DEV_STATE_FILE).read_text())
        asyncio.run(_run(stack["settings"], loaded, tokens=stack["tokens"]))
    finally:
        if keep:
            click.echo(f"\nthe demo's stack keeps running: BUDGETGATE_HOME={root} budgetgate budgets; BUDGETGATE_HOME={root} budgetgate dev down", err=True)
        else:
            _dev(root, "down")
            _forget(root)


def load_policies(policies: Path | None) -> LoadedPolicies:
    """The policies of `policies` at its Git revision (its working tree, if dirty), or the
    shipped examples."""
    from budgetgate.cli.policy import load_revision

    if policies is not None:
        return load_revision(policies, allow_dirty=True)[1]
    # As plain files, not through Git: installed, they may sit in a virtualenv inside some Git
    # repository that ignores it, where Git holds none of them.
    from budgetgate.core.loader import load_files
    from budgetgate.core.policy_files import directory_files
    from budgetgate.policies.repository import Revision, dirty_sha

    files = directory_files(EXAMPLES)
    return load_files(files, git_sha=dirty_sha(Revision("examples", None, True), load_files(files, git_sha="examples").documents))


def _forget(root: Path) -> None:
    """Drop what the demo's stack left on shared servers (its database), then its folder."""
    shared = os.environ.get("BUDGETGATE_POSTGRES_DSN")
    if shared:
        from budgetgate.devstack.isolation import checkout_tag, database_name

        asyncio.run(_drop_database(shared, database_name(checkout_tag(root))))
    shutil.rmtree(root, ignore_errors=True)


async def _drop_database(dsn: str, name: str) -> None:
    import asyncpg

    conn = await asyncpg.connect(dsn, timeout=10)
    try:
        await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await conn.close()


async def _run(settings: dict[str, Any], loaded: LoadedPolicies, *, tokens: dict[str, str]) -> None:
    from budgetgate.cli.policy import apply_loaded

    with contextlib.redirect_stdout(sys.stderr):  # the plan: the demo's output is its story
        await apply_loaded(settings["postgres_dsn"], loaded, source="budgetgate demo", applied_by="budgetgate demo")
    # The platform's submission API submits; the budget owners' dashboards read.
    async with (
        AsyncClient(settings["admission_url"], token=tokens["submitter"]) as client,
        AsyncClient(settings["admission_url"], token=tokens["reader"]) as reader,
    ):
        await client.wait_ready(timeout=10)
        rows = []
        for w in MIX:
            body = {
                "run_id": f"demo/{w.run}",
                "attempt": w.attempt,
                "namespace": w.namespace,
                "labels": w.labels,
                "resources": {"gpus": w.gpus, "nodes": 1, "flavor": w.flavor, **({"region": w.region} if w.region else {})},
                "projected_runtime_hours": w.hours,
                "job": {"namespace": w.namespace, "name": w.run.split("/")[-1]},
            }
            rows.append((w, (await client.submit(body)).model_dump(mode="json")))
        _print_decisions(rows)
        scopes = sorted({e["scope_id"] for _, answer in rows for e in answer["evaluations"]})
        _print_budgets(await _usage(reader, scopes))
        rows.append(await _grant_and_resubmit(settings, tokens, client))
        allowed = [(w, answer) for w, answer in rows if answer["decision"] == "ALLOW" and not answer["replayed"]]
        finished = await _lifecycles(settings, allowed)
        settled = await _wait_settled(reader, scopes)
        _print_runs(finished)
        _print_budgets(settled, title="Budgets after the runs finished: reservations replaced by actuals")
        if loaded.bundle.accounts:
            month, next_month = _this_month()
            report = await reader.chargeback(month, next_month, group_by=("account",))
            _print_chargeback(loaded, report.model_dump(mode="json", by_alias=True))
        if any(b["reserved"] for scope in settled for b in scope.get("budgets", [])):
            click.echo("\n(some reservations are still held: the reconciler has not caught up yet; `budgetgate usage --scope …` shows the ledger as it goes)")


async def _usage(client: AsyncClient, scopes: list[str]) -> list[dict[str, Any]]:
    """Each scope's budgets (none for a scope no budget of the bundle has)."""
    found = []
    for scope in scopes:
        try:
            found.append((await client.scope_usage(scope)).model_dump(mode="json"))
        except NotFound:
            found.append({"scope_id": scope, "budgets": []})
    return found


# How much of its projection each finished run really used, in turn: most finish early, one runs over.
USE = (0.6, 0.9, 1.25, 0.4)


async def _lifecycles(settings: dict[str, Any], allowed: list[tuple[Workload, dict[str, Any]]]) -> list[tuple[Workload, dict[str, Any], float]]:
    """Each admitted run starts, reports cumulative GPU usage halfway and at the end, and completes."""
    from datetime import UTC, datetime, timedelta

    from budgetgate.client import KafkaFeed, lifecycle_event, metering_sample

    now = datetime.now(UTC).replace(microsecond=0)
    finished = []
    async with KafkaFeed(settings["kafka_bootstrap"], topic_prefix=settings.get("topic_prefix") or "", client_id="budgetgate-demo") as feed:
        for i, (w, answer) in enumerate(allowed):
            used = USE[i % len(USE)]
            ran = timedelta(hours=w.hours * used)
            start, run_id = now - ran, answer["run_id"]
            await feed.send_lifecycle(lifecycle_event(run_id, "STARTED", at=start, gpus=w.gpus, nodes=1, flavor=w.flavor, event_id=str(uuid.uuid4())))
            for part in (0.5, 1.0):
                at = start + ran * part
                await feed.send_metering(metering_sample(
                    run_id, sample_id=f"{run_id}/{part}", observed_at=at, gpu_seconds=w.gpus * ran.total_seconds() * part,
                    node_seconds=ran.total_seconds() * part, exporter="budgetgate-demo", event_id=str(uuid.uuid4()),
                ))  # fmt: skip
            await feed.send_lifecycle(lifecycle_event(run_id, "COMPLETED", at=now, gpus=w.gpus, nodes=1, flavor=w.flavor, event_id=str(uuid.uuid4())))
            finished.append((w, answer, used))
    return finished


async def _wait_settled(client: AsyncClient, scopes: list[str], timeout: float = 60.0) -> list[dict[str, Any]]:
    """The scopes' budgets once no reservation is held any more (or as they are at `timeout`)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        usage = await _usage(client, scopes)
        if all(b["reserved"] == 0 for scope in usage for b in scope.get("budgets", [])) or asyncio.get_running_loop().time() > deadline:
            return usage
        await asyncio.sleep(0.5)


# Finance grants the research budget 40 GPU-hours for this week: a third experiment as large as
# the one it had to wait (48 GPU-hours on 88 of 120 used) is then admitted.
GRANTED = ("gpu-budget/team-vision-research", 40, "finance approved extra hours for the paper deadline (FIN-1234)")
REGRANTED = Workload("research experiment 3, after the grant", "vision/research-3", "vision-research", {"team": "vision", "environment": "dev"}, 4, 12.0)


async def _grant_and_resubmit(settings: dict[str, Any], tokens: dict[str, str], client: AsyncClient) -> tuple[Workload, dict[str, Any]]:
    policy_id, amount, reason = GRANTED
    async with AsyncClient(settings["admission_url"], token=tokens["accounting"]) as accounting:
        grant = await accounting.grant_budget(policy_id, {"amount": amount, "reason": reason})
    click.echo(f"\nA grant (budgetgate grant add {policy_id} {amount} --reason …), by the accounting role\n")
    click.echo(f"- {policy_id}: limit {grant.limit_before:g} -> {grant.limit_after:g} GPU-hours this window: {grant.reason}")
    w = REGRANTED
    body = {
        "run_id": f"demo/{w.run}",
        "attempt": w.attempt,
        "namespace": w.namespace,
        "labels": w.labels,
        "resources": {"gpus": w.gpus, "nodes": 1, "flavor": w.flavor},
        "projected_runtime_hours": w.hours,
        "job": {"namespace": w.namespace, "name": w.run.split("/")[-1]},
    }
    answer = (await client.submit(body)).model_dump(mode="json")
    click.echo(f"- {w.what} ({w.gpus}x{w.flavor} {w.hours:g}h): {answer['decision']}")
    return w, answer


def _this_month() -> tuple[str, str]:
    from datetime import UTC, datetime

    today = datetime.now(UTC).date()
    start = today.replace(day=1)
    end = start.replace(year=start.year + 1, month=1) if start.month == 12 else start.replace(month=start.month + 1)
    return start.isoformat(), end.isoformat()


def _print_chargeback(loaded: LoadedPolicies, report: dict[str, Any]) -> None:
    """The month's chargeback by account, down the tree: each account's row is its whole subtree."""
    click.echo(f"\nChargeback this month by account (budgetgate report --group-by account), in {report['currency']}\n")
    rows = {row["account"]: row for row in report["rows"]}
    tree = loaded.bundle.accounts
    table = []

    for account, depth in tree.walk():
        row = rows.get(account.id)
        table.append(["  " * depth + account.id, *(_figures(row) if row else ["0", "0", "0.00", "0"])])
    if None in rows:
        table.append(["(no account)", *_figures(rows[None])])
    table.append(["total (each run once)", *_figures(report["total"])])
    _table(["account", "metered GPU-h", "node-h", "cost", "reserved GPU-h"], table)


def _figures(row: dict[str, Any]) -> list[str]:
    return [f"{row['gpu_hours']:g}", f"{row['node_hours']:g}", f"{row['cost']:.2f}", f"{row['reserved_gpu_hours']:g}"]


def _print_runs(finished: list[tuple[Workload, dict[str, Any], float]]) -> None:
    click.echo("\nRuns: started, metered, completed\n")
    table = []
    for w, answer, used in finished:
        projected = answer["projected_gpu_hours"]
        actual = projected * used
        table.append([w.what, f"{projected:g}", f"{actual:g}", f"{actual - projected:+g}", "over-ran its reservation" if used > 1 else ""])
    _table(["workload", "reserved GPU-h", "metered GPU-h", "error", ""], table)


def _table(headers: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    click.echo("  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)))
    click.echo("  ".join("-" * w for w in widths))
    for row in rows:
        click.echo("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)))


def _print_decisions(rows: list[tuple[Workload, dict[str, Any]]]) -> None:
    click.echo("\nDecisions\n")
    table = []
    for w, answer in rows:
        cost = f"{answer['showback_cost']:.2f} {answer['currency']}" if answer["showback_cost"] is not None else "-"
        dry = [e["policy_id"] for e in answer["evaluations"] if e["enforcement"] == "dry-run" and e["decision"] != "ALLOW"]
        decision = answer["decision"] + (" (replay)" if answer["replayed"] else "")
        table.append(
            [w.what, f"{w.gpus}x{w.flavor} {w.hours:g}h", f"{answer['projected_gpu_hours']:g}", cost, decision, "would deny: " + ", ".join(dry) if dry else ""]
        )
    _table(["workload", "request", "GPU-h", "showback", "decision", "dry-run"], table)
    click.echo("\nReasons\n")
    for w, answer in rows:
        bounds = [e[edge] for e in answer["evaluations"] for edge in ("window_start", "window_end") if e.get(edge)]
        click.echo(f"- {w.what}: {_relative_times(answer['reason'], answer['decided_at'], bounds)}")


_INSTANT = re.compile(r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(?:\.\d+)?Z")


def _relative_times(text: str, decided_at: str, bounds: Iterable[str] = ()) -> str:
    """Instants within a day of the decision as a distance from it ("decision time + 1h00m"), so
    the demo prints the same on every run; the bounds of the decision's windows (`bounds`) and
    later instants are stable as they are, and as a distance would change with the minute the
    demo runs in. (Which instants are windows' bounds is known, not guessed: an instant a duration
    after the decision, rounded up to a second, falls on a quarter hour too, one run in 900.)"""
    start = datetime.fromisoformat(decided_at)
    stable = {datetime.fromisoformat(bound) for bound in bounds}

    def relative(match: re.Match[str]) -> str:
        instant = datetime.fromisoformat(match.group())
        seconds = (instant - start).total_seconds()
        if not 0 <= seconds < 86400 or instant in stable:
            return match.group()
        minutes = round(seconds / 60)
        return f"decision time + {minutes // 60}h{minutes % 60:02d}m"

    return _INSTANT.sub(relative, text)


def _print_budgets(usage: list[dict[str, Any]], *, title: str = "Budgets, current window") -> None:
    click.echo(f"\n{title}\n")
    table = []
    for scope in usage:
        for b in scope.get("budgets", []):
            unit = b["currency"] if b["unit"] == "cost" else b["unit"].replace("_", "-")
            table.append(
                [
                    b["policy_id"],
                    b["enforcement"],
                    unit,
                    f"{b['limit']:g}",
                    f"{b['reserved']:g}",
                    f"{b['consumed']:g}",
                    f"{b['remaining']:g}",
                    f"{100 * (b['utilization'] or 0):.1f}%",
                ]
            )
    _table(["budget", "mode", "unit", "limit", "reserved", "consumed", "remaining", "used"], table)
