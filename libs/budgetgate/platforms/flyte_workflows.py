"""flytepropeller's FlyteWorkflow (flyte.lyft.com/v1alpha1) to a submission, without I/O.

FlyteAdmin creates one FlyteWorkflow per execution, whatever launched it (`pyflyte run --remote`,
the console, a schedule, FlyteRemote, the preflight), and flytepropeller runs it: the object is
where the admission webhook enforces budgets server-side. What it holds
(flytepropeller/pkg/apis/flyteworkflow/v1alpha1, written by the compiler's k8s transformer):
- labels `execution-id`, `project`, `domain` (FlyteAdmin's): the run id, `flyte_run_id`, the one
  the preflight submits (`flyte/<project>/<domain>/<execution name>`). A child execution (a
  launch-plan node's) is created with its parent's labels, so it carries its parent's run id;
- `tasks`: core TaskTemplates as protobuf JSON (`container.resources` as `{"name": "GPU",
  "value": "2"}` entries, `k8sPod.podSpec`, `metadata.timeout` as "3600s", `metadata.retries`,
  `extendedResources.gpuAccelerator`), keyed by the task's identifier as Go prints it;
- `spec.nodes`: the primary workflow's nodes, a branch's cases among them (named by the branch),
  each with its `kind`, its `task` key, the overrides as Kubernetes `resources`, its
  `executionDeadline` (a Go duration, "1h0m0s"), `retry.minAttempts` (retries + 1, the node's
  when not 0, else the task's); an array node's element inline (`array.SubNodeSpec`, with
  `Parallelism`, `BoundInputs`: Go's field names); `subWorkflows` the sub-workflows' specs;
- `inputs`: the execution's inputs (a LiteralMap), whose lists give a map's elements;
- with FlyteAdmin's `useOffloadedWorkflowClosure`, none of `spec`, `tasks`, `subWorkflows`, but
  `workflowClosureReference`, a blob-store location this mapping cannot read (`offloaded`).

The projection follows the preflight's rules (flyte_usage, and docs/adapters.md's table): a
task node's GPUs (the node's resources when they name GPUs, else the task's request, else its
limit, else its pod template's containers') for its timeout (the node's, else the task's, else
the namespace's or the default runtime) × its attempts; a branch, its costliest case; a gate,
nothing; a sub-workflow, its nodes; a map, its element × the elements of its list (from the
execution's inputs or a literal list), at most its parallelism at once. A launch-plan node is a
child execution whose workflow the object does not hold: it cannot be projected here (the
preflight fetches it), and is refused naming the node.
"""

from __future__ import annotations

import re
from collections.abc import Mapping as MappingType
from dataclasses import dataclass

from pydantic import ValidationError

from budgetgate.contracts.admission import AdmissionRequest
from budgetgate.platforms.flyte_usage import (
    POD_GPU,
    Projection,
    TaskUse,
    Unprojectable,
    attempts,
    costliest,
    flavor_of,
    flyte_run_id,
    gpu_count,
    mapped,
)
from budgetgate.platforms.kubernetes import Mapping, Skip, Submit
from budgetgate.platforms.reviews import Asked, At, Unmappable
from budgetgate.platforms.run_labels import RUN_LABEL

GROUP = "flyte.lyft.com"
KIND = "FlyteWorkflow"
EXECUTION_LABEL, PROJECT_LABEL, DOMAIN_LABEL = "execution-id", "project", "domain"
# Labels FlyteAdmin and flytepropeller write for themselves, one value per execution or shard:
# not submitted (a policy matches the execution's own labels).
SYSTEM_LABELS = (EXECUTION_LABEL, "shard-key", RUN_LABEL)
OFFLOADED_FIELD = "workflowClosureReference"
OFFLOAD_SETTING = "useOffloadedWorkflowClosure"
_SYSTEM_NODES = {"start-node", "end-node"}
_GLOBAL_INPUTS = {"", "start-node"}
_GO_DURATION = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|μs|ms|s|m|h)")
_UNIT_SECONDS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_PROTO_DURATION = re.compile(r"^(\d+(?:\.\d+)?)s$")
_WHOLE = re.compile(r"^[0-9]+$")


def is_flyte_workflow(group: str, kind: str) -> bool:
    """Whether (group, kind) names a FlyteWorkflow: an AdmissionReview names it by its CRD's kind,
    and flytepropeller's ownerReferences by its own constant, "flyteworkflow"."""
    return group == GROUP and kind.lower() == KIND.lower()


@dataclass(frozen=True)
class FlyteRun:
    """The execution a FlyteWorkflow runs: its run id, and whether its closure is offloaded."""

    run_id: str
    project: str
    domain: str
    execution: str
    offloaded: bool


