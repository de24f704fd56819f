"""Kueue's AdmissionCheck protocol for budgets, without I/O: a Workload (kueue.x-k8s.io/v1beta1)
that has reserved quota and carries budgetgate's check is submitted as one run (all its pod
sets), and the decision becomes the check's state.

- ALLOW → `Ready`; a soft-budget penalty becomes the KEP-7990 annotation
  `kueue.x-k8s.io/priority-boost` = −round(1000 × priority_penalty) (the effective priority is the
  Workload's priority plus the boost, so penalised work yields to others).
- DELAY → `Retry`, the message saying when to retry; Kueue releases the quota and requeues.
- DENY → `Rejected`; Kueue deactivates the Workload.
- budgetgate unable to decide (503, 429, unreachable) → the check stays `Pending`, saying why,
  and the controller tries again (on the next event, and on its periodic requeue); a Workload
  that cannot be a submission (no runtime, say) → `Rejected`, saying what to add.
- budgetgate's permanent answers (`error_answer`): 409 for a refused run asked for another
  request → `Retry` at the attempt the 409 names; 409 for a run admitted for another request
  (readmitted on another flavor, say), or a run id that is another namespace's or tenant's, and
  422 → `Rejected`, saying what is wrong; 401/403 (the controller's own token) → `Pending`,
  saying what the operator must fix.

The submission: GPUs are each pod set's `nvidia.com/gpu` per pod (as for Pods) × its count (the
admitted count when Kueue gives one); nodes the pods; the runtime `spec.maximumExecutionTimeSeconds`,
else the annotation `budgetgate.io/projected-runtime-hours`, else the namespace's default; the
flavor the ResourceFlavor Kueue assigned to the GPUs; labels those of the Workload and of its
first pod set's template (Kueue's own `kueue.x-k8s.io/` labels left out); the run id the
annotation `budgetgate.io/run-id`, else the UID of the Workload's owner (the Job), else its own.
"""

from __future__ import annotations

import math
from collections.abc import Mapping as MappingType
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from pydantic import ValidationError

from budgetgate.client.errors import BudgetgateError, Conflict, InvalidRequest, Unauthorized
from budgetgate.platforms.kubernetes import Mapping, Unmappable, pod_gpus
from budgetgate.platforms.reviews import At
from budgetgate.contracts.admission import AdmissionRequest

CONTROLLER_NAME = "budgetgate.io/budget"
PRIORITY_BOOST = "kueue.x-k8s.io/priority-boost"
GROUP, VERSION = "kueue.x-k8s.io", "v1beta2"


def _time(at: datetime) -> str:
    return at.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _condition(obj: MappingType[str, Any], kind: str) -> bool:
    return any(c.get("type") == kind and c.get("status") == "True" for c in (obj.get("status") or {}).get("conditions") or [])


def pending_checks(workload: MappingType[str, Any], ours: set[str]) -> list[str]:
    """budgetgate's checks this Workload waits on: it has reserved quota, is not finished, and
    our check's state is Pending."""
    if not _condition(workload, "QuotaReserved") or _condition(workload, "Finished"):
        return []
    return [s["name"] for s in (workload.get("status") or {}).get("admissionChecks") or [] if s.get("name") in ours and s.get("state") == "Pending"]


