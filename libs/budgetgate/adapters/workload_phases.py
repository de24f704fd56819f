"""What a run's Kubernetes objects say happened to it, as lifecycle events, without I/O: the rules
of the lifecycle controller (budgetgate/adapters/lifecycle_controller.py), which watches the
objects and publishes what these rules derive.

The rules read the objects' current state (level-based, not edge-based), so a restart, a re-list
or two replicas overlapping derive the same facts again; each fact's event id is derived from the
run, the kind and the Kubernetes fact it stands for (`Fact.event_id`), so the same fact published
twice is recorded once (the reconciler's and metering-ingest's inboxes key on the event id).

A run's objects: its pods (the run label, `budgetgate.platforms.run_labels`), its Jobs (the run
label or annotation, or the Job owning one of its pods or Workloads), its Kueue Workloads (the run
id Kueue's admission check submitted, `kueue_workloads.submission`). From them:

- **STORED**: any object of the run exists (its earliest `creationTimestamp`). Confirms the
  provisional hold the validating webhook took (core/reconciliation.py).
- **STARTED**: the first pod of the run running (the earliest container start), once per run;
  `gpus` the GPUs of its bound, unfinished pods, `nodes` their distinct nodes, `flavor` Kueue's
  assigned GPU flavor or the pods' flavor annotation.
- **COMPLETED** / **FAILED**: every Job of the run finished (Complete / a Failed condition);
  without a Job, the Workload's `Finished` condition; without either, pods that no controller
  owns: all Succeeded, or none active and one Failed. Pods that another controller owns
  (a ReplicaSet, a RayCluster) never end a run by themselves: their controller replaces them.
- **EVICTED**: the Workload's `Evicted` condition True (one per transition time); without a
  Workload, no pod of the run active and the last to stop was disrupted (the `DisruptionTarget`
  condition, or a kubelet eviction, `status.reason` Evicted/Preempting).
- **READMITTED**: the Workload `Admitted` again after an eviction (one per admission time);
  without a Workload, a pod running that started after the run's last known eviction.
- **CANCELLED**: the run's Job (or, without a Job, its Workload, or its bare pods) deleted
  before it finished (`deleted`).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from budgetgate.core.reconciliation import CANCELLED, COMPLETED, EVICTED, FAILED, READMITTED, STARTED, STORED
from budgetgate.platforms.kubernetes import Unmappable, pod_gpus
from budgetgate.platforms.reviews import At

Obj = Mapping[str, Any]

_IDS = uuid.uuid5(uuid.NAMESPACE_URL, "https://budgetgate.dev/kubernetes/lifecycle-event")
# Why a pod stopped that means it was put off its node, not that it failed.
DISRUPTIONS = frozenset({"Evicted", "Preempting", "PreemptionByScheduler", "EvictionByEvictionAPI", "DeletionByTaintManager", "TerminationByKubelet"})


class BadObject(ValueError):
    """An object a rule cannot read (a timestamp that is not RFC 3339, say): named, with the field."""


@dataclass(frozen=True, slots=True)
class Fact:
    """A lifecycle event a run's objects imply."""

    run_id: str
    kind: str
    at: datetime
    identity: str  # the Kubernetes fact it stands for, within the run and kind
    gpus: int = 0
    nodes: int = 0
    flavor: str = ""
    reason: str = ""

    @property
    def event_id(self) -> str:
        """The same run, kind and Kubernetes fact give the same id, whoever derives it when."""
        return str(uuid.uuid5(_IDS, f"{self.run_id}\x00{self.kind}\x00{self.identity}"))


