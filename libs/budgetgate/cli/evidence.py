"""`budgetgate evidence …`: the OpenLineage events the evidence-emitter set aside.

An event is dead-lettered when the receiver refused it (400, 413, 422) or kept failing on it
(a 5xx, again and again, while it accepted other events): see services/evidence_emitter/sender.py.
Its run's later events then go on without it. `resend` puts such events back, for after the
receiver (or the event's cause) is fixed; the emitter sends them within a second or two.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import click

from budgetgate.cli import backend


@click.group()
def evidence() -> None:
    """Evidence events the emitter dead-lettered: list them, or send them again."""


def _seqs(seqs: tuple[int, ...], every: bool) -> list[int] | None:
    if bool(seqs) == every:
        raise click.UsageError("name the events to resend (--seq, repeatable) or pass --all, not both")
    return list(seqs) if seqs else None


@evidence.command("dead")
@click.option("--limit", default=100, show_default=True, type=click.IntRange(1), help="At most this many, oldest first.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
def dead(limit: int, as_json: bool) -> None:
    """Dead-lettered evidence events: run, stage, the receiver's answer and the reason."""
    rows = asyncio.run(_with_store(lambda store, conn: store.dead(conn, limit=limit)))
    for row in rows:
        data = _as_json(row)
        if as_json:
            click.echo(json.dumps(data, sort_keys=True))
        else:
            answer = f"HTTP {data['status_code']}" if data["status_code"] is not None else "no answer"
            click.echo(f"#{data['seq']}  {data['dead_at'] or '-'}  run {data['run_id']} {data['stage']} {data['event_type']}  {answer}: {data['error']}")
    if not rows and not as_json:
        click.echo("no dead-lettered evidence events")


@evidence.command("resend")
@click.option("--seq", "seqs", multiple=True, type=int, help="The event's number (as `budgetgate evidence dead` shows it); repeatable.")
@click.option("--all", "every", is_flag=True, help="Every dead-lettered event.")
def resend(seqs: tuple[int, ...], every: bool) -> None:
    """Send dead-lettered events again (after the receiver, or what it refused, is fixed)."""
    wanted = _seqs(seqs, every)
    back = asyncio.run(_with_store(lambda store, conn: store.resend(conn, seqs=wanted)))
    missing = sorted(set(wanted or ()) - set(back))
    click.echo(f"{len(back)} event(s) back in the emitter's queue" + (f": {', '.join(f'#{s}' for s in back)}" if back and len(back) <= 20 else ""))
    if missing:
        raise click.ClickException(f"not dead-lettered (delivered, pending, or no such event): {', '.join(f'#{s}' for s in missing)}")


async def _with_store(call: Callable[[Any, Any], Awaitable[Any]]) -> Any:
    """`call(store, connection)` on the stack's ledger database (budgetgate.evidence.event_store)."""
    from budgetgate.evidence import event_store

    async with backend.postgres(backend.stack_settings().postgres_dsn) as conn:
        return await call(event_store, conn)


def _as_json(row: Any) -> dict[str, Any]:
    return {
        "seq": row["seq"],
        "run_id": row["run_id"],
        "stage": row["stage"],
        "event_type": row["event_type"],
        "event_time": row["event_time"].isoformat(),
        "attempts": row["attempts"],
        "status_code": row["status_code"],
        "error": row["last_error"],
        "body": (row["body"] or "")[:2000],
        "dead_at": row["dead_at"].isoformat() if row["dead_at"] else None,
    }
