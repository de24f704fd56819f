"""The webhook configurations' matchConditions, evaluated as the API server evaluates them: CEL
(cel-python, the Common Expression Language's Python implementation) over the variables
`object`, `oldObject` and `request` of each AdmissionReview. A request is sent only when every
condition is true; a condition that errors is a failed call (failurePolicy Fail: the request
is rejected), so none may error on any object.

What must hold: every object whose pods ask for a GPU is sent, wherever the GPU is asked (a
container or an init container, a request or a limit, the head or a worker group, any
replicated job), and nothing else is (a CPU-only object never meets a failurePolicy Fail
webhook); the mapping (platforms/kubernetes.py) agrees with the conditions on which objects ask
for GPUs; a Pod's UPDATE is sent only when it changes its run id label or annotation."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import celpy
import pytest
import yaml

from budgetgate.platforms.kubernetes import Skip, Submit, submission
from tests.support.kubernetes import admission_review, as_json, container, job, job_spec, jobset, pod, raycluster, rayjob

WEBHOOK = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes" / "webhook"
RUNTIME = {"budgetgate.io/projected-runtime-hours": "1"}


def _conditions(name: str, kind: str) -> list[tuple[str, Any]]:
    doc = next(d for d in yaml.safe_load_all((WEBHOOK / name).read_text()) if d["kind"] == kind)
    (hook,) = doc["webhooks"]
    env = celpy.Environment()
    return [(c["name"], env.program(env.compile(c["expression"]))) for c in hook["matchConditions"]]


VALIDATING = _conditions("validatingwebhookconfiguration.yaml", "ValidatingWebhookConfiguration")
MUTATING = _conditions("mutatingwebhookconfiguration.yaml", "MutatingWebhookConfiguration")


def sent(conditions: list[tuple[str, Any]], review: dict[str, Any]) -> bool:
    """Whether the API server sends `review` to the webhook: every condition true. A condition
    that errors or is not a boolean fails the test (the API server would reject the request)."""
    request = review["request"]
    variables = {
        "object": celpy.json_to_cel(request.get("object")),
        "oldObject": celpy.json_to_cel(request.get("oldObject")),
        "request": celpy.json_to_cel({k: v for k, v in request.items() if k not in ("object", "oldObject")}),
    }
    results = {}
    for name, program in conditions:
        value = program.evaluate(variables)  # raises on an error
        assert isinstance(value, celpy.celtypes.BoolType), (name, value)
        results[name] = bool(value)
    return all(results.values())


def _annotated(obj: dict[str, Any]) -> dict[str, Any]:
    obj["metadata"]["annotations"] = {**(obj["metadata"].get("annotations") or {}), **RUNTIME}
    return obj


def _no_gpu(obj: dict[str, Any]) -> dict[str, Any]:
    """`obj` with every nvidia.com/gpu taken out of its resources (the CPU-only twin)."""
    cpu = copy.deepcopy(obj)

    def walk(value: Any) -> None:
        if isinstance(value, dict):
            value.pop("nvidia.com/gpu", None)
            for inner in value.values():
                walk(inner)
        elif isinstance(value, list):
            for inner in value:
                walk(inner)

    walk(cpu)
    return cpu


def samples() -> dict[str, dict[str, Any]]:
    """Objects asking for GPUs in each place a pod may ask for them."""
    init_only = as_json(pod("init-only", containers=[container()], init=[container("warm", gpus=1)], deadline=60))
    requested = as_json(pod("requested", containers=[container(gpus=1, limits_only=False)], deadline=60))
    del requested["spec"]["containers"][0]["resources"]["limits"]
    second_job = jobset("second", [(1, job_spec(gpus=0, deadline=60)), (2, job_spec(gpus=1, deadline=60))])
    second_job["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]["resources"] = {"limits": {"cpu": "1"}}
    return {
        "pod": as_json(pod(containers=[container(gpus=2)], deadline=60)),
        "pod-init-container": init_only,
        "pod-sidecar": as_json(pod("sidecar", containers=[container()], init=[container("proxy", gpus=1, sidecar=True)], deadline=60)),
        "pod-requests-only": requested,
        "job": as_json(job(gpus=8, parallelism=2, deadline=60)),
        "jobset-second-job": second_job,
        "rayjob-head": rayjob("head", head_gpus=1, workers=[(1, 1, 0)], deadline=60),
        "rayjob-worker": rayjob("worker", head_gpus=0, workers=[(1, 1, 0), (2, 1, 4)], deadline=60),
        "raycluster-worker": _annotated(raycluster("rc", head_gpus=0, workers=[(2, 1, 1)])),
    }


@pytest.mark.parametrize("name", list(samples()))
@pytest.mark.parametrize(("conditions", "operations"), [(VALIDATING, ("CREATE", "UPDATE")), (MUTATING, ("CREATE",))], ids=["validating", "mutating"])
def test_what_asks_for_gpus_is_sent_and_its_cpu_only_twin_is_not(name: str, conditions: list[tuple[str, Any]], operations: tuple[str, ...]) -> None:
    gpu = samples()[name]
    cpu = _no_gpu(gpu)
    for operation in operations:
        if gpu["kind"] == "Pod" and operation == "UPDATE":
            continue  # a Pod's update is sent for its run id only (below)
        old = (lambda o: o) if operation == "UPDATE" else (lambda o: None)
        assert sent(conditions, admission_review(gpu, operation=operation, old=old(gpu))), (name, operation)
        assert not sent(conditions, admission_review(cpu, operation=operation, old=old(cpu))), (name, operation)
        # The mapping agrees: the one is a submission, the other asks for no GPU.
        if operation == "CREATE":
            assert isinstance(submission(admission_review(gpu)), Submit)
            skipped = submission(admission_review(cpu))
            assert isinstance(skipped, Skip) and "asks for no nvidia.com/gpu" in skipped.reason


def test_objects_missing_optional_fields_are_answered_not_errors() -> None:
    # Fields the API leaves out when empty (resources, containers' lists, labels, a template's
    # spec, worker groups): each condition guards what it reads, or the API server would reject.
    bare_pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "namespace": "vision-prod"}, "spec": {"containers": [{"name": "c"}]}}
    no_template = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "j", "namespace": "vision-prod"}, "spec": {}}
    no_spec_set = {
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": {"name": "s", "namespace": "vision-prod"},
        "spec": {"replicatedJobs": [{}]},
    }
    no_workers = {"apiVersion": "ray.io/v1", "kind": "RayCluster", "metadata": {"name": "r", "namespace": "vision-prod"}, "spec": {"headGroupSpec": {}}}
    no_cluster = {"apiVersion": "ray.io/v1", "kind": "RayJob", "metadata": {"name": "r", "namespace": "vision-prod"}, "spec": {"entrypoint": "x"}}
    for obj in (bare_pod, no_template, no_spec_set, no_workers, no_cluster):
        for conditions in (VALIDATING, MUTATING):
            assert sent(conditions, admission_review(obj)) is False, obj["kind"]
    assert sent(VALIDATING, admission_review(bare_pod, operation="UPDATE", old=bare_pod)) is False


def _labelled(obj: dict[str, Any], labels: dict[str, str] | None = None, annotations: dict[str, str] | None = None) -> dict[str, Any]:
    changed = copy.deepcopy(obj)
    if labels is not None:
        changed["metadata"]["labels"] = labels
    if annotations is not None:
        changed["metadata"]["annotations"] = annotations
    return changed


def test_a_pod_update_is_sent_only_when_it_renames_the_run() -> None:
    base = _labelled(
        as_json(pod(containers=[container(gpus=1)], deadline=60)), {"team": "vision", "budgetgate.io/run-id": "r1"}, {"budgetgate.io/run-id": "r1"}
    )
    cases = {
        "unchanged": (base, False),
        "other label": (_labelled(base, {"team": "nlp", "budgetgate.io/run-id": "r1"}), False),
        "label changed": (_labelled(base, {"team": "vision", "budgetgate.io/run-id": "r2"}), True),
        "label removed": (_labelled(base, {"team": "vision"}), True),
        "labels removed": (_labelled(base, {}), True),
        "annotation changed": (_labelled(base, annotations={"budgetgate.io/run-id": "r2"}), True),
        "annotation removed": (_labelled(base, annotations={}), True),
    }
    for what, (new, expected) in cases.items():
        assert sent(VALIDATING, admission_review(new, operation="UPDATE", old=base)) is expected, what
    # Added where there was none.
    unnamed = _labelled(base, {"team": "vision"}, {})
    assert sent(VALIDATING, admission_review(base, operation="UPDATE", old=unnamed)) is True
    # A CPU-only pod's renaming is not sent: it is not metered.
    cpu = _no_gpu(base)
    assert sent(VALIDATING, admission_review(_labelled(cpu, {}), operation="UPDATE", old=cpu)) is False
    # The mutating webhook is not called on updates at all (its rules), and its conditions hold
    # for any CREATE of a GPU pod.
    assert sent(MUTATING, admission_review(base)) is True


def test_every_flyteworkflow_is_sent_and_its_gpu_pods_too() -> None:
    # Which GPUs a FlyteWorkflow asks for is in its task templates' protobuf JSON: no condition
    # reads it, so every FlyteWorkflow's CREATE reaches both webhooks (the mapping lets one asking
    # for none through), and none of the conditions errors on its shape.
    from tests.support.kubernetes import flyte_pod, flyte_review, flyte_workflow

    workflow = flyte_workflow()
    cpu_only = flyte_workflow()
    for template in cpu_only["tasks"].values():
        template["container"]["resources"] = {}
    for obj in (workflow, cpu_only):
        assert sent(VALIDATING, flyte_review(obj)) and sent(MUTATING, flyte_review(obj))
    # flytepropeller's pod for a GPU task is sent (and passes on its owner, the mapping says).
    assert sent(VALIDATING, admission_review(flyte_pod(workflow))) and sent(MUTATING, admission_review(flyte_pod(workflow)))
