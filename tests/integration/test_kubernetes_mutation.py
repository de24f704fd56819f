"""`POST /v1/kubernetes/mutate` on a real admission service, as the API server calls it: on the
CREATE of an object that has no UID yet (the API server assigns it on storing, after the
mutating webhooks), applying the answer's JSON patch (RFC 6902), then assigning the UID and
asking the validating webhook, which decides under the run id the mutating one named. The pods a
controller then makes from the templates carry the run's label."""

from __future__ import annotations

import base64
import copy
import json
import uuid
from typing import Any

import jsonpatch
import pytest

from budgetgate.platforms.kubernetes import Submit, submission
from budgetgate.platforms.run_labels import RUN_LABEL, pod_run_id, run_label_value
from tests.support.admission import apply_policies, budget_yaml, decision_of, held_in_postgres
from tests.support.kubernetes import (
    JOB_CONTROLLER,
    VISION,
    admission_review,
    as_json,
    container,
    job,
    jobset,
    job_spec,
    mutated,
    pod,
    pod_of,
    stored,
    unstored,
    validated,
)
from tests.support.kubernetes import FLYTEPROPELLER, flyte_pod, flyte_review, flyte_workflow
from budgetgate.platforms.flyte_usage import flyte_run_id

MUTATE = "/v1/kubernetes/mutate"
VALIDATE = "/v1/kubernetes/admission-review"
H100 = {"budgetgate.io/flavor": "h100"}
KUEUE = "system:serviceaccount:kueue-system:kueue-controller-manager"


async def test_the_run_is_named_before_the_uid_and_decided_under_that_name(admission, pg_dsn) -> None:
    created = unstored(job("named", gpus=2, parallelism=2, deadline=3600, annotations=H100))
    response, patched = await mutated(admission, created)
    run_id = patched["metadata"]["annotations"]["budgetgate.io/run-id"]
    assert uuid.UUID(run_id) and response["status"]["message"] == f"budgetgate: run {run_id}"
    assert patched["metadata"]["labels"][RUN_LABEL] == run_id and patched["metadata"]["labels"]["team"] == "vision"
    assert patched["spec"]["template"]["metadata"]["labels"][RUN_LABEL] == run_id
    assert await held_in_postgres(pg_dsn) == {}  # naming reserves nothing
    # The API server stores it with a UID, and the validating webhook decides it under the name.
    job_obj = stored(patched)
    answer = await validated(admission, job_obj)
    assert answer["allowed"] is True and answer["status"]["message"].startswith("budgetgate: admitted"), answer
    assert (await admission.client.get(f"/v1/admissions/{run_id}")).json()["projected_gpu_hours"] == 4.0
    assert (await admission.client.get(f"/v1/admissions/{job_obj['metadata']['uid']}")).status_code == 404
    # Its pods, made by the Job controller from the template, carry the run and pass on the Job:
    # the mutating webhook leaves them as they are, the validating one lets them through.
    child = pod_of(job_obj, "named-0", patched["spec"]["template"])
    kept, child_patched = await mutated(admission, child, user=JOB_CONTROLLER)
    assert "patch" not in kept and "carries its owner's run id" in kept["status"]["message"]
    assert pod_run_id(child_patched) == run_id
    passed = await validated(admission, stored(child_patched), user=JOB_CONTROLLER)
    assert passed["allowed"] is True and "which was admitted for it" in passed["status"]["message"], passed
    # A tenant's Pod copying the template and naming the Job is a run of its own, under a name of
    # its own: its usage is not metered to the Job's run.
    copied = pod_of(job_obj, "named-extra", patched["spec"]["template"])
    copied["spec"]["activeDeadlineSeconds"] = 600
    copied["metadata"]["annotations"] = {**H100}
    copied["metadata"]["labels"].update(VISION)  # the budget's required labels
    _, own = await mutated(admission, copied, user="mallory@example.com")
    own_run = pod_run_id(own)
    assert own_run and own_run != run_id and own["metadata"]["annotations"]["budgetgate.io/run-id"] == own_run
    decided = await validated(admission, stored(own), user="mallory@example.com")
    assert decided["allowed"] is True, decided
    assert (await admission.client.get(f"/v1/admissions/{own_run}")).status_code == 200


