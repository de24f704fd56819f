"""The consumer's handlers: each decision or reconciliation becomes one stored OpenLineage event,
in the transaction that also records the message in the inbox (budgetgate.messaging.inbox)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from typing import Any

import asyncpg

from budgetgate.messaging.inbox import Poison
from budgetgate.evidence import event_store, events, facet
from budgetgate.v1 import decisions_pb2, reconciliations_pb2

Stored = Callable[[str, str], None]  # (stage, event type), for metrics


class EvidenceHandlers:
    """Handlers for budget.decisions.v1 and budget.reconciliations.v1."""

    def __init__(self, *, producer: str, on_stored: Stored | None = None) -> None:
        self.producer = producer
        self.on_stored = on_stored or (lambda _stage, _type: None)

    async def decision(self, conn: asyncpg.Connection, message: decisions_pb2.Decision, _record: Any) -> None:
        with _poison_if_unusable():
            fields = facet.decision_fields(message)
            event_type = events.decision_event_type(fields["decision"])
            at = facet.event_time(message.event_time)
        job = _job(message.job) or (message.namespace or "budgetgate", message.run_id)
        await self._store(
            conn,
            stage=facet.DECISION,
            message_id=message.event_id,
            run_id=message.run_id,
            decision_id=fields["decision_id"],
            event_type=event_type,
            at=at,
            job=job,
            fields=fields,
        )
        await self._settle_waiting(conn, message.run_id, fields, job)

    async def _settle_waiting(self, conn: asyncpg.Connection, run_id: str, decided: dict[str, Any], job: tuple[str, str]) -> None:
        """Reconciliations of this decision that came first get its facet (and its job) now."""
        for seq, payload in await event_store.waiting_for_run(conn, run_id):
            reconciled = payload["run"]["facets"][facet.FACET_KEY]
            if reconciled.get("decision_id") not in (None, decided["decision_id"]):
                continue
            await _release(conn, run_id, seq, payload, decided, job)

    async def reconciliation(self, conn: asyncpg.Connection, message: reconciliations_pb2.Reconciliation, _record: Any) -> None:
        decided = await event_store.decision_event(conn, message.run_id, message.decision_id or None)
        decided_facet = decided["run"]["facets"][facet.FACET_KEY] if decided else None
        terminal_sent = await event_store.terminal_sent(conn, message.run_id)
        with _poison_if_unusable():
            fields = facet.reconciliation_fields(message, decided_facet)
            event_type = events.reconciliation_event_type(fields["final_state"], terminal_sent=terminal_sent)
            at = facet.event_time(message.event_time)
            row = _reconciliation_row(message, fields, at)
        # The decision's job first: every event of a run must name the same job in Marquez.
        job = (decided["job"]["namespace"], decided["job"]["name"]) if decided else _job(message.job) or ("budgetgate", message.run_id)
        await event_store.add_reconciliation(conn, row)
        await self._store(
            conn,
            stage=facet.RECONCILIATION,
            message_id=message.event_id,
            run_id=message.run_id,
            decision_id=fields.get("decision_id"),
            event_type=event_type,
            at=at,
            job=job,
            fields=fields,
            state="pending" if decided else "waiting",
        )

    async def _store(
        self,
        conn: asyncpg.Connection,
        *,
        stage: str,
        message_id: str,
        run_id: str,
        decision_id: str | None,
        event_type: events.RunState,
        at: datetime,
        job: tuple[str, str],
        fields: dict[str, Any],
        state: str = "pending",
    ) -> None:
        event = events.run_event(event_type=event_type, at=at, run_id=run_id, job=job, fields=fields, producer=self.producer)
        await event_store.add_event(conn, event_store.StoredEvent(
            source_event_id=message_id,
            stage=stage,
            run_id=run_id,
            run_uuid=events.run_uuid(run_id),
            decision_id=decision_id,
            event_type=event_type.value,
            event_time=at,
            payload=events.to_json(event),
            state=state,
        ))  # fmt: skip
        self.on_stored(stage, event_type.value)


async def release_decided(conn: asyncpg.Connection, run_id: str) -> int:
    """Release the run's waiting reconciliations whose decision is stored by now; returns how
    many. A decision and its reconciliation consumed at the same time (by two instances, or two
    consumers of one) each miss the other's uncommitted row: the decision finds nothing waiting,
    the reconciliation no decision, and it would wait out the decision wait and go out with an
    inferred decision. The sender calls this for every run with such a row, each pass."""
    released = 0
    for seq, payload in await event_store.waiting_for_run(conn, run_id):
        decision = await event_store.decision_event(conn, run_id, payload["run"]["facets"][facet.FACET_KEY].get("decision_id"))
        if decision is None:
            continue
        decided = {k: v for k, v in decision["run"]["facets"][facet.FACET_KEY].items() if not k.startswith("_")}
        await _release(conn, run_id, seq, payload, decided, (decision["job"]["namespace"], decision["job"]["name"]))
        released += 1
    return released


async def _release(conn: asyncpg.Connection, run_id: str, seq: int, payload: dict[str, Any], decided: dict[str, Any], job: tuple[str, str]) -> None:
    """A waiting reconciliation, given its decision's facet and job, released to the sender."""
    reconciled = payload["run"]["facets"][facet.FACET_KEY]
    payload["run"]["facets"][facet.FACET_KEY] = {
        **{k: v for k, v in reconciled.items() if k.startswith("_")},
        **facet.with_decision(reconciled, decided),
    }
    payload["job"] = {**payload["job"], "namespace": job[0], "name": job[1]}
    # Typed again after the decision's own event: typed when it came, before a START that
    # began the run's life again (a refused attempt's ABORT then counted as its end).
    final_state = payload["run"]["facets"][facet.FACET_KEY].get("final_state", "")
    with _poison_if_unusable():
        payload["eventType"] = events.reconciliation_event_type(final_state, terminal_sent=await event_store.terminal_sent(conn, run_id)).value
    await event_store.settle_waiting(conn, seq, payload)


