"""A budget preflight for flytekit: before `FlyteRemote.execute`, ask budgetgate whether the
execution may start, and refuse to launch it on DENY or DELAY.

    from budgetgate.client import Client
    from budgetgate.adapters.flyte import execute

    with Client() as bg:
        execution = execute(remote, training_wf, {"epochs": 10}, client=bg, labels={"team": "vision", "cost-center": "1042"})

What an entity projects (`project`): for a task, its GPUs — `Resources(gpu=…)` requested, else
the limit — for its timeout (`@task(timeout=…)`, else `default_runtime_hours`); its flavor from
`accelerator=` (`nvidia-tesla-a100` → `a100`, `nvidia-h100` → `h100`). For a workflow, every task
node, sub-workflows included, as if each ran for its whole timeout: the execution's GPU-hours
are their sum, submitted as the largest task's GPUs for the hours that sum takes them (a
submission has one GPU count and one runtime; GPU-hours, what budgets count, are exact).
Flyte's own node-level overrides and map tasks' fan-out are not seen.

An execution name is one run: `execute` again with the same `execution_name` and another
request (another entity, labels, flavor) launches nothing and raises budgetgate.client.Conflict
(409), whose `changes` name each field, then and now. After an ALLOW no attempt changes that
(`next_attempt` is None: launch under a new execution name); after a DENY or DELAY,
`attempt=conflict.next_attempt` asks the new question.

A launch that fails after the ALLOW (bad inputs, FlyteAdmin unavailable) would leave the run's
reservation held with no execution to end it. `execute` first asks FlyteAdmin for the execution
(`fetch_execution`): a launch whose answer was lost may have created it, and it is then returned
as launched. When FlyteAdmin says it has none, `execute` publishes the run's end (a CANCELLED
lifecycle event, through `lifecycle`, by default `client`: metering-ingest, with a token holding
the exporter role) and raises LaunchFailed, naming the run and its execution name. When the
reservation was released, the run is over: a retry is a new run (call `execute` again without
`execution_name`). When it was not (FlyteAdmin could not say whether the execution exists, or the
end could not be published: no metering-ingest URL, the token lacks the role, metering-ingest
down), retry with `execution_name=error.execution_name`: the same run, replayed on its one
reservation (never retried, the reconciler reclaims it after its start deadline).
"""

from __future__ import annotations

import logging
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from budgetgate.client import Client, lifecycle_event
from budgetgate.contracts.admission import AdmissionRequest, AdmissionResponse

log = logging.getLogger(__name__)


class Unprojectable(ValueError):
    """An entity whose GPU-hours cannot be projected; the message says what to add."""


class BudgetRefused(RuntimeError):
    """budgetgate did not admit the execution; `answer` is the decision."""

    def __init__(self, answer: AdmissionResponse, message: str) -> None:
        super().__init__(message)
        self.answer = answer


class BudgetDenied(BudgetRefused):
    """DENY: the execution must not start (its budget is exhausted, or labels are missing)."""


class BudgetDelayed(BudgetRefused):
    """DELAY: resubmit at or after `next_eligible_time`, with a higher attempt."""

    @property
    def next_eligible_time(self) -> datetime | None:
        times = [e.next_eligible_time for e in self.answer.evaluations if e.decision == "DELAY" and e.next_eligible_time]
        return max(times) if times else None


class LaunchFailed(RuntimeError):
    """budgetgate admitted the execution and `FlyteRemote.execute` raised (the cause); `released`
    says whether the run's end was published, freeing its reservation (see the module docstring)."""

    def __init__(self, message: str, *, run_id: str, execution_name: str, attempt: int, released: bool) -> None:
        super().__init__(message)
        self.run_id = run_id
        self.execution_name = execution_name
        self.attempt = attempt
        self.released = released


@dataclass(frozen=True)
class TaskUse:
    """One task's projected use: `gpus` for `hours`, on `flavor`."""

    name: str
    gpus: int
    hours: float
    flavor: str | None


@dataclass(frozen=True)
class Projection:
    """What an execution is projected to use, task by task."""

    tasks: tuple[TaskUse, ...]

    @property
    def gpu_hours(self) -> float:
        return sum(t.gpus * t.hours for t in self.tasks)

    @property
    def gpus(self) -> int:
        return max((t.gpus for t in self.tasks), default=0)

    @property
    def runtime_hours(self) -> float:
        """Hours the largest task's GPUs would take for all the GPU-hours (the longest task's
        hours for CPU-only work)."""
        if self.gpus:
            return self.gpu_hours / self.gpus
        return max((t.hours for t in self.tasks), default=0.0)

    @property
    def flavor(self) -> str | None:
        """The flavor of most of the GPU-hours."""
        by_flavor: dict[str, float] = {}
        for t in self.tasks:
            if t.flavor and t.gpus:
                by_flavor[t.flavor] = by_flavor.get(t.flavor, 0.0) + t.gpus * t.hours
        return max(by_flavor, key=by_flavor.__getitem__) if by_flavor else None