async def test_an_object_naming_its_run_keeps_the_name_hashed_into_the_label(admission) -> None:
    run_id = "flyte/vision/exec-42/n0"  # not a label value: the label is its hash, the annotation whole
    created = unstored(jobset("suite", [(2, job_spec(gpus=1, parallelism=1, deadline=3600))], annotations={**H100, "budgetgate.io/run-id": run_id}))
    _, patched = await mutated(admission, created)
    assert patched["metadata"]["annotations"]["budgetgate.io/run-id"] == run_id
    assert patched["metadata"]["labels"][RUN_LABEL] == run_label_value(run_id) != run_id
    template = patched["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]
    assert pod_run_id(template) == run_id
    assert (await validated(admission, stored(patched)))["allowed"] is True
    assert decision_of(await admission.client.get(f"/v1/admissions/{run_id}")) == "ALLOW"
    # A pod made from that template for an owner never admitted (or not remembered) is a run of
    # its own: the run id it inherited is its owner's, so it is named afresh (else it would be
    # decided under the owner's run id, and refused as a conflicting resend).
    stray_owner = {**patched, "kind": "Job", "apiVersion": "batch/v1", "metadata": {**patched["metadata"], "name": "suite-x", "uid": str(uuid.uuid4())}}
    orphan = pod_of(stray_owner, "suite-x-0", template)
    orphan["spec"]["activeDeadlineSeconds"] = 600
    orphan["metadata"]["labels"].update(VISION)
    orphan["metadata"]["annotations"].update(H100)
    _, renamed = await mutated(admission, orphan, user=JOB_CONTROLLER)
    fresh = renamed["metadata"]["annotations"]["budgetgate.io/run-id"]
    assert fresh != run_id and uuid.UUID(fresh) and pod_run_id(renamed) == fresh
    answer = await validated(admission, stored(renamed), user=JOB_CONTROLLER)
    assert answer["allowed"] is True and (await admission.client.get(f"/v1/admissions/{fresh}")).status_code == 200, answer


async def test_a_dry_run_is_named_and_nothing_is_recorded(admission, pg_dsn) -> None:
    created = unstored(job("dry", gpus=8, deadline=3600, annotations=H100))
    response, patched = await mutated(admission, created, dry_run=True)
    run_id = patched["metadata"]["annotations"]["budgetgate.io/run-id"]
    assert response["status"]["message"].endswith("(dry run: nothing recorded)")
    assert (await validated(admission, stored(patched), dry_run=True))["allowed"] is True
    assert (await admission.client.get(f"/v1/admissions/{run_id}")).status_code == 404
    assert await held_in_postgres(pg_dsn) == {}


async def test_what_is_not_a_run_to_name_is_left_unchanged(admission) -> None:
    cpu = unstored(job("etl", gpus=0, deadline=3600))
    response, _ = await mutated(admission, cpu)
    assert "patch" not in response and "asks for no nvidia.com/gpu" in response["status"]["message"]
    queued = unstored(job("queued", gpus=8, deadline=3600))
    queued["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] = "team-a"
    response, _ = await mutated(admission, queued)
    assert "patch" not in response and "queued in Kueue's 'team-a'" in response["status"]["message"]
    malformed = unstored(job("bad", gpus=8, deadline=3600))
    malformed["metadata"]["labels"] = ["team"]
    response, _ = await mutated(admission, malformed)
    assert "patch" not in response and "metadata.labels must be an object of strings" in response["status"]["message"]
    # The validating webhook refuses it, naming the same field.
    refused = await validated(admission, stored(malformed))
    assert refused["allowed"] is False and refused["status"]["code"] == 422 and refused["status"]["reason"] == "Invalid"
    no_runtime = unstored(job("forever", gpus=8))
    response, _ = await mutated(admission, no_runtime)
    assert "patch" not in response and "no projected runtime" in response["status"]["message"]
    update = as_json(job("upd", gpus=8, deadline=3600))
    response, _ = await mutated(admission, update, operation="UPDATE", old=update)
    assert "patch" not in response and "only the CREATE of a workload is named" in response["status"]["message"]
    bad = await admission.client.post(MUTATE, json={"kind": "Pod"})
    assert bad.status_code == 400 and bad.headers["content-type"] == "application/problem+json"


async def _soft_budget_server(admission_factory, pg_dsn, monkeypatch, classes: dict[str, str], *, override: bool = False):  # type: ignore[no-untyped-def]
    await apply_policies(pg_dsn, {"s.yaml": budget_yaml("soft-gpu", limit="gpu_hours: 100", enforcement="soft")}, sha="5" * 40)
    monkeypatch.setenv("BUDGETGATE_KUBERNETES_PRIORITY_CLASSES", json.dumps(classes))
    monkeypatch.setenv("BUDGETGATE_KUBERNETES_OVERRIDE_PRIORITY_CLASS", "true" if override else "false")
    server = await admission_factory()
    await server.wait_ready()
    return server


def _classes_of(obj: dict[str, Any]) -> list[str | None]:
    return [t["template"]["spec"]["template"]["spec"].get("priorityClassName") for t in obj["spec"]["replicatedJobs"]]


async def test_the_priority_class_follows_the_quote_of_the_same_submission(admission_factory, pg_dsn, monkeypatch) -> None:
    server = await _soft_budget_server(admission_factory, pg_dsn, monkeypatch, {"0": "gpu-normal", "0.2": "gpu-low"})
    first = unstored(job("first", gpus=8, deadline=3600))  # 8 of 100 soft GPU-hours: no penalty
    response, patched = await mutated(server, first)
    assert patched["spec"]["template"]["spec"]["priorityClassName"] == "gpu-normal" and "priority class gpu-normal" in response["status"]["message"]
    assert (await validated(server, stored(patched)))["allowed"] is True
    # The next one would take the soft budget to 88 %: its quote carries a penalty in the low band.
    second = unstored(job("second", gpus=8, deadline=10 * 3600))
    response, patched = await mutated(server, second)
    decided_as = submission(admission_review(stored(patched)))
    assert isinstance(decided_as, Submit)
    quote = (await server.client.post("/v1/quotes", json=decided_as.request.model_dump(mode="json"))).json()
    assert quote["decision"] == "ALLOW" and quote["priority_penalty"] >= 0.2, quote
    assert patched["spec"]["template"]["spec"]["priorityClassName"] == "gpu-low"
    # What the object sets is kept; a bare Pod's class is left to the API server's own admission.
    own = unstored(jobset("own", [(1, job_spec(gpus=1, deadline=3600)), (1, job_spec(gpus=1, deadline=3600))]))
    own["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["priorityClassName"] = "research"
    _, patched = await mutated(server, own)
    assert _classes_of(patched) == ["research", "gpu-normal"]  # 8 % used still: no penalty
    _, bare = await mutated(server, unstored(pod("bare", containers=[container(gpus=1)], deadline=600)))
    assert "priorityClassName" not in bare["spec"] and pod_run_id(bare)


async def test_the_users_class_is_replaced_when_configured(admission_factory, pg_dsn, monkeypatch) -> None:
    server = await _soft_budget_server(admission_factory, pg_dsn, monkeypatch, {"0": "gpu-normal"}, override=True)
    own = unstored(jobset("own", [(1, job_spec(gpus=1, deadline=3600))]))
    own["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["priorityClassName"] = "research"
    _, patched = await mutated(server, own)
    assert _classes_of(patched) == ["gpu-normal"]


async def test_without_a_quote_the_run_is_named_without_a_class(admission_factory, monkeypatch) -> None:
    monkeypatch.setenv("BUDGETGATE_KUBERNETES_PRIORITY_CLASSES", '{"0": "gpu-normal"}')
    server = await admission_factory()  # no policy bundle: nothing can be quoted
    response, patched = await mutated(server, unstored(job("early", gpus=1, deadline=60)))
    assert pod_run_id(patched["spec"]["template"]) and "priorityClassName" not in patched["spec"]["template"]["spec"]
    assert any("no priority class set: could not quote" in w for w in response["warnings"]) and all(len(w) <= 120 for w in response["warnings"])


@pytest.mark.parametrize("user", ["alice@example.com", KUEUE])
async def test_the_run_label_of_an_admitted_object_is_fixed(admission, user: str) -> None:
    _, patched = await mutated(admission, unstored(job("fixed", gpus=1, deadline=3600, annotations=H100)))
    running = stored(patched)
    assert (await validated(admission, running))["allowed"] is True
    relabelled = copy.deepcopy(running)
    relabelled["metadata"]["labels"][RUN_LABEL] = "someone-elses-run"
    answer = await validated(admission, relabelled, operation="UPDATE", old=running, user=user)
    if user == KUEUE:  # a controller's (Kueue writing its pod set updates)
        assert answer["allowed"] is True and "a controller's update" in answer["status"]["message"]
    else:
        assert answer["allowed"] is False and (answer["status"]["code"], answer["status"]["reason"]) == (403, "Forbidden")
        assert "may not change once created" in answer["status"]["message"] and RUN_LABEL in answer["status"]["message"]
    unlabelled = copy.deepcopy(running)
    del unlabelled["spec"]["template"]["metadata"]["labels"][RUN_LABEL]
    answer = await validated(admission, unlabelled, operation="UPDATE", old=running, user=user)
    assert answer["allowed"] is (user == KUEUE)


async def test_a_flyteworkflow_is_named_as_its_execution_and_its_pods_carry_the_run(admission, pg_dsn) -> None:
    # The run of a FlyteWorkflow is its Flyte execution's (the preflight's run id), not a fresh
    # UUID: a path with '/', so the label is its hash and the annotation holds it whole.
    # flytepropeller copies the workflow's labels and annotations onto its pods: the meter reads
    # the run there.
    execution = "f0e1d2c3b4a596877869"
    run_id = flyte_run_id("vision", "production", execution)
    sent = flyte_review(flyte_workflow(execution, uid=""))
    answer = (await admission.client.post(MUTATE, json=sent)).json()["response"]
    assert answer["allowed"] is True and answer["status"]["message"] == f"budgetgate: run {run_id}", answer
    workflow = jsonpatch.apply_patch(sent["request"]["object"], json.loads(base64.b64decode(answer["patch"])))
    meta = workflow["metadata"]
    assert meta["labels"][RUN_LABEL] == run_label_value(run_id) != run_id and meta["annotations"]["budgetgate.io/run-id"] == run_id
    assert meta["labels"]["execution-id"] == execution  # FlyteAdmin's labels kept
    # Stored (with its UID), it is decided under that run, and flytepropeller's pod passes on it
    # carrying the run, as the meter reads it.
    workflow = stored(workflow)
    decided_answer = (await admission.client.post(VALIDATE, json=flyte_review(workflow))).json()["response"]
    assert decided_answer["allowed"] is True, decided_answer
    assert decision_of(await admission.client.get(f"/v1/admissions/{run_id}")) == "ALLOW"
    propeller_pod = unstored(flyte_pod(workflow))
    assert pod_run_id(propeller_pod) == run_id
    left, unchanged = await mutated(admission, propeller_pod, user=FLYTEPROPELLER)
    assert "patch" not in left and unchanged is propeller_pod, left
    passed = await validated(admission, stored(propeller_pod), user=FLYTEPROPELLER)
    assert passed["allowed"] is True and "which was admitted for it" in passed["status"]["message"], passed
    # Without FlyteAdmin's labels it cannot be named: left unchanged, and refused by the validating webhook.
    unlabelled = flyte_workflow(execution, uid="")
    del unlabelled["metadata"]["labels"]["execution-id"]
    left_alone = (await admission.client.post(MUTATE, json=flyte_review(unlabelled))).json()["response"]
    assert "patch" not in left_alone and "execution-id" in left_alone["status"]["message"]
