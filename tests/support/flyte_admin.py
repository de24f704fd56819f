"""A stand-in FlyteAdmin for a real `FlyteRemote`: what `FlyteRemote.fetch_*` and `execute` ask of
its client (SynchronousFlyteClient), answered from workflows compiled here by flytekit and
registered as `pyflyte register` would (each entity's IDL model, round-tripped through its
protobuf as FlyteAdmin stores it). No Flyte cluster runs here: FlyteAdmin's own compiler is not
involved (its closures hold flytekit's templates, without start and end nodes), nor is any
execution run; `create_execution` records the request, and executions stay RUNNING unless told.

    admin = FlyteAdminStandIn()
    admin.register(flows.fan_out_plan)
    remote = admin.remote()            # a real FlyteRemote, its client this stand-in
    plan = remote.fetch_launch_plan(name="budgetgate_fan_out_of_six", version=admin.version)
"""

from __future__ import annotations

import datetime
from collections import OrderedDict
from typing import Any

from flyteidl.admin import task_pb2 as admin_task_pb2
from flyteidl.admin import workflow_pb2 as admin_workflow_pb2
from flyteidl.core import compiler_pb2
from flytekit.configuration import Config, ImageConfig, SerializationSettings
from flytekit.exceptions.system import FlyteSystemUnavailableException
from flytekit.exceptions.user import FlyteEntityAlreadyExistsException, FlyteEntityNotExistException
from flytekit.models import execution as execution_models
from flytekit.models import launch_plan as launch_plan_models
from flytekit.models import task as task_models
from flytekit.models.admin import workflow as workflow_models
from flytekit.models.core.execution import WorkflowExecutionPhase
from flytekit.models.core.identifier import WorkflowExecutionIdentifier
from flytekit.remote import FlyteRemote
from flytekit.tools.translator import get_serializable


def _stored(model: Any) -> Any:
    """The model as FlyteAdmin gives it back: through its protobuf."""
    return type(model).from_flyte_idl(model.to_flyte_idl())


def _key(ident: Any) -> tuple[str, str, str, str]:
    return (ident.project, ident.domain, ident.name, ident.version)


class FlyteAdminStandIn:
    """The client calls FlyteRemote makes to fetch entities and to create and read executions."""

    def __init__(self, project: str = "vision", domain: str = "production", version: str = "v1") -> None:
        self.project, self.domain, self.version = project, domain, version
        self.tasks: dict[tuple[str, ...], Any] = {}
        self.workflows: dict[tuple[str, ...], Any] = {}
        self.launch_plans: dict[tuple[str, ...], Any] = {}
        self.executions: dict[tuple[str, str, str], Any] = {}
        self.created: list[dict[str, Any]] = []  # what create_execution was asked
        self.reads = 0  # get_execution calls so far
        self.failing_reads: set[int] = set()  # which of them (1, 2, ...) find FlyteAdmin unavailable

    def remote(self) -> FlyteRemote:
        remote = FlyteRemote(Config.for_endpoint("flyteadmin.invalid:443"), default_project=self.project, default_domain=self.domain)
        remote._client, remote._client_initialized = self, True
        return remote

    def register(self, *entities: Any) -> None:
        """Register local entities (and every task, workflow and launch plan they use)."""
        settings = SerializationSettings(image_config=ImageConfig.auto_default_image(), project=self.project, domain=self.domain, version=self.version)
        mapping: OrderedDict[Any, Any] = OrderedDict()
        for entity in entities:
            get_serializable(mapping, settings, entity)
        specs = list(mapping.values())
        tasks = [compiler_pb2.CompiledTask(template=s.template.to_flyte_idl()) for s in specs if isinstance(s, task_models.TaskSpec)]
        for compiled in tasks:
            stored = admin_task_pb2.Task(id=compiled.template.id, closure=admin_task_pb2.TaskClosure(compiled_task=compiled))
            self.tasks[_key(compiled.template.id)] = task_models.Task.from_flyte_idl(stored)
        for spec in specs:
            if isinstance(spec, workflow_models.WorkflowSpec):
                closure = compiler_pb2.CompiledWorkflowClosure(
                    primary=compiler_pb2.CompiledWorkflow(template=spec.template.to_flyte_idl()),
                    sub_workflows=[compiler_pb2.CompiledWorkflow(template=sub.to_flyte_idl()) for sub in spec.sub_workflows],
                    tasks=tasks,
                )
                stored = admin_workflow_pb2.Workflow(id=spec.template.id.to_flyte_idl(), closure=admin_workflow_pb2.WorkflowClosure(compiled_workflow=closure))
                self.workflows[_key(spec.template.id)] = workflow_models.Workflow.from_flyte_idl(stored)
            elif isinstance(spec, launch_plan_models.LaunchPlan):
                self.launch_plans[_key(spec.id)] = _stored(spec)

    # -- fetching (FlyteRemote.fetch_task / fetch_workflow / fetch_launch_plan)

    def _get(self, store: dict[tuple[str, ...], Any], ident: Any) -> Any:
        found = store.get(_key(ident))
        if found is None:
            raise FlyteEntityNotExistException(f"entity {_key(ident)} not found")
        return found

    def get_task(self, ident: Any) -> Any:
        return self._get(self.tasks, ident)

    def get_workflow(self, ident: Any) -> Any:
        return self._get(self.workflows, ident)

    def get_launch_plan(self, ident: Any) -> Any:
        return self._get(self.launch_plans, ident)

    def _latest(self, store: dict[tuple[str, ...], Any], named: Any, **_: Any) -> tuple[list[Any], str]:
        found = [v for k, v in store.items() if k[:3] == (named.project, named.domain, named.name)]
        return found[-1:], ""

    def list_tasks_paginated(self, named: Any, **kwargs: Any) -> tuple[list[Any], str]:
        return self._latest(self.tasks, named, **kwargs)

    def list_workflows_paginated(self, named: Any, **kwargs: Any) -> tuple[list[Any], str]:
        return self._latest(self.workflows, named, **kwargs)

    def list_launch_plans_paginated(self, named: Any, **kwargs: Any) -> tuple[list[Any], str]:
        return self._latest(self.launch_plans, named, **kwargs)

    # -- executions (FlyteRemote.execute, fetch_execution, wait)

    def create_execution(self, project: str, domain: str, name: str, execution_spec: Any, inputs: Any) -> WorkflowExecutionIdentifier:
        if (project, domain, name) in self.executions:
            raise FlyteEntityAlreadyExistsException(f"execution {project}/{domain}/{name} already exists")
        self.created.append({"project": project, "domain": domain, "name": name, "entity": execution_spec.launch_plan, "inputs": inputs})
        ident = WorkflowExecutionIdentifier(project, domain, name)
        closure = execution_models.ExecutionClosure(
            phase=WorkflowExecutionPhase.RUNNING,
            started_at=datetime.datetime.now(datetime.UTC),
            duration=datetime.timedelta(),
        )
        self.executions[(project, domain, name)] = _stored(execution_models.Execution(ident, execution_spec, closure))
        return ident

    def get_execution(self, ident: Any) -> Any:
        self.reads += 1
        if self.reads in self.failing_reads:
            raise FlyteSystemUnavailableException("FlyteAdmin is unavailable")
        found = self.executions.get((ident.project, ident.domain, ident.name))
        if found is None:
            raise FlyteEntityNotExistException(f"execution {ident.project}/{ident.domain}/{ident.name} not found")
        return found