@dataclass(frozen=True)
class RunObjects:
    """What the controller holds of one run: its objects as last seen, and what it remembers."""

    run_id: str
    pods: tuple[Obj, ...] = ()
    jobs: tuple[Obj, ...] = ()
    workloads: tuple[Obj, ...] = ()
    # The time of the run's last eviction this controller derived, when no readmission followed
    # (the evicted pods may be gone by the time their replacement runs).
    evicted_at: datetime | None = None
    gpu_resource: str = "nvidia.com/gpu"
    flavor_annotation: str = "budgetgate.io/flavor"

    @property
    def empty(self) -> bool:
        return not (self.pods or self.jobs or self.workloads)


@dataclass(frozen=True)
class Phases:
    """The facts of a run now, and what they say about it."""

    facts: tuple[Fact, ...]
    finished: bool = False  # a terminal fact is among them
    evicted_at: datetime | None = None  # the eviction no readmission followed, if any


def parse_time(value: Any, what: str) -> datetime | None:
    """A Kubernetes timestamp (RFC 3339, `Z` or an offset) as an aware datetime; None if absent."""
    if value in (None, ""):
        return None
    if not isinstance(value, str):
        raise BadObject(f"{what} is not a timestamp: {value!r}")
    try:
        parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise BadObject(f"{what} is not an RFC 3339 timestamp: {value!r}") from None
    if parsed.tzinfo is None:
        raise BadObject(f"{what} has no time zone: {value!r}")
    return parsed.astimezone(UTC)


def conditions(obj: Obj) -> dict[str, Obj]:
    """The object's status conditions by type (the last of a type wins)."""
    found = (obj.get("status") or {}).get("conditions") or []
    return {c["type"]: c for c in found if isinstance(c, Mapping) and isinstance(c.get("type"), str)}


def _true(obj: Obj, kind: str) -> Obj | None:
    condition = conditions(obj).get(kind)
    return condition if condition is not None and condition.get("status") == "True" else None


def _uid(obj: Obj) -> str:
    return str((obj.get("metadata") or {}).get("uid") or (obj.get("metadata") or {}).get("name") or "")


def _what(obj: Obj) -> str:
    meta = obj.get("metadata") or {}
    return f"{obj.get('kind') or 'object'} {meta.get('namespace', '')}/{meta.get('name', '')}"


def _condition_time(obj: Obj, condition: Obj) -> datetime | None:
    return parse_time(condition.get("lastTransitionTime"), f"{_what(obj)}: condition {condition.get('type')}.lastTransitionTime")


def _reason(condition: Obj | None, fallback: str = "") -> str:
    if not condition:
        return fallback
    text = ": ".join(str(p) for p in (condition.get("reason"), condition.get("message")) if p)
    return text[:1024] or fallback


def controller_owner(obj: Obj) -> Obj | None:
    """The ownerReference marked controller, if any."""
    return next((o for o in (obj.get("metadata") or {}).get("ownerReferences") or [] if o.get("controller")), None)


# -- pods ----------------------------------------------------------------------------------------


def pod_started(pod: Obj) -> datetime | None:
    """When the pod's first container started running (running now or terminated after running);
    None if none ever ran."""
    status = pod.get("status") or {}
    times = []
    for i, container in enumerate([*(status.get("initContainerStatuses") or []), *(status.get("containerStatuses") or [])]):
        state = container.get("state") or {}
        for part in ("running", "terminated"):
            started = parse_time((state.get(part) or {}).get("startedAt"), f"{_what(pod)}: containerStatuses[{i}].state.{part}.startedAt")
            if started is not None:
                times.append(started)
    if not times and status.get("phase") == "Running":
        started = parse_time(status.get("startTime"), f"{_what(pod)}: status.startTime")
        times += [started] if started else []
    return min(times, default=None)


def pod_stopped(pod: Obj) -> datetime | None:
    """When the pod's last container stopped, for a pod that is over (Succeeded or Failed)."""
    status = pod.get("status") or {}
    times = []
    for i, container in enumerate(status.get("containerStatuses") or []):
        finished = parse_time(((container.get("state") or {}).get("terminated") or {}).get("finishedAt"), f"{_what(pod)}: containerStatuses[{i}].finishedAt")
        if finished is not None:
            times.append(finished)
    for kind in ("DisruptionTarget", "Ready"):
        condition = conditions(pod).get(kind)
        if not times and condition is not None:
            at = _condition_time(pod, condition)
            times += [at] if at else []
    return max(times, default=None)


