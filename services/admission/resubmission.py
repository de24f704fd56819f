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
    """The run id and attempt were already submitted with a different request, or the run id is
    another namespace's or tenant's (`owned`); nothing changed."""

    def __init__(self, run_id: str, attempt: int, fields: list[str], *, owned: bool = False) -> None:
        super().__init__(
            f"run {run_id!r} is decided in another {' and '.join(fields)}: a run keeps its namespace and tenant in every attempt; use a new run id"
            if owned
            else f"run {run_id!r} attempt {attempt} was already submitted with a different {', '.join(fields)}; submit a higher attempt or a new run id"
        )
        self.fields = fields


def ownership(stored: Mapping[str, Any] | str, request: AdmissionRequest, *, tenant_label: str) -> list[str]:
    """Where `request` names another owner than the run's stored decision: its namespace, or
    its tenant (`labels.<tenant_label>`, when the stored one had a tenant). Whatever its attempt,
    such a submission neither replays the run's decision (another tenant's figures) nor decides
    the run afresh (taking it over): a principal limited to its own namespaces and tenants is
    checked against the submission's, so the run must be theirs too."""
    before = stored_request(stored)
    moved = [] if before.get("namespace") == request.namespace else ["namespace"]
    owner = (before.get("labels") or {}).get(tenant_label)
    if owner is not None and owner != request.labels.get(tenant_label):
        moved.append(f"labels.{tenant_label}")
    return moved


def stored_request(stored: Mapping[str, Any] | str) -> Mapping[str, Any]:
    """A decision's stored request (jsonb, as text or decoded) as a mapping."""
    return json.loads(stored) if isinstance(stored, str) else stored


def differences(stored: Mapping[str, Any] | str, request: AdmissionRequest) -> list[str]:
    """The fields (dotted paths of COMPARED) in which `request` differs from `stored`."""
    before = stored_request(stored)
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