def flavor_of(device: str) -> str:
    """The rate card's flavor of a Flyte accelerator device name."""
    name = device.lower().removeprefix("nvidia-").removeprefix("tesla-")
    return re.sub(r"[^a-z0-9._-]", "-", name)


def _gpus(task: Any) -> int:
    resources = getattr(task, "resources", None)
    asked = None
    if resources is not None:
        asked = getattr(resources.requests, "gpu", None) or getattr(resources.limits, "gpu", None)
    if asked in (None, ""):
        return 0
    try:
        count = float(str(asked))
    except ValueError:
        raise Unprojectable(f"task {task.name}: gpu={asked!r} is not a number of GPUs") from None
    if count < 0 or count != int(count):
        raise Unprojectable(f"task {task.name}: gpu={asked!r} is not a whole number of GPUs")
    return int(count)


def _task(task: Any, default_runtime_hours: float | None) -> TaskUse:
    timeout = getattr(getattr(task, "metadata", None), "timeout", None)
    if timeout:
        hours = timeout.total_seconds() / 3600
    elif default_runtime_hours is not None:
        hours = default_runtime_hours
    else:
        raise Unprojectable(f"task {task.name} has no timeout: set @task(timeout=timedelta(...)) or pass default_runtime_hours")
    accelerator = getattr(task, "accelerator", None)
    flavor = flavor_of(accelerator.to_flyte_idl().device) if accelerator is not None else None
    return TaskUse(task.name, _gpus(task), hours, flavor)


def project(entity: Any, *, default_runtime_hours: float | None = None) -> Projection:
    """The projected use of a flytekit task or workflow (see the module docstring)."""
    from flytekit.core.base_task import PythonTask
    from flytekit.core.launch_plan import LaunchPlan
    from flytekit.core.workflow import WorkflowBase

    if isinstance(entity, LaunchPlan):
        entity = entity.workflow
    if isinstance(entity, PythonTask):
        return Projection((_task(entity, default_runtime_hours),))
    if isinstance(entity, WorkflowBase):
        found: list[TaskUse] = []
        for node in entity.nodes:
            found.extend(project(node.flyte_entity, default_runtime_hours=default_runtime_hours).tasks)
        return Projection(tuple(found))
    raise Unprojectable(f"{type(entity).__name__} {getattr(entity, 'name', '')!r} is not a flytekit task, workflow or launch plan")


def submission(
    entity: Any,
    *,
    run_id: str,
    namespace: str,
    labels: Mapping[str, str] | None = None,
    attempt: int = 1,
    flavor: str | None = None,
    region: str | None = None,
    default_runtime_hours: float | None = None,
) -> AdmissionRequest:
    """The submission for executing `entity` as run `run_id` (flavor: the accelerator's, unless given)."""
    projected = project(entity, default_runtime_hours=default_runtime_hours)
    if projected.runtime_hours <= 0:
        raise Unprojectable(f"{getattr(entity, 'name', 'the entity')} has no task to run")
    chosen = flavor or projected.flavor
    return AdmissionRequest.model_validate({
        "run_id": run_id, "attempt": attempt, "namespace": namespace, "labels": dict(labels or {}),
        "resources": {"gpus": projected.gpus, "nodes": 1, **({"flavor": chosen} if chosen else {}), **({"region": region} if region else {})},
        "projected_runtime_hours": projected.runtime_hours,
        "job": {"namespace": namespace, "name": getattr(entity, "name", run_id)},
    })  # fmt: skip


def preflight(entity: Any, *, client: Client, **request: Any) -> AdmissionResponse:
    """Submit `entity` (keywords of `submission`); the ALLOW answer, else BudgetDenied or
    BudgetDelayed, or budgetgate.client.Conflict when the run was decided for another request."""
    answer = client.submit(submission(entity, **request))
    if answer.decision == "DENY":
        raise BudgetDenied(answer, f"budgetgate denied run {answer.run_id}: {answer.reason}")
    if answer.decision == "DELAY":
        refused = BudgetDelayed(answer, "")
        when = refused.next_eligible_time
        refused.args = (f"budgetgate delayed run {answer.run_id}: {answer.reason}; resubmit with attempt={answer.attempt + 1}"
                        + (f" at or after {when.isoformat()}" if when else ""),)  # fmt: skip
        raise refused
    return answer


