"""What the reconciler publishes, written to the transactional outbox in the transaction of the
change it reports: reconciliations (budget.reconciliations.v1) and actions (budget.actions.v1)."""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from datetime import datetime

import asyncpg
from google.protobuf.message import Message

from budgetgate.contracts import topics, wire
from budgetgate.core.policy import BudgetPolicy
from budgetgate.core.reconciliation import Settlement
from budgetgate.core.waiting import Headroom
from budgetgate.core.windows import Window
from budgetgate.messaging.outbox import enqueue
from budgetgate.contracts.timestamps import maybe_timestamp
from budgetgate.v1 import actions_pb2, common_pb2, reconciliations_pb2


async def _outbox(conn: asyncpg.Connection, topic: str, key: str, message: Message) -> None:
    await enqueue(conn, topic=topic, record=wire.encode(message, key=key))


async def reconciliation(
    conn: asyncpg.Connection,
    *,
    run_id: str,
    decision_id: str,
    result: Settlement,
    windows: Mapping[str, tuple[BudgetPolicy, Window]],
    bundle_sha: str,
    job: tuple[str, str] | None,
    revision: int,
    now: datetime,
) -> None:
    """A run's reservation replaced by actuals (or released), with the windows it charged."""
    # One event per revision of the run's settlement: a redelivered outbox row dedupes, a
    # correction (late samples) is a new event.
    event_id = str(uuid.uuid5(uuid.NAMESPACE_URL, f"budgetgate:reconciliation:{run_id}:{revision}"))
    message = reconciliations_pb2.Reconciliation(
        event_id=event_id,
        event_time=maybe_timestamp(now),
        run_id=run_id,
        decision_id=decision_id,
        final_state=result.final_state or ("RELEASED" if result.released else result.phase.upper()),
        provisional=result.provisional,
        projected_gpu_milli_hours=result.projected_gpu,
        actual_gpu_milli_hours=result.actual_gpu,
        error_gpu_milli_hours=result.error_gpu,
        job=common_pb2.Job(namespace=job[0], name=job[1]) if job else None,
        policy_bundle_sha=bundle_sha,
        wall_milli_hours=result.wall,
        over_running=result.over_running,
        released=result.released,
    )
    for key, amount in sorted(result.consumed_by_key().items()):
        policy, window = windows[key]
        message.charges.append(
            reconciliations_pb2.Reconciliation.WindowCharge(
                ledger_key=key,
                scope_id=policy.scope.scope_id,
                policy_id=policy.id,
                window_start=None if policy.window.rolling else maybe_timestamp(window.start),
                window_end=None if policy.window.rolling else maybe_timestamp(window.end),
                amount=amount,
                unit=str(policy.limit.unit),
            )
        )
    await _outbox(conn, topics.RECONCILIATIONS, run_id, message)


async def headroom(conn: asyncpg.Connection, found: Headroom, *, cause: str, now: datetime) -> None:
    """HEADROOM for a waiting run that fits now, keyed by run; one event per decision and cause."""
    run = found.run
    budget = next((limit for limit in found.limiting if limit.kind == "budget"), None)
    message = actions_pb2.BudgetAction(
        event_id=str(uuid.uuid5(uuid.NAMESPACE_URL, f"budgetgate:headroom:{run.decision_id}:{cause}")),
        event_time=maybe_timestamp(now),
        type=actions_pb2.HEADROOM,
        scope_id=budget.scope_id or "" if budget else "",
        policy_id=budget.name if budget else "",
        run_id=run.run_id,
        attempt=run.attempt,
        message=f"run {run.run_id!r} attempt {run.attempt} was {run.state}; it fits now, resubmit it with attempt {run.attempt + 1}: {found.describe()}",
    )
    await _outbox(conn, topics.ACTIONS, run.run_id, message)


async def action(
    conn: asyncpg.Connection,
    *,
    kind: int,
    ledger_key: str,
    policy_id: str,
    scope_id: str,
    text: str,
    now: datetime,
    run_id: str = "",
    threshold: int = 0,
    measure: str = "",
) -> None:
    """One action on budget.actions.v1, keyed by scope so a scope's actions stay in order."""
    name = actions_pb2.ActionType.Name(kind)
    message = actions_pb2.BudgetAction(
        event_id=str(uuid.uuid5(uuid.NAMESPACE_URL, f"budgetgate:action:{name}:{ledger_key}:{run_id}:{measure}{threshold}:{now.isoformat()}")),
        event_time=maybe_timestamp(now),
        type=kind,  # type: ignore[arg-type]
        scope_id=scope_id,
        ledger_key=ledger_key,
        policy_id=policy_id,
        run_id=run_id,
        threshold_percent=threshold,
        measure=measure,
        message=text,
    )
    await _outbox(conn, topics.ACTIONS, scope_id, message)
