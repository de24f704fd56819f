"""`budgetgate report`: chargeback over a period, in GPU-hours, node-hours and the rate card's
currency, grouped by tenant, user, budget, flavor or region and by day, week or month, read from
the ledger's truth in Postgres (budgetgate.reports.chargeback)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import click

from budgetgate.cli.tables import table


@click.command()
@click.option("--from", "start", required=True, help="Start of the period, included: a date (2026-11-01, midnight UTC) or an RFC 3339 instant.")
@click.option("--to", "end", required=True, help="End of the period, excluded: a date or an RFC 3339 instant.")
@click.option(
    "--group-by",
    "group_by",
    multiple=True,
    help="account (rolled up the tree), tenant, user, budget, flavor or region; several by repeating or joining with commas (default: tenant).",
)
@click.option("--period", default="none", show_default=True, help="Rows per day, week (ISO, from Monday) or month, in UTC; none for the whole period.")
@click.option("--format", "fmt", default="table", show_default=True, type=click.Choice(["table", "csv", "json"]), help="How to print the report.")
@click.option("--tenant-label", default=None, help="The label naming tenants (default: BUDGETGATE_TENANT_LABEL, else team).")
@click.option("--user-label", default=None, help="The label naming users (default: BUDGETGATE_USER_LABEL, else user).")
def report(start: str, end: str, group_by: tuple[str, ...], period: str, fmt: str, tenant_label: str | None, user_label: str | None) -> None:
    """Chargeback over [--from, --to): metered GPU-hours, node-hours and cost, and apart from
    them what is reserved but not yet metered, by the group keys and period asked."""
    from budgetgate.reports.chargeback import ReportError, ReportRequest, as_csv

    try:
        request = ReportRequest.parse(start, end, group_by or ("tenant",), period)
    except ReportError as exc:
        raise click.UsageError(f"--{exc.field.replace('_', '-')}: {exc}") from None
    from budgetgate.cli import backend
    from budgetgate.reports.usage import UserSettings

    settings = backend.stack_settings()
    labels = (tenant_label or settings.tenant_label, user_label or UserSettings().user_label)
    try:
        result = asyncio.run(_read(settings.postgres_dsn, request, *labels))
    except ReportError as exc:  # by account, without an account tree
        raise click.UsageError(f"--{exc.field.replace('_', '-')}: {exc}") from None
    if fmt == "json":
        click.echo(json.dumps(result, indent=2))
    elif fmt == "csv":
        click.echo(as_csv(result), nl=False)
    else:
        _print(result)


async def _read(dsn: str, request: Any, tenant_label: str, user_label: str) -> dict[str, Any]:
    from budgetgate.cli import backend
    from budgetgate.core.loader import bundle_from_json
    from budgetgate.ledger.queries import sql
    from budgetgate.reports.chargeback import chargeback

    async with backend.postgres(dsn) as conn:
        row = await conn.fetchrow(sql("active_bundle"))
        bundle = bundle_from_json(row["documents"], git_sha=row["git_sha"]) if row else None
        return await chargeback(conn, bundle, request, tenant_label=tenant_label, user_label=user_label)


def _print(result: dict[str, Any]) -> None:
    from budgetgate.reports.chargeback import as_table

    names, rows = as_table(result)
    click.echo(f"chargeback {result['from']} to {result['to']} (excluded), currency {result['currency'] or 'none (no rate card)'}")
    for line in table(names, rows):
        click.echo(line)
    if result["currency"] is None:
        click.echo("no active rate card prices usage: every GPU-hour is unpriced")