def submission(workload: MappingType[str, Any], mapping: Mapping = Mapping()) -> AdmissionRequest:
    """The run a Workload is; raises Unmappable saying what to add."""
    meta = workload.get("metadata") or {}
    spec, status = workload.get("spec") or {}, workload.get("status") or {}
    annotations: MappingType[str, str] = meta.get("annotations") or {}
    namespace = meta.get("namespace") or "default"
    assigned = {a.get("name"): a for a in (status.get("admission") or {}).get("podSetAssignments") or []}
    gpus = pods = 0
    flavors: list[str] = []
    for pod_set in At(workload, "").obj("spec").objects("podSets"):
        assignment = assigned.get(pod_set.text("name") or "main", {})
        count = assignment.get("count", pod_set.count("count", 1))
        per_pod = pod_gpus(pod_set.obj("template").obj("spec"), mapping.gpu_resource)
        gpus, pods = gpus + count * per_pod, pods + count
        if per_pod and (assignment.get("flavors") or {}).get(mapping.gpu_resource):
            flavors.append(assignment["flavors"][mapping.gpu_resource])
    if gpus == 0 and not mapping.submit_cpu_only:
        raise Unmappable(f"the Workload asks for no {mapping.gpu_resource}; nothing for budgetgate to check")
    seconds = spec.get("maximumExecutionTimeSeconds")
    if seconds:
        hours = seconds / 3600
    elif mapping.runtime_annotation in annotations:
        raw = annotations[mapping.runtime_annotation]
        try:
            hours = float(raw)
        except ValueError:
            raise Unmappable(f"annotation {mapping.runtime_annotation}={raw!r} is not a number of hours") from None
        if not math.isfinite(hours) or hours <= 0:
            raise Unmappable(f"annotation {mapping.runtime_annotation}={raw!r} must be a positive number of hours")
    else:
        found = mapping.namespace_runtime_hours.get(namespace, mapping.default_runtime_hours)
        if found is None:
            raise Unmappable(
                "no projected runtime: set spec.maximumExecutionTimeSeconds (kueue.x-k8s.io/max-exec-time-seconds on the job) "
                f"or the annotation {mapping.runtime_annotation}"
            )
        hours = found
    owners = meta.get("ownerReferences") or []
    owner = next((o for o in owners if o.get("controller")), owners[0] if owners else {})
    first = ((spec.get("podSets") or [{}])[0].get("template") or {}).get("metadata") or {}
    labels = {k: v for k, v in {**(first.get("labels") or {}), **(meta.get("labels") or {})}.items() if not k.startswith("kueue.x-k8s.io/")}
    flavor = flavors[0] if flavors else (annotations.get(mapping.flavor_annotation) or mapping.default_flavor)
    body = {
        "run_id": annotations.get(mapping.run_id_annotation) or owner.get("uid") or meta.get("uid"),
        "attempt": int(annotations.get(mapping.attempt_annotation, "1")) if annotations.get(mapping.attempt_annotation, "1").isdigit() else 0,
        "namespace": namespace,
        "labels": labels,
        "resources": {"gpus": gpus, "nodes": max(1, pods), **({"flavor": flavor} if flavor else {})},
        "projected_runtime_hours": hours,
        "job": {"namespace": namespace, "name": owner.get("name") or meta.get("name") or "workload"},
    }
    try:
        return AdmissionRequest.model_validate(body)
    except ValidationError as exc:
        raise Unmappable("not a valid submission: " + "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())) from None


@dataclass(frozen=True)
class Patch:
    """What to write back: the Workload's status (its whole admissionChecks list, guarded by
    the resourceVersion it was computed from) and, when they change, its annotations."""

    status: dict[str, Any]
    annotations: dict[str, str | None] = field(default_factory=dict)


def _state(workload: MappingType[str, Any], name: str, state: str, message: str, now: datetime) -> dict[str, Any]:
    status = workload.get("status") or {}
    checks = []
    for found in status.get("admissionChecks") or []:
        if found.get("name") == name:
            changed = found.get("state") != state
            found = {
                **found,
                "state": state,
                "message": message[:32768],
                "lastTransitionTime": _time(now) if changed else found.get("lastTransitionTime", _time(now)),
            }
        checks.append(found)
    return {"metadata": {"resourceVersion": (workload.get("metadata") or {}).get("resourceVersion")}, "status": {"admissionChecks": checks}}


def decided(
    workload: MappingType[str, Any], check: str, answer: MappingType[str, Any], *, now: datetime, attempt_annotation: str = Mapping.attempt_annotation
) -> Patch:
    """The check's new state for a decision (the admission API's answer). On DELAY the Workload's
    attempt annotation is raised, so that when Kueue makes the check Pending again the run is
    decided afresh rather than replayed."""
    reason = f"budgetgate: {answer['reason']}"
    if answer["decision"] == "ALLOW":
        penalty = float(answer.get("priority_penalty") or 0.0)
        current = ((workload.get("metadata") or {}).get("annotations") or {}).get(PRIORITY_BOOST)
        wanted = str(-round(1000 * penalty)) if penalty > 0 else None
        return Patch(_state(workload, check, "Ready", reason, now), {PRIORITY_BOOST: wanted} if wanted != current else {})
    if answer["decision"] == "DENY":
        return Patch(_state(workload, check, "Rejected", reason, now))
    times = sorted(str(e["next_eligible_time"]) for e in answer.get("evaluations", []) if e.get("decision") == "DELAY" and e.get("next_eligible_time"))
    when = f"; retry at or after {times[-1]}" if times else "; retry later"
    return Patch(_state(workload, check, "Retry", reason + when, now), {attempt_annotation: str(int(answer.get("attempt", 1)) + 1)})


def undecided(workload: MappingType[str, Any], check: str, why: str, *, now: datetime) -> Patch:
    """budgetgate could not decide: still Pending, saying why (tried again on the next event or
    the controller's periodic requeue, whichever comes first)."""
    return Patch(_state(workload, check, "Pending", f"budgetgate: {why}", now))


def error_answer(
    workload: MappingType[str, Any],
    check: str,
    error: BudgetgateError,
    *,
    now: datetime,
    attempt_annotation: str = Mapping.attempt_annotation,
) -> Patch:
    """The check's state for an error answer to the Workload's submission.

    - 409 that a higher attempt resolves (the run was refused, and is asked for another request
      now: readmitted for fewer pods, say): `Retry`, the attempt annotation raised to the
      conflict's `next_attempt`, so the try after Kueue's requeue is decided afresh.
    - 409 that no attempt resolves: the run was admitted for another request (the Workload
      preempted and readmitted on another flavor, say: the reservation was made for the first),
      or its run id is another namespace's or tenant's: `Rejected`, saying what changed.
    - 422: `Rejected`, the message naming the fields budgetgate refused.
    - 401/403: `Pending`, saying the controller's token is missing, invalid, or lacks the submitter
      role for the namespace. That is an operator's fix, not the Workload's fault: `Rejected` would
      deactivate every Workload for a configuration error, and `Retry` would have Kueue release and
      reserve their quota again and again; `Pending` leaves them as they are, and the controller's
      periodic requeue decides them once the token is fixed.
    - any other (a 5xx, a 429 after the client's resends): `Pending`, tried again.
    """
    detail = error.detail or str(error)
    if isinstance(error, Conflict):
        if error.next_attempt is None:
            return Patch(_state(workload, check, "Rejected", f"budgetgate: {detail}", now))
        message = f"budgetgate: {detail}; the next try is attempt {error.next_attempt}"
        return Patch(_state(workload, check, "Retry", message, now), {attempt_annotation: str(error.next_attempt)})
    if isinstance(error, InvalidRequest):
        return Patch(_state(workload, check, "Rejected", f"budgetgate: not a valid submission ({detail})", now))
    if isinstance(error, Unauthorized):
        whose = (
            "the controller's token is missing, unknown, revoked or expired"
            if error.status == 401
            else "the controller's token lacks the submitter role for this namespace"
        )
        message = (
            f"budgetgate refused the controller ({error.status}: {detail}): {whose}; an operator must fix the controller's BUDGETGATE_TOKEN; will try again"
        )
        return Patch(_state(workload, check, "Pending", message, now))
    return undecided(workload, check, f"cannot decide now ({type(error).__name__}: {error}); will try again", now=now)


def unchanged(workload: MappingType[str, Any], patch: Patch) -> bool:
    """Whether writing `patch` would change nothing (the API server would announce no event)."""
    current = (workload.get("status") or {}).get("admissionChecks") or []
    return not patch.annotations and patch.status["status"]["admissionChecks"] == current


def unmappable(workload: MappingType[str, Any], check: str, why: str, *, now: datetime) -> Patch:
    """The Workload cannot be a submission: Rejected, the message saying what to add."""
    return Patch(_state(workload, check, "Rejected", f"budgetgate: {why}", now))


def active(admission_check: MappingType[str, Any], *, now: datetime) -> dict[str, Any] | None:
    """The status patch marking an AdmissionCheck of ours Active, or None when it already is."""
    if _condition(admission_check, "Active"):
        return None
    generation = (admission_check.get("metadata") or {}).get("generation", 0)
    return {"status": {"conditions": [{
        "type": "Active", "status": "True", "reason": "Active", "message": "budgetgate checks workloads against their budgets",
        "lastTransitionTime": _time(now), "observedGeneration": generation,
    }]}}  # fmt: skip
