"""Kueue's AdmissionCheck protocol for budgets, without I/O: a Workload (kueue.x-k8s.io/v1beta2)
that has reserved quota and carries budgetgate's check is submitted as one run (all its pod
sets), and the decision becomes the check's state (`AdmissionCheckState`: state, message,
lastTransitionTime, requeueAfterSeconds, podSetUpdates).

What Kueue does with each state (its workload controller): `Ready` on every check with quota
reserved admits the Workload; `Retry` evicts it (its quota released, every check reset to
`Pending`) and queues it again no sooner than the check's lastTransitionTime +
`requeueAfterSeconds` (at once when that is absent); `Rejected` deactivates it
(`spec.active: false`) until someone reactivates it. So `Retry` is for what time fixes and
`Rejected` for what it does not (`Refusal` names each kind, docs/adapters.md tabulates them):

- ALLOW → `Ready`, with `podSetUpdates` labelling every pod set's pods with the run id
  (`budgetgate.io/run-id`, hashed when it is not a label value, the whole id then in the
  annotation of the same name; `budgetgate.platforms.run_labels`); a soft-budget penalty becomes
  the KEP-7990 annotation `kueue.x-k8s.io/priority-boost` = −round(1000 × priority_penalty).
- DELAY → `Retry`, `requeueAfterSeconds` until the decision's next eligible time (the latest of
  its delaying hard budgets'), and the Workload's attempt annotation raised so the next try is
  decided afresh rather than replayed.
- DENY by a concurrency limit that is full now (a tenant quota, the sensitive pool, a token
  pool) → `Retry` after `Retries.quota_seconds`, the attempt raised likewise; by one the run
  can never fit (it asks for more than the limit itself) → `Rejected`.
- DENY for missing labels (no attribution), by a budget the run is larger than, or by a hard
  budget whose policy says `on_exhausted: deny` → `Rejected`.
- budgetgate unable to decide (503, 429, another 5xx, unreachable) → `Retry` after
  `Retries.outage_seconds` (the same attempt: nothing was decided).
- a Workload that cannot be a submission (no runtime, say) → `Rejected`, saying what to add; one
  asking for no GPU → `Ready` without a decision, unless `Mapping.submit_cpu_only`.
- budgetgate's permanent answers (`error_answer`): 409 for a refused run asked for another
  request → `Retry` at the attempt the 409 names; 409 for a run admitted for another request
  (readmitted on another flavor, say), or a run id that is another namespace's or tenant's, and
  422 → `Rejected`, saying what is wrong; 401/403 (the controller's own token) and other 4xx
  answers → `Pending`, saying what the operator must fix.

A Workload Kueue is evicting (condition `Evicted` true: it resets every check to `Pending` while
the quota is still reserved) or has deactivated is not decided: it is decided when Kueue reserves
quota for it again, as Kueue's own provisioning controller does.

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
from enum import StrEnum
from typing import Any

from pydantic import ValidationError

from budgetgate.client.errors import BudgetgateError, Conflict, InvalidRequest, RateLimited, Unauthorized
from budgetgate.platforms.kubernetes import Mapping, Unmappable, pod_gpus
from budgetgate.platforms.reviews import At
from budgetgate.platforms.run_labels import RUN_ANNOTATION, RUN_LABEL, run_label_value
from budgetgate.contracts.admission import AdmissionRequest

CONTROLLER_NAME = "budgetgate.io/budget"
PRIORITY_BOOST = "kueue.x-k8s.io/priority-boost"
GROUP, VERSION = "kueue.x-k8s.io", "v1beta2"
MAX_REQUEUE_SECONDS = 2**31 - 1  # requeueAfterSeconds is an int32


class Refusal(StrEnum):
    """Why a Workload was not let through, as the controller tells them apart (on the answer's
    fields, never its words). Time fixes the first four (`Retry`), not the others (`Rejected`)."""

    DELAY = "delay"  # a hard budget lacks room now; it has room at the next eligible time
    QUOTA = "quota"  # a tenant quota or the sensitive pool is full now
    TOKEN_POOL = "token_pool"  # a token pool (or its project cap) is full now
    UNAVAILABLE = "unavailable"  # budgetgate could not decide (503, 429, another 5xx, unreachable)
    MISSING_LABELS = "missing_labels"  # a hard policy requires labels the Workload lacks
    NEVER_FITS = "never_fits"  # the run asks for more than a budget's or a quota's whole limit
    BUDGET_DENIES = "budget_denies"  # a hard budget lacks room and its policy says on_exhausted: deny
    # A concurrency limit refused it, and which one (or whether the run could ever fit) is not
    # known: the run's status could not be read. Retried as QUOTA is.
    CONCURRENCY = "concurrency"


RETRIED = frozenset({Refusal.DELAY, Refusal.QUOTA, Refusal.TOKEN_POOL, Refusal.UNAVAILABLE, Refusal.CONCURRENCY})


@dataclass(frozen=True)
class Retries:
    """`requeueAfterSeconds` of each `Retry` that has no instant of its own to wait for."""

    quota_seconds: int = 60  # a concurrency limit full: how often to ask again while it stays full
    outage_seconds: int = 30  # budgetgate unable to decide; a 429's Retry-After when longer
    delay_seconds: int = 900  # a DELAY whose budgets name no next eligible time
    minimum_seconds: int = 1  # never sooner (a replayed DELAY's time may have passed)

    def __post_init__(self) -> None:
        for name in ("quota_seconds", "outage_seconds", "delay_seconds", "minimum_seconds"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_REQUEUE_SECONDS:
                raise ValueError(f"Retries.{name} must be a whole number of seconds from 0 to {MAX_REQUEUE_SECONDS}, got {value!r}")


def _time(at: datetime) -> str:
    return at.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _condition(obj: MappingType[str, Any], kind: str) -> bool:
    return any(c.get("type") == kind and c.get("status") == "True" for c in (obj.get("status") or {}).get("conditions") or [])


def pending_checks(workload: MappingType[str, Any], ours: set[str]) -> list[str]:
    """budgetgate's checks this Workload waits on: it has reserved quota, is active, not being
    evicted and not finished, and our check's state is Pending."""
    if not _condition(workload, "QuotaReserved") or _condition(workload, "Finished") or _condition(workload, "Evicted"):
        return []
    if (workload.get("spec") or {}).get("active") is False:
        return []
    return [s["name"] for s in (workload.get("status") or {}).get("admissionChecks") or [] if s.get("name") in ours and s.get("state") == "Pending"]


