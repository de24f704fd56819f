"""`budgetgate settlements dead-letters|resolve`: the settlements the reconciler set aside after
they kept failing, and their resolution by an operator, through the reconciler's own API
(`GET /v1/settlements/dead-letters`, `POST /v1/settlements/{run_id}/resolve`) with the
project's client: the reconciler resolves them with its own settler and settings, and logs the
caller's principal in the admin log. Its URL is BUDGETGATE_RECONCILER_URL, else the local
stack's; the token BUDGETGATE_TOKEN, else the local stack's operator token."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, TypeVar

import click

from budgetgate.cli.calling import call

T = TypeVar("T")


@click.group()
def settlements() -> None:
    """Settlements the reconciler dead-lettered: list them with what their runs hold, resolve them."""


def _call(work: Callable[[Any], T]) -> T:
    return call(work, service="reconciler", url=lambda client: client.reconciler_url)


@settlements.command("dead-letters")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def dead_letters(as_json: bool) -> None:
    """Runs whose settlement kept failing and was set aside: the reason, the tries, since when,
    and what each still holds, on which budgets. Until resolved, that stays held."""
    found = [dead.model_dump(mode="json") for dead in _call(lambda client: client.dead_letters()).dead_letters]
    if as_json:
        click.echo(json.dumps(found, indent=2))
        return
    if not found:
        click.echo("no dead-lettered settlements")
        return
    for dead in found:
        click.echo(f"run {dead['run_id']}: dead-lettered since {dead['dead_since']} after {dead['tries']} tries (failing since {dead['failing_since']})")
        click.echo(f"  reason: {dead['reason']}")
        for line in _holds(dead):
            click.echo(f"  holds {line}")


def _said(_ctx: click.Context, _param: click.Parameter, value: str) -> str:
    if not value.strip():
        raise click.BadParameter("say why, for the admin log (e.g. a ticket number)")
    return value.strip()


@settlements.command()
@click.argument("run_id", metavar="RUN")
@click.option("--release", is_flag=True, help="Give back what the run holds, charging nothing more (it never used it, or you decide so).")
@click.option("--settle", is_flag=True, help="Settle the run again now, once the cause of its failure is fixed.")
@click.option("--reason", required=True, callback=_said, help="Why, for the admin log.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def resolve(run_id: str, release: bool, settle: bool, reason: str, as_json: bool) -> None:
    """Resolve RUN's dead-lettered settlement: --release its hold, or --settle it again.

    Either is one ledger transaction (Postgres and Redis kept in line, as the reconciler's own
    settlements) that also forgets the dead letter and logs who did it and why in the admin log.
    A release leaves a running run its quota slot and pool token until its end is settled."""
    if release == settle:
        raise click.UsageError("say how to resolve it: --release (give back what the run holds) or --settle (settle it again), one of the two")
    done = _call(lambda client: client.resolve_settlement(run_id, action="release" if release else "settle", reason=reason)).model_dump(mode="json")
    if as_json:
        click.echo(json.dumps(done, indent=2))
        return
    held = _holds(done["held"])
    if release:
        click.echo(f"run {run_id}: released what it held: {'; '.join(held)}" if done["held"]["reservations"] else f"run {run_id}: released")
    else:
        click.echo(f"run {run_id}: settled again" + ("" if done["changed"] else " (its charges stood as they were)"))
    for line in _holds(done["holds"]):
        click.echo(f"  holds now {line}")
    click.echo(f"logged as {done['action']} by {done['actor']}", err=True)


def _holds(holdings: dict[str, Any]) -> list[str]:
    """What a run holds, a line each: reservations by budget, its quota slot, its pool tokens."""
    lines = [
        f"{_amount(r)} on budget {r['policy_id']} (scope {r['scope_id']}, window {r['window_key']}, ledger key {r['ledger_key']})"
        for r in holdings["reservations"]
    ]
    quota = holdings["quota"]
    if quota is not None:
        lines.append(f"a quota slot of tenant {quota['tenant'] or '-'}: {quota['gpus']} GPU(s), {quota['nodes']} node(s)")
    lines += [f"pool token {token}" for token in holdings["pool_tokens"]]
    return lines or ["nothing"]


def _amount(reservation: dict[str, Any]) -> str:
    unit = reservation["unit"]
    return f"{reservation['amount']:,.2f} of cost" if unit == "cost" else f"{reservation['amount']:g} {unit.replace('_', '-')}"
