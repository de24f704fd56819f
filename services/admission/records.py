"""A decision as Postgres stores it: one `DecisionRecord` per decision (with its evaluations,
ledger entries, reservations, holds and pool token), written a batch at a time in one statement
together with the decisions' outbox rows."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import orjson

from budgetgate.messaging import outbox

from budgetgate.contracts import topics
from budgetgate.core.accounting import BudgetSource
from budgetgate.core.evaluation import Charge, Decision, Evaluation, Plan, Reading
from budgetgate.core.ledger_key import LedgerKey
from budgetgate.ledger.queries import owned_by
from budgetgate.contracts.trace_context import inject_headers
from budgetgate.decisions.concurrency import Asks
from budgetgate.decisions.rendering import decision_message
from budgetgate.contracts.admission import AdmissionRequest
from budgetgate.v1.decisions_pb2 import Decision as DecisionMessage

sql = owned_by("budgetgate.services.admission")


@dataclass(frozen=True)
class DecisionRecord:
    """Everything one decision writes; `reserved` when the ledger holds its charges."""

    request: AdmissionRequest
    plan: Plan
    decision: Decision
    body: dict[str, Any]  # the answer, as replays repeat it
    asks: Asks
    decided_at: datetime
    reserved: bool
    ledger_seq: int | None
    readings: dict[str, Any]  # what the decision was made on (deciding.readings_record)
    # Taken by the Kubernetes validating webhook before the object was stored: given back unless
    # the object is confirmed (the reconciler's provisional hold, migration 0028).
    provisional: bool = False

    def row(self) -> dict[str, Any]:
        """The jsonb object record_decisions reads (see queries.sql)."""
        request, the_plan, reserved = self.request, self.plan, self.reserved
        res = request.resources
        charges = the_plan.charges if reserved else ()
        pool = self.asks.pool if reserved else None
        return {
            "decision_id": self.body["decision_id"],
            "run_id": request.run_id,
            "attempt": request.attempt,
            "outcome": self.decision.outcome,
            "reason": self.decision.reason,
            "namespace": request.namespace,
            "labels": request.labels,
            "job_namespace": request.job.namespace if request.job else None,
            "job_name": request.job.name if request.job else None,
            "policy_bundle_sha": the_plan.bundle_sha,
            "projected_gpu": the_plan.projected_gpu,
            "showback_micros": the_plan.showback_micros,
            "currency": the_plan.currency,
            "request": request.model_dump(mode="json"),
            "response": self.body,
            "decided_at": self.decided_at.isoformat(),
            "ledger_seq": self.ledger_seq,
            "readings": self.readings,
            "override_revision": the_plan.override_revision,
            "gpus": res.gpus,
            "nodes": res.nodes,
            "flavor": res.flavor,
            "region": res.region,
            "expected_end": (self.decided_at + timedelta(hours=float(the_plan.submission.runtime_hours))).isoformat(),
            "evaluations": [_evaluation(e) for e in self.decision.evaluations],
            "entries": [entry(c) for c in charges],
            "reservations": [{"ledger_key": c.ledger_key, "amount": c.amount} for c in charges],
            "holds": (
                {"tenant": self.asks.tenant, "gpus": res.gpus, "nodes": res.nodes, "sensitive": self.asks.sensitive}
                if reserved and self.asks.counters
                else None
            ),
            "token": {
                "namespace": pool.levels[0].namespace,
                "levels": [level.namespace for level in pool.levels],
                "project": pool.project,
                "sub_namespace": pool.sub_namespace,
                "lease_expires_at": datetime.fromtimestamp(pool.expiry_ms / 1000, UTC).isoformat(),
                "lease_seconds": pool.lease_seconds,
            } if pool else None,
            "provisional": self.provisional,
        }  # fmt: skip

    def message(self) -> DecisionMessage:
        """The budget.decisions.v1 message announcing the decision."""
        job = (self.request.job.namespace, self.request.job.name) if self.request.job else None
        standing = {k: self.body[k] for k in ("tenant", "priority_penalty", "preemptible")}
        readings = {r["ledger_key"]: Reading(r["limit"], r["reserved"], r["consumed"]) for r in self.readings.get("ledger", [])}
        message = decision_message(
            plan=self.plan,
            decision=self.decision,
            decision_id=self.body["decision_id"],
            decided_at=self.decided_at,
            job=job,
            standing=standing,
            readings=readings,
            accounting=BudgetSource.recorded(self.readings.get("accounting")),
        )
        return message


def entry(c: Charge) -> dict[str, Any]:
    """The ledger entry a charge is filed under, as record_decisions and ensure_ledger_entries read it."""
    return {
        "ledger_key": c.ledger_key,
        # (an escrow lease's scope is its budget's with `@<root>` after it)
        "scope_id": c.policy.scope.scope_id if c.root is None else LedgerKey.parse(c.ledger_key).scope_id,
        "unit": str(c.policy.limit.unit),
        "window_key": c.window.key,
        "window_start": None if c.policy.window.rolling else c.window.start.isoformat(),
        "window_end": None if c.policy.window.rolling else c.window.end.isoformat(),
        "policy_id": c.policy.id,
        "limit_amount": c.policy.limit.amount,
    }


def _evaluation(e: Evaluation) -> dict[str, Any]:
    return {
        "policy_id": e.policy_id,
        "policy_git_sha": e.policy_git_sha,
        "scope_id": e.scope_id,
        "ledger_key": e.ledger_key,
        "window_start": e.window_start.isoformat() if e.window_start else None,
        "window_end": e.window_end.isoformat() if e.window_end else None,
        "unit": str(e.unit),
        "enforcement": str(e.enforcement),
        "outcome": e.outcome,
        "limit_amount": e.limit,
        "projected": e.projected,
        "remaining": e.remaining,
        "admitted": e.admitted,
        "deficit": e.deficit,
        "next_eligible_time": e.next_eligible_time.isoformat() if e.next_eligible_time else None,
    }


async def record(conn: asyncpg.Connection, records: Sequence[DecisionRecord]) -> None:
    """Store `records` and the outbox bundle of their decision messages (one row: one to write,
    claim and mark per batch) in one statement: in `conn`'s transaction, or, outside one
    (admission's ledger_session), committing as it ends."""
    messages = [r.message() for r in records]
    bundle = outbox.bundle_messages(topic=topics.DECISIONS, messages=messages, keys=[r.request.run_id for r in records], trace_headers=inject_headers())
    await conn.execute(
        sql("record_decisions"),
        orjson.dumps([r.row() for r in records]).decode(),
        bundle.topic,
        bundle.keys,
        bundle.payloads,
        bundle.event_ids,
        bundle.headers,
    )