def _pod_sets(workload: MappingType[str, Any], mapping: Mapping) -> tuple[int, int, list[str]]:
    """GPUs and pods of all the pod sets (the admitted counts), and the flavors assigned to GPUs."""
    status = workload.get("status") or {}
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
    return gpus, pods, flavors


def asks_no_gpu(workload: MappingType[str, Any], mapping: Mapping = Mapping()) -> bool:
    """Whether the Workload asks for no GPU at all (raises Unmappable for a malformed request)."""
    return _pod_sets(workload, mapping)[0] == 0


def submission(workload: MappingType[str, Any], mapping: Mapping = Mapping()) -> AdmissionRequest:
    """The run a Workload is; raises Unmappable saying what to add."""
    meta = workload.get("metadata") or {}
    spec = workload.get("spec") or {}
    annotations: MappingType[str, str] = meta.get("annotations") or {}
    namespace = meta.get("namespace") or "default"
    gpus, pods, flavors = _pod_sets(workload, mapping)
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


def pod_set_updates(workload: MappingType[str, Any], run_id: str) -> list[dict[str, Any]]:
    """One update per pod set (by name): its pods labelled with the run id, and annotated with
    the whole run id when the label is its hash (`budgetgate.platforms.run_labels`)."""
    value = run_label_value(run_id)
    updates = []
    for pod_set in (workload.get("spec") or {}).get("podSets") or []:
        update: dict[str, Any] = {"name": pod_set.get("name") or "main", "labels": {RUN_LABEL: value}}
        if value != run_id:
            update["annotations"] = {RUN_ANNOTATION: run_id}
        updates.append(update)
    return updates


