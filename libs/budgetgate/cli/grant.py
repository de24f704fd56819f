"""`budgetgate grant add|list`: hours (or money) granted to one budget in one window, or taken
from it, with a reason, and the grants made; through admission's API
(`POST`/`GET /v1/budgets/{policy_id}/grants`) with the project's client, so the token's holder is
who the admin log names."""

from __future__ import annotations

import json
from decimal import Decimal, InvalidOperation
from typing import Any

import click

from budgetgate.cli.calling import call


@click.group()
def grant() -> None:
    """Grant hours to a budget's window, or take them away, without a Git commit."""


def _call(work: Any) -> Any:
    return call(work, service="admission", url=lambda client: client.url)


def _amount(value: str) -> float:
    try:
        figure = Decimal(value)
    except InvalidOperation:
        raise click.BadParameter(f"{value!r} is not a number", param_hint="AMOUNT") from None
    if not figure.is_finite() or figure == 0:
        raise click.BadParameter(f"{value!r}: give a non-zero amount (negative takes away)", param_hint="AMOUNT")
    return float(figure)


@grant.command()
@click.argument("policy_id")
@click.argument("amount")
@click.option("--reason", required=True, help="why, for the admin log (who approved it, a ticket)")
@click.option("--window", help="the window: its key (<start>/<end>, as `budgetgate budgets` shows it) or a date inside it; default: the current one")
@click.option("--scope", "scope_id", help="the budget's scope id, checked against the budget's")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def add(policy_id: str, amount: str, reason: str, window: str | None, scope_id: str | None, as_json: bool) -> None:
    """Add AMOUNT (in the budget's unit: GPU-hours, node-hours, wall-hours or its currency) to the
    limit of budget POLICY_ID in its current window or the one named; a negative AMOUNT (after
    `--`, e.g. `grant add --reason r -- POLICY -50`) takes it away. Effective from the next decision."""
    if not reason.strip():
        raise click.BadParameter("give a reason", param_hint="--reason")
    body: dict[str, Any] = {"amount": _amount(amount), "reason": reason}
    if window is not None:
        body["window"] = window
    if scope_id is not None:
        body["scope_id"] = scope_id
    answer = _call(lambda client: client.grant_budget(policy_id, body)).model_dump(mode="json")
    if as_json:
        click.echo(json.dumps(answer, indent=2))
        return
    click.echo(
        f"granted {answer['amount']:+g} {answer['unit']} to {answer['policy_id']} for {answer['window_start']} to {answer['window_end']}: "
        f"limit {answer['limit_before']:g} -> {answer['limit_after']:g} (revision {answer['revision']})"
    )


@grant.command(name="list")
@click.argument("policy_id")
@click.option("--window", help="only this window's grants: its key, or a date inside it")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def list_grants(policy_id: str, window: str | None, as_json: bool) -> None:
    """The grants made to budget POLICY_ID, oldest first: amount, the window's limit before and
    after, who and why."""
    answer = _call(lambda client: client.budget_grants(policy_id, window=window)).model_dump(mode="json")
    if as_json:
        click.echo(json.dumps(answer, indent=2))
        return
    if not answer["grants"]:
        click.echo(f"no grants to {policy_id}" + (f" in window {window}" if window else ""))
        return
    for g in answer["grants"]:
        click.echo(
            f"{g['revision']:>6}  {g['granted_at']}  {g['window_start'][:10]} to {g['window_end'][:10]}  {g['amount']:+g} {g['unit']}  "
            f"{g['limit_before']:g} -> {g['limit_after']:g}  {g['actor']}: {g['reason']}"
        )