def pod_disrupted(pod: Obj) -> tuple[datetime | None, str] | None:
    """(when, why) the pod was put off its node (evicted, preempted, its node drained), or None."""
    target = _true(pod, "DisruptionTarget")
    status = pod.get("status") or {}
    if target is not None:
        return _condition_time(pod, target), _reason(target, "DisruptionTarget")
    if status.get("reason") in DISRUPTIONS:
        return pod_stopped(pod), ": ".join(p for p in (status.get("reason"), status.get("message")) if p)
    return None


def pod_active(pod: Obj) -> bool:
    """Running, or bound to a node and not over: it holds its node's GPUs."""
    status = pod.get("status") or {}
    phase = status.get("phase")
    if phase == "Running":
        return True
    return phase == "Pending" and bool((pod.get("spec") or {}).get("nodeName"))


def _gpus(pod: Obj, resource: str) -> int:
    try:
        return pod_gpus(At(pod, "").obj("spec"), resource)
    except Unmappable as exc:
        raise BadObject(f"{_what(pod)}: {exc}") from None


# -- the rules -----------------------------------------------------------------------------------


def phases(run: RunObjects) -> Phases:
    """Every fact the run's objects imply now (each with its stable event id)."""
    facts: list[Fact] = []
    stored = _stored(run)
    if stored is not None:
        facts.append(stored)
    flavor = _flavor(run)
    at = _first_start(run)
    if at is not None:
        gpus, nodes = _bound(run)
        facts.append(Fact(run.run_id, STARTED, at, "first-start", gpus=gpus, nodes=nodes, flavor=flavor))
    evicted_at = run.evicted_at
    if run.workloads:
        queue = _queue_facts(run, flavor)
        facts += queue
        for fact in sorted(queue, key=lambda f: f.at):
            evicted_at = fact.at if fact.kind == EVICTED else None if fact.kind == READMITTED else evicted_at
    else:
        moved, evicted_at = _pod_moves(run, flavor, evicted_at)
        facts += moved
    end = _end(run)
    if end is not None:
        facts.append(end)
    return Phases(tuple(facts), finished=end is not None, evicted_at=None if end is not None else evicted_at)


def _stored(run: RunObjects) -> Fact | None:
    times = [
        parse_time((obj.get("metadata") or {}).get("creationTimestamp"), f"{_what(obj)}: metadata.creationTimestamp")
        for obj in (*run.jobs, *run.workloads, *run.pods)
    ]
    known = [t for t in times if t is not None]
    if not known and run.empty:
        return None
    # An object without its creation time (never from an API server) is stored now: the first
    # derivation's time stands, since the event id does not depend on it.
    at = min(known) if known else datetime.now(UTC)
    return Fact(run.run_id, STORED, at, "stored")


def _first_start(run: RunObjects) -> datetime | None:
    return min((at for at in (pod_started(p) for p in run.pods) if at is not None), default=None)


def _bound(run: RunObjects) -> tuple[int, int]:
    """GPUs of the run's pods bound and not over, and their distinct nodes."""
    active = [p for p in run.pods if pod_active(p)]
    gpus = sum(_gpus(p, run.gpu_resource) for p in active)
    nodes = len({(p.get("spec") or {}).get("nodeName") for p in active if (p.get("spec") or {}).get("nodeName")})
    return gpus, nodes


def _flavor(run: RunObjects) -> str:
    for workload in run.workloads:
        for assignment in ((workload.get("status") or {}).get("admission") or {}).get("podSetAssignments") or []:
            flavor = (assignment.get("flavors") or {}).get(run.gpu_resource)
            if isinstance(flavor, str) and flavor:
                return flavor
    for pod in run.pods:
        flavor = ((pod.get("metadata") or {}).get("annotations") or {}).get(run.flavor_annotation)
        if isinstance(flavor, str) and flavor:
            return flavor
    return ""