def flyte_run(obj: At) -> FlyteRun:
    """The run of a FlyteWorkflow object, from FlyteAdmin's labels; Unmappable naming a missing one."""
    labels_at = obj.obj("metadata").field("labels")
    labels = obj.obj("metadata").strings("labels")
    found = {}
    for label in (EXECUTION_LABEL, PROJECT_LABEL, DOMAIN_LABEL):
        value = labels.get(label)
        if not value:
            raise Unmappable(
                f"{labels_at.path}[{label!r}] is missing: FlyteAdmin labels each FlyteWorkflow with its execution's "
                f"{EXECUTION_LABEL}, {PROJECT_LABEL} and {DOMAIN_LABEL}, which name its run (flyte/<project>/<domain>/<execution>)"
            )
        if "/" in value:
            labels_at.entry(label).fail("must be a Flyte name (no '/')")
        found[label] = value
    reference = obj.field(OFFLOADED_FIELD).value
    return FlyteRun(
        flyte_run_id(found[PROJECT_LABEL], found[DOMAIN_LABEL], found[EXECUTION_LABEL]),
        found[PROJECT_LABEL],
        found[DOMAIN_LABEL],
        found[EXECUTION_LABEL],
        offloaded=bool(reference),
    )


def offloaded_message(run: FlyteRun) -> str:
    return (
        f"FlyteWorkflow of run {run.run_id} has its closure offloaded ({OFFLOADED_FIELD} is set, and spec, tasks and subWorkflows are not "
        f"in the object: FlyteAdmin's {OFFLOAD_SETTING} is true), so its GPUs cannot be projected here: set flyteadmin.{OFFLOAD_SETTING}: false "
        "for the namespaces budgetgate enforces, or launch the execution through budgetgate's preflight (budgetgate.adapters.flyte.execute), "
        "whose decision lets it through"
    )


def _go_seconds(at: At) -> float | None:
    """A metav1.Duration (Go's "1h30m0s") in seconds; None when absent or zero."""
    text = at.value
    if text is None:
        return None
    if not isinstance(text, str) or not text or _GO_DURATION.sub("", text) not in ("", "-"):
        at.fail('must be a duration as Go writes one ("1h30m0s")')
    if text.startswith("-"):
        at.fail("must not be negative")
    seconds = sum(float(n) * _UNIT_SECONDS[u] for n, u in _GO_DURATION.findall(text))
    return seconds or None


def _proto_seconds(at: At) -> float | None:
    """A protobuf Duration as JSON ("3600s") in seconds; None when absent or zero."""
    if at.value is None:
        return None
    match = _PROTO_DURATION.match(at.value) if isinstance(at.value, str) else None
    if match is None:
        at.fail('must be a protobuf duration ("3600s")')
    return float(match.group(1)) or None


