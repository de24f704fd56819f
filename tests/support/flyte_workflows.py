"""Real flytekit workflows for the Flyte preflight's tests, compiled locally by flytekit when
this module is imported; the example of examples/flyte/ loaded as well."""

from __future__ import annotations

import functools
import importlib.util
import sys
from datetime import timedelta
from pathlib import Path
from types import ModuleType

from flytekit import ImageSpec, LaunchPlan, PodTemplate, Resources, approve, conditional, map_task, reference_task, sleep, task, workflow
from flytekit.extras.accelerators import A100
from kubernetes.client import V1Container, V1PodSpec, V1ResourceRequirements

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "flyte" / "workflows.py"


def example() -> ModuleType:
    """examples/flyte/workflows.py, imported as flytekit would import it."""
    name = "budgetgate_example_flyte_workflows"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, EXAMPLE)
        assert spec and spec.loader, f"{EXAMPLE} is missing"
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


@task(limits=Resources(gpu="2"), accelerator=A100, timeout=timedelta(hours=3))
def prepare(n: int) -> int:
    return n


@task(requests=Resources(gpu="4"), accelerator=A100, timeout=timedelta(hours=1))
def finetune(n: int) -> int:
    return n


@task(requests=Resources(gpu="1"))
def untimed(n: int) -> int:
    return n


@workflow
def inner(n: int) -> int:
    return finetune(n=n)


@workflow
def nested(n: int = 1) -> int:
    """2 A100s × 3 h, then a sub-workflow with 4 A100s × 1 h: 10 GPU-hours."""
    return inner(n=prepare(n=n))


@workflow
def without_timeout(n: int = 1) -> int:
    return untimed(n=n)


# Fan-out, branches, gates, retries and overrides: what a projection that reads only each task's
# own resources gets wrong.


@task(requests=Resources(gpu="2"), accelerator=A100, timeout=timedelta(hours=1))
def shard(x: int) -> int:
    return x


@task(requests=Resources(gpu="1"), accelerator=A100, timeout=timedelta(hours=1), retries=2)
def flaky(x: int) -> int:
    return x


@task(timeout=timedelta(minutes=30))
def listing(n: int) -> list[int]:
    return list(range(n))


@workflow
def fan_out(xs: list[int]) -> list[int]:
    """A map of `shard` (2 A100s × 1 h each), 3 elements at once: 2 GPU-hours per element."""
    return map_task(shard, concurrency=3)(x=xs)


@workflow
def fan_out_of_a_default(xs: list[int] = [1, 2, 3, 4]) -> list[int]:  # noqa: B006 - flytekit's form of a default list
    return map_task(shard)(x=xs)


@workflow
def fan_out_of_a_literal() -> list[int]:
    return map_task(shard)(x=[1, 2, 3, 4, 5])


@workflow
def fan_out_of_an_output(n: int = 10) -> list[int]:
    """Maps over a list another node makes: its length is known only at run time."""
    return map_task(shard)(x=listing(n=n))


fan_out_plan = LaunchPlan.get_or_create(fan_out, name="budgetgate_fan_out_of_six", fixed_inputs={"xs": [1, 2, 3, 4, 5, 6]})


@task(timeout=timedelta(minutes=10))
def check(x: int) -> int:
    return x


@workflow
def branching(x: int = 1) -> int:
    """An approval gate and a 2-hour sleep (no GPU), then either 4 A100s for an hour, 2 for an
    hour, or the nested workflow (10 GPU-hours): 10 GPU-hours at most."""
    approved = approve(check(x=x), "go-ahead", timeout=timedelta(hours=24))
    pause = sleep(timedelta(hours=2))
    pause >> approved
    return conditional("size").if_(approved > 10).then(finetune(n=approved)).elif_(approved > 5).then(shard(x=approved)).else_().then(nested(n=approved))


@workflow
def retried(x: int = 1) -> int:
    """`flaky` may run 3 times (retries=2): 3 GPU-hours."""
    return flaky(x=x)


@workflow
def overridden(x: int = 1) -> int:
    """`shard` on 8 GPUs for 3 hours on this node (its own: 2 for 1 h), then `flaky` held to 1
    retry (retries=0 on a node leaves the task's 2, as flytepropeller counts them)."""
    big = shard(x=x).with_overrides(requests=Resources(gpu="8"), limits=Resources(gpu="8"), timeout=timedelta(hours=3), retries=1)
    return flaky(x=big).with_overrides(retries=0)


@workflow
def through_a_plan() -> list[int]:
    """A launch plan node: its child execution maps 6 elements (12 GPU-hours)."""
    return fan_out_plan()


@reference_task(project="vision", domain="production", name="tests.support.flyte_workflows.flaky", version="v1")
def registered_flaky(x: int) -> int:
    """`flaky` as registered on FlyteAdmin (3 GPU-hours with its retries)."""
    ...


@workflow
def with_a_reference(x: int = 1) -> int:
    return registered_flaky(x=shard(x=x))


retried_plan = LaunchPlan.get_or_create(retried, name="budgetgate_retried")


@workflow
def over_plans(xs: list[int]) -> list[int]:
    """A map over a launch plan (3 GPU-hours per child execution), 2 at once."""
    return map_task(retried_plan, concurrency=2)(x=xs)


@task(requests=Resources(gpu="1"), timeout=timedelta(hours=1))
def score(x: int, weights: list[float]) -> float:
    return x * sum(weights)


@workflow
def fan_out_with_a_bound_list(xs: list[int]) -> list[float]:
    """A map over `xs` whose `weights` (a list of 9) is bound: the same for every element."""
    return map_task(functools.partial(score, weights=[0.1] * 9))(x=xs)


# Images and pod templates: an ImageSpec the projection must not build; GPUs a pod template names.

trainer_image = ImageSpec(name="budgetgate-trainer", packages=["torch"], registry="ghcr.io/budgetgate-example")


@task(container_image=trainer_image, requests=Resources(gpu="2"), timeout=timedelta(hours=1))
def imaged(x: int) -> int:
    return x


@task(
    pod_template=PodTemplate(
        primary_container_name="primary",
        pod_spec=V1PodSpec(
            containers=[V1Container(name="primary", resources=V1ResourceRequirements(limits={"nvidia.com/gpu": "4"})), V1Container(name="sidecar")]
        ),
    ),
    timeout=timedelta(hours=1),
)
def podded(x: int) -> int:
    return x


@task(pod_template=PodTemplate(primary_container_name="primary"), requests=Resources(gpu="3"), timeout=timedelta(hours=1))
def podded_with_resources(x: int) -> int:
    return x


@workflow
def images_and_pods(x: int = 1) -> int:
    """2 GPUs (an ImageSpec image), 4 (a pod template's nvidia.com/gpu), 3 (Resources on a pod template task)."""
    return podded_with_resources(x=podded(x=imaged(x=x)))
