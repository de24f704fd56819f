"""What a submission is to the decisions its run already has: a retry answered again, a new
attempt decided afresh, or a conflicting reuse of a run id and attempt (409)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from budgetgate.services.admission.schemas import AdmissionRequest

# What makes two submissions of one run id and attempt the same request.
COMPARED = ("namespace", "labels", "resources.gpus", "resources.nodes", "resources.flavor", "resources.region", "projected_runtime_hours", "job", "pool_token")
REFUSED = ("DENY", "DELAY")


class Conflict(ValueError):
    """The run id and attempt were already submitted with a different request; nothing changed."""

    def __init__(self, run_id: str, attempt: int, fields: list[str]) -> None:
        super().__init__(
            f"run {run_id!r} attempt {attempt} was already submitted with a different {', '.join(fields)}; submit a higher attempt or a new run id"
        )
        self.fields = fields


def differences(stored: Mapping[str, Any] | str, request: AdmissionRequest) -> list[str]:
    """The fields (dotted paths of COMPARED) in which `request` differs from `stored`."""
    before = json.loads(stored) if isinstance(stored, str) else stored
    after = request.model_dump(mode="json")
    return [path for path in COMPARED if _at(before, path) != _at(after, path)]


def _at(body: Mapping[str, Any], path: str) -> Any:
    value: Any = body
    for part in path.split("."):
        value = value.get(part) if isinstance(value, Mapping) else None
    if path == "resources.nodes" and value is None:
        return 1
    return value


def decided_afresh(prior_outcome: str, prior_attempt: int, attempt: int) -> bool:
    """A higher attempt after a refusal is a new submission: a refused run holds nothing."""
    return prior_outcome in REFUSED and attempt > prior_attempt