def _queue_facts(run: RunObjects, flavor: str) -> list[Fact]:
    """Kueue's word on the run: evictions and admissions again after them."""
    facts = []
    for workload in run.workloads:
        uid = _uid(workload)
        found = conditions(workload)
        evicted = found.get("Evicted")
        evicted_at = _condition_time(workload, evicted) if evicted is not None else None
        if evicted is not None and evicted.get("status") == "True" and evicted_at is not None:
            facts.append(Fact(run.run_id, EVICTED, evicted_at, f"workload:{uid}:evicted:{evicted_at.isoformat()}", reason=_reason(evicted, "Evicted")))
        admitted = _true(workload, "Admitted")
        admitted_at = _condition_time(workload, admitted) if admitted is not None else None
        # Admitted after the eviction: Kueue turns Evicted False when it reserves quota again, or
        # the Evicted condition still says True with an older time than this admission.
        if admitted_at is not None and evicted_at is not None and evicted_at <= admitted_at:
            facts.append(Fact(run.run_id, READMITTED, admitted_at, f"workload:{uid}:admitted:{admitted_at.isoformat()}", flavor=flavor))
    return facts


def _pod_moves(run: RunObjects, flavor: str, evicted_at: datetime | None) -> tuple[list[Fact], datetime | None]:
    """Evictions and readmissions from pods alone (runs without a Workload)."""
    facts: list[Fact] = []
    disrupted = []
    for pod in run.pods:
        found = pod_disrupted(pod) if not pod_active(pod) else None
        at = (found[0] or pod_stopped(pod)) if found is not None else None
        if found is not None and at is not None:
            disrupted.append((at, _uid(pod), found[1]))
    if disrupted:
        at, uid, why = max(disrupted)
        # Evicted when nothing of the run ran on past it: no pod active now that had started by then.
        if (evicted_at is None or at > evicted_at) and not any(pod_active(p) and _started_before(p, at) for p in run.pods):
            facts.append(Fact(run.run_id, EVICTED, at, f"pod:{uid}:evicted", reason=why or "Evicted"))
            evicted_at = at
    if evicted_at is not None:
        after = sorted((started, _uid(p)) for p in run.pods if pod_active(p) and (started := pod_started(p)) is not None and started > evicted_at)
        if after:
            at, uid = after[0]
            gpus, nodes = _bound(run)
            facts.append(Fact(run.run_id, READMITTED, at, f"pod:{uid}:readmitted", gpus=gpus, nodes=nodes, flavor=flavor))
            evicted_at = None
    return facts, evicted_at


def _started_before(pod: Obj, at: datetime) -> bool:
    started = pod_started(pod)
    return started is not None and started <= at


def _end(run: RunObjects) -> Fact | None:
    if run.jobs:
        return _jobs_end(run)
    if run.workloads:
        for workload in run.workloads:
            finished = _true(workload, "Finished")
            if finished is not None:
                at = _condition_time(workload, finished)
                if at is not None:
                    kind = FAILED if finished.get("reason") == "Failed" else COMPLETED
                    return Fact(run.run_id, kind, at, "end", reason=_reason(finished))
        return None
    return _pods_end(run)


def _jobs_end(run: RunObjects) -> Fact | None:
    ends = []
    for job in run.jobs:
        failed, complete = _true(job, "Failed"), _true(job, "Complete")
        if failed is not None:
            ends.append((FAILED, _condition_time(job, failed), _reason(failed, "Failed")))
        elif complete is not None:
            at = _condition_time(job, complete) or parse_time((job.get("status") or {}).get("completionTime"), f"{_what(job)}: status.completionTime")
            ends.append((COMPLETED, at, ""))
        else:
            return None  # a Job of the run goes on
    known = [(kind, at, why) for kind, at, why in ends if at is not None]
    if not known:
        return None
    kind = FAILED if any(k == FAILED for k, _, _ in known) else COMPLETED
    at = max(a for _, a, _ in known)
    why = next((w for k, _, w in known if k == FAILED), "")
    return Fact(run.run_id, kind, at, "end", reason=why)


