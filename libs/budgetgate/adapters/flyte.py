"""A budget preflight for flytekit: before `FlyteRemote.execute`, ask budgetgate whether the
execution may start, and refuse to launch it on DENY or DELAY.

    from budgetgate.client import Client
    from budgetgate.adapters.flyte import execute

    with Client() as bg:
        execution = execute(remote, training_wf, {"epochs": 10}, client=bg, labels={"team": "vision", "cost-center": "1042"})

What an execution projects (`project`, budgetgate.adapters.flyte_projection, whose docstring has
the rules): local tasks, workflows and launch plans compiled by flytekit, and what FlyteRemote
fetches (FlyteTask, FlyteWorkflow, FlyteLaunchPlan) from their compiled templates; references and
anything else not at hand through the remote `execute` launches with. Each task node: its GPUs
(node overrides first) for its timeout times its attempts; a branch, its costliest case; a gate,
nothing; a map, its element × the list's length when known before launch (`inputs`, defaults,
fixed inputs), else `max_map_size`, else Unprojectable. The execution's GPU-hours are their sum,
submitted as the largest node's GPUs for the hours that sum takes them (a submission has one GPU
count and one runtime; GPU-hours, what budgets count, are exact).

The call is checked before anything is submitted: arguments `remote.execute` does not take,
inputs the entity does not have, an execution name FlyteAdmin refuses, or both a name and
`execution_name_prefix` (which `execute` turns into the name, as flytekit does) raise TypeError or
ValueError, with no decision made. With `wait=True`, the execution is launched, then waited for
(`remote.wait`); an error while waiting is raised as it is (a note names the run): the execution
was launched, its reservation is its own, nothing is ended.

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
from datetime import datetime
from typing import Any

from budgetgate.adapters.flyte_projection import Projection, TaskUse, Unprojectable, flavor_of, project
from budgetgate.client import Client, lifecycle_event
from budgetgate.contracts.admission import AdmissionRequest, AdmissionResponse
from budgetgate.platforms.flyte_usage import flyte_run_id

log = logging.getLogger(__name__)


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


def submission(
    entity: Any,
    *,
    run_id: str,
    namespace: str,
    labels: Mapping[str, str] | None = None,
    attempt: int = 1,
    flavor: str | None = None,
    region: str | None = None,
    inputs: Mapping[str, Any] | None = None,
    remote: Any = None,
    default_runtime_hours: float | None = None,
    count_retries: bool = True,
    max_map_size: int | None = None,
) -> AdmissionRequest:
    """The submission for executing `entity` with `inputs` as run `run_id` (flavor: the
    accelerator's, unless given; `remote`, `count_retries`, `max_map_size`: see `project`)."""
    projected = project(
        entity, inputs=inputs, remote=remote, default_runtime_hours=default_runtime_hours, count_retries=count_retries, max_map_size=max_map_size
    )
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


EXECUTION_NAME = re.compile(r"^[a-z][a-z0-9-]*$")  # FlyteAdmin's rule for an execution name
MAX_EXECUTION_NAME = 63  # FlyteAdmin's limit (a Kubernetes label value)


def execution_name_for(execution_name: str | None, prefix: str | None) -> str:
    """The execution name to launch under: the one given, else `<prefix>-<19 hex>` (flytekit's
    form for execution_name_prefix), else `b<19 hex>`; ValueError, before anything is submitted,
    for a name FlyteAdmin would refuse or for both a name and a prefix."""
    if execution_name is not None and prefix is not None:
        raise ValueError("pass execution_name or execution_name_prefix, not both (flytekit refuses both)")
    if execution_name is not None:
        name, what = execution_name, f"execution_name {execution_name!r}"
    elif prefix is not None:
        name, what = f"{prefix}-{uuid.uuid4().hex[:19]}", f"execution_name_prefix {prefix!r}"
    else:
        return f"b{uuid.uuid4().hex[:19]}"  # a letter, then 19 more: within FlyteAdmin's older limit of 20 as well
    if not isinstance(name, str) or not EXECUTION_NAME.match(name) or len(name) > MAX_EXECUTION_NAME:
        raise ValueError(
            f"{what}: FlyteAdmin takes execution names of lowercase letters, digits and '-', starting with a letter, "
            f"at most {MAX_EXECUTION_NAME} characters (a prefix: at most {MAX_EXECUTION_NAME - 20})"
        )
    return name


def _check_call(remote: Any, entity: Any, inputs: Mapping[str, Any], arguments: Mapping[str, Any]) -> None:
    """Refuse, before the submission, a call `remote.execute` would refuse after it: an argument
    it does not take, an input the entity does not have."""
    import inspect

    try:
        signature = inspect.signature(remote.execute)
    except (TypeError, ValueError):  # a callable without a signature: nothing to check against
        signature = None
    if signature is not None:
        try:
            signature.bind(entity, dict(inputs), **arguments)
        except TypeError as exc:
            raise TypeError(f"{type(remote).__name__}.execute would refuse these arguments ({exc}); nothing was submitted") from None
    declared = None
    interface = getattr(entity, "python_interface", None)
    if interface is not None:
        declared = set(interface.inputs)
    elif getattr(entity, "interface", None) is not None and entity.interface.inputs is not None:
        declared = set(entity.interface.inputs)
    unknown = sorted(set(inputs) - declared) if declared is not None else []
    if unknown:
        raise ValueError(
            f"{getattr(entity, 'name', 'the entity')} has no input {', '.join(unknown)} "
            f"(its inputs: {', '.join(sorted(declared or ())) or 'none'}); nothing was submitted"
        )


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
    execution_name_prefix: str | None = None,
    attempt: int = 1,
    flavor: str | None = None,
    region: str | None = None,
    default_runtime_hours: float | None = None,
    count_retries: bool = True,
    max_map_size: int | None = None,
    lifecycle: Client | None = None,
    wait: bool = False,
    **execute_kwargs: Any,
) -> Any:
    """`remote.execute(entity, inputs, ...)` once budgetgate has admitted it, as run
    `flyte/<project>/<domain>/<execution name>` in namespace `<project>-<domain>` (Flyte's default
    mapping) unless `namespace` is given. The execution name is made here when not given (from
    `execution_name_prefix` when given, as flytekit makes it), so a retry of this call with the
    same name is the same run. The call is checked before the submission (arguments
    `remote.execute` takes, inputs the entity has, the execution name). A launch that raises ends
    the run (through `lifecycle`, default `client`) and raises LaunchFailed (see the module
    docstring). With `wait`, the launched execution is waited for (`remote.wait`); an error while
    waiting is raised as it is, the execution launched and its reservation kept."""
    project_name = project or remote.default_project
    domain = domain or remote.default_domain
    if not project_name or not domain:
        raise ValueError("no Flyte project or domain: pass project= and domain=, or configure the remote's defaults")
    name = execution_name_for(execution_name, execution_name_prefix)
    given = dict(inputs or {})
    if wait and not callable(getattr(remote, "wait", None)):
        raise TypeError(f"wait=True, and {type(remote).__name__} has no wait(execution) to wait with; nothing was submitted")
    _check_call(remote, entity, given, {"project": project_name, "domain": domain, "execution_name": name, **execute_kwargs})
    run_id = flyte_run_id(project_name, domain, name)
    preflight(
        entity, client=client, run_id=run_id, namespace=namespace or f"{project_name}-{domain}", labels=labels,
        attempt=attempt, flavor=flavor, region=region, inputs=given, remote=remote,
        default_runtime_hours=default_runtime_hours, count_retries=count_retries, max_map_size=max_map_size,
    )  # fmt: skip
    try:
        execution = remote.execute(entity, given, project=project_name, domain=domain, execution_name=name, **execute_kwargs)
    except Exception as exc:
        found = _existing(remote, project=project_name, domain=domain, name=name)
        if found is _UNKNOWN:
            message = (
                f"launching run {run_id} failed ({type(exc).__name__}: {exc}), and whether FlyteAdmin created the execution cannot be told now: "
                f"its reservation is held; retry with execution_name={name!r} (an execution that exists is then found and returned)"
            )
            raise LaunchFailed(message, run_id=run_id, execution_name=name, attempt=attempt, released=False) from exc
        if found is None:
            raise _launch_failed(exc, run_id=run_id, execution_name=name, attempt=attempt, lifecycle=lifecycle or client) from exc
        execution = found  # it launched all the same (an answer lost after FlyteAdmin created it, or a retry of one that did)
    if not wait:
        return execution
    try:
        return remote.wait(execution)
    except Exception as exc:
        # The execution was launched: its reservation belongs to it (the run's end comes from its
        # own lifecycle, not from here); the caller learns that waiting failed, and can wait again.
        exc.add_note(
            f"budgetgate: run {run_id} was launched (execution {project_name}/{domain}/{name}); waiting for it failed, the execution and its reservation stand"
        )
        raise


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


__all__ = [
    "BudgetDelayed", "BudgetDenied", "BudgetRefused", "LaunchFailed", "Projection", "TaskUse", "Unprojectable",
    "execute", "execution_name_for", "flavor_of", "preflight", "project", "submission",
]  # fmt: skip
