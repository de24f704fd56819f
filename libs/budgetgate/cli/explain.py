"""`budgetgate explain RUN_ID` and `budgetgate replay`: recorded decisions recomputed from what
they were decided on (the submission, the bundle at its SHA, the recorded readings), read from
the ledger's Postgres; nothing is changed."""

from __future__ import annotations

import asyncio
import json
import re
from datetime import UTC, datetime, timedelta
from typing import Any

import click

from budgetgate.cli import backend

_PERIOD = re.compile(r"^(\d+)([hdw])$")


def since(value: str) -> datetime:
    """`30d`, `12h`, `2w` ago, or an ISO date or instant (UTC unless it says otherwise)."""
    match = _PERIOD.match(value)
    if match:
        n, unit = int(match[1]), match[2]
        try:
            return datetime.now(UTC) - timedelta(hours=n) * {"h": 1, "d": 24, "w": 168}[unit]
        except OverflowError:
            raise click.BadParameter(f"{value!r} reaches back before the year 1: give a shorter period or an ISO date") from None
    try:
        at = datetime.fromisoformat(value)
    except ValueError:
        raise click.BadParameter(f"{value!r}: give a period (30d, 12h, 2w) or an ISO date") from None
    return at if at.tzinfo else at.replace(tzinfo=UTC)


@click.command()
@click.argument("run_id")
@click.option("--json", "as_json", is_flag=True, help="Print the explanation as JSON (as GET /v1/admissions/{run_id}/explain).")
def explain(run_id: str, as_json: bool) -> None:
    """Recompute RUN_ID's latest decision from its recorded inputs and explain it."""
    found = asyncio.run(_explain(backend.stack_settings().postgres_dsn, run_id))
    if found is None:
        raise click.ClickException(f"no decision for run {run_id!r}")
    if isinstance(found, str):  # archived
        raise click.ClickException(found)
    if as_json:
        click.echo(json.dumps(found, indent=2))
        return
    identical = {True: "identical", False: "DIFFERENT", None: "not replayable"}[found["identical"]]
    click.echo(f"{found['run_id']} attempt {found['attempt']} (decision {found['decision_id']}): stored {found['stored']['decision']}, "
               f"recomputed {(found['recomputed'] or {}).get('decision', '-')} — {identical}")  # fmt: skip
    for line in found["account"]:
        click.echo(f"  {line}")
    for difference in found["differences"] if found["identical"] is False else []:
        click.echo(f"  differs: {difference}")


async def _explain(dsn: str, run_id: str) -> dict[str, Any] | str | None:
    """The explanation; or, when the run's latest decision is archived, what says so; or None."""
    from budgetgate.ledger.archive import archived_decision
    from budgetgate.ledger.queries import sql
    from budgetgate.decisions.explain import explanation, recompute
    from budgetgate.policies.policy_store import PolicyStore

    async with backend.postgres(dsn) as conn:
        row = await conn.fetchrow(sql("decision_inputs"), run_id)  # type: ignore[attr-defined]
        if row is None:
            gone = await archived_decision(conn, run_id)  # type: ignore[arg-type]
            return None if gone is None else str(gone)
        bundle = await PolicyStore().under(conn, row["policy_bundle_sha"], row["override_revision"])
    return explanation(recompute(dict(row), bundle), bundle)


@click.command()
@click.option("--since", "period", default="30d", show_default=True, help="From when: a period (30d, 12h, 2w) or an ISO date.")
@click.option("--scope", default=None, help="Only decisions with an evaluation on this scope id (or policy id).")
@click.option(
    "--json", "as_json", is_flag=True, help='Print {"replayed": N, "mismatches": [...], "not_replayable": [...]} (and "archived": [...] when months are).'
)
def replay(period: str, scope: str | None, as_json: bool) -> None:
    """Recompute every recorded decision of the period, in order, from its recorded readings.

    Exits 1 when any recomputed decision differs from the stored one. Months of the period that
    are archived (`budgetgate ledger archive`) are named: their decisions are not replayed."""
    report = asyncio.run(_replay(backend.stack_settings().postgres_dsn, since(period), scope))
    if as_json:
        click.echo(json.dumps(report, indent=2))
    else:
        click.echo(f"replayed {report['replayed']} decisions: {len(report['mismatches'])} mismatches"
                   + (f"; {len(report['not_replayable'])} not replayable (recorded before readings were)" if report["not_replayable"] else ""))  # fmt: skip
        for m in report["mismatches"]:
            click.echo(f"  {m['run_id']} attempt {m['attempt']} at {m['decided_at']}: stored {m['stored']}, recomputed {m['recomputed']}: {m['reason']}")
        from budgetgate.ledger.archive import not_read

        for a in report.get("archived", []):
            click.echo(f"  {not_read(a)}")
    if report["mismatches"]:
        raise SystemExit(1)


async def _replay(dsn: str, start: datetime, scope: str | None) -> dict[str, Any]:
    from budgetgate.decisions.explain import replay as replay_decisions

    async with backend.postgres(dsn) as conn:
        return await replay_decisions(conn, since=start, scope=scope)
