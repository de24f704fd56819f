"""The reconciler's operator API: the settlements it dead-lettered after they kept failing, with
what their runs still hold (`GET /v1/settlements/dead-letters`), and their resolution
(`POST /v1/settlements/{run_id}/resolve`). `OPERATIONS` names each endpoint for generated clients."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StringConstraints

from budgetgate.contracts.admission import Text, UnitName
from budgetgate.contracts.operations import Operation

RELEASE, SETTLE = "release", "settle"


def _said(reason: str) -> str:
    if not reason.strip():
        raise ValueError("say why, for the admin log (e.g. a ticket number)")
    return reason.strip()


Reason = Annotated[Text, StringConstraints(max_length=2000), AfterValidator(_said)]

_RESERVATION = {
    "ledger_key": "dl|ns=vision-prod;team=vision|2026-07",
    "ledger_amount": 216000000,
    "policy_id": "dl",
    "scope_id": "ns=vision-prod;team=vision",
    "window_key": "2026-07",
    "unit": "gpu_hours",
    "amount": 60.0,
}
_HOLDINGS = {"reservations": [_RESERVATION], "quota": {"tenant": "vision", "gpus": 6, "nodes": 1}, "pool_tokens": []}
_DEAD = {
    "run_id": "victim",
    "reason": "AmountOutOfRange: 4503599627370497 + 4503599627370497 is beyond the ledger's range",
    "tries": 3,
    "failing_since": "2026-07-14T09:12:01.412000+00:00",
    "dead_since": "2026-07-14T09:12:05.807000+00:00",
    **_HOLDINGS,
}
_RESOLVE = {"action": RELEASE, "reason": "bad exporter sample, ticket OPS-7"}
_RESOLVED = {
    "run_id": "victim",
    "action": "settlement.release",
    "actor": "ops-on-call",
    "reason": "bad exporter sample, ticket OPS-7",
    "changed": True,
    "held": _HOLDINGS,
    "holds": {"reservations": [], "quota": None, "pool_tokens": []},
}


class HeldReservation(BaseModel):
    """A reservation a run holds on one budget's window."""

    ledger_key: str = Field(description="the ledger entry (budget, scope and window) it holds room on")
    ledger_amount: int = Field(description="what it holds, in the ledger's integers (milli-unit-seconds: 3,600,000 a GPU-hour; micro-units of money)")
    policy_id: str = Field(description="the budget's policy id")
    scope_id: str = Field(description="the budget's canonical scope id")
    window_key: str = Field(description="the budget's window")
    unit: UnitName = Field(description="the budget's unit")
    amount: float = Field(description="what it holds, in the budget's unit")


class QuotaHold(BaseModel):
    """A run's slot in its tenant's hard quotas."""

    tenant: str | None = Field(description="the tenant (null: the run has none)")
    gpus: int = Field(description="GPUs it counts for")
    nodes: int = Field(description="nodes it counts for")


class Holdings(BaseModel):
    """What a run holds now: its reservations, its quota slot and its pool tokens."""

    model_config = ConfigDict(json_schema_extra={"examples": [_HOLDINGS]})

    reservations: list[HeldReservation] = Field(description="its reservations, a budget window each")
    quota: QuotaHold | None = Field(description="its quota slot (null: none)")
    pool_tokens: list[str] = Field(description="its pool tokens, as namespace/token")


class DeadLetter(BaseModel):
    """A settlement the reconciler set aside after it kept failing, and what its run still holds
    (held until an operator resolves it)."""

    model_config = ConfigDict(json_schema_extra={"examples": [_DEAD]})

    run_id: str = Field(description="the run")
    reason: str = Field(description="why its last settlement was refused")
    tries: int = Field(description="settlements tried and refused")
    failing_since: str = Field(description="when the first of them was refused (RFC 3339)")
    dead_since: str = Field(description="when it was dead-lettered (RFC 3339)")
    reservations: list[HeldReservation] = Field(description="the run's reservations, a budget window each")
    quota: QuotaHold | None = Field(description="the run's quota slot (null: none)")
    pool_tokens: list[str] = Field(description="the run's pool tokens, as namespace/token")


class DeadLetterList(BaseModel):
    """The dead-lettered settlements, longest dead first."""

    model_config = ConfigDict(json_schema_extra={"examples": [{"dead_letters": [_DEAD]}]})

    dead_letters: list[DeadLetter] = Field(description="each dead-lettered settlement with what its run holds")


class ResolveIn(BaseModel):
    """How to resolve a run's dead-lettered settlement, and why."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [_RESOLVE]})

    action: Literal["release", "settle"] = Field(
        description="release: give back what the run holds, charging nothing more; settle: settle it again now, once the cause of its failure is fixed"
    )
    reason: Reason = Field(description="why, for the admin log (text, no control characters but tab and newline)")


class Resolved(BaseModel):
    """A dead-lettered settlement resolved: one ledger transaction that also forgot the dead letter
    and logged who did it and why."""

    model_config = ConfigDict(json_schema_extra={"examples": [_RESOLVED]})

    run_id: str = Field(description="the run")
    action: Literal["settlement.release", "settlement.settle"] = Field(description="what was done, as the admin log names it")
    actor: str = Field(description="who did it: the caller's principal")
    reason: str = Field(description="why, as logged")
    changed: bool = Field(description="whether the ledger changed (a settlement that came out as before changes nothing)")
    held: Holdings = Field(description="what the run held before")
    holds: Holdings = Field(description="what it holds now")


OPERATIONS: dict[str, Operation] = {
    "GET /v1/settlements/dead-letters": Operation("listDeadLetteredSettlements", answer=DeadLetterList),
    "POST /v1/settlements/{run_id}/resolve": Operation(
        "resolveSettlement", answer=Resolved, parameters={"run_id": "the run whose settlement is dead-lettered (it may contain slashes)"}
    ),
}
