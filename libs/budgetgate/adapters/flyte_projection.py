"""What a Flyte execution is projected to use: GPUs, for how long, on which flavor, read from the
Flyte IDL templates of what is launched (docs/adapters.md, "Flyte preflight", has the rules).

Local entities (a `@task`, a `@workflow`, a `LaunchPlan`) are compiled here by flytekit into the
templates FlyteAdmin would be given (`get_serializable`, what `FlyteRemote.execute` registers);
remote ones (`FlyteTask`, `FlyteWorkflow`, `FlyteLaunchPlan`, fetched by FlyteRemote) carry their
compiled templates; a reference (`reference_task`, `reference_workflow`, `reference_launch_plan`)
and any entity a template names that is not at hand is fetched through `remote`, the FlyteRemote
that launches the execution. One walk over the templates projects them all:

- a task node: its GPUs (the node's `with_overrides` resources when they name GPUs, else the
  task's: request, else limit; a pod template's containers' `gpu` or `<vendor>/gpu` when the container
  names none) for its timeout (the node's, else the task's, else `default_runtime_hours`) times
  its attempts (`retries + 1`: the node's retries when not 0, else the task's, as flytepropeller
  counts them; `count_retries=False` counts one attempt);
- a sub-workflow or launch-plan node: its workflow's nodes (a launch plan's child execution runs
  on the parent's behalf);
- a branch (`conditional()`): the branch with the most GPU-hours (which runs is decided at run
  time); a gate node (`approve`, `sleep`, `wait_for_input`): nothing, it waits and holds no GPU;
- a map (an array node, `map_task` or a map over a launch plan): the mapped node × its elements,
  at most `concurrency` at once; the elements are counted from the list the map is given when it
  is known before launch (a literal list, or a workflow input given in `inputs`, a launch plan's
  fixed or default input, a workflow's default; a partial's bound inputs aside), else
  `max_map_size`, else Unprojectable.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

from budgetgate.platforms.flyte_usage import (
    POD_GPU,
    Projection,
    TaskUse,
    Unprojectable,
    attempts,
    costliest,
    flavor_of,
    gpu_count,
    mapped,
)

_GLOBAL_INPUTS = {"", "start-node"}  # a binding to the workflow's inputs (flytekit: GLOBAL_INPUT_NODE_ID; compiled: START_NODE_ID)
_SYSTEM_NODES = {"start-node", "end-node"}
_LOCAL = "budgetgate-preflight"  # the project, domain and version local entities are compiled under (ids only)


def _key(ident: Any) -> tuple[Any, ...]:
    return (ident.resource_type, ident.project, ident.domain, ident.name, ident.version)


def _named(ident: Any) -> str:
    return f"{ident.project}/{ident.domain}/{ident.name}@{ident.version}"


class _Templates:
    """The templates an execution's nodes refer to: those given, else fetched through `remote`."""

    def __init__(self, remote: Any) -> None:
        self.remote = remote
        self.tasks: dict[tuple[Any, ...], Any] = {}
        self.workflows: dict[tuple[Any, ...], Any] = {}
        self.launch_plans: dict[tuple[Any, ...], Any] = {}

    def add_flyte_workflow(self, workflow: Any) -> Any:
        """Add a FlyteWorkflow's templates; its primary template. FlyteRemote keeps the compiled
        closure it was made from, whose nodes still hold their overrides (its promoted nodes do not)."""
        closure = getattr(workflow, "_compiled_closure", None)
        if closure is not None:
            for task in closure.tasks or []:
                self.tasks[_key(task.template.id)] = task.template
            for sub in closure.sub_workflows or []:
                self.workflows[_key(sub.template.id)] = sub.template
            primary = closure.primary.template
        else:
            for task in workflow.flyte_tasks or []:
                self.tasks[_key(task.id)] = task.template
            for sub in workflow.flyte_sub_workflows or []:
                self.add_flyte_workflow(sub)
            primary = workflow.template
        for ident, spec in (getattr(workflow, "_launch_plans", None) or {}).items():
            self.launch_plans.setdefault(_key(ident), spec)
        self.workflows[_key(primary.id)] = primary
        return primary

    def add_flyte_launch_plan(self, plan: Any) -> Any:
        if plan.flyte_workflow is not None:
            self.add_flyte_workflow(plan.flyte_workflow)
        self.launch_plans[_key(plan.id)] = plan
        return plan

    def add_compiled(self, mapping: Mapping[Any, Any]) -> None:
        """Add what flytekit's `get_serializable` compiled (TaskSpec, WorkflowSpec, admin LaunchPlan)."""
        from flytekit.models.admin.workflow import WorkflowSpec
        from flytekit.models.launch_plan import LaunchPlan as LaunchPlanModel
        from flytekit.models.task import TaskSpec

        for model in mapping.values():
            if isinstance(model, TaskSpec):
                self.tasks[_key(model.template.id)] = model.template
            elif isinstance(model, WorkflowSpec):
                self.workflows[_key(model.template.id)] = model.template
                for sub in model.sub_workflows or []:
                    self.workflows[_key(sub.id)] = sub
            elif isinstance(model, LaunchPlanModel):
                self.launch_plans[_key(model.id)] = model.spec

    def task(self, ident: Any, where: str) -> Any:
        found = self.tasks.get(_key(ident))
        if found is None:
            found = self.tasks[_key(ident)] = self._fetch("task", ident, where).template
        return found

    def workflow(self, ident: Any, where: str) -> Any:
        found = self.workflows.get(_key(ident))
        if found is None:
            found = self.add_flyte_workflow(self._fetch("workflow", ident, where))
        return found

    def launch_plan(self, ident: Any, where: str) -> Any:
        found = self.launch_plans.get(_key(ident))
        if found is None:
            found = self.add_flyte_launch_plan(self._fetch("launch_plan", ident, where))
        return found

    def _fetch(self, kind: str, ident: Any, where: str) -> Any:
        what = f"{where}: {kind.replace('_', ' ')} {_named(ident)}"
        if self.remote is None:
            raise Unprojectable(f"{what} is not at hand: pass remote= (the FlyteRemote that launches it) so it can be fetched from FlyteAdmin")
        fetch = getattr(self.remote, f"fetch_{kind}", None)
        if fetch is None:
            raise Unprojectable(f"{what} is not at hand and {type(self.remote).__name__} cannot fetch it (no fetch_{kind}): pass a FlyteRemote")
        try:
            return fetch(project=ident.project, domain=ident.domain, name=ident.name, version=ident.version or None)
        except Exception as exc:
            raise Unprojectable(
                f"{what} cannot be fetched from FlyteAdmin ({type(exc).__name__}: {exc}): "
                "register it, or correct the reference's project, domain, name and version"
            ) from exc