def execute(
    remote: Any,
    entity: Any,
    inputs: Mapping[str, Any] | None = None,
    *,
    client: Client,
    labels: Mapping[str, str] | None = None,
    namespace: str | None = None,
    project: str | None = None,
    domain: str | None = None,
    execution_name: str | None = None,
    attempt: int = 1,
    flavor: str | None = None,
    region: str | None = None,
    default_runtime_hours: float | None = None,
    lifecycle: Client | None = None,
    **execute_kwargs: Any,
) -> Any:
    """`remote.execute(entity, inputs, ...)` once budgetgate has admitted it, as run
    `flyte/<project>/<domain>/<execution name>` in namespace `<project>-<domain>` (Flyte's default
    mapping) unless `namespace` is given. The execution name is made here when not given, so a
    retry of this call with the same name is the same run. A launch that raises ends the run
    (through `lifecycle`, default `client`) and raises LaunchFailed (see the module docstring)."""
    project = project or remote.default_project
    domain = domain or remote.default_domain
    if not project or not domain:
        raise ValueError("no Flyte project or domain: pass project= and domain=, or configure the remote's defaults")
    name = execution_name or f"b{uuid.uuid4().hex[:19]}"  # Flyte execution names: a letter, then up to 19 more
    run_id = f"flyte/{project}/{domain}/{name}"
    preflight(
        entity, client=client, run_id=run_id, namespace=namespace or f"{project}-{domain}", labels=labels,
        attempt=attempt, flavor=flavor, region=region, default_runtime_hours=default_runtime_hours,
    )  # fmt: skip
    try:
        return remote.execute(entity, dict(inputs or {}), project=project, domain=domain, execution_name=name, **execute_kwargs)
    except Exception as exc:
        found = _existing(remote, project=project, domain=domain, name=name)
        if found is _UNKNOWN:
            message = (
                f"launching run {run_id} failed ({type(exc).__name__}: {exc}), and whether FlyteAdmin created the execution cannot be told now: "
                f"its reservation is held; retry with execution_name={name!r} (an execution that exists is then found and returned)"
            )
            raise LaunchFailed(message, run_id=run_id, execution_name=name, attempt=attempt, released=False) from exc
        if found is not None:
            return found  # it launched all the same (an answer lost after FlyteAdmin created it, or a retry of one that did)
        raise _launch_failed(exc, run_id=run_id, execution_name=name, attempt=attempt, lifecycle=lifecycle or client) from exc


_UNKNOWN = object()


def _existing(remote: Any, *, project: str, domain: str, name: str) -> Any:
    """The execution `name` if FlyteAdmin has it, None if it has not, _UNKNOWN if it cannot say:
    a launch that raised may still have created it, and ending such a run would free the
    reservation of a workload that runs."""
    try:
        from flytekit.exceptions.user import FlyteEntityNotExistException as missing
    except ImportError:  # without flytekit, no FlyteRemote: a stand-in raising LookupError
        missing = LookupError
    try:
        return remote.fetch_execution(project=project, domain=domain, name=name)
    except missing:
        return None
    except Exception as exc:  # noqa: BLE001 - FlyteAdmin unavailable: no answer either way
        log.warning("execution %s/%s/%s: cannot tell whether it exists (%s: %s)", project, domain, name, type(exc).__name__, exc)
        return _UNKNOWN


def _launch_failed(exc: Exception, *, run_id: str, execution_name: str, attempt: int, lifecycle: Client) -> LaunchFailed:
    """Publish the end of a run whose launch raised `exc`; the error saying what a retry should do."""
    why = f"{type(exc).__name__}: {exc}"
    try:
        lifecycle.publish_lifecycle(lifecycle_event(run_id, "CANCELLED", reason=f"launch failed: {why}"[:1024]))
    except Exception as unpublished:  # noqa: BLE001 - the launch's error is the one to raise
        log.warning(
            "run %s: publishing its end failed (%s: %s); its reservation stays until the start deadline", run_id, type(unpublished).__name__, unpublished
        )
        message = (
            f"launching run {run_id} failed ({why}); its end could not be published ({type(unpublished).__name__}: {unpublished}), "
            f"so its reservation is held: retry with execution_name={execution_name!r} to reuse it"
        )
        return LaunchFailed(message, run_id=run_id, execution_name=execution_name, attempt=attempt, released=False)
    message = f"launching run {run_id} failed ({why}); the run is ended (CANCELLED published, its reservation released): retry as a new run (no execution_name)"
    return LaunchFailed(message, run_id=run_id, execution_name=execution_name, attempt=attempt, released=True)
