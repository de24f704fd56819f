"""`budgetgate budgets`: every budget of the active bundle in its current window, from the
ledger's truth in Postgres (the same figures as `GET /v1/budgets`)."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime
from typing import Any

import click

from budgetgate.cli import backend


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def budgets(as_json: bool) -> None:
    """Limit (the policy's plus the window's grants), reserved, consumed, remaining, committed %
    (reserved + consumed), consumed % and state of every budget: the two measures the alerts and
    gauges use."""
    settings = backend.stack_settings()
    found = asyncio.run(read_budgets(settings.postgres_dsn))
    if found is None:
        raise click.ClickException("no policy bundle has been applied yet; `budgetgate policy apply DIR` applies one")
    if as_json:
        click.echo(json.dumps(found, indent=2))
        return
    click.echo(f"bundle {found['policy_bundle_sha']}")
    table(
        ["budget", "scope", "window", "unit", "limit", "granted", "reserved", "consumed", "remaining", "committed", "consumed %", "state"],
        [[b["policy_id"], b["scope_id"], b["window_key"], unit_label(b), f"{b['limit']:g}", granted(b), f"{b['reserved']:g}", f"{b['consumed']:g}",
          f"{b['remaining']:g}", f"{b['committed_percent']:.1f}%", f"{b['consumed_percent']:.1f}%", b["state"]] for b in found["budgets"]],
    )  # fmt: skip


async def read_budgets(dsn: str) -> dict[str, Any] | None:
    from budgetgate.policies.override_store import decided_under
    from budgetgate.reports.budgets import list_budgets

    async with backend.postgres(dsn) as conn:
        # What admission decides under: the Git bundle with tenant overrides and grants.
        bundle = await decided_under(conn)
        if bundle is None:
            return None
        return {"policy_bundle_sha": bundle.git_sha, "budgets": await list_budgets(conn, bundle, datetime.now(UTC))}


def granted(budget: dict[str, Any]) -> str:
    """The window's grants beside its limit: `+200 (2)`, or blank when nothing was granted."""
    found = budget.get("grants") or []
    return f"{budget['granted']:+g} ({len(found)})" if found else ""


def unit_label(budget: dict[str, Any]) -> str:
    return budget["currency"] if budget["unit"] == "cost" else budget["unit"].replace("_", "-")


def table(headers: list[str], rows: list[list[str]]) -> None:
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]
    click.echo("  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip())
    click.echo("  ".join("-" * w for w in widths))
    for row in rows:
        click.echo("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