@contextlib.contextmanager
def _poison_if_unusable() -> Iterator[None]:
    """What a message cannot be turned into an event from is poison: it goes to the dead-letter
    topic with the reason and the consumer goes on. Besides UnusableMessage, that is any
    ValueError or OverflowError of reading it (an enum value this build does not know, as from a
    newer producer during a rolling upgrade; a time out of range), which the inbox would
    otherwise take for an outage and retry for ever, every later message waiting."""
    try:
        yield
    except facet.UnusableMessage as exc:
        raise Poison(str(exc)) from exc
    except (ValueError, OverflowError) as exc:
        raise Poison(f"unusable message: {type(exc).__name__}: {exc}") from exc


def _job(job: Any) -> tuple[str, str] | None:
    if job is not None and job.namespace and job.name:
        return job.namespace, job.name
    return None


def _reconciliation_row(message: reconciliations_pb2.Reconciliation, fields: dict[str, Any], at: datetime) -> event_store.ReconciliationRow:
    state = fields["final_state"]
    return event_store.ReconciliationRow(
        event_id=message.event_id,
        run_id=message.run_id,
        decision_id=message.decision_id or fields.get("decision_id"),
        final_state=state,
        terminal=events.reconciliation_event_type(state, terminal_sent=False) in events.TERMINAL,
        provisional=message.provisional,
        policy_git_sha=fields.get("policy_bundle_sha", "") or message.policy_bundle_sha,
        projected_gpu=message.projected_gpu_milli_hours,
        actual_gpu=message.actual_gpu_milli_hours,
        reconciled_at=at,
        charges=_charges_by_key(message),
    )


def _charges_by_key(message: reconciliations_pb2.Reconciliation) -> tuple[tuple[Any, ...], ...]:
    """One row per ledger key: a reconciler may split a key's charge (rolling-window buckets)."""
    rows: dict[str, list[Any]] = {}
    for c in message.charges:
        row = rows.get(c.ledger_key)
        if row is None:
            rows[c.ledger_key] = [
                c.ledger_key,
                c.scope_id,
                facet.window_key(c.ledger_key),
                c.window_start.ToDatetime(tzinfo=UTC) if c.HasField("window_start") else None,
                c.window_end.ToDatetime(tzinfo=UTC) if c.HasField("window_end") else None,
                c.policy_id or None,
                c.unit,
                c.amount,
            ]
        else:
            row[7] += c.amount
    return tuple(tuple(row) for row in rows.values())
