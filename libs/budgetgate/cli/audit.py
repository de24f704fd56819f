"""`budgetgate audit`: the audit figures of one scope, from Postgres or from Marquez."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime
from typing import Any

import click

from budgetgate.cli import backend


def parse_window(text: str | None) -> tuple[datetime | None, str | None]:
    """`--window`: a window key (`rolling-30d`, `<start>/<end>`), or an instant the window
    contains: `2026-07`, `2026-07-15`, or a full ISO 8601 time (UTC when no zone is given)."""
    if not text:
        return None, None
    if text.startswith("rolling-") or "/" in text:
        return None, text
    for fmt in ("%Y-%m", "%Y-%m-%d"):
        try:
            return datetime.strptime(text, fmt).replace(tzinfo=UTC), None
        except ValueError:
            pass
    try:
        at = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise click.BadParameter(f"{text!r} is neither a window key nor a date or time (try 2026-07, 2026-07-15 or rolling-30d)") from None
    return (at if at.tzinfo else at.replace(tzinfo=UTC)), None


@click.command()
@click.option("--scope", "scope_id", required=True, help="Scope id, e.g. 'ns=vision-prod;cost-center=1042;team=vision', or a budget's policy id.")
@click.option("--window", "window_text", help="Windows containing this date/time (2026-07, 2026-07-15, ISO time), or a window key.")
@click.option("--marquez", "marquez_url", help="Compute denial rate and reservation error from this Marquez's run history instead.")
@click.option("--json", "as_json", is_flag=True, help="Print the figures as JSON.")
def audit(scope_id: str, window_text: str | None, marquez_url: str | None, as_json: bool) -> None:
    """Denial rate, reservation-to-actual error, window exhaustion and decisions by policy SHA of a
    scope; --window narrows every section to the windows it names."""
    from budgetgate.evidence.audit import WindowFilter, marquez_report, marquez_runs, postgres_report

    at, key = parse_window(window_text)
    window = WindowFilter(at=at, key=key)
    if marquez_url:
        backend.announce("marquez", marquez_url)
        try:
            report = marquez_report(marquez_runs(marquez_url), scope_id, window)
        except Exception as exc:  # noqa: BLE001 - any transport failure is the same news to the user
            raise click.ClickException(f"cannot read Marquez at {marquez_url}: {exc}") from exc
        where = f"Marquez at {marquez_url}"
    else:
        report = asyncio.run(_from_postgres(backend.stack_settings().postgres_dsn, scope_id, window, postgres_report))
        where = "the ledger or the active bundle"
    if not report.pop("known"):
        raise click.ClickException(f"unknown scope {scope_id!r}: {where} names no budget with that scope or policy id; `budgetgate budgets` lists them")
    report["window"] = window_text
    if as_json:
        click.echo(json.dumps(report, indent=2, sort_keys=True))
    else:
        _print(report)


async def _from_postgres(dsn: str, scope_id: str, window: Any, report: Any) -> dict[str, Any]:
    from budgetgate.core.loader import PolicyValidationError, bundle_from_json
    from budgetgate.ledger.queries import sql

    async with backend.postgres(dsn) as conn:
        row = await conn.fetchrow(sql("active_bundle"))  # type: ignore[attr-defined]
        policies = ()
        if row is not None:
            try:
                policies = bundle_from_json(row["documents"], git_sha=row["git_sha"]).policies
            except PolicyValidationError:
                policies = ()
        # A policy id names its scope, as in `budgetgate usage --scope`.
        scope_id = next((p.scope.scope_id for p in policies if p.id == scope_id), scope_id)
        found = await report(conn, scope_id, window)
        found["known"] = found["known"] or any(p.scope.scope_id == scope_id for p in policies)
        return found


def _print(report: dict[str, Any]) -> None:
    click.echo(f"scope {report['scope']}" + (f", windows matching {report['window']}" if report["window"] else "") + f" (from {report['source']})")
    _table(
        "Denial rate (runs by their latest decision)",
        report["denial_rate"],
        [("window", "window_key"), ("runs", "runs"), ("allowed", "allowed"), ("denied", "denied"), ("delayed", "delayed"), ("denial rate", "denial_rate")],
    )
    _table(
        "Reservation-to-actual error (ended runs, GPU-hours)",
        report["reservation_error"],
        [
            ("window", "window_key"),
            ("policy SHA", "policy_git_sha"),
            ("runs", "runs"),
            ("reserved", "reserved_gpu_hours"),
            ("actual", "actual_gpu_hours"),
            ("error", "error_gpu_hours"),
            ("error ratio", "error_ratio"),
        ],
    )
    if "window_exhaustion" in report:
        rows = [{**r, "unit": r["unit"].replace("_", "-")} for r in report["window_exhaustion"]]
        _table(
            "Window exhaustion (hours of the budget's unit, or its currency)",
            rows,
            [
                ("policy", "policy_id"),
                ("window", "window_key"),
                ("unit", "unit"),
                ("limit", "limit"),
                ("used", "used"),
                ("remaining", "remaining"),
                ("burn/hour", "burn_per_hour"),
                ("ran out at", "exhausted_at"),
                ("projected to run out", "projected_exhaustion_at"),
            ],
        )
        _table(
            "Decisions by policy SHA",
            report["decisions_by_policy_sha"],
            [
                ("policy", "policy_id"),
                ("SHA", "policy_git_sha"),
                ("enforcement", "enforcement"),
                ("decisions", "decisions"),
                ("allowed", "allowed"),
                ("denied", "denied"),
                ("delayed", "delayed"),
                ("first", "first_decided_at"),
                ("last", "last_decided_at"),
            ],
        )
    else:
        click.echo("\n(window exhaustion and decisions by policy SHA come from Postgres: run without --marquez)")


def _table(title: str, rows: list[dict[str, Any]], columns: list[tuple[str, str]]) -> None:
    click.echo(f"\n{title}")
    if not rows:
        click.echo("  (none)")
        return
    cells = [[h for h, _ in columns]] + [[_cell(row.get(k)) for _, k in columns] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    for line in cells:
        click.echo("  " + "  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip())


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    return f"{value:g}" if isinstance(value, float) else str(value)