class _Walk:
    """One walk over a FlyteWorkflow's nodes (the rules: the module's docstring)."""

    def __init__(self, obj: At, *, default_runtime_hours: float | None, count_retries: bool) -> None:
        self.tasks = obj.obj("tasks")
        self.sub_workflows = obj.obj("subWorkflows")
        self.default_runtime_hours = default_runtime_hours
        self.count_retries = count_retries

    def workflow(self, spec: At, known: MappingType[str, int], path: str) -> list[TaskUse]:
        nodes = spec.obj("nodes")
        # A branch's cases are nodes of the workflow too: they run only as the branch's case.
        cases: set[str] = set()
        for node_id in nodes.value:
            branch = nodes.entry(node_id).obj().obj("branch")
            for block in [branch.obj("if"), *branch.objects("elseIf")]:
                cases.add(block.text("then") or "")
            cases.add(branch.text("else") or "")
        found: list[TaskUse] = []
        for node_id in sorted(nodes.value):
            if node_id not in _SYSTEM_NODES and node_id not in cases:
                found.extend(self.node(nodes, nodes.entry(node_id).obj(), known, f"{path}/{node_id}" if path else node_id))
        return found

    def node(self, nodes: At, node: At, known: MappingType[str, int], path: str) -> list[TaskUse]:
        kind = node.text("kind")
        if kind == "task":
            return [self.task(node, path)]
        if kind == "branch":
            return self.branch(nodes, node, known, path)
        if kind == "gate":
            return []  # approve, signal, sleep: waits, holds no GPU
        if kind == "workflow":
            ref = node.obj("workflow")
            key = ref.text("subWorkflowRef")
            if key:
                spec = self.sub_workflows.entry(key)
                if spec.value is None:
                    spec.fail("is missing: the sub-workflow a node names")
                inner = {b.text("var") or "": n for b in node.objects("inputBindings") if (n := _length(b.obj("binding"), known)) is not None}
                return self.workflow(spec.obj(), inner, path)
            plan = ref.obj("launchPlanRefId")
            raise Unmappable(
                f"node {path} launches launch plan {plan.text('project') or ''}/{plan.text('domain') or ''}/{plan.text('name') or ''}"
                f"@{plan.text('version') or ''} as a child execution, whose workflow the FlyteWorkflow does not hold: its GPUs cannot be "
                "projected here; launch the execution through budgetgate's preflight (budgetgate.adapters.flyte.execute), which fetches it "
                "and whose decision lets this FlyteWorkflow and its child's through"
            )
        if kind == "array":
            return self.array(nodes, node, known, path)
        raise Unmappable(f"{node.path}.kind {kind!r}: neither a task, branch, gate, workflow nor array node; its use cannot be projected")

    def branch(self, nodes: At, node: At, known: MappingType[str, int], path: str) -> list[TaskUse]:
        branch = node.obj("branch")
        labelled = [("then", branch.obj("if").text("then"))]
        labelled += [(f"elif-{i}", block.text("then")) for i, block in enumerate(branch.objects("elseIf"), start=1)]
        if branch.text("else"):
            labelled.append(("else", branch.text("else")))  # else a failure (elseFail): runs nothing
        options = []
        for label, case in labelled:
            at = nodes.entry(case or "")
            if at.value is None:
                raise Unmappable(f"{node.path}.branch names case {case!r}, which is not a node of the workflow")
            options.append(self.node(nodes, at.obj(), known, f"{path}/{label}"))
        return costliest(options)

    def array(self, nodes: At, node: At, known: MappingType[str, int], path: str) -> list[TaskUse]:
        array = node.obj("array")
        bound = set(array.field("BoundInputs").value or ())
        lengths = [n for b in node.objects("inputBindings") if b.text("var") not in bound and (n := _length(b.obj("binding"), known)) is not None]
        if not lengths:
            raise Unmappable(
                f"map node {path}: how many elements it maps is not known from the FlyteWorkflow (its list is neither a literal nor an "
                "input of the execution given inline); launch the execution through budgetgate's preflight with the list, or max_map_size="
            )
        elements = max(lengths)
        sub = array.field("SubNodeSpec")
        if sub.value is None:
            sub.fail("is missing: an array node's element")
        element = self.node(nodes, sub.obj(), {}, f"{path}/[{elements}]")
        return mapped(element, elements, array.count("Parallelism"))

    def task(self, node: At, path: str) -> TaskUse:
        key = node.text("task") or ""
        at = self.tasks.entry(key)
        if at.value is None:
            raise Unmappable(f"{node.path}.task names {key!r}, which is not in the FlyteWorkflow's tasks")
        template = at.obj()
        name = template.obj("id").text("name") or key
        what = f"task {name}" + (f" (node {path})" if path != name else "")
        if template.text("type") == "container_array":  # a map task of the plugin before array nodes
            raise Unmappable(f"{what} is a container_array map task, which budgetgate does not project: map with an array node (flytekit's map_task)")
        gpus = _k8s_gpus(node.obj("resources"), what)
        if gpus is None:
            gpus = _flyte_gpus(template.obj("container").obj("resources"), what)
        if gpus is None:
            gpus = _pod_gpus(template.obj("k8sPod").obj("podSpec"), what) or 0
        device = _device(node.obj("extendedResources")) or _device(template.obj("extendedResources"))
        metadata = template.obj("metadata")
        seconds = _go_seconds(node.field("executionDeadline")) or _proto_seconds(metadata.field("timeout"))
        if seconds is not None:
            hours = seconds / 3600
        elif self.default_runtime_hours is not None:
            hours = self.default_runtime_hours
        else:
            raise Unmappable(
                f"{what} has no timeout: set @task(timeout=...) or with_overrides(timeout=...), or a default runtime "
                "(BUDGETGATE_KUBERNETES_NAMESPACE_RUNTIME_HOURS, BUDGETGATE_KUBERNETES_DEFAULT_RUNTIME_HOURS)"
            )
        # flytepropeller wrote the node's attempts, retries + 1 (the node's retries when not 0,
        # else the task's), and none when both are 0.
        node_retries = max(0, (node.obj("retry").count("minAttempts") or 1) - 1)
        tries = attempts(node_retries, metadata.obj("retries").count("retries", 0) or 0, count_retries=self.count_retries)
        return TaskUse(name, gpus, hours * tries, flavor_of(device) if device else None, node=path, attempts=tries)


