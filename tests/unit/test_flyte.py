"""The Flyte preflight's projection of real flytekit workflows (compiled locally by flytekit)."""

from __future__ import annotations

import pytest

from tests.support.extras import import_extra

# flytekit is the `flyte` extra, outside `dev`; CI installs it (constraints/dev-flyte.txt).
import_extra("flytekit", extra="flyte")

from budgetgate.adapters.flyte import Unprojectable, flavor_of, project, submission
from tests.support import flyte_workflows as flows


def test_the_example_workflow_projects_its_gpu_hours() -> None:
    training = flows.example().training
    projected = project(training)
    assert [(t.name.rsplit(".", 1)[-1], t.gpus, t.hours, t.flavor) for t in projected.tasks] == [
        ("train", 8, 6.0, "h100"), ("evaluate", 1, 0.5, "h100"), ("report", 0, 10 / 60, None),
    ]  # fmt: skip
    assert (projected.gpu_hours, projected.gpus, projected.flavor) == (48.5, 8, "h100")
    request = submission(training, run_id="flyte/vision/production/b123", namespace="vision-prod", labels={"team": "vision"})
    assert (request.resources.gpus, request.resources.flavor, request.projected_runtime_hours) == (8, "h100", 48.5 / 8)
    assert request.job is not None and request.job.name.endswith("training")


def test_sub_workflows_limits_and_single_tasks() -> None:
    projected = project(flows.nested)
    assert (projected.gpu_hours, projected.gpus, projected.runtime_hours, projected.flavor) == (10.0, 4, 2.5, "a100")
    assert project(flows.prepare).gpu_hours == 6.0  # a limit without a request counts


def test_a_task_without_timeout_needs_a_default() -> None:
    with pytest.raises(Unprojectable, match="timeout"):
        project(flows.without_timeout)
    assert project(flows.without_timeout, default_runtime_hours=2.0).gpu_hours == 2.0


def test_accelerator_devices_name_flavors() -> None:
    assert [flavor_of(d) for d in ("nvidia-tesla-a100", "nvidia-h100", "nvidia-l4", "nvidia-a100-80gb")] == ["a100", "h100", "l4", "a100-80gb"]


def test_the_example_workflow_runs_locally() -> None:
    # What `pyflyte run examples/flyte/workflows.py training` does before any cluster is involved.
    assert flows.example().training(epochs=3) == "accuracy 0.903"


def _rows(projected) -> list[tuple[str, str, int, float, int, int]]:
    return [(t.name.rsplit(".", 1)[-1], t.node, t.gpus, t.hours, t.attempts, t.instances) for t in projected.tasks]


@pytest.fixture(scope="module")
def admin():
    """A stand-in FlyteAdmin with the test workflows registered (as `pyflyte register` would)."""
    from tests.support.flyte_admin import FlyteAdminStandIn

    registered = FlyteAdminStandIn()
    registered.register(flows.example().training, flows.fan_out_plan, flows.overridden, flows.branching, flows.retried)
    return registered


def test_a_fetched_launch_plan_projects_through_its_workflow(admin) -> None:
    # The common production path (fetch a launch plan, execute it) was refused: Unprojectable.
    remote = admin.remote()
    plan = remote.fetch_launch_plan(name="budgetgate_fan_out_of_six", version="v1")
    projected = project(plan)
    assert (projected.gpu_hours, projected.gpus, projected.flavor) == (12.0, 6, "a100")  # its fixed input: 6 elements, 3 at once
    # A launch plan promoted without its workflow (a launch plan node's, or FlyteAdmin's model
    # as it is) gets it through the remote it is launched by.
    from flytekit.remote.entities import FlyteLaunchPlan

    bare = FlyteLaunchPlan.promote_from_model(plan.id, admin.get_launch_plan(plan.id).spec)
    with pytest.raises(Unprojectable, match=r"fan_out@v1 is not at hand: pass remote="):
        project(bare)
    assert project(bare, remote=remote).gpu_hours == 12.0


def test_fetched_workflows_and_tasks_project_as_their_local_definitions(admin) -> None:
    remote = admin.remote()
    training = remote.fetch_workflow(name=flows.example().training.name, version="v1")
    assert _rows(project(training)) == _rows(project(flows.example().training))
    assert project(training).gpu_hours == 48.5
    overridden = remote.fetch_workflow(name=flows.overridden.name, version="v1")
    assert _rows(project(overridden)) == _rows(project(flows.overridden))  # its node overrides survive FlyteAdmin's closure
    flaky = remote.fetch_task(name=flows.flaky.name, version="v1")
    assert (project(flaky).gpu_hours, project(flaky).flavor) == (3.0, "a100")


def test_references_are_fetched_through_the_remote_or_refused_with_what_to_do(admin) -> None:
    from flytekit import reference_launch_plan, reference_task

    @reference_launch_plan(project="vision", domain="production", name="budgetgate_fan_out_of_six", version="v1")
    def six() -> list[int]: ...

    @reference_task(project="vision", domain="production", name="tests.support.flyte_workflows.flaky", version="v1")
    def flaky(x: int) -> int: ...

    @reference_task(project="vision", domain="production", name="never.registered", version="v9")
    def missing(x: int) -> int: ...

    remote = admin.remote()
    assert project(six, remote=remote).gpu_hours == 12.0
    assert project(flaky, remote=remote).gpu_hours == 3.0
    with pytest.raises(
        Unprojectable,
        match=r"reference task vision/production/tests\.support\.flyte_workflows\.flaky@v1 cannot be projected without its templates: pass remote=",
    ):
        project(flaky)
    with pytest.raises(Unprojectable, match=r"never\.registered@v9 cannot be fetched from FlyteAdmin .*register it, or correct the reference"):
        project(missing, remote=remote)


