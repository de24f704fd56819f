"""Routes that decide nothing for real: a quote (what admission would decide now) and the
explanation of a recorded decision (recomputed from what it was decided on)."""

from __future__ import annotations

import json

import time
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from budgetgate.edge.auth import Action, Principal, allow
from budgetgate.ledger.archive import archived_decision
from budgetgate.services.admission.access import archived_problem, require_submission
from pydantic import BaseModel, ConfigDict, Field, create_model

from budgetgate.runtime.backends import BACKEND_ERRORS
from budgetgate.ledger.queries import owned_by
from budgetgate.contracts.operations import Operation
from budgetgate.services.admission.admitter import Unavailable
from budgetgate.decisions.explain import explanation, recompute
from budgetgate.services.admission.quoting import Quoter
from budgetgate.services.admission.routes.admissions import RUN_ID
from budgetgate.contracts.admission import _EVALUATION_EXAMPLE, AdmissionRequest, AdmissionResponse, Problem

sql = owned_by("budgetgate.services.admission")

router = APIRouter()

_QUOTE_EXAMPLE = {
    "run_id": "flyte/vision/exec-7f3a/n0",
    "attempt": 1,
    "quote": True,
    "quoted_at": "2026-07-14T09:30:00Z",
    "decision": "ALLOW",
    "reason": ("admitted: reserved on 3 budgets; tightest is 'gpu-budget/team-vision-prod' with 452 GPU-hours of 500 GPU-hours left after this run"),
    "next_eligible_time": None,
    "policy_bundle_sha": "e" * 40,
    "projected_gpu_hours": 48.0,
    "showback_cost": 188.78,
    "currency": "USD",
    "evaluations": [_EVALUATION_EXAMPLE],
    "tenant": "vision",
    "priority_penalty": 0.0,
    "preemptible": False,
    "fair_share": None,
}
_EXPLAIN_EXAMPLE = {
    "run_id": "flyte/vision/exec-7f3a/n0",
    "attempt": 1,
    "decision_id": "5d0f3c1e-8a8e-4d43-9a57-0b9a8f0e6c11",
    "policy_bundle_sha": "e" * 40,
    "replayable": True,
    "identical": True,
    "differences": [],
    "stored": {"decision": "ALLOW"},
    "recomputed": {"decision": "ALLOW"},
    "readings": [
        {
            "ledger_key": "ns=vision-prod;cost-center=1042;team=vision|2026-07|gpu_hours",
            "limit": 1800000000,
            "reserved": 0,
            "consumed": 0,
            "remaining": 1800000000,
        }
    ],
    "account": [
        "Policy 'gpu-budget/team-vision-prod' (hard, on exhaustion deny) matched: "
        "namespace 'vision-prod' is one of its namespaces (vision-prod); labels cost-center=1042, team=vision."
    ],
}


# A quote answers what a submission's answer would hold, bar what only a recorded decision has.
QuoteResponse = create_model(
    "QuoteResponse",
    __doc__="What admission would decide on the submission now; nothing is reserved or recorded.",
    __config__=ConfigDict(json_schema_extra={"examples": [_QUOTE_EXAMPLE]}),
    quote=(bool, Field(description="always true: this answer decided nothing")),
    quoted_at=(str, Field(description="the instant the quote was computed (UTC)")),
    next_eligible_time=(str | None, Field(description="for a DELAY (and a DENY some time will cure): the deciding budget's earliest instant with room")),
    **{name: (f.annotation, f) for name, f in AdmissionResponse.model_fields.items() if name not in ("decision_id", "replayed", "decided_at")},  # type: ignore[call-overload]
)


class ExplainResponse(BaseModel):
    """A recorded decision beside its recomputation from the recorded inputs, and in words."""

    model_config = ConfigDict(json_schema_extra={"examples": [_EXPLAIN_EXAMPLE]})

    run_id: str = Field(description="the run id")
    attempt: int = Field(description="the attempt of the latest decision, the one explained")
    decision_id: str = Field(description="the decision explained")
    policy_bundle_sha: str | None = Field(description="the bundle it was decided under")
    replayable: bool = Field(description="false for decisions recorded before their readings were (see README)")
    identical: bool | None = Field(description="whether the recomputed answer equals the stored one; null when not replayable")
    differences: list[str] = Field(description="each differing field, stored against recomputed (or why it cannot be recomputed)")
    stored: dict[str, Any] = Field(description="the answer as given at the time")
    recomputed: dict[str, Any] | None = Field(description="the answer recomputed now from the recorded inputs")
    readings: list[dict[str, Any]] = Field(description="each ledger key's limit, reserved, consumed and remaining as the decision read them")
    account: list[str] = Field(description="the decision in sentences: what matched and why, each budget's figures, what decided")


OPERATIONS: dict[str, Operation] = {
    "POST /v1/quotes": Operation("quoteAdmission"),
    "GET /v1/admissions/{run_id}/explain": Operation("explainAdmission", parameters={"run_id": "the run id (it may contain slashes)"}),
}


@router.post("/v1/quotes", response_model=QuoteResponse, responses={422: {}, 503: {"model": Problem}})
async def quote(body: AdmissionRequest, request: Request, principal: Principal = Depends(allow(Action.SUBMIT))) -> JSONResponse:
    """What POST /v1/admissions would answer now, without reserving or recording anything."""
    require_submission(principal, namespace=body.namespace, labels=body.labels, tenant_label=request.app.state.rt.settings.tenant_label)
    started = time.perf_counter()
    answer = await Quoter(request.app.state.rt.admitter).quote(body)
    request.app.state.metrics.observe_quote(answer, time.perf_counter() - started)
    return JSONResponse(answer)


@router.get(
    "/v1/admissions/{run_id:path}/explain",
    response_model=ExplainResponse,
    responses={404: {"model": Problem}, 410: {"model": Problem}, 503: {"model": Problem}},
)
async def explain(request: Request, run_id: str = RUN_ID, principal: Principal = Depends(allow(Action.LOOKUP))) -> JSONResponse:
    """The run's latest decision recomputed from its recorded inputs, side by side, explained; 410
    when it is archived (`budgetgate ledger archive`), naming the archive."""
    try:
        rt = request.app.state.rt
        async with rt.pool.acquire() as conn:
            row = await conn.fetchrow(sql("decision_inputs"), run_id)
            if row is None:
                gone = await archived_decision(conn, run_id)
                if gone is not None:
                    return JSONResponse(archived_problem(principal, gone), status_code=410)
                return JSONResponse({"detail": f"no decision for run {run_id!r}"}, status_code=404)
            bundle = await rt.policies.under(conn, row["policy_bundle_sha"], row["override_revision"])
    except BACKEND_ERRORS as exc:
        raise Unavailable(f"Postgres unavailable: {exc}") from exc
    asked = row["request"] if isinstance(row["request"], dict) else json.loads(row["request"])
    require_submission(principal, namespace=asked["namespace"], labels=asked.get("labels") or {}, tenant_label=request.app.state.rt.settings.tenant_label)
    found = recompute(dict(row), bundle)
    return JSONResponse(explanation(found, bundle))
