"""`budgetgate settlements dead-letters|resolve`: the settlements the reconciler set aside after
they kept failing (services/reconciler/dead_letters.py), and their resolution by an operator.

Like `budgetgate ledger`, these talk to the stack's Postgres and Redis directly: `resolve`
changes the ledger as the reconciler does, in its ledger transaction, so it reads the
reconciler's settings (the same BUDGETGATE_* variables; run it where the reconciler runs)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import click

from budgetgate.cli import backend

if TYPE_CHECKING:
    from budgetgate.services.reconciler.settings import ReconcilerSettings
    from budgetgate.services.reconciler.settler import Settler


@click.group()
def settlements() -> None:
    """Settlements the reconciler dead-lettered: list them with what their runs hold, resolve them."""


@settlements.command("dead-letters")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def dead_letters(as_json: bool) -> None:
    """Runs whose settlement kept failing and was set aside: the reason, the tries, since when,
    and what each still holds, on which budgets. Until resolved, that stays held."""
    from budgetgate.services.reconciler import dead_letters as letters

    settings = backend.stack_settings()

    async def read() -> list[dict[str, Any]]:
        async with backend.postgres(settings.postgres_dsn) as conn:
            return await letters.dead_letters(conn)  # type: ignore[arg-type]

    found = asyncio.run(read())
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
    from budgetgate.runtime.backends import BACKEND_ERRORS
    from budgetgate.services.reconciler.dead_letters import NotDeadLettered, StillFailing, resolve as resolve_one
    from budgetgate.services.reconciler.settings import ReconcilerSettings

    settings = backend.stack_settings(ReconcilerSettings, needs=("postgres", "redis"))
    actor = backend.actor()

    async def run() -> Any:
        async with _settler(settings) as settler:
            return await resolve_one(settler, run_id, release=release, actor=actor, reason=reason)

    try:
        done = asyncio.run(run())
    except NotDeadLettered as exc:
        raise click.ClickException(f"{exc}; nothing changed") from None
    except StillFailing as exc:
        raise click.ClickException(
            f"{exc}; it stays dead-lettered and nothing changed: fix the cause first, or give back what it holds with --release"
        ) from None
    except BACKEND_ERRORS as exc:
        text = " ".join(str(exc).split()) or type(exc).__name__
        raise click.ClickException(f"Postgres or Redis failed while resolving run {run_id!r} ({text}); nothing changed, try again") from None
    if as_json:
        answer = {"run_id": run_id, "action": done.action, "actor": actor, "reason": reason, "changed": done.outcome.changed}
        click.echo(json.dumps({**answer, "held": done.before, "holds": done.after}, indent=2))
        return
    held = _holds(done.before)
    if release:
        click.echo(f"run {run_id}: released what it held: {'; '.join(held)}" if done.before["reservations"] else f"run {run_id}: released")
    else:
        click.echo(f"run {run_id}: settled again" + ("" if done.outcome.changed else " (its charges stood as they were)"))
    for line in _holds(done.after):
        click.echo(f"  holds now {line}")
    click.echo(f"logged as {done.action} by {actor}", err=True)


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


@contextlib.asynccontextmanager
async def _settler(settings: ReconcilerSettings) -> AsyncIterator[Settler]:
    """The reconciler's settler on the stack's Postgres and Redis (both checked reachable), with
    the active policy bundle read, closed on exit."""
    from budgetgate.ledger.redis_ledger import RedisLedger
    from budgetgate.ledger.sync import LedgerSync
    from budgetgate.services.reconciler.bundles import Bundles
    from budgetgate.services.reconciler.settler import Settler

    async with backend.postgres_pool(settings.postgres_dsn, max_size=3) as pool, backend.redis(settings.redis_url) as client:
        ledger = RedisLedger(client, prefix=settings.redis_prefix)  # type: ignore[arg-type]
        bundles = Bundles()
        async with pool.acquire() as conn:  # type: ignore[attr-defined]
            await bundles.refresh(conn)
        yield Settler.configured(settings, pool=pool, ledger=ledger, sync=LedgerSync(pool, ledger), bundles=bundles)  # type: ignore[arg-type]