def test_a_branch_projects_its_costliest_case_and_gates_wait_for_nothing(admin) -> None:
    # if 4 A100s × 1 h, elif 2 × 1 h, else the nested workflow (2 × 3 h + 4 × 1 h): the else
    # branch; the approval gate and the 2-hour sleep hold no GPU.
    projected = project(flows.branching)
    assert _rows(projected) == [
        ("check", "n0", 0, 10 / 60, 1, 1), ("prepare", "n3/else/n0", 2, 3.0, 1, 1), ("finetune", "n3/else/n1/n0", 4, 1.0, 1, 1),
    ]  # fmt: skip
    assert (projected.gpu_hours, projected.gpus) == (10.0, 4)
    fetched = admin.remote().fetch_workflow(name=flows.branching.name, version="v1")
    assert _rows(project(fetched)) == _rows(projected)


def test_a_map_counts_its_fan_out_or_refuses(admin) -> None:
    # 2 A100s × 1 h per element: an ArrayNodeMapTask has no `resources`, and was projected as 0 GPUs.
    five = project(flows.fan_out, inputs={"xs": [1, 2, 3, 4, 5]})
    (mapped,) = five.tasks
    assert (mapped.gpus, mapped.instances, five.gpu_hours, five.flavor) == (6, 5, 10.0, "a100")  # 3 at once (concurrency)
    assert project(flows.fan_out_of_a_default).gpu_hours == 8.0  # the workflow's default list: 4 elements, no concurrency limit
    assert project(flows.fan_out_of_a_default, inputs={"xs": list(range(9))}).gpu_hours == 18.0  # given beats the default
    assert project(flows.fan_out_of_a_literal).gpu_hours == 10.0
    assert project(flows.fan_out_plan).gpu_hours == 12.0  # the launch plan's fixed input
    assert project(flows.fan_out, inputs={"xs": []}).gpu_hours == 0.0  # nothing to map: nothing runs
    with pytest.raises(Unprojectable, match=r"map node n1: how many elements it maps is not known before launch.*max_map_size="):
        project(flows.fan_out_of_an_output)
    with pytest.raises(Unprojectable, match="not known before launch"):
        project(flows.fan_out)  # its list not given
    assert project(flows.fan_out_of_an_output, max_map_size=7).gpu_hours == 14.0
    with pytest.raises(Unprojectable, match="inside a @workflow"):
        project(flows.map_task(flows.shard))
    assert project(flows.fan_out_with_a_bound_list, inputs={"xs": [1, 2]}).gpu_hours == 2.0  # a bound list is not mapped over
    over_plans = project(flows.over_plans, inputs={"xs": [1, 2, 3]})  # child executions: 3 × (1 GPU × 1 h × 3 attempts)
    assert [(t.gpus, t.instances, t.attempts) for t in over_plans.tasks] == [(2, 3, 3)] and over_plans.gpu_hours == 9.0


def test_retries_count_every_attempt_and_overrides_replace_the_task_s_resources() -> None:
    retried = project(flows.retried)
    assert (_rows(retried), retried.gpu_hours) == ([("flaky", "n0", 1, 3.0, 3, 1)], 3.0)  # retries=2: up to 3 attempts of 1 h
    assert project(flows.retried, count_retries=False).gpu_hours == 1.0
    # shard: 8 GPUs (not its 2) for 3 h (not 1), 2 attempts (retries=1 on the node); flaky:
    # retries=0 on the node leaves the task's 2 (flytepropeller takes a node's retries when not 0).
    overridden = project(flows.overridden)
    assert _rows(overridden) == [("shard", "n0", 8, 6.0, 2, 1), ("flaky", "n1", 1, 3.0, 3, 1)]
    assert (overridden.gpu_hours, overridden.gpus) == (51.0, 8)


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="max_map_size"):
        project(flows.fan_out, max_map_size=-1)
    with pytest.raises(ValueError, match="default_runtime_hours"):
        project(flows.without_timeout, default_runtime_hours=0)


def test_launch_plan_nodes_and_reference_nodes_count(admin) -> None:
    assert project(flows.through_a_plan).gpu_hours == 12.0
    with pytest.raises(Unprojectable, match=r"node n1: task vision/production/tests\.support\.flyte_workflows\.flaky@v1 is not at hand: pass remote="):
        project(flows.with_a_reference)
    projected = project(flows.with_a_reference, remote=admin.remote())  # 2 GPU-hours of shard, 3 of the registered flaky
    assert [(t.name.rsplit(".", 1)[-1], t.gpu_hours) for t in projected.tasks] == [("shard", 2.0), ("flaky", 3.0)]


def test_pod_template_gpus_count_and_images_are_not_built(monkeypatch: pytest.MonkeyPatch) -> None:
    # Compiling for the projection resolved the ImageSpec image, which builds it (docker).
    from flytekit.image_spec.image_spec import ImageBuildEngine

    def build(image_spec) -> None:
        raise AssertionError(f"the projection built image {image_spec.name}")

    monkeypatch.setattr(ImageBuildEngine, "build", build)
    projected = project(flows.images_and_pods)
    assert [(t.name.rsplit(".", 1)[-1], t.gpus) for t in projected.tasks] == [("imaged", 2), ("podded", 4), ("podded_with_resources", 3)]