def _k8s_gpus(resources: At, what: str) -> int | None:
    """GPUs in a node's overridden Kubernetes resources (requests, else limits); None when none."""
    for side in ("requests", "limits"):
        asked = [v for k, v in resources.strings(side).items() if POD_GPU.match(k)]
        if asked:
            return sum(gpu_count(v, what) or 0 for v in asked)
    return None


def _flyte_gpus(resources: At, what: str) -> int | None:
    """GPUs a core.Resources names as JSON (request, else limit); None when it names none."""
    for side in ("requests", "limits"):
        for entry in resources.objects(side):
            if entry.field("name").value in ("GPU", 2):
                count = gpu_count(entry.field("value").value, what)
                if count is not None:
                    return count
    return None


def _pod_gpus(pod_spec: At, what: str) -> int | None:
    total = None
    for container in pod_spec.objects("containers"):
        resources = container.obj("resources")
        for side in ("requests", "limits"):
            asked = [v for k, v in resources.strings(side).items() if POD_GPU.match(k)] if isinstance(resources.field(side).value, dict) else []
            if asked:
                total = (total or 0) + sum(gpu_count(v, what) or 0 for v in asked)
                break
    return total


def _device(extended: At) -> str | None:
    return extended.obj("gpuAccelerator").text("device") or None


def _length(binding: At, known: MappingType[str, int]) -> int | None:
    """How many items a binding's list holds, when the FlyteWorkflow says."""
    if binding.field("collection").value is not None:
        return len(binding.obj("collection").objects("bindings"))
    promise = binding.field("promise")
    if promise.value is not None and (promise.obj().text("nodeId") or "") in _GLOBAL_INPUTS:
        return known.get(promise.obj().text("var") or "")
    return None


def _input_lengths(obj: At) -> dict[str, int]:
    found = {}
    literals = obj.obj("inputs").obj("literals")
    for name in literals.value:
        collection = literals.entry(name).obj().field("collection")
        if collection.value is not None:
            found[name] = len(collection.obj().objects("literals"))
    return found


def project_workflow(obj: At, *, default_runtime_hours: float | None, count_retries: bool = True) -> Projection:
    """The projected use of a FlyteWorkflow whose closure is in the object (the rules: the module's docstring)."""
    if obj.field("spec").value is None:
        raise Unmappable("spec is missing: a FlyteWorkflow carries its workflow's nodes (unless its closure is offloaded)")
    walk = _Walk(obj, default_runtime_hours=default_runtime_hours, count_retries=count_retries)
    try:
        return Projection(tuple(walk.workflow(obj.obj("spec"), _input_lengths(obj), "")))
    except Unprojectable as exc:
        raise Unmappable(str(exc)) from None


def flyte_submission(asked: Asked, mapping: Mapping = Mapping()) -> Submit | Skip:
    """The submission of a created FlyteWorkflow (not offloaded), or Skip when it asks for no GPU;
    Unmappable when it cannot be one."""
    obj = asked.object
    if obj is None:
        raise Unmappable("request.object is missing: a CREATE carries the object it creates")
    run = flyte_run(obj)
    if run.offloaded:
        raise Unmappable(offloaded_message(run))
    default_hours = mapping.namespace_runtime_hours.get(asked.namespace, mapping.default_runtime_hours)
    projected = project_workflow(obj, default_runtime_hours=default_hours)
    if projected.gpus == 0 and not mapping.submit_cpu_only:
        return Skip(f"asks for no GPU (execution {run.execution})")
    if projected.runtime_hours <= 0:
        return Skip(f"runs no task (execution {run.execution})")
    meta = obj.obj("metadata")
    labels = {k: v for k, v in meta.strings("labels").items() if k not in SYSTEM_LABELS}
    annotations = meta.strings("annotations")
    attempt = meta.obj("annotations").entry(mapping.attempt_annotation)
    if attempt.value is not None and (not _WHOLE.match(attempt.value) or int(attempt.value) < 1):
        attempt.fail("must be a whole number from 1")
    flavor = annotations.get(mapping.flavor_annotation) or projected.flavor or mapping.default_flavor
    region = annotations.get(mapping.region_annotation)
    body = {
        "run_id": run.run_id,
        "attempt": int(attempt.value or 1),
        "namespace": asked.namespace,
        "labels": labels,
        "resources": {"gpus": projected.gpus, "nodes": 1, **({"flavor": flavor} if flavor else {}), **({"region": region} if region else {})},
        "projected_runtime_hours": projected.runtime_hours,
        "job": {"namespace": asked.namespace, "name": asked.name or run.execution},
    }
    try:
        return Submit(AdmissionRequest.model_validate(body))
    except ValidationError as exc:
        wrong = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors())
        raise Unmappable(f"not a valid submission: {wrong}") from None
