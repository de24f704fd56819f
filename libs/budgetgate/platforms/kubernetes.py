"""Kubernetes objects to submissions, and decisions to AdmissionReview answers, without I/O.

What a Pod, a batch/v1 Job, a JobSet, a RayJob or a RayCluster asks for (see `Mapping` for
every knob):
- **namespace and labels**: the object's own (the AdmissionRequest's namespace first).
- **GPUs**: per pod, Kubernetes' effective request of `nvidia.com/gpu` (a container's request,
  else its limit: Kubernetes then takes the limit as the request): the containers and the
  native sidecars (init containers with `restartPolicy: Always`, which keep running) summed, or
  an init container's own plus the sidecars started before it when that is more (init
  containers run one at a time); times the pods that run at once: a Job's parallelism (at most
  its completions), a JobSet's replicas × each job's parallelism, a RayJob's or RayCluster's
  head plus each worker group's replicas × numOfHosts (maxReplicas × numOfHosts with
  `enableInTreeAutoscaling: true`, since the autoscaler may grow the group that far). Nodes are
  the pods that run at once.
- **projected runtime**: `activeDeadlineSeconds` (the object's, else the largest of its jobs'
  or pod templates'; a pod template's deadline limits one pod, so a Job's is multiplied by its
  waves, ceil(completions / parallelism)), else the annotation
  `budgetgate.io/projected-runtime-hours`, else the namespace's default, else the default for
  all namespaces; none of them is an error that names what to add.
- **run id**: the annotation `budgetgate.io/run-id`, else the object's own UID (never its
  owner's: the replicas of a ReplicaSet or StatefulSet, and the Jobs of a CronJob, share their
  owner and are each a run of their own). `budgetgate.io/attempt` gives the attempt (else 1).
- Objects created by an object the webhook admits too (a Job's pods, a JobSet's Jobs, a
  RayJob's RayCluster and pods, a RayCluster's pods, the pods and objects flytepropeller
  creates for a FlyteWorkflow (flyte_workflows), which name it "flyteworkflow") are `Owned`:
  let through without a decision when their owner was admitted (the webhook checks, since an
  ownerReference is the creator's to write), else decided as a run of their own
  (`submission(..., own_run=True)`).
- A Job, JobSet, RayJob or RayCluster labelled `kueue.x-k8s.io/queue-name` and created
  suspended (`spec.suspend: true`) is `Queued`: Kueue decides it, through budgetgate's
  AdmissionCheck, when it admits the Workload, and only Kueue resumes it (below). Labelled but
  not suspended, it is decided here like any other: the label alone passes nothing. A bare Pod
  is decided here whatever its labels (Kueue's scheduling gate on a Pod is removed by an UPDATE
  nothing here sees).
- An UPDATE of a Job, JobSet, RayJob or RayCluster that raises its GPU count (a patched
  parallelism, replicas or maxReplicas) is refused: the decision covered the GPUs it was
  created with (a queued object still suspended may change: Kueue decides it when it admits
  it). An UPDATE only a controller may make is `Controlled`: resuming a suspended queued object
  (Kueue does, once its checks passed), taking the queue label off a suspended one (it would
  then be resumable by anyone), and changing the run id label or annotation of any object, or of
  its pod templates (the label names the run a pod's usage is metered to). Every other UPDATE
  (Kueue suspending it, other labels, scaling down) is let through.
- The mutating webhook names a run before the object exists (`naming`): the API server gives
  an object its UID only when it stores it, after every mutating webhook, so the run id is the
  annotation `budgetgate.io/run-id`, set to a fresh UUID when absent, and the label
  `budgetgate.io/run-id` (`run_labels`) on the object and its pod templates, so its pods carry it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping as MappingType
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from budgetgate.core.evaluation import hypothetical
from budgetgate.platforms.reviews import Asked, At, Unmappable, ask
from budgetgate.platforms.run_labels import RUN_ANNOTATION, RUN_LABEL, run_label_value
from budgetgate.contracts.admission import AdmissionRequest

ADMITTED_KINDS = {("", "Pod"), ("batch", "Job"), ("jobset.x-k8s.io", "JobSet"), ("ray.io", "RayJob"), ("ray.io", "RayCluster")}
# Kinds whose UPDATEs are checked for more GPUs than their CREATE was decided for (a Pod's
# GPU requests cannot change).
SCALABLE_KINDS = ADMITTED_KINDS - {("", "Pod")}
# Owners whose children are admitted with them: a child of one of these is skipped.
ADMITTED_OWNERS = {("batch", "Job"), ("jobset.x-k8s.io", "JobSet"), ("ray.io", "RayJob"), ("ray.io", "RayCluster"), ("flyte.lyft.com", "FlyteWorkflow")}
# Owner kinds as their controllers write them in ownerReferences, where that is not the kind's
# own name: flytepropeller names a FlyteWorkflow by its constant "flyteworkflow"
# (v1alpha1.FlyteWorkflowKind) on the pods and objects it creates for it.
OWNER_KINDS = {("flyte.lyft.com", "flyteworkflow"): "FlyteWorkflow"}
# The label that hands a Job (JobSet, RayJob, RayCluster) to Kueue; Kueue keeps what it queues
# suspended (spec.suspend) until it admits its Workload.
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
# The metav1.StatusReason of each code an answer denies with (k8s.io/apimachinery metav1).
STATUS_REASONS = {400: "BadRequest", 403: "Forbidden", 409: "Conflict", 422: "Invalid", 429: "TooManyRequests", 503: "ServiceUnavailable"}
# The API server passes a warning on as an HTTP Warning header; longer than this it may be cut.
WARNING_LIMIT = 120
_WHOLE = re.compile(r"^[0-9]+$")


@dataclass(frozen=True)
class Mapping:
    """How objects become submissions; every name here is configurable (README, webhook)."""

    gpu_resource: str = "nvidia.com/gpu"
    run_id_annotation: str = "budgetgate.io/run-id"
    attempt_annotation: str = "budgetgate.io/attempt"
    runtime_annotation: str = "budgetgate.io/projected-runtime-hours"
    flavor_annotation: str = "budgetgate.io/flavor"
    region_annotation: str = "budgetgate.io/region"
    namespace_runtime_hours: MappingType[str, float] = field(default_factory=dict)
    default_runtime_hours: float | None = None
    default_flavor: str | None = None
    # Objects asking for no GPU are let through without a decision unless this is set (then
    # they are submitted with "gpus": 0 and charged on node-hour and wall-hour budgets).
    submit_cpu_only: bool = False


@dataclass(frozen=True)
class Submit:
    """The object is a submission; `warnings` to pass on with its answer."""

    request: AdmissionRequest
    warnings: tuple[str, ...] = ()


@dataclass(frozen=True)
class Queued:
    """The object is Kueue's to admit (labelled for a queue and created suspended): let through
    without a decision, and remembered so that its children are let through on it."""

    queue: str
    reason: str


@dataclass(frozen=True)
class Controlled:
    """An UPDATE a controller may make and nobody else: allowed when a trusted controller makes
    it, else refused (403) with `reason`; `what` says what it does."""

    what: str
    reason: str


@dataclass(frozen=True)
class Skip:
    """The object is let through without a decision, for `reason`."""

    reason: str


@dataclass(frozen=True)
class Owned:
    """The object names as its controller an object of a kind the webhook admits (`owner_uid`):
    let through without a decision when that owner was admitted, else decided on its own.
    `owns`: the object may own admitted kinds itself (a JobSet's Job, a RayJob's RayCluster), so
    its own children are let through on it in turn."""

    owner_uid: str
    owner_kind: str
    owner_name: str
    reason: str
    owns: bool


@dataclass(frozen=True)
class Refuse:
    """The request is denied (403) without a decision, for `reason`."""

    reason: str


def _group(api_version: str) -> str:
    return api_version.split("/")[0] if "/" in api_version else ""


def pod_gpus(pod_spec: At, resource: str) -> int:
    """GPUs one pod holds, as Kubernetes computes a pod's effective request.

    The containers and the native sidecars (init containers with `restartPolicy: Always`)
    summed, or, when more, an init container's own request plus the sidecars started before it."""

    def of(container: At) -> int:
        resources = container.obj("resources")
        asked = resources.obj("requests").entry(resource)
        if asked.value is None:
            asked = resources.obj("limits").entry(resource)
        return asked.quantity() if asked.value is not None else 0

    running = sum(of(c) for c in pod_spec.objects("containers"))
    sidecars = init = 0
    for container in pod_spec.objects("initContainers"):
        asked = of(container)
        if container.text("restartPolicy") == "Always":  # a native sidecar: runs on beside what starts after it
            sidecars, running = sidecars + asked, running + asked
        else:
            init = max(init, asked + sidecars)
    return max(running, init)


