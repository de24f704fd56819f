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
