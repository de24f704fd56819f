"""`budgetgate usage`: limit, reserved, consumed and remaining of budgets, by scope, by tenant or
by user, read from the ledger's truth in Postgres."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime
from typing import Any

import click

from budgetgate.cli.tables import table


@click.command()
@click.option("--scope", "scope_id", default=None, help="A scope id, e.g. 'ns=vision-prod;cost-center=1042;team=vision', or a budget's policy id.")
@click.option("--tenant", default=None, help="A tenant: the value of the tenant label (see --label).")
@click.option("--user", default=None, help="A user: the value of the user label (see --label).")
@click.option(
    "--label", default=None, help="The label naming tenants or users (default: BUDGETGATE_TENANT_LABEL, else team; BUDGETGATE_USER_LABEL, else user)."
)
@click.option("--days", default=90, show_default=True, type=click.IntRange(1, 3660), help="For --tenant and --user: how far back runs' usage is summed.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def usage(scope_id: str | None, tenant: str | None, user: str | None, label: str | None, days: int, as_json: bool) -> None:
    """Budgets' limit, reserved, consumed and remaining in their current windows."""
    if [scope_id, tenant, user].count(None) != 2:
        raise click.UsageError("give exactly one of --scope, --tenant or --user")
    from budgetgate.cli import backend
    from budgetgate.reports.usage import UserSettings

    who, value = ("user", user) if user is not None else ("tenant", tenant)
    settings = backend.stack_settings(UserSettings)  # (the tenant label is everyone's)
    label = label or getattr(settings, f"{who}_label")
    result = asyncio.run(_read(settings.postgres_dsn, scope_id=scope_id, who=who, value=value, label=label, days=days))
    if result is None:
        raise click.ClickException(f"no budget policy of the active bundle has scope or id {scope_id!r}; `budgetgate budgets` lists them")
    if as_json:
        click.echo(json.dumps(result, indent=2))
        return
    _print(result)


async def _read(dsn: str, *, scope_id: str | None, who: str, value: str | None, label: str, days: int) -> dict[str, Any] | None:
    from budgetgate.cli import backend
    from budgetgate.policies.override_store import decided_under
    from budgetgate.reports.usage import labelled_usage, scope_usage

    async with backend.postgres(dsn) as pool:
        # What admission decides under: the Git bundle with tenant overrides and grants.
        bundle = await decided_under(pool)
        now = datetime.now(UTC)
        if value is not None:
            return await labelled_usage(pool, bundle, who=who, label=label, value=value, days=days, now=now)
        if bundle is None:
            return None
        # A policy id names its scope: `--scope gpu-budget/team-vision-prod` is what people type.
        by_id = next((p.scope.scope_id for p in bundle.policies if p.id == scope_id), None)
        found = await scope_usage(pool, bundle, by_id or scope_id or "", now)
        return None if found is None else {**found, "budgets": [{"scope_id": found["scope_id"], **b} for b in found["budgets"]]}


def _print(result: dict[str, Any]) -> None:
    who = "tenant" if "tenant" in result else "user" if "user" in result else None
    if result["budgets"]:
        rows = []
        for b in result["budgets"]:
            unit = b["currency"] if b["unit"] == "cost" else b["unit"].replace("_", "-")
            window = f"{b['window_start'][:10]} to {b['window_end'][:10]}"
            used = f"{100 * (b['utilization'] or 0):.1f}%"
            granted = f"{b['granted']:+g} ({len(b['grants'])})" if b.get("grants") else ""
            rows.append([
                b["policy_id"], b["scope_id"], unit, window, f"{b['limit']:g}", granted, f"{b['reserved']:g}", f"{b['consumed']:g}",
                f"{b['remaining']:g}", used,
            ])  # fmt: skip
        for line in table(["budget", "scope", "unit", "window", "limit", "granted", "reserved", "consumed", "remaining", "used"], rows):
            click.echo(line)
    elif who is None:
        click.echo(f"scope {result['scope_id']} has no budget in its current window")
    elif result.get("policy_bundle_sha") is None:
        click.echo("no budgets: no policy bundle is active (`budgetgate policy apply`)")
    else:
        # No policy's scope requires this label value: what limits the runs are the budgets of
        # the namespaces and labels they are submitted under, which this reading cannot name.
        other = "--tenant TEAM" if who == "user" else "--scope SCOPE"
        click.echo(
            f"no budget names {result['label']}={result[who]} in its scope; the budgets of the scopes its runs are submitted in apply "
            f"(`budgetgate usage {other}`, `budgetgate budgets`)"
        )
    if who is not None:
        r = result["runs"]
        click.echo(
            f"\n{who} {result['label']}={result[who]}, last {result['days']} days: {r['runs']} run(s), {r['admitted']} admitted; "
            f"{r['reserved_gpu_hours']:g} GPU-hours reserved, {r['consumed_gpu_hours']:g} GPU-hours and {r['consumed_node_hours']:g} node-hours metered"
        )
