"""`budgetgate policy what-if DIR`: the period's recorded submissions decided again under a
candidate policy folder (its working tree, as `policy diff` reads it), on a simulated ledger
(budgetgate.core.whatif); nothing live changes."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import click

from budgetgate.cli import backend
from budgetgate.cli.explain import since as parse_since
from budgetgate.cli.policy import load_candidate
from budgetgate.core.policy import PolicyBundle


@click.command("what-if")
@click.argument("directory", type=click.Path(exists=True, path_type=Path))
@click.option("--since", "period", default="30d", show_default=True, help="From when: a period (30d, 12h, 2w) or an ISO date.")
@click.option("--json", "as_json", is_flag=True, help='Print {"decisions": N, "flips": [...], "not_simulated": [...], "by_budget": [...]}.')
def what_if(directory: Path, period: str, as_json: bool) -> None:
    """Replay the period's recorded submissions against the policies in DIRECTORY.

    DIRECTORY is read as `policy diff` reads it: its working tree, uncommitted changes included
    (the files Git would commit; a folder outside Git as it is)."""
    rev, loaded = load_candidate(directory)
    start = parse_since(period)
    report = asyncio.run(run(backend.stack_settings().postgres_dsn, loaded.bundle, start, show_progress=sys.stderr.isatty()))
    report = {"candidate": {"directory": str(directory), "source": rev.describe(), "git_sha": loaded.bundle.git_sha}, **report}
    if as_json:
        click.echo(json.dumps(report, indent=2))
    else:
        print_report(report, directory)


async def run(dsn: str, candidate: PolicyBundle, start: datetime, *, show_progress: bool = False) -> dict[str, Any]:
    """The what-if report of `candidate` over the decisions recorded since `start`."""
    from budgetgate.reports.whatif_report import decisions_since, what_if

    async with backend.postgres(dsn) as conn:
        total = await decisions_since(conn, start)
        with _progress(2 * total, show_progress) as advance:
            return await what_if(conn, candidate, start, progress=advance)


@contextlib.contextmanager
def _progress(length: int, shown: bool) -> Iterator[Callable[[int], None]]:
    if not shown or length == 0:
        yield lambda _n: None
        return
    with click.progressbar(length=length, label="what-if", file=sys.stderr) as bar:
        yield bar.update
        bar.update(length - bar.pos)


def print_report(report: dict[str, Any], directory: Path) -> None:
    skipped = report["not_simulated"]
    click.echo(f"candidate: {directory}, {report['candidate']['source']}")
    click.echo(
        f"what-if {directory} since {report['since']}: {report['decisions']} decisions replayed, {len(report['flips'])} would flip"
        + (f", {len(skipped)} not simulated" if skipped else "")
    )
    from budgetgate.ledger.archive import not_read

    for a in report.get("archived", []):
        click.echo(f"  {not_read(a)}")
    for f in report["flips"]:
        click.echo(f"  {f['before']} -> {f['after']}  {f['run_id']} (attempt {f['attempt']}, {f['decided_at']}): {f['reason']}")
    if skipped:
        by = ", ".join(f"{n} by {factor}" for factor, n in report["not_simulated_by"].items())
        click.echo(f"  {len(skipped)} not simulated ({by}): what-if models budgets only, so history's outcome is kept and never counted as a flip:")
        for n in skipped:
            alone = f"; the candidate's budgets alone: {n['budgets_after']}" if n["budgets_after"] else "; the candidate cannot price it"
            click.echo(f"  = {n['outcome']}  {n['run_id']} (attempt {n['attempt']}, {n['decided_at']}) by {n['decided_by']}: {n['reason']}{alone}")
    for b in report["by_budget"]:
        line = (
            f"  {b['policy_id']}: admitted {b['admitted_gpu_hours_before']:g} -> {b['admitted_gpu_hours_after']:g} GPU-hours "
            f"({b['admitted_gpu_hours_change']:+g})"
        )
        if b["showback_cost_before"] is not None:
            line += f", {b['showback_cost_before']:.2f} -> {b['showback_cost_after']:.2f} {b['currency'] or ''} ({b['showback_cost_change']:+.2f})".rstrip()
        if b["exhausted_at"]:
            line += f"; exhausted at {b['exhausted_at']}"
        click.echo(line)