def _pods_end(run: RunObjects) -> Fact | None:
    """Bare pods (no controller owns them) end the run when all are over."""
    pods = [p for p in run.pods if controller_owner(p) is None]
    if not pods or len(pods) != len(run.pods) or any(pod_active(p) for p in pods):
        return None
    phases_ = [(p.get("status") or {}).get("phase") for p in pods]
    if any(phase not in ("Succeeded", "Failed") for phase in phases_):
        return None
    failed = [p for p in pods if (p.get("status") or {}).get("phase") == "Failed" and pod_disrupted(p) is None]
    if any((p.get("status") or {}).get("phase") == "Failed" and pod_disrupted(p) is not None for p in pods) and not failed:
        return None  # put off their nodes, not failed: EVICTED says so
    stops = [t for t in (pod_stopped(p) for p in pods) if t is not None]
    if not stops:
        return None
    if failed:
        status = failed[0].get("status") or {}
        why = ": ".join(str(p) for p in (status.get("reason"), status.get("message")) if p) or "a pod failed"
        return Fact(run.run_id, FAILED, max(stops), "end", reason=why[:1024])
    return Fact(run.run_id, COMPLETED, max(stops), "end")


def deleted(run: RunObjects, gone: Obj, *, kind: str, now: datetime) -> Fact | None:
    """The fact of `gone` (its last state as the API server announced its deletion) leaving the
    run, whose remaining objects are `run`: CANCELLED when what governs the run went before it
    finished (its Job; without a Job its Workload; without either its last bare pod), EVICTED
    when that last bare pod was put off its node."""
    at = parse_time((gone.get("metadata") or {}).get("deletionTimestamp"), f"{_what(gone)}: metadata.deletionTimestamp") or now
    if kind == "Job":
        if _true(gone, "Complete") is not None or _true(gone, "Failed") is not None or run.jobs:
            return None
        return Fact(run.run_id, CANCELLED, at, "end", reason=f"Job {(gone.get('metadata') or {}).get('name')} deleted before it finished")
    if kind == "Workload":
        if run.jobs or _true(gone, "Finished") is not None or run.workloads:
            return None
        return Fact(run.run_id, CANCELLED, at, "end", reason=f"Workload {(gone.get('metadata') or {}).get('name')} deleted before it finished")
    if kind != "Pod" or run.jobs or run.workloads or controller_owner(gone) is not None:
        return None
    if (gone.get("status") or {}).get("phase") in ("Succeeded", "Failed") or any(pod_active(p) for p in run.pods):
        return None
    disrupted = pod_disrupted(gone)
    if disrupted is not None:
        return Fact(run.run_id, EVICTED, disrupted[0] or at, f"pod:{_uid(gone)}:evicted", reason=disrupted[1] or "Evicted")
    if run.pods:
        return None  # others of the run remain, over: their own phases end the run
    return Fact(run.run_id, CANCELLED, at, "end", reason=f"pod {(gone.get('metadata') or {}).get('name')} deleted before it finished")


def new_facts(facts: Iterable[Fact], published: set[str]) -> list[Fact]:
    """The facts not published yet, in time order (ties: the order the reconciler applies)."""
    order = {STORED: 0, STARTED: 1, EVICTED: 2, READMITTED: 3, COMPLETED: 4, FAILED: 4, CANCELLED: 4}
    return sorted((f for f in facts if f.event_id not in published), key=lambda f: (f.at, order.get(f.kind, 9), f.event_id))