def _hours(duration: Any) -> float | None:
    if not duration:
        return None
    return duration.total_seconds() / 3600 or None


def _retries(metadata: Any) -> int:
    strategy = getattr(metadata, "retries", None)
    return int(getattr(strategy, "retries", strategy) or 0) if strategy is not None else 0


def _resource_gpus(resources: Any, what: str) -> int | None:
    """The GPUs a Resources model names (request, else limit); None when it names none."""
    from flytekit.models.task import Resources

    if resources is None:
        return None
    for entries in (resources.requests, resources.limits):
        for entry in entries or []:
            if entry.name == Resources.ResourceName.GPU:
                count = gpu_count(entry.value, what)
                if count is not None:
                    return count
    return None


def _pod_gpus(template: Any, what: str) -> int | None:
    """The GPUs of a pod-template task: its containers' `gpu` or `<vendor>/gpu` (request, else limit)."""
    pod = getattr(template, "k8s_pod", None)
    spec = getattr(pod, "pod_spec", None) or {}
    total = None
    for container in spec.get("containers") or []:
        resources = container.get("resources") or {}
        for side in ("requests", "limits"):
            asked = [v for k, v in (resources.get(side) or {}).items() if POD_GPU.match(k)]
            if asked:
                total = (total or 0) + sum(gpu_count(v, what) or 0 for v in asked)
                break
    return total


def _device(extended: Any) -> str | None:
    accelerator = getattr(extended, "gpu_accelerator", None)
    return getattr(accelerator, "device", None) or None


def _length(binding: Any, known: Mapping[str, int]) -> int | None:
    """How many items a binding's list holds, when known before launch."""
    if getattr(binding, "collection", None) is not None:
        return len(binding.collection.bindings or [])
    promise = getattr(binding, "promise", None)
    if promise is not None and promise.node_id in _GLOBAL_INPUTS:
        return known.get(promise.var)
    return None


def _literal_length(value: Any) -> int | None:
    """How many items a given input holds: a Python list or tuple, or a collection literal."""
    from flytekit.models.literals import Literal

    if isinstance(value, Literal):
        return len(value.collection.literals or []) if value.collection is not None else None
    if isinstance(value, list | tuple):
        return len(value)
    return None


def _lengths(values: Mapping[str, Any] | None) -> dict[str, int]:
    found = {}
    for name, value in (values or {}).items():
        n = _literal_length(value)
        if n is not None:
            found[name] = n
    return found


