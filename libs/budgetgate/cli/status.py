"""`budgetgate status RUN_ID`: a run's latest decision and, for a run refused for now (a DELAY,
a quota rejection), what it waits for with the limiting figures as they are now, read from the
ledger's truth in Postgres (the same answer as GET /v1/admissions/{run_id})."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime
from typing import Any

import click

from budgetgate.cli import backend


@click.command()
@click.argument("run_id")
@click.option("--json", "as_json", is_flag=True, help="Print the answer as JSON (as GET /v1/admissions/{run_id}).")
def status(run_id: str, as_json: bool) -> None:
    """RUN_ID's latest decision, and whether (and for what) it waits."""
    found = asyncio.run(_status(backend.stack_settings().postgres_dsn, run_id))
    if found is None:
        raise click.ClickException(f"no decision for run {run_id!r}")
    if as_json:
        click.echo(json.dumps(found, indent=2))
        return
    click.echo(f"{found['run_id']} attempt {found['attempt']}: {found['decision']} at {found['decided_at']} — {found['reason']}")
    waiting = found["waiting"]
    if waiting is None:
        click.echo("not waiting")
        return
    click.echo(f"{waiting['state']} since {waiting['since']}; as of {waiting['as_of']}:")
    for line in waiting["summary"].split("; "):
        click.echo(f"  {line}")
    click.echo(f"headroom now: resubmit with attempt {found['attempt'] + 1}" if waiting["headroom"] else "no headroom yet (a HEADROOM action announces it)")


async def _status(dsn: str, run_id: str) -> dict[str, Any] | None:
    from budgetgate.policies.override_store import decided_under
    from budgetgate.reports.status import run_status

    async with backend.postgres(dsn) as conn:
        # What admission decides under (Git and the tenant overrides), so the figures are the
        # same as GET /v1/admissions/{run_id} answers.
        found = await run_status(conn, await decided_under(conn), run_id, now=datetime.now(UTC))  # type: ignore[arg-type]
    return None if found is None else found[0]
