"""The bodies of `POST` and `GET /v1/budgets/{policy_id}/grants`: an amount granted to (or taken
from) one budget in one window, with its reason, and the grants made (core/grants.py). A grant
as recorded is `GrantOut` of contracts/admission.py, which the budget listings show too."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, StrictFloat, StrictInt, StringConstraints

from budgetgate.contracts.admission import GrantOut, Text
from budgetgate.contracts.operations import Operation

_GRANT_EXAMPLE = {"amount": 2000, "reason": "allocation committee 2026-17: extra hours for the spring release"}

_GRANTED = {
    "revision": 41,
    "policy_id": "gpu-budget/team-vision-prod",
    "scope_id": "ns=vision-prod;team=vision",
    "unit": "gpu_hours",
    "ledger_key": "ns=vision-prod;team=vision|2026-04-01T00:00:00Z/2027-04-01T00:00:00Z|gpu_hours",
    "window_start": "2026-04-01T00:00:00Z",
    "window_end": "2027-04-01T00:00:00Z",
    "amount": 2000.0,
    "limit_before": 10000.0,
    "limit_after": 12000.0,
    "actor": "token:finance",
    "reason": "allocation committee 2026-17: extra hours for the spring release",
    "granted_at": "2026-07-14T09:30:00Z",
}


class GrantIn(BaseModel):
    """An amount to add to (or, negative, take from) one budget's limit in one window."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [_GRANT_EXAMPLE]})

    amount: StrictInt | Annotated[StrictFloat, Field(allow_inf_nan=False)] = Field(
        description="in the budget's own unit: GPU-hours, node-hours, wall-hours, or its currency; negative takes away; never zero"
    )
    reason: Annotated[Text, StringConstraints(min_length=1, max_length=500)] = Field(description="why, for the admin log (who approved it, a ticket); required")
    window: str | None = Field(
        default=None,
        max_length=100,
        description="the window: its key (<start>/<end>, as GET /v1/budgets shows it) or a date or instant inside it; "
        "omitted, the current window. A window that has ended is refused.",
    )
    scope_id: str | None = Field(default=None, max_length=1000, description="the budget's scope id; when given, it must be the budget's")


class GrantList(BaseModel):
    """The grants made to one budget, oldest first."""

    model_config = ConfigDict(
        json_schema_extra={"examples": [{"policy_id": "gpu-budget/team-vision-prod", "policy_bundle_sha": "e" * 40, "grants": [_GRANTED]}]}
    )

    policy_id: str = Field(description="the budget")
    policy_bundle_sha: str = Field(description="the active Git bundle")
    grants: list[GrantOut] = Field(description="every grant, oldest first (only the named window's when one was named)")


OPERATIONS: dict[str, Operation] = {
    "POST /v1/budgets/{policy_id}/grants": Operation("grantBudget", answer=GrantOut, parameters={"policy_id": "the budget's policy id"}),
    "GET /v1/budgets/{policy_id}/grants": Operation(
        "listBudgetGrants", answer=GrantList, parameters={"policy_id": "the budget's policy id", "window": "only this window's grants"}
    ),
}