class _Walk:
    """One walk over an execution's templates (the rules: this module's docstring)."""

    def __init__(self, templates: _Templates, *, default_runtime_hours: float | None, count_retries: bool, max_map_size: int | None) -> None:
        self.templates = templates
        self.default_runtime_hours = default_runtime_hours
        self.count_retries = count_retries
        self.max_map_size = max_map_size

    def workflow(self, template: Any, known: Mapping[str, int], path: str) -> list[TaskUse]:
        found: list[TaskUse] = []
        for node in template.nodes:
            if node.id not in _SYSTEM_NODES:
                found.extend(self.node(node, known, f"{path}/{node.id}" if path else node.id))
        return found

    def launch_plan(self, spec: Any, known: Mapping[str, int], path: str) -> list[TaskUse]:
        defaults = {name: p.default for name, p in (spec.default_inputs.parameters or {}).items() if p.default is not None}
        fixed = spec.fixed_inputs.literals if spec.fixed_inputs is not None else {}
        merged = {**_lengths(defaults), **known, **_lengths(fixed)}  # what is given beats a default; fixed inputs cannot be given
        return self.workflow(self.templates.workflow(spec.workflow_id, path or spec.workflow_id.name), merged, path)

    def node(self, node: Any, known: Mapping[str, int], path: str) -> list[TaskUse]:
        if node.task_node is not None:
            template = self.templates.task(node.task_node.reference_id, f"node {path}")
            return [self.task(template, node.metadata, node.task_node.overrides, path)]
        if node.workflow_node is not None:
            inner = {b.var: n for b in node.inputs or [] if (n := _length(b.binding, known)) is not None}
            ref = node.workflow_node
            if ref.sub_workflow_ref is not None:
                return self.workflow(self.templates.workflow(ref.sub_workflow_ref, f"node {path}"), inner, path)
            return self.launch_plan(self.templates.launch_plan(ref.launchplan_ref, f"node {path}"), inner, path)
        if node.branch_node is not None:
            return self.branch(node.branch_node.if_else, known, path)
        if node.gate_node is not None:
            return []  # approve, sleep, wait_for_input: waits, holds no GPU
        if node.array_node is not None:
            return self.array(node, known, path)
        raise Unprojectable(f"node {path}: neither a task, workflow, branch, gate nor array node; its use cannot be projected")

    def branch(self, block: Any, known: Mapping[str, int], path: str) -> list[TaskUse]:
        """The branch with the most GPU-hours (the first of equals): which one runs is decided at run time."""
        cases = [("then", block.case.then_node)]
        cases += [(f"elif-{i}", other.then_node) for i, other in enumerate(block.other or [], start=1)]
        if block.else_node is not None:
            cases.append(("else", block.else_node))  # else: an error (fail) runs nothing
        return costliest([self.node(node, known, f"{path}/{label}") for label, node in cases])

    def array(self, node: Any, known: Mapping[str, int], path: str) -> list[TaskUse]:
        array = node.array_node
        bound = set(getattr(array, "_bound_inputs", None) or ())  # a partial's inputs, the same for every element
        lengths = [n for b in node.inputs or [] if b.var not in bound and (n := _length(b.binding, known)) is not None]
        if lengths:
            elements = max(lengths)
        elif self.max_map_size is not None:
            elements = self.max_map_size
        else:
            raise Unprojectable(
                f"map node {path}: how many elements it maps is not known before launch (its list is not a literal, nor an input given to execute, "
                "nor a default): pass the input in inputs=, or max_map_size= (the most elements a map may have)"
            )
        parallelism = getattr(array, "_parallelism", None) or getattr(array, "parallelism", None)
        element = self.node(array.node, {}, f"{path}/[{elements}]")
        return mapped(element, elements, parallelism)

    def task(self, template: Any, metadata: Any, overrides: Any, path: str) -> TaskUse:
        name = template.id.name
        what = f"task {name}" + (f" (node {path})" if path and path != name else "")
        gpus = _resource_gpus(getattr(overrides, "resources", None), what)
        if gpus is None:
            gpus = _resource_gpus(template.container.resources if template.container is not None else None, what)
        if gpus is None:
            gpus = _pod_gpus(template, what) or 0
        device = _device(getattr(overrides, "extended_resources", None)) or _device(template.extended_resources)
        hours = _hours(getattr(metadata, "timeout", None)) or _hours(template.metadata.timeout)
        if hours is None:
            if self.default_runtime_hours is None:
                raise Unprojectable(f"{what} has no timeout: set @task(timeout=timedelta(...)) or pass default_runtime_hours")
            hours = self.default_runtime_hours
        tries = attempts(_retries(metadata), _retries(template.metadata), count_retries=self.count_retries)
        return TaskUse(name, gpus, hours * tries, flavor_of(device) if device else None, node=path, attempts=tries)