def run_label_conflict(workload: MappingType[str, Any], run_id: str) -> str | None:
    """Why the run id cannot be written on the Workload's pods, or None. Kueue refuses to start a
    Workload whose podSetUpdates change a label or annotation its pod template already has."""
    for update in pod_set_updates(workload, run_id):
        pod_set = next(p for p in workload["spec"]["podSets"] if (p.get("name") or "main") == update["name"])
        meta = (pod_set.get("template") or {}).get("metadata") or {}
        for where, wanted in (("labels", update["labels"]), ("annotations", update.get("annotations") or {})):
            for key, value in wanted.items():
                found = (meta.get(where) or {}).get(key)
                if found is not None and found != value:
                    return (
                        f"pod set {update['name']!r} already has the {where[:-1]} {key}={found!r}, but the Workload is run {run_id!r} "
                        f"({key}={value!r}): remove it from the pod template, or set the Workload's run id annotation to the run it names"
                    )
    return None


@dataclass(frozen=True)
class Patch:
    """What to write back: the Workload's status (its whole admissionChecks list, guarded by
    the resourceVersion it was computed from) and, when they change, its annotations."""

    status: dict[str, Any]
    annotations: dict[str, str | None] = field(default_factory=dict)


def _state(
    workload: MappingType[str, Any],
    name: str,
    state: str,
    message: str,
    now: datetime,
    *,
    requeue_after: int | None = None,
    updates: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """The admissionChecks list with check `name` set. `requeueAfterSeconds` is written only with
    `Retry` (Kueue keeps the last one on the Pending state it resets a check to; the Retry it
    belonged to is over), `podSetUpdates` only with `Ready`; Kueue's own `retryCount` is kept."""
    status = workload.get("status") or {}
    checks = []
    for found in status.get("admissionChecks") or []:
        if found.get("name") == name:
            changed = found.get("state") != state
            found = {k: v for k, v in found.items() if k not in ("requeueAfterSeconds", "podSetUpdates")}
            found.update(
                state=state,
                message=message[:32768],
                lastTransitionTime=_time(now) if changed else found.get("lastTransitionTime", _time(now)),
            )
            if requeue_after is not None:
                found["requeueAfterSeconds"] = requeue_after
            if updates:
                found["podSetUpdates"] = updates
        checks.append(found)
    return {"metadata": {"resourceVersion": (workload.get("metadata") or {}).get("resourceVersion")}, "status": {"admissionChecks": checks}}


def requeue_seconds(until: datetime, now: datetime, retries: Retries = Retries()) -> int:
    """`requeueAfterSeconds` that has Kueue try again no sooner than `until`, for a check whose
    lastTransitionTime is written at `now` (to the second, so counted from the second it shows)."""
    written = now.astimezone(UTC).replace(microsecond=0)
    wanted = math.ceil((until - written).total_seconds())
    return min(MAX_REQUEUE_SECONDS, max(retries.minimum_seconds, wanted))


def refusal(answer: MappingType[str, Any]) -> Refusal | None:
    """What kind of refusal a decision is (None for ALLOW), from its outcome and its hard
    evaluations. A DENY that no hard budget explains was refused by a concurrency limit:
    `Refusal.CONCURRENCY` until the run's status says which (`concurrency`)."""
    if answer["decision"] == "ALLOW":
        return None
    if answer["decision"] == "DELAY":
        return Refusal.DELAY
    hard = [e for e in answer.get("evaluations") or [] if e.get("enforcement") == "hard"]
    if any(e.get("missing_labels") for e in hard):
        return Refusal.MISSING_LABELS
    denying = [e for e in hard if e.get("decision") == "DENY"]
    if any(float(e["projected"]) > float(e["limit"]) for e in denying):
        return Refusal.NEVER_FITS
    if denying:
        return Refusal.BUDGET_DENIES
    return Refusal.CONCURRENCY


def concurrency(status: MappingType[str, Any] | None) -> Refusal:
    """Which concurrency refusal a run's status (GET /v1/admissions/{run_id}) shows: `waiting`
    names each quota and pool limit with what the run asks of it. Asking more than a limit
    itself can never fit; otherwise the limit is full now. A concurrency refusal the status does
    not list as waiting for quota headroom is a token pool's."""
    if status is None:
        return Refusal.CONCURRENCY
    waiting = status.get("waiting")
    if waiting is None:
        return Refusal.TOKEN_POOL
    if any(float(limit["requested"]) > float(limit["limit"]) for limit in waiting.get("limiting") or []):
        return Refusal.NEVER_FITS
    return Refusal.QUOTA


def _next_eligible(answer: MappingType[str, Any]) -> datetime | None:
    """The instant every delaying hard budget has room again (the latest of theirs), or None
    when one of them names none."""
    times = [e.get("next_eligible_time") for e in answer.get("evaluations") or [] if e.get("decision") == "DELAY" and e.get("enforcement") == "hard"]
    if not times or any(t is None for t in times):
        return None
    return max(datetime.fromisoformat(str(t).replace("Z", "+00:00")) for t in times)


def decided(
    workload: MappingType[str, Any],
    check: str,
    answer: MappingType[str, Any],
    *,
    now: datetime,
    kind: Refusal | None = None,
    retries: Retries = Retries(),
    attempt_annotation: str = Mapping.attempt_annotation,
) -> Patch:
    """The check's new state for a decision (the admission API's answer); `kind` is the refusal
    as the controller told it (`refusal`, then `concurrency` for a concurrency limit), found
    from the answer alone when not given. A refusal retried after a decision raises the
    Workload's attempt annotation, so the try after Kueue's requeue is decided afresh rather
    than replayed."""
    reason = f"budgetgate: {answer['reason']}"
    if answer["decision"] == "ALLOW":
        penalty = float(answer.get("priority_penalty") or 0.0)
        current = ((workload.get("metadata") or {}).get("annotations") or {}).get(PRIORITY_BOOST)
        wanted = str(-round(1000 * penalty)) if penalty > 0 else None
        state = _state(workload, check, "Ready", reason, now, updates=pod_set_updates(workload, str(answer["run_id"])))
        return Patch(state, {PRIORITY_BOOST: wanted} if wanted != current else {})
    kind = kind or refusal(answer)
    assert kind is not None
    if kind not in RETRIED:
        return Patch(_state(workload, check, "Rejected", reason, now))
    after_decision = {attempt_annotation: str(int(answer.get("attempt", 1)) + 1)}
    if kind is Refusal.DELAY:
        until = _next_eligible(answer)
        if until is None:
            seconds = retries.delay_seconds
            message = f"{reason}; no budget names when it has room again: asking again in {seconds}s"
        else:
            seconds = requeue_seconds(until, now, retries)
            message = f"{reason}; retry at or after {_time(until)}"
        return Patch(_state(workload, check, "Retry", message, now, requeue_after=seconds), after_decision)
    seconds = retries.quota_seconds
    full = {
        Refusal.QUOTA: "the quota is full now",
        Refusal.TOKEN_POOL: "the token pool is full now",
        Refusal.CONCURRENCY: "a concurrency limit is full now (the run's status could not be read to tell which)",
    }[kind]
    return Patch(_state(workload, check, "Retry", f"{reason}; {full}: asking again in {seconds}s", now, requeue_after=seconds), after_decision)


def unavailable(workload: MappingType[str, Any], check: str, why: str, *, now: datetime, retries: Retries = Retries(), after: float | None = None) -> Patch:
    """budgetgate could not decide: `Retry` after `outage_seconds` (or the `after` seconds it
    asked for, when longer), the attempt unchanged: nothing was decided."""
    seconds = min(MAX_REQUEUE_SECONDS, max(retries.outage_seconds, math.ceil(after or 0)))
    return Patch(_state(workload, check, "Retry", f"budgetgate: {why}; asking again in {seconds}s", now, requeue_after=seconds))


def undecided(workload: MappingType[str, Any], check: str, why: str, *, now: datetime) -> Patch:
    """Left for an operator's fix: still Pending, saying why (decided again by the controller's
    periodic requeue once it is fixed)."""
    return Patch(_state(workload, check, "Pending", f"budgetgate: {why}", now))


def error_answer(
    workload: MappingType[str, Any],
    check: str,
    error: BudgetgateError,
    *,
    now: datetime,
    retries: Retries = Retries(),
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
      periodic requeue decides them once the token is fixed. Another 4xx (a wrong admission URL's
      404, say) is the operator's too, and left `Pending` likewise.
    - 503, 429 and any other 5xx: budgetgate cannot decide now: `Retry` (`unavailable`).
    """
    detail = error.detail or str(error)
    if isinstance(error, Conflict):
        if error.next_attempt is None:
            return Patch(_state(workload, check, "Rejected", f"budgetgate: {detail}", now))
        message = f"budgetgate: {detail}; the next try is attempt {error.next_attempt}"
        return Patch(_state(workload, check, "Retry", message, now, requeue_after=retries.minimum_seconds), {attempt_annotation: str(error.next_attempt)})
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
    if isinstance(error, RateLimited) or error.status >= 500:
        return unavailable(workload, check, f"cannot decide now ({type(error).__name__}: {error})", now=now, retries=retries, after=error.retry_after)
    why = f"admission answered {error.status} ({detail}); an operator must fix the controller's configuration; will try again"
    return undecided(workload, check, why, now=now)


def unchanged(workload: MappingType[str, Any], patch: Patch) -> bool:
    """Whether writing `patch` would change nothing (the API server would announce no event)."""
    current = (workload.get("status") or {}).get("admissionChecks") or []
    return not patch.annotations and patch.status["status"]["admissionChecks"] == current


def carried_over(decided_from: MappingType[str, Any], fresh: MappingType[str, Any], check: str, patch: Patch) -> dict[str, Any] | None:
    """The status write of `patch`, decided on `decided_from`, carried over to `fresh`: the version
    someone else (Kueue) wrote after the controller's annotation write, before its status write.
    Our check's new entry replaces the fresh one, every other check stays as `fresh` has it, and
    the write is guarded by `fresh`'s version. None when the decision does not stand for `fresh`:
    our check no longer waits on it, the admission or the pod sets it was decided on changed, or
    the annotations are no longer the ones written (client-go's RetryOnConflict re-reads and
    re-applies the same way)."""
    if check not in pending_checks(fresh, {check}):
        return None
    before, after = decided_from.get("status") or {}, fresh.get("status") or {}
    if before.get("admission") != after.get("admission") or (decided_from.get("spec") or {}).get("podSets") != (fresh.get("spec") or {}).get("podSets"):
        return None
    annotations = (fresh.get("metadata") or {}).get("annotations") or {}
    if any(annotations.get(key) != value for key, value in patch.annotations.items()):
        return None
    (ours,) = [c for c in patch.status["status"]["admissionChecks"] if c.get("name") == check]
    checks = [ours if c.get("name") == check else c for c in after.get("admissionChecks") or []]
    return {"metadata": {"resourceVersion": (fresh.get("metadata") or {}).get("resourceVersion")}, "status": {"admissionChecks": checks}}


def unmappable(workload: MappingType[str, Any], check: str, why: str, *, now: datetime) -> Patch:
    """The Workload cannot be a submission: Rejected, the message saying what to add."""
    return Patch(_state(workload, check, "Rejected", f"budgetgate: {why}", now))


def let_through(workload: MappingType[str, Any], check: str, why: str, *, now: datetime) -> Patch:
    """`Ready` without a decision (a Workload asking for no GPU, as the webhook lets such objects
    through): nothing reserved, no run id to write on the pods."""
    return Patch(_state(workload, check, "Ready", f"budgetgate: {why}", now))


def active(admission_check: MappingType[str, Any], *, now: datetime) -> dict[str, Any] | None:
    """The status patch marking an AdmissionCheck of ours Active, or None when it already is."""
    if _condition(admission_check, "Active"):
        return None
    generation = (admission_check.get("metadata") or {}).get("generation", 0)
    return {"status": {"conditions": [{
        "type": "Active", "status": "True", "reason": "Active", "message": "budgetgate checks workloads against their budgets",
        "lastTransitionTime": _time(now), "observedGeneration": generation,
    }]}}  # fmt: skip
