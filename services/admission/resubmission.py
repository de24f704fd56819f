"""What a submission is to the decisions its run already has: a resend answered again, a
submission decided afresh, a 409 (`Conflict`), or a 410 when its latest decision is archived.

A run id names one request. Sent again unchanged, at any attempt, it gets the run's stored
decision (`replayed: true`), except that a higher attempt after a refusal (DENY or DELAY, which
hold nothing) is decided afresh: the run waited for room and asks again. Sent with a different
request (anything a decision depends on: `COMPARED`), it is a 409 naming each change, old and
new, unless the earlier decision holds nothing and the attempt is higher: a changed request
after a refusal is a new question, decided afresh. So an admitted run's request never changes
(resizing a run is not a resend: submit under a new run id), the same attempt never answers two
requests, and a changed request never reads another request's ALLOW as its own.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

from budgetgate.contracts.admission import AdmissionRequest
from budgetgate.core.windows import rfc3339

# What makes two submissions of one run id the same request.
COMPARED = ("namespace", "labels", "resources.gpus", "resources.nodes", "resources.flavor", "resources.region", "projected_runtime_hours", "job", "pool_token")
REFUSED = ("DENY", "DELAY")
_SAID = {"ALLOW": "admitted", "DENY": "denied", "DELAY": "delayed"}


@dataclass(frozen=True)
class Change:
    """One field a resend changed: its dotted path, the value decided on and the value sent now."""

    field: str
    was: Any
    now: Any

    def __str__(self) -> str:
        return f"{self.field}: {_shown(self.was)} → {_shown(self.now)}"

    def as_json(self) -> dict[str, Any]:
        return {"field": self.field, "was": self.was, "now": self.now}


def _shown(value: Any) -> str:
    return "none" if value is None else json.dumps(value, ensure_ascii=False)


class Conflict(ValueError):
    """409: the submission cannot be answered from, or decided beside, what its run holds;
    nothing changed. `fields` names what differs, `extensions` goes into the problem details."""

    def __init__(self, message: str, fields: list[str], **extensions: Any) -> None:
        super().__init__(message)
        self.fields = fields
        self.extensions = extensions

    @property
    def next_attempt(self) -> int | None:
        """The attempt at which the new request would be decided afresh; None when none would
        (the run holds what its decision reserved, or is another owner's): a new run id."""
        return self.extensions.get("next_attempt")

    def problem(self) -> dict[str, Any]:
        return {"detail": str(self), "fields": self.fields, **self.extensions}


class Archived(Conflict):
    """410 Gone: the run's latest decision is archived (`budgetgate ledger archive`). The request
    it was decided for is not at hand, so a resend can neither be answered from it nor decided
    afresh (it could be another owner's run, or a changed request); nothing changed."""


def archived(run_id: str, attempt: int, decided_at: datetime) -> Archived:
    return Archived(
        f"run {run_id!r}'s latest decision (attempt {attempt}, decided at {rfc3339(decided_at)}) is archived (`budgetgate ledger archive`): "
        "a resend can neither be answered from it nor decided again; submit under a new run id",
        [],
        next_attempt=None,
        archived={"attempt": attempt, "decided_at": rfc3339(decided_at)},
    )


def owned_elsewhere(run_id: str, moved: list[str]) -> Conflict:
    """The run id is decided in another namespace or for another tenant: whose, and what it was
    decided for, is not said (a run id is no way into another team's run)."""
    return Conflict(
        f"run {run_id!r} is decided in another {' and '.join(moved)}: a run keeps its namespace and tenant in every attempt; use a new run id",
        moved,
        next_attempt=None,
    )


def changed(run_id: str, changes: Sequence[Change], *, fields: list[str], outcome: str, attempt: int) -> Conflict:
    """The run was decided (`outcome` at `attempt`) for another request than this one."""
    listed = "; ".join(str(c) for c in changes)
    said = f"run {run_id!r} was {_SAID.get(outcome, outcome)} at attempt {attempt} for another request ({listed}); nothing was decided or reserved now."
    if outcome in REFUSED:
        advice = f"A refused run holds nothing: submit the new request as attempt {attempt + 1}, or under a new run id."
        return Conflict(f"{said} {advice}", fields, changes=[c.as_json() for c in changes], next_attempt=attempt + 1)
    advice = "An admitted run keeps its request in every attempt: submit the new request under a new run id."
    return Conflict(f"{said} {advice}", fields, changes=[c.as_json() for c in changes], next_attempt=None)


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


def changes(stored: Mapping[str, Any] | str, request: AdmissionRequest) -> list[Change]:
    """Each value in which `request` differs from `stored`, down to a label or a job's name."""
    before = stored_request(stored)
    after = request.model_dump(mode="json")
    return [c for path in COMPARED for c in _changes(path, _at(before, path), _at(after, path))]


def _changes(path: str, was: Any, now: Any) -> list[Change]:
    if was == now:
        return []
    if isinstance(was, Mapping) or isinstance(now, Mapping):
        was, now = was if isinstance(was, Mapping) else {}, now if isinstance(now, Mapping) else {}
        return [c for key in sorted({*was, *now}) for c in _changes(f"{path}.{key}", was.get(key), now.get(key))]
    return [Change(path, was, now)]


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


def resent(prior: Mapping[str, Any] | None, request: AdmissionRequest, *, tenant_label: str) -> Literal["decide", "replay"] | Conflict:
    """What `request` is to its run's latest decision (`prior`: its `request`, `outcome` and
    `attempt`; None when the run has none; `outcome` None when it is archived, with its
    `decided_at`): to be decided, to be answered with `prior` again, or a Conflict (Archived)."""
    if prior is None:
        return "decide"
    if prior["outcome"] is None:  # known by its keys only: its month is archived
        return archived(request.run_id, prior["attempt"], prior["decided_at"])
    stored = stored_request(prior["request"])
    moved = ownership(stored, request, tenant_label=tenant_label)
    if moved:
        return owned_elsewhere(request.run_id, moved)
    if decided_afresh(prior["outcome"], prior["attempt"], request.attempt):
        return "decide"
    found = changes(stored, request)
    if found:
        return changed(request.run_id, found, fields=differences(stored, request), outcome=prior["outcome"], attempt=prior["attempt"])
    return "replay"
