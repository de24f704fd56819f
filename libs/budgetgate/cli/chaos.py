"""`budgetgate chaos …`: the fault campaign (budgetgate.chaos, docs/promises.md)."""

from __future__ import annotations

import asyncio
import json
import sys
from collections import Counter
from pathlib import Path

import click

from budgetgate.chaos.cluster import PLANTS
from budgetgate.chaos.schedule import FAULT_KINDS


@click.group()
def chaos() -> None:
    """Seeded fault campaigns against a stack of their own, judged by checkers of every promise."""


@chaos.command()
@click.option("--seed", required=True, type=int, help="Draws the operations and the fault schedule; the same seed plans the same campaign.")
@click.option("--duration", default=60.0, show_default=True, type=click.FloatRange(5.0), help="Seconds of workload and faults (settling comes on top).")
@click.option(
    "--rate", default=4.0, show_default=True, type=click.FloatRange(0.1, 100.0), help="Submissions a second (each with its retries, events and samples)."
)
@click.option("--fault", "fault_kinds", multiple=True, type=click.Choice(tuple(FAULT_KINDS)), help="Only these fault kinds (repeatable). Default: every kind.")
@click.option("--without", "without_kinds", multiple=True, type=click.Choice(tuple(FAULT_KINDS)), help="Every fault kind but these (repeatable).")
@click.option("--no-faults", is_flag=True, help="Run the workload without any fault (a baseline).")
@click.option(
    "--settle", "settle_seconds", default=45.0, show_default=True, type=click.FloatRange(0.0), help="Seconds the stack gets after the faults to settle."
)
@click.option("--out", "folder", default=Path(".budgetgate/chaos"), show_default=True, type=click.Path(path_type=Path), help="Where the history goes.")
@click.option("--keep-database", is_flag=True, help="Keep the campaign's Postgres database (dropped by default).")
@click.option(
    "--postgres",
    type=click.Choice(("own", "shared")),
    default="own",
    show_default=True,
    help="own: a Postgres server of the campaign's own, which the Postgres faults kill and pause; "
    "shared: a database on BUDGETGATE_POSTGRES_DSN's server, never killed (the Postgres faults are skipped).",
)
@click.option(
    "--plant",
    type=click.Choice(tuple(PLANTS)),
    help="Plant a bug on purpose, to see the checkers catch it: " + "; ".join(f"{k}: {v}" for k, v in PLANTS.items()),
)
@click.option(
    "--ledger-shards",
    type=click.IntRange(1, 64),
    default=1,
    show_default=True,
    help="Shards of the Redis ledger (BUDGETGATE_LEDGER_SHARDS). With several, a hard budget every namespace shares is added, "
    "charged through each tenant's escrow lease, and the conservation checker judges it whole.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
def run(
    seed: int,
    duration: float,
    rate: float,
    fault_kinds: tuple[str, ...],
    without_kinds: tuple[str, ...],
    no_faults: bool,
    settle_seconds: float,
    folder: Path,
    keep_database: bool,
    postgres: str,
    plant: str | None,
    ledger_shards: int,
    as_json: bool,
) -> None:
    """Start a stack, run a seeded workload and faults against it, judge the history.

    Exits 1 on a violation, printing the seed, the checker and the operations involved; the
    history stays in --out either way."""
    from budgetgate.chaos.campaign import Options
    from budgetgate.chaos.campaign import run as run_campaign

    if fault_kinds and without_kinds:
        raise click.UsageError("--fault names the kinds to inject, --without the kinds to leave out: give one of them")
    if without_kinds:
        fault_kinds = tuple(k for k in FAULT_KINDS if k not in without_kinds)
        if not fault_kinds:
            raise click.UsageError("--without leaves no fault kind; use --no-faults for a run without faults")

    options = Options(
        seed=seed,
        duration=duration,
        rate=rate,
        faults=not no_faults,
        fault_kinds=fault_kinds or None,
        settle_seconds=settle_seconds,
        folder=folder,
        keep_database=keep_database,
        postgres=postgres,
        plant=plant,
        ledger_shards=ledger_shards,
    )
    echo = (lambda _m: None) if as_json else (lambda m: click.echo(m, err=True))
    try:
        outcome = asyncio.run(run_campaign(options, echo=echo))
    except asyncio.CancelledError:
        click.echo(f"the campaign was stopped (SIGTERM) before its end; what it recorded is under {folder}", err=True)
        sys.exit(1)
    summary = {
        "seed": seed,
        "duration": duration,
        "plan": outcome.plan.fingerprint(),
        "history": str(outcome.history),
        "operations": outcome.operations,
        "faults": outcome.faults,
        "faults_skipped": outcome.skipped_faults,
        **outcome.verdict.as_dict(),
    }
    _report(summary, outcome.verdict.ok, as_json, seed=seed)


@chaos.command()
@click.argument("history", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the verdict as JSON.")
def check(history: Path, as_json: bool) -> None:
    """Judge a kept history again (every checker); exits 1 on a violation."""
    from budgetgate.chaos import checkers, recorder

    try:
        lines = recorder.read(history)
        verdict = checkers.check(lines)
    except (recorder.HistoryError, ValueError, KeyError) as exc:
        raise click.ClickException(f"{history}: {exc}") from exc
    setup = next(line for line in lines if line["type"] == "setup")
    ops = Counter(f"{line['kind']}:{line.get('outcome')}" for line in lines if line["type"] == "op")
    faults = Counter(line["kind"] for line in lines if line["type"] == "fault" and line.get("outcome") == "done")
    summary = {
        "seed": setup["seed"],
        "plan": setup["fingerprint"],
        "history": str(history),
        "operations": dict(ops),
        "faults": dict(faults),
        **verdict.as_dict(),
    }
    _report(summary, verdict.ok, as_json, seed=setup["seed"])


def _report(summary: dict, ok: bool, as_json: bool, *, seed: int) -> None:  # type: ignore[type-arg]
    if as_json:
        click.echo(json.dumps(summary, indent=2, sort_keys=True))
    else:
        click.echo(f"seed {seed}, plan {summary['plan']}, history {summary['history']}")
        click.echo("operations: " + ", ".join(f"{k} {v}" for k, v in sorted(summary["operations"].items())))
        click.echo("faults: " + (", ".join(f"{k} {v}" for k, v in sorted(summary["faults"].items())) or "none"))
        for kind, why in sorted(summary.get("faults_skipped", {}).items()):
            click.echo(f"fault kind {kind} skipped: {why}")
        click.echo("judged: " + ", ".join(f"{k} {v}" for k, v in summary["judged"].items()))
        for note in summary["notes"]:
            click.echo(f"note: {note}")
        for v in summary["violations"]:
            click.echo(f"VIOLATION seed={seed} checker={v['checker']} operations={v['operations']}: {v['message']}")
        click.echo("every checker passed" if ok else f"{len(summary['violations'])} violation(s); the history is kept at {summary['history']}")
    if not ok:
        sys.exit(1)
