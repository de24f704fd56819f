"""A decision as the API answers it, and as the Decision message the outbox publishes.

Every answer has one shape: the keys in the order of the published models (AdmissionResponse,
EvaluationOut) and every instant as RFC 3339 UTC with a `Z`, first answers and replays alike
(a replay comes back from Postgres's jsonb, which keeps neither key order nor text)."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any

import orjson

from budgetgate.core.accounting import BudgetSource
from budgetgate.core.evaluation import Decision, Evaluation, Plan, Reading, deciding_index
from budgetgate.core.units import Unit, display, hours, money
from budgetgate.core.windows import rfc3339
from budgetgate.contracts.admission import AdmissionResponse, EvaluationOut
from budgetgate.contracts.timestamps import maybe_timestamp
from budgetgate.v1 import common_pb2, decisions_pb2

_ANSWER_KEYS = tuple(AdmissionResponse.model_fields)
_EVALUATION_KEYS = tuple(EvaluationOut.model_fields)
_INSTANTS = ("decided_at", "window_start", "window_end", "next_eligible_time")


def response_body(*, plan: Plan, decision: Decision, decision_id: str, decided_at: datetime, standing: dict[str, Any] | None = None) -> dict[str, Any]:
    """The JSON answer to a submission, stored with the decision so a replay repeats it."""
    sub = plan.submission
    return {
        "run_id": sub.run_id,
        "attempt": sub.attempt,
        "decision_id": decision_id,
        "decision": decision.outcome,
        "reason": decision.reason,
        "replayed": False,
        "policy_bundle_sha": plan.bundle_sha,
        "override_revision": plan.override_revision,
        "projected_gpu_hours": hours(plan.projected_gpu),
        "showback_cost": float(money(plan.showback_micros)) if plan.showback_micros is not None else None,
        "currency": plan.currency,
        "decided_at": rfc3339(decided_at),
        "evaluations": [_evaluation(e, plan.projected_gpu) for e in decision.evaluations],
        **(standing or {"tenant": None, "priority_penalty": 0.0, "preemptible": False, "fair_share": None, "accounting": None}),
        "warnings": list(plan.warnings),
    }


def _evaluation(e: Evaluation, projected_gpu: int) -> dict[str, Any]:
    gpu = e.unit is Unit.GPU_HOURS
    return {
        "policy_id": e.policy_id,
        "policy_git_sha": e.policy_git_sha,
        "scope_id": e.scope_id,
        "window_start": rfc3339(e.window_start) if e.window_start else None,
        "window_end": rfc3339(e.window_end) if e.window_end else None,
        "unit": str(e.unit),
        "enforcement": str(e.enforcement),
        "on_exhausted": e.on_exhausted,
        "decision": e.outcome,
        "limit": display(e.unit, e.limit),
        "projected": display(e.unit, e.projected),
        "remaining": display(e.unit, e.remaining) if e.remaining is not None else None,
        "admitted": display(e.unit, e.admitted),
        "projected_gpu_hours": hours(projected_gpu),
        "remaining_gpu_hours": hours(e.remaining) if gpu and e.remaining is not None else None,
        "admitted_gpu_hours": hours(projected_gpu) if e.admitted else 0.0,
        "deficit": display(e.unit, e.deficit) if e.deficit is not None else None,
        "deficit_gpu_hours": hours(e.deficit) if gpu and e.deficit is not None else None,
        "next_eligible_time": rfc3339(e.next_eligible_time) if e.next_eligible_time else None,
        "missing_labels": list(e.missing_labels),
    }


def canonical(body: dict[str, Any]) -> dict[str, Any]:
    """A stored answer in the one shape every answer has (see the module doc); keys the models
    do not name keep their place after the known ones."""
    answer = {k: _instant(k, body[k]) for k in _ANSWER_KEYS if k in body}
    answer["evaluations"] = [
        {**{k: _instant(k, e[k]) for k in _EVALUATION_KEYS if k in e}, **{k: v for k, v in e.items() if k not in _EVALUATION_KEYS}}
        for e in body.get("evaluations", [])
    ]
    answer.setdefault("warnings", [])  # an answer stored before warnings were given had none
    answer.update((k, v) for k, v in body.items() if k not in answer)
    return answer


def replayed(row: Mapping[str, Any]) -> dict[str, Any]:
    """The answer stored with a decision row, as it is given again (to a resubmission, a status
    read): in the one shape, marked `replayed`."""
    body = canonical(orjson.loads(row["response"]) if isinstance(row["response"], str) else dict(row["response"]))
    body["replayed"] = True
    return body


def _instant(key: str, value: Any) -> Any:
    if key in _INSTANTS and isinstance(value, str):
        return rfc3339(datetime.fromisoformat(value))
    return value


def decision_message(
    *,
    plan: Plan,
    decision: Decision,
    decision_id: str,
    decided_at: datetime,
    job: tuple[str, str] | None,
    standing: dict[str, Any] | None = None,
    readings: Mapping[str, Reading] | None = None,
    accounting: BudgetSource | None = None,
) -> decisions_pb2.Decision:
    """The budget.decisions.v1 message; its event id is the decision id, so redelivery dedupes.
    `readings` are what each ledger key held before the decision, and `accounting` which figure
    the tenant's soft budget was judged on when an accounting source was asked, carried for the
    evidence."""
    sub = plan.submission
    res = sub.resources
    message = decisions_pb2.Decision(
        event_id=decision_id,
        event_time=maybe_timestamp(decided_at),
        decision_id=decision_id,
        run_id=sub.run_id,
        attempt=sub.attempt,
        outcome=common_pb2.Outcome.Value(decision.outcome),
        reason=decision.reason,
        policy_bundle_sha=plan.bundle_sha,
        namespace=sub.namespace,
        labels=dict(sub.labels),
        job=common_pb2.Job(namespace=job[0], name=job[1]) if job else None,
        resources=common_pb2.Resources(gpus=res.gpus, nodes=res.nodes, flavor=res.flavor or "", region=res.region or ""),
        projected_runtime_hours=float(sub.runtime_hours),
        projected_gpu_milli_hours=plan.projected_gpu,
        showback_cost_micros=plan.showback_micros or 0,
        currency=plan.currency or "",
        tenant=(standing or {}).get("tenant") or "",
        priority_penalty=(standing or {}).get("priority_penalty", 0.0),
        preemptible=(standing or {}).get("preemptible", False),
        deciding_evaluation=deciding_index(decision),
        override_revision=plan.override_revision,
        accounting=_accounting(accounting),
    )
    for e in decision.evaluations:
        reading = (readings or {}).get(e.ledger_key or "")
        policy_limit, grants = plan.granted.get(e.ledger_key or "", (None, ()))
        message.evaluations.append(
            decisions_pb2.Decision.Evaluation(
                policy_id=e.policy_id,
                policy_git_sha=e.policy_git_sha,
                scope_id=e.scope_id,
                ledger_key=e.ledger_key or "",
                window_start=maybe_timestamp(e.window_start),
                window_end=maybe_timestamp(e.window_end),
                unit=str(e.unit),
                enforcement=str(e.enforcement),
                on_exhausted=e.on_exhausted,
                limit_amount=e.limit,
                projected_amount=e.projected,
                remaining_amount=e.remaining or 0,
                admitted_amount=e.admitted,
                deficit_amount=e.deficit or 0,
                outcome=common_pb2.Outcome.Value(e.outcome),
                next_eligible_time=maybe_timestamp(e.next_eligible_time),
                missing_labels=list(e.missing_labels),
                reserved_amount=reading.reserved if reading else None,
                consumed_amount=reading.consumed if reading else None,
                policy_limit_amount=policy_limit,
                grants=[decisions_pb2.Decision.Grant(revision=g.revision, amount=g.amount, actor=g.actor, reason=g.reason) for g in grants],
            )
        )
    return message


def _accounting(source: BudgetSource | None) -> decisions_pb2.Decision.Accounting | None:
    if source is None:
        return None
    return decisions_pb2.Decision.Accounting(policy_id=source.policy_id, source=source.source, remaining_amount=source.remaining, detail=source.detail)
