"""flytepropeller's FlyteWorkflow mapped to a submission (budgetgate/platforms/flyte_workflows.py),
on tests/fixtures/flyte (its README says what the workflow runs and why each figure below is
what it is), and the pods flytepropeller creates for it passing as owned."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from budgetgate.platforms.flyte_usage import flyte_run_id
from budgetgate.platforms.flyte_workflows import flyte_run, flyte_submission, is_flyte_workflow, project_workflow
from budgetgate.platforms.kubernetes import Mapping, Owned, Skip, Submit, submission
from budgetgate.platforms.reviews import At, Unmappable, ask
from tests.support.kubernetes import FLYTEPROPELLER, admission_review, flyte_pod, flyte_review, flyte_workflow

EXECUTION = "f4d1c0ffee5a7b9e2c31"


def _submitted(obj: dict[str, Any], mapping: Mapping = Mapping()) -> Submit | Skip:
    return flyte_submission(ask(flyte_review(obj)), mapping)


def test_the_fixture_projects_node_by_node_by_the_preflights_rules() -> None:
    projected = project_workflow(At(flyte_workflow(), ""), default_runtime_hours=None)
    by_node = {u.node: (u.name, u.gpus, u.hours, u.attempts, u.instances, u.flavor) for u in projected.tasks}
    assert by_node == {
        "n0": ("training.prepare", 0, 600 / 3600, 1, 1, None),
        # 4 GPUs for its 2 h timeout × 2 attempts (one retry: minAttempts 2), on its accelerator's flavor
        "n1": ("training.train", 4, 4.0, 2, 1, "h100"),
        # the branch's costliest case: evaluate_large (2 GPUs × 1 h) over evaluate (1 GPU × its 30 min override)
        "n2/then": ("training.evaluate_large", 2, 1.0, 1, 1, None),
        # the map: 3 shards of the execution's inputs, 2 at once: 2 GPUs for 3 × 0.5 h / 2
        "n3/[3]": ("training.score_shard", 2, 0.75, 1, 3, None),
    }
    assert projected.gpu_hours == pytest.approx(16 + 2 + 1.5)


def test_the_submission_is_the_preflights_run_with_the_executions_labels() -> None:
    mapped = _submitted(flyte_workflow())
    assert isinstance(mapped, Submit)
    request = mapped.request
    assert request.run_id == flyte_run_id("vision", "production", EXECUTION) == f"flyte/vision/production/{EXECUTION}"
    assert (request.resources.gpus, request.resources.flavor, request.projected_runtime_hours) == (4, "h100", pytest.approx(19.5 / 4))
    # FlyteAdmin's own labels of one execution or shard are not submitted; the execution's are.
    assert request.labels == {
        "domain": "production",
        "project": "vision",
        "workflow-name": "training-train-wf",
        "team": "vision",
        "cost-center": "1042",
        "environment": "prod",
    }
    assert (request.namespace, request.job.name, request.attempt) == ("vision-prod", EXECUTION, 1)


def test_the_kind_is_read_as_the_review_and_flytepropeller_write_it() -> None:
    assert is_flyte_workflow("flyte.lyft.com", "FlyteWorkflow") and is_flyte_workflow("flyte.lyft.com", "flyteworkflow")
    assert not is_flyte_workflow("example.com", "FlyteWorkflow") and not is_flyte_workflow("flyte.lyft.com", "FlyteTask")


@pytest.mark.parametrize("label", ["execution-id", "project", "domain"])
def test_a_missing_flyteadmin_label_is_refused_naming_it(label: str) -> None:
    obj = flyte_workflow()
    del obj["metadata"]["labels"][label]
    with pytest.raises(Unmappable, match=rf"metadata.labels\['{label}'\] is missing: FlyteAdmin labels"):
        flyte_run(At(obj, ""))


def test_an_offloaded_closure_is_refused_naming_the_field_and_flyteadmins_setting() -> None:
    obj = flyte_workflow()
    for field in ("spec", "tasks", "subWorkflows"):
        obj.pop(field, None)
    obj["workflowClosureReference"] = "s3://flyte/metadata/vision/production/closure.pb"
    assert flyte_run(At(obj, "")).offloaded
    with pytest.raises(Unmappable, match="workflowClosureReference is set.*useOffloadedWorkflowClosure is true.*useOffloadedWorkflowClosure: false"):
        _submitted(obj)


def test_a_launch_plan_node_is_refused_naming_the_node_and_the_preflight() -> None:
    obj = flyte_workflow()
    plan = {"resourceType": "LAUNCH_PLAN", "project": "vision", "domain": "production", "name": "etl", "version": "v3"}
    obj["spec"]["nodes"]["n0"] = {"id": "n0", "resources": {}, "kind": "workflow", "workflow": {"launchPlanRefId": plan}}
    with pytest.raises(Unmappable, match=r"node n0 launches launch plan vision/production/etl@v3 as a child execution.*\(budgetgate.adapters.flyte.execute\)"):
        _submitted(obj)


def test_a_map_whose_list_is_not_in_the_object_is_refused_naming_it() -> None:
    obj = flyte_workflow()
    del obj["inputs"]  # FlyteAdmin's useOffloadedInputs
    with pytest.raises(Unmappable, match="map node n3: how many elements it maps is not known"):
        _submitted(obj)


def test_a_sub_workflow_is_walked_with_its_inputs_lengths() -> None:
    obj = flyte_workflow()
    sub = copy.deepcopy(obj["spec"])
    sub["nodes"] = {k: v for k, v in sub["nodes"].items() if k in ("start-node", "end-node", "n3")}
    obj["subWorkflows"] = {'resource_type:WORKFLOW name:"scoring"': sub}
    obj["spec"]["nodes"]["n3"] = {"id": "n3", "resources": {}, "kind": "workflow", "workflow": {"subWorkflowRef": "resource_type:WORKFLOW name:\"scoring\""},
                                  "inputBindings": [{"var": "shards", "binding": {"collection": {"bindings": [{"scalar": {}}] * 5}}}]}  # fmt: skip
    uses = {u.node: u for u in project_workflow(At(obj, ""), default_runtime_hours=None).tasks}
    assert (uses["n3/n3/[5]"].instances, uses["n3/n3/[5]"].gpus) == (5, 2)


def test_cpu_only_is_let_through_and_no_timeout_takes_the_namespaces_default() -> None:
    obj = flyte_workflow()
    for template in obj["tasks"].values():
        template["container"]["resources"] = {}
    assert isinstance(_submitted(obj), Skip)
    timeless = flyte_workflow()
    for template in timeless["tasks"].values():
        template["metadata"].pop("timeout", None)
    del timeless["spec"]["nodes"]["n2-n0"]["executionDeadline"]
    with pytest.raises(Unmappable, match="task training.prepare .*has no timeout"):
        _submitted(timeless)
    mapped = _submitted(timeless, Mapping(namespace_runtime_hours={"vision-prod": 1.0}))
    assert isinstance(mapped, Submit) and mapped.request.projected_runtime_hours == pytest.approx((4 * 2 + 2 + 3) / 4)


@pytest.mark.parametrize(("deadline", "hours"), [("1h30m0s", 1.5), ("45m0s", 0.75), ("5400s", 1.5), ("1h0m0.5s", 1 + 0.5 / 3600)])
def test_a_node_timeout_is_read_as_go_writes_it(deadline: str, hours: float) -> None:
    obj = flyte_workflow()
    obj["spec"]["nodes"]["n1"]["executionDeadline"] = deadline
    (train,) = [u for u in project_workflow(At(obj, ""), default_runtime_hours=None).tasks if u.node == "n1"]
    assert train.hours == pytest.approx(hours * 2)


@pytest.mark.parametrize(("where", "value", "says"), [
    (("spec", "nodes", "n1", "executionDeadline"), "90 minutes", "spec.nodes['n1'].executionDeadline must be a duration as Go writes one"),
    (("spec", "nodes", "n1", "retry", "minAttempts"), "2", "spec.nodes['n1'].retry.minAttempts must be a whole number"),
    (("spec", "nodes", "n1", "resources", "limits"), {"nvidia.com/gpu": "two"}, "gpu='two' is not a number of GPUs"),
])  # fmt: skip
def test_a_malformed_field_is_refused_naming_it(where: tuple[str, ...], value: Any, says: str) -> None:
    obj = flyte_workflow()
    at = obj
    for key in where[:-1]:
        at = at.setdefault(key, {})
    at[where[-1]] = value
    with pytest.raises(Unmappable, match=__import__("re").escape(says)):
        _submitted(obj)


def test_a_node_override_of_gpus_replaces_the_tasks() -> None:
    obj = flyte_workflow()
    obj["spec"]["nodes"]["n1"]["resources"] = {"limits": {"nvidia.com/gpu": "8"}, "requests": {"nvidia.com/gpu": "8"}}
    mapped = _submitted(obj)
    assert isinstance(mapped, Submit) and mapped.request.resources.gpus == 8


def test_flytepropellers_pod_is_owned_by_its_flyteworkflow() -> None:
    # flytepropeller names its FlyteWorkflow "flyteworkflow" in the ownerReference: read as the
    # kind the webhook records, so the pod passes on the workflow's decision.
    pod = flyte_pod(flyte_workflow())
    review = admission_review(pod, user=FLYTEPROPELLER)
    owned = submission(review)
    assert isinstance(owned, Owned) and (owned.owner_kind, owned.owner_name, owned.owns) == ("FlyteWorkflow", EXECUTION, False)
    assert owned.owner_uid == pod["metadata"]["ownerReferences"][0]["uid"]
