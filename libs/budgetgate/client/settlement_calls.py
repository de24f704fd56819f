"""The reconciler's operator API as Calls, for both clients: the settlements it dead-lettered,
and their resolution (budgetgate.contracts.settlements has the models)."""

from __future__ import annotations

from typing import Literal
from urllib.parse import quote

from budgetgate.client.calls import Call, validated
from budgetgate.contracts.settlements import DeadLetterList, ResolveIn, Resolved


def dead_letters() -> Call[DeadLetterList]:
    """GET /v1/settlements/dead-letters (an operator without limits)."""
    return Call("GET", "/v1/settlements/dead-letters", DeadLetterList.model_validate)


def resolve(run_id: str, *, action: Literal["release", "settle"], reason: str) -> Call[Resolved]:
    """POST /v1/settlements/{run_id}/resolve (validated here first, with the server's own model)."""
    body = validated(ResolveIn, {"action": action, "reason": reason})
    return Call("POST", f"/v1/settlements/{quote(run_id, safe='/')}/resolve", Resolved.model_validate, json=body.model_dump(mode="json"))