@dataclass(frozen=True)
class _Shape:
    gpus: int
    pods: int
    deadline_seconds: int | None


def _job(spec: At, resource: str) -> _Shape:
    parallelism = spec.count("parallelism", 1) or 0
    completions = spec.count("completions")
    pods = min(parallelism, completions) if completions is not None else parallelism
    template = spec.obj("template").obj("spec")
    deadline = spec.seconds("activeDeadlineSeconds")
    pod_deadline = template.seconds("activeDeadlineSeconds")
    if not deadline and pod_deadline:
        # A pod's deadline limits one pod: the Job runs its completions in waves of `pods`.
        waves = -(-completions // pods) if completions and pods else 1
        deadline = pod_deadline * waves
    return _Shape(pod_gpus(template, resource) * pods, pods, deadline)


def _ray_cluster(cluster: At, resource: str) -> tuple[int, int]:
    """GPUs and pods of a rayClusterSpec: its head and worker groups, at their autoscaling bound."""
    gpus, pods = pod_gpus(cluster.obj("headGroupSpec").obj("template").obj("spec"), resource), 1
    autoscaled = cluster.flag("enableInTreeAutoscaling")
    for group_spec in cluster.objects("workerGroupSpecs"):
        replicas = group_spec.count("replicas", group_spec.count("minReplicas", 1)) or 0
        most = group_spec.count("maxReplicas")
        if autoscaled:
            if most is None:
                name = group_spec.text("groupName")
                raise Unmappable(f"worker group {name!r} is autoscaled without maxReplicas ({group_spec.path}.maxReplicas): set it, the most it may grow to")
            replicas = max(replicas, most)
        count = replicas * (group_spec.count("numOfHosts", 1) or 0)
        gpus += count * pod_gpus(group_spec.obj("template").obj("spec"), resource)
        pods += count
    return gpus, pods


def _shape(group: str, kind: str, obj: At, resource: str) -> _Shape:
    spec = obj.obj("spec")
    if kind == "Pod":
        return _Shape(pod_gpus(spec, resource), 1, spec.seconds("activeDeadlineSeconds"))
    if kind == "Job":
        return _job(spec, resource)
    if kind == "JobSet":
        jobs = [(rj.count("replicas", 1) or 0, _job(rj.obj("template").obj("spec"), resource)) for rj in spec.objects("replicatedJobs")]
        deadlines = [j.deadline_seconds for _, j in jobs if j.deadline_seconds]
        return _Shape(sum(n * j.gpus for n, j in jobs), sum(n * j.pods for n, j in jobs), max(deadlines) if deadlines else None)
    if kind == "RayCluster":  # its spec is a rayClusterSpec, and it has no deadline
        return _Shape(*_ray_cluster(spec, resource), None)
    # RayJob: the cluster it creates.
    return _Shape(*_ray_cluster(spec.obj("rayClusterSpec"), resource), spec.seconds("activeDeadlineSeconds"))


def _runtime_hours(shape: _Shape, annotations: At, namespace: str, mapping: Mapping) -> float:
    if shape.deadline_seconds:
        return shape.deadline_seconds / 3600
    raw = annotations.entry(mapping.runtime_annotation)
    if raw.value is not None:
        try:
            hours = float(raw.value)
        except ValueError:
            raw.fail("must be a number of hours")
        if not 0 < hours < float("inf"):
            raw.fail("must be a positive number of hours")
        return hours
    found = mapping.namespace_runtime_hours.get(namespace, mapping.default_runtime_hours)
    if found is None:
        raise Unmappable(f"no projected runtime: set spec.activeDeadlineSeconds or the annotation {mapping.runtime_annotation} (hours)")
    return found


def _controller(meta: At) -> At | None:
    owners = meta.objects("ownerReferences")
    return next((o for o in owners if o.flag("controller")), owners[0] if owners else None)


def _missing(asked: Asked) -> Unmappable:
    article, verb = ("a", "creates") if asked.operation == "CREATE" else ("an", "updates")
    return Unmappable(f"request.object is missing: {article} {asked.operation} carries the object it {verb}")


def submission(
    review: MappingType[str, Any] | Asked, mapping: Mapping = Mapping(), *, own_run: bool = False
) -> Submit | Skip | Refuse | Owned | Queued | Controlled:
    """What the `request` of an admission.k8s.io/v1 AdmissionReview (or the request as `ask`
    read it) asks of budgetgate.

    A CREATE is a submission (or skipped, or `Owned` by an object of an admitted kind; with
    `own_run`, whatever its owner: the owner was not admitted; or `Queued` for Kueue); an UPDATE
    that raises the GPUs of a Job, JobSet, RayJob or RayCluster is refused, one only a
    controller may make is `Controlled`, any other UPDATE skipped. Raises
    Unmappable when the request or its object is malformed (a CREATE or UPDATE without its
    object, a field of another type than the API's), or when the object should be a submission,
    or an UPDATE checked, and cannot be."""
    asked = review if isinstance(review, Asked) else ask(review)
    group, kind = asked.group, asked.kind
    if (group, kind) not in ADMITTED_KINDS:
        return Skip(f"{kind or 'this kind'} ({group or 'core'}) is not a workload budgetgate admits")
    if asked.object is None and asked.operation in ("CREATE", "UPDATE"):
        raise _missing(asked)
    if asked.operation == "UPDATE":
        return _update(asked, kind, mapping)
    if asked.operation != "CREATE" or asked.object is None:
        return Skip(f"{asked.operation} is not a submission; only CREATE is")
    obj = asked.object
    meta = obj.obj("metadata")
    owner = _controller(meta)
    owner_group = _group(owner.text("apiVersion") or "") if owner is not None else ""
    owner_kind = OWNER_KINDS.get((owner_group, owner.text("kind") or ""), owner.text("kind") or "") if owner is not None else ""
    if not own_run and owner is not None and (owner_group, owner_kind) in ADMITTED_OWNERS:
        owner_name = owner.text("name") or ""
        reason = f"created by {owner_kind} {owner_name}, which was admitted for it"
        return Owned(owner.text("uid") or "", owner_kind, owner_name, reason, owns=(group, kind) in ADMITTED_OWNERS)
    labels = meta.strings("labels")
    annotations = meta.strings("annotations")
    notes = meta.field("annotations")
    warnings: tuple[str, ...] = ()
    queue = labels.get(QUEUE_LABEL)
    if queue and (group, kind) in SCALABLE_KINDS:
        if obj.obj("spec").flag("suspend"):
            return Queued(
                queue, f"left to Kueue: {kind} {asked.name} waits suspended in queue {queue!r} until Kueue admits it, after budgetgate's AdmissionCheck"
            )
        # Not suspended, it would run before Kueue admitted anything: the label passes nothing.
        warnings = (short(f"budgetgate: labelled for Kueue queue {queue!r} but not suspended (spec.suspend): decided here"),)
    shape = _shape(group, kind, obj, mapping.gpu_resource)
    if shape.gpus == 0 and not mapping.submit_cpu_only:
        return Skip(f"asks for no {mapping.gpu_resource}")
    # Never the owner's UID: the replicas of a ReplicaSet or StatefulSet and the Jobs of a
    # CronJob share their owner, and each is a run that needs its own reservation.
    run_id = annotations.get(mapping.run_id_annotation) or asked.uid
    if not run_id:
        raise Unmappable(f"no run id: the object has no UID or annotation {mapping.run_id_annotation}")
    attempt = notes.entry(mapping.attempt_annotation)
    if attempt.value is not None and (not _WHOLE.match(attempt.value) or int(attempt.value) < 1):
        attempt.fail("must be a whole number from 1")
    flavor = annotations.get(mapping.flavor_annotation) or mapping.default_flavor
    region = annotations.get(mapping.region_annotation)
    body = {
        "run_id": run_id,
        "attempt": int(attempt.value or 1),
        "namespace": asked.namespace,
        "labels": labels,
        "resources": {"gpus": shape.gpus, "nodes": max(1, shape.pods), **({"flavor": flavor} if flavor else {}), **({"region": region} if region else {})},
        "projected_runtime_hours": _runtime_hours(shape, notes, asked.namespace, mapping),
        "job": {"namespace": asked.namespace, "name": asked.name or run_id},
    }
    try:
        return Submit(AdmissionRequest.model_validate(body), warnings)
    except ValidationError as exc:
        sources = _sources(mapping)
        wrong = [(".".join(str(p) for p in e["loc"]), e["msg"]) for e in exc.errors()]
        problems = "; ".join(f"{where} (from {sources[where]}): {msg}" if where in sources else f"{where}: {msg}" for where, msg in wrong)
        raise Unmappable(f"not a valid submission: {problems}") from None


def _sources(mapping: Mapping) -> dict[str, str]:
    """Where each field of the submission comes from in the object."""
    return {
        "run_id": f"metadata.annotations[{mapping.run_id_annotation!r}], else metadata.uid",
        "attempt": f"metadata.annotations[{mapping.attempt_annotation!r}]",
        "namespace": "request.namespace, else metadata.namespace",
        "resources.flavor": f"metadata.annotations[{mapping.flavor_annotation!r}]",
        "resources.region": f"metadata.annotations[{mapping.region_annotation!r}]",
        "resources.gpus": f"the {mapping.gpu_resource} its pods ask for",
        "resources.nodes": "its pods that run at once",
        "job.name": "metadata.name",
        "job.namespace": "request.namespace, else metadata.namespace",
    }


def _update(asked: Asked, kind: str, mapping: Mapping) -> Skip | Refuse | Controlled:
    old, new = asked.old_object, asked.object
    if old is None or new is None:
        raise Unmappable("request.oldObject is missing: an UPDATE carries the object as it was, to compare what it changes")
    group = asked.group
    # Both named from their own root, so that a place has one name in both.
    names_before, names_after = _run_names(group, kind, At(old.value, ""), mapping), _run_names(group, kind, new, mapping)
    renamed = sorted(where for where in {*names_before, *names_after} if names_before.get(where) != names_after.get(where))
    if (group, kind) not in SCALABLE_KINDS:  # a Pod: its GPU requests cannot change, its run's names can
        return _renaming(asked, kind, renamed) or Skip("an UPDATE of a Pod that keeps its run id")
    old_labels, new_labels = old.obj("metadata").strings("labels"), new.obj("metadata").strings("labels")
    was_queued = bool(old_labels.get(QUEUE_LABEL)) and old.obj("spec").flag("suspend")
    still_suspended = new.obj("spec").flag("suspend")
    # Whatever created the object (a CREATE decided, or skipped as asking for no GPU) covered the
    # GPUs it had then; a patch that raises them (parallelism, replicas, maxReplicas) would run
    # more on that one reservation. Children are checked too: their owner was decided for the
    # GPUs they had when it was. A queued object still suspended is Kueue's to decide on resuming.
    counts = ""
    if not (was_queued and still_suspended):
        before = _shape(group, kind, old, mapping.gpu_resource).gpus
        after = _shape(group, kind, new, mapping.gpu_resource).gpus
        counts = f" ({before} before, {after} after)"
        if after > before:
            return Refuse(
                f"{kind} {asked.name} asks for {before} {mapping.gpu_resource}; an update may not raise that to {after}, which no decision covered: "
                f"create a new {kind} for {after} instead (under a new run id: a new object without the annotation {mapping.run_id_annotation} is named afresh)"
            )
    renaming = _renaming(asked, kind, renamed)
    if renaming is not None:
        return renaming
    if was_queued and not still_suspended:
        return Controlled(
            f"resumes {kind} {asked.name}, queued in Kueue",
            f"{kind} {asked.name} is queued in Kueue ({QUEUE_LABEL}={old_labels[QUEUE_LABEL]}): only Kueue resumes it (spec.suspend: false), "
            "once it admitted its Workload after budgetgate's AdmissionCheck",
        )
    if was_queued and not new_labels.get(QUEUE_LABEL):
        return Controlled(
            f"takes {kind} {asked.name} out of Kueue",
            f"{kind} {asked.name} is suspended in Kueue's queue {old_labels[QUEUE_LABEL]!r}: its {QUEUE_LABEL} label may change but not go "
            "(unlabelled, it could be resumed without Kueue); to run it outside Kueue, delete it and create it again without the label",
        )
    return Skip(f"an UPDATE asking for no more {mapping.gpu_resource}{counts}, keeping its run id")


def _renaming(asked: Asked, kind: str, renamed: list[str]) -> Controlled | None:
    if not renamed:
        return None
    return Controlled(
        f"changes the run id of {kind} {asked.name}",
        f"{kind} {asked.name}: {', '.join(renamed)} may not change once created: it names the run its GPUs are metered to "
        "(create a new object to run under another run id)",
    )


def templates(group: str, kind: str, obj: At) -> list[tuple[str, At, bool]]:
    """The templates of an object's children that it has, as (JSON pointer, template, whether it
    is a pod template): a Job's pod template; a JobSet's Job templates and theirs; a RayJob's or
    RayCluster's head and worker pod templates. A Pod has none."""

    def present(at: At | None, *names: str) -> At | None:
        for name in names:
            if at is None or at.field(name).value is None:
                return None
            at = at.obj(name)
        return at

    found: list[tuple[str, At | None, bool]] = []
    if kind == "Job":
        found.append(("/spec/template", present(obj, "spec", "template"), True))
    elif kind == "JobSet":
        for i, replicated in enumerate(present(obj, "spec").objects("replicatedJobs") if present(obj, "spec") else []):
            job_template = present(replicated, "template")
            found.append((f"/spec/replicatedJobs/{i}/template", job_template, False))
            found.append((f"/spec/replicatedJobs/{i}/template/spec/template", present(job_template, "spec", "template"), True))
    elif kind in ("RayJob", "RayCluster"):
        base, cluster = ("/spec/rayClusterSpec", present(obj, "spec", "rayClusterSpec")) if kind == "RayJob" else ("/spec", present(obj, "spec"))
        found.append((f"{base}/headGroupSpec/template", present(cluster, "headGroupSpec", "template"), True))
        for i, group_spec in enumerate(cluster.objects("workerGroupSpecs") if cluster else []):
            found.append((f"{base}/workerGroupSpecs/{i}/template", present(group_spec, "template"), True))
    return [(pointer, at, pod) for pointer, at, pod in found if at is not None]


def _run_names(group: str, kind: str, obj: At, mapping: Mapping) -> dict[str, str]:
    """Where the object names its run, and the names: the run id label and annotation of the
    object and of its children's templates (absent ones left out)."""
    found: dict[str, str] = {}
    places = [("metadata", obj.obj("metadata"), mapping.run_id_annotation)]
    places += [(f"{t.path}.metadata", t.obj("metadata"), RUN_ANNOTATION) for _pointer, t, _pod in templates(group, kind, obj)]
    for where, meta, annotation in places:
        label = meta.strings("labels").get(RUN_LABEL)
        if label is not None:
            found[f"{where}.labels[{RUN_LABEL!r}]"] = label
        note = meta.strings("annotations").get(annotation)
        if note is not None:
            found[f"{where}.annotations[{annotation!r}]"] = note
    return found


def _pointer_key(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")


def naming(
    asked: Asked, run_id: str, mapping: Mapping = Mapping(), *, priority_class: str | None = None, override_priority: bool = False
) -> list[dict[str, Any]]:
    """The JSON patch (RFC 6902) that names the run of a created object `run_id`: the annotation
    `mapping.run_id_annotation` on the object; the label RUN_LABEL (`run_label_value`) on it and
    on its children's templates, with the annotation RUN_ANNOTATION holding the whole run id where
    the label is a hash of it; and `priority_class` as the pod templates' priorityClassName (kept
    where the object sets one, unless `override_priority`). A bare Pod's priorityClassName is left
    as it is: the API server resolved its priority before any webhook ran. Raises Unmappable when
    a field it writes into is of another type than the API's."""
    obj = asked.object
    if obj is None:
        raise Unmappable("request.object is missing: a CREATE carries the object it creates")
    label = run_label_value(run_id)
    hashed = label != run_id
    meta = obj.obj("metadata")
    labels, annotations = meta.strings("labels"), meta.strings("annotations")
    patch: list[dict[str, Any]] = []
    wanted_notes = {mapping.run_id_annotation: run_id, **({RUN_ANNOTATION: run_id} if hashed else {})}
    if any(annotations.get(k) != v for k, v in wanted_notes.items()):
        patch.append({"op": "add", "path": "/metadata/annotations", "value": {**annotations, **wanted_notes}})
    if labels.get(RUN_LABEL) != label:
        patch.append({"op": "add", "path": "/metadata/labels", "value": {**labels, RUN_LABEL: label}})
    for pointer, template, pod in templates(asked.group, asked.kind, obj):
        template_meta = template.obj("metadata")
        inner_labels, inner_notes = template_meta.strings("labels"), template_meta.strings("annotations")
        if inner_labels.get(RUN_LABEL) != label or (hashed and inner_notes.get(RUN_ANNOTATION) != run_id):
            written = {**template_meta.value, "labels": {**inner_labels, RUN_LABEL: label}}
            if hashed:
                written["annotations"] = {**inner_notes, RUN_ANNOTATION: run_id}
            patch.append({"op": "add", "path": f"{pointer}/metadata", "value": written})
        if pod and priority_class and template.field("spec").value is not None:
            current = template.obj("spec").text("priorityClassName")
            if current != priority_class and (not current or override_priority):
                patch.append({"op": "add", "path": f"{pointer}/spec/{_pointer_key('priorityClassName')}", "value": priority_class})
    return patch


def priority_class_for(classes: MappingType[str, str], *, penalty: float, preemptible: bool) -> str | None:
    """The PriorityClass a quote maps to: `classes["preemptible"]` for a run above its tenant's
    fair-share target (when configured), else the class of the largest penalty bound (a key "0"
    to "1") at or below the run's soft-budget penalty; None when no bound is that low."""
    if preemptible and classes.get("preemptible"):
        return classes["preemptible"]
    bounds = sorted((float(k), v) for k, v in classes.items() if k != "preemptible")
    chosen = None
    for bound, name in bounds:
        if bound <= penalty + 1e-12:
            chosen = name
    return chosen


def short(text: str, limit: int = WARNING_LIMIT) -> str:
    """`text` cut to `limit` characters (ending "..." when cut): the API server may cut a longer
    warning anywhere."""
    return text if len(text) <= limit else text[: limit - 3].rstrip() + "..."


def review(uid: str, *, allowed: bool, message: str | None = None, code: int | None = None, warnings: list[str] | None = None) -> dict[str, Any]:
    """An admission.k8s.io/v1 AdmissionReview answering the request `uid`."""
    response: dict[str, Any] = {"uid": uid, "allowed": allowed}
    if not allowed:
        code = code or 403
        if code not in STATUS_REASONS:
            raise ValueError(f"a denial's code is one of {sorted(STATUS_REASONS)} (each with its metav1.StatusReason), got {code}")
    elif code not in (None, 200):
        raise ValueError(f"an admission's code is 200, got {code}")
    if message is not None or not allowed:
        response["status"] = {"code": code or 200, "message": message or ""}
        if not allowed:
            response["status"]["reason"] = STATUS_REASONS[code or 403]
    if warnings:
        response["warnings"] = [short(w) for w in warnings]
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "response": response}


def decided(uid: str, answer: MappingType[str, Any], *, attempt_annotation: str = Mapping.attempt_annotation, dry_run: bool = False) -> dict[str, Any]:
    """The AdmissionReview for a decision (the admission API's answer): ALLOW admits, with soft
    budgets' penalties as warnings; DENY denies with the reason; DELAY denies saying when to retry.
    A dry run's answer (a quote) says what the decision would do: it reserved nothing."""
    reason = f"budgetgate (dry run, nothing reserved): {hypothetical(answer['reason'])}" if dry_run else f"budgetgate: {answer['reason']}"
    warnings = []
    penalty = answer.get("priority_penalty") or 0.0
    if penalty > 0:
        warnings.append(f"budgetgate: a soft budget is nearly used up; priority penalty {penalty:.2f} (0 none, 1 run last)")
    if answer.get("preemptible"):
        warnings.append("budgetgate: admitted above the tenant's fair-share target; preemptible")
    warnings += [
        short(f"budgetgate: dry-run policy {e['policy_id']} would {e['decision']}")
        for e in answer.get("evaluations", [])
        if e.get("enforcement") == "dry-run" and e.get("decision") != "ALLOW"
    ]
    if answer["decision"] == "ALLOW":
        return review(uid, allowed=True, message=reason, warnings=warnings)
    if answer["decision"] == "DENY":
        return review(uid, allowed=False, message=reason, code=403, warnings=warnings)
    times = sorted(str(e["next_eligible_time"]) for e in answer.get("evaluations", []) if e.get("decision") == "DELAY" and e.get("next_eligible_time"))
    if not times and answer.get("next_eligible_time"):
        times = [str(answer["next_eligible_time"])]
    # The time goes in the message only: details.retryAfterSeconds would have client-go sleep
    # that long inside the call before trying again.
    when = f"retry at or after {times[-1]}" if times else "retry later (no eligible time was given)"
    again = int(answer.get("attempt", 1)) + 1
    return review(uid, allowed=False, code=429, warnings=warnings, message=(
        f"{reason}; {when} (create the object again, or with a fixed run id set the annotation {attempt_annotation}={again})"
    ))  # fmt: skip