def _compile(entity: Any, templates: _Templates) -> Any:
    """Compile a local entity as FlyteRemote.execute would register it; the entity's own model.
    Images are not resolved: an ImageSpec is named, not built (a projection needs no image)."""
    from flytekit.configuration import Image, ImageConfig, SerializationSettings
    from flytekit.tools.translator import get_serializable

    class _AnyImage(ImageConfig):
        def find_image(self, name: str) -> Image:
            return Image(name=name, fqn=f"{_LOCAL}/{name}", tag=_LOCAL)

    default = ImageConfig.auto_default_image()
    images = _AnyImage(default_image=default.default_image, images=default.images)
    settings = SerializationSettings(image_config=images, project=_LOCAL, domain=_LOCAL, version=_LOCAL)
    mapping: OrderedDict[Any, Any] = OrderedDict()
    try:
        model = get_serializable(mapping, settings, entity)
    except Exception as exc:
        raise Unprojectable(f"{getattr(entity, 'name', entity)!r} cannot be compiled by flytekit ({type(exc).__name__}: {exc})") from exc
    templates.add_compiled(mapping)
    return model


def _resolve_reference(entity: Any, templates: _Templates) -> Any:
    """The FlyteTask, FlyteWorkflow or FlyteLaunchPlan a reference points to, fetched through the remote."""
    from flytekit.core.launch_plan import ReferenceLaunchPlan
    from flytekit.core.task import ReferenceTask

    kind = "task" if isinstance(entity, ReferenceTask) else "launch_plan" if isinstance(entity, ReferenceLaunchPlan) else "workflow"
    ident = entity.id
    what = f"reference {kind.replace('_', ' ')} {_named(ident)}"
    if templates.remote is None:
        raise Unprojectable(
            f"{what} cannot be projected without its templates: "
            "pass remote= (execute passes the FlyteRemote it launches through) so it is fetched from FlyteAdmin"
        )
    return templates._fetch(kind, ident, "the executed entity")


def project(
    entity: Any,
    *,
    inputs: Mapping[str, Any] | None = None,
    remote: Any = None,
    default_runtime_hours: float | None = None,
    count_retries: bool = True,
    max_map_size: int | None = None,
) -> Projection:
    """The projected use of executing `entity` with `inputs` (the rules: the module docstring).
    `remote` (a FlyteRemote) fetches what is not at hand: a reference's templates, a launch plan's
    workflow, a task or launch plan a workflow's node names."""
    from flytekit.core.array_node_map_task import ArrayNodeMapTask
    from flytekit.core.base_task import PythonTask
    from flytekit.core.launch_plan import LaunchPlan
    from flytekit.core.reference_entity import ReferenceEntity
    from flytekit.core.workflow import WorkflowBase
    from flytekit.remote.entities import FlyteLaunchPlan, FlyteTask, FlyteWorkflow

    if max_map_size is not None and (isinstance(max_map_size, bool) or not isinstance(max_map_size, int) or max_map_size < 0):
        raise ValueError(f"max_map_size must be a whole number of elements, not {max_map_size!r}")
    if default_runtime_hours is not None and not (
        isinstance(default_runtime_hours, int | float) and math.isfinite(default_runtime_hours) and default_runtime_hours > 0
    ):
        raise ValueError(f"default_runtime_hours must be a positive number of hours, not {default_runtime_hours!r}")
    templates = _Templates(remote)
    walk = _Walk(templates, default_runtime_hours=default_runtime_hours, count_retries=count_retries, max_map_size=max_map_size)
    known = _lengths(inputs)
    if isinstance(entity, ReferenceEntity):
        entity = _resolve_reference(entity, templates)
    if isinstance(entity, ArrayNodeMapTask):
        raise Unprojectable(f"map task {entity.name} launched on its own: launch it inside a @workflow, whose map node's fan-out is projected")
    if isinstance(entity, PythonTask):
        return Projection((walk.task(_compile(entity, templates).template, None, None, entity.name),))
    if isinstance(entity, WorkflowBase):
        defaults = _lengths(entity.python_interface.default_inputs_as_kwargs)
        return Projection(tuple(walk.workflow(_compile(entity, templates).template, {**defaults, **known}, "")))
    if isinstance(entity, LaunchPlan):
        return Projection(tuple(walk.launch_plan(_compile(entity, templates).spec, known, "")))
    if isinstance(entity, FlyteTask):
        return Projection((walk.task(entity.template, None, None, entity.name),))
    if isinstance(entity, FlyteWorkflow):
        return Projection(tuple(walk.workflow(templates.add_flyte_workflow(entity), known, "")))
    if isinstance(entity, FlyteLaunchPlan):
        return Projection(tuple(walk.launch_plan(templates.add_flyte_launch_plan(entity), known, "")))
    raise Unprojectable(
        f"{type(entity).__name__} {getattr(entity, 'name', '')!r} is not a flytekit task, workflow or launch plan: "
        "local, remote (FlyteRemote.fetch_*) or a reference"
    )


__all__: Sequence[str] = ("Projection", "TaskUse", "Unprojectable", "flavor_of", "project")
