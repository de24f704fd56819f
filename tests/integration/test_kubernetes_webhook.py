"""`POST /v1/kubernetes/admission-review` on a real admission service: AdmissionReviews of objects
built with the official client's models are decided like submissions and answered as the API
server expects; dry runs reserve nothing; failing closed or open when budgetgate cannot decide."""

from __future__ import annotations

import asyncio
import json
import os
import ssl
import subprocess
import sys
from typing import Any

import asyncpg
import httpx
import pytest

from budgetgate.core.principals import Role
from tests.support.principals import bearer, issue
from tests.support.admission import apply_policies, budget_yaml, example_policies, held_in_postgres, submission
from budgetgate.platforms.flyte_usage import flyte_run_id
from kubernetes.client import V1OwnerReference

from tests.support.kubernetes import JOB_CONTROLLER, JOBSET_CONTROLLER, admission_review, as_json, container, job, jobset, job_spec, pod
from tests.support.kubernetes import FLYTEPROPELLER, flyte_pod, flyte_review, flyte_workflow
from tests.support.servers import free_port
from tests.support.waiting import wait_for

URL = "/v1/kubernetes/admission-review"
H100 = {"budgetgate.io/flavor": "h100"}  # the example policies price GPU-hours by flavor


async def reviewed(server, review: dict[str, Any]) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    answer = await server.client.post(URL, json=review)
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert (body["apiVersion"], body["kind"], body["response"]["uid"]) == ("admission.k8s.io/v1", "AdmissionReview", review["request"]["uid"])
    return body["response"]


async def test_a_job_within_budget_is_admitted_and_its_retry_replays(admission) -> None:
    obj = job(gpus=8, parallelism=1, deadline=6 * 3600, annotations=H100)
    first = await reviewed(admission, admission_review(obj))
    assert first["allowed"] is True and first["status"]["message"].startswith("budgetgate: admitted")
    decision = (await admission.client.get(f"/v1/admissions/{obj.metadata.uid}")).json()
    assert (decision["decision"], decision["projected_gpu_hours"], decision["attempt"]) == ("ALLOW", 48.0, 1)
    again = await reviewed(admission, admission_review(obj))  # the API server retried the call
    assert again["allowed"] is True
    replay = (await admission.client.get(f"/v1/admissions/{obj.metadata.uid}")).json()
    assert replay["decision_id"] == decision["decision_id"]


async def test_each_replica_of_another_controller_is_its_own_run(admission, pg_dsn) -> None:
    # The replicas of a ReplicaSet share their owner's UID: as run id it made the second a 409
    # (another job name under the same run id), or else a replay of the first one's reservation.
    owner = V1OwnerReference(api_version="apps/v1", kind="ReplicaSet", name="infer-5d8f", uid="0f9e8d7c-1111-2222-3333-444455556666", controller=True)
    replicas = [pod(f"infer-5d8f-{i}", containers=[container(gpus=2)], deadline=3600, owner=owner, annotations=H100) for i in range(2)]
    assert (await reviewed(admission, admission_review(replicas[0])))["allowed"] is True
    one = await held_in_postgres(pg_dsn)
    second = await reviewed(admission, admission_review(replicas[1]))
    assert second["allowed"] is True, second
    assert one and await held_in_postgres(pg_dsn) == {key: 2 * held for key, held in one.items()}  # a reservation each
    decisions = [(await admission.client.get(f"/v1/admissions/{p.metadata.uid}")).json() for p in replicas]
    assert [d["projected_gpu_hours"] for d in decisions] == [2.0, 2.0] and decisions[0]["decision_id"] != decisions[1]["decision_id"]


async def test_children_pass_on_an_admitted_owner_only_and_a_forged_owner_is_decided(admission) -> None:
    # A Pod naming a Job as its controller was let through without a decision, whatever the
    # Job: an ownerReference is the creator's to write, so naming a CPU-only Job (never decided)
    # ran 8 GPUs unbudgeted.
    def owned_by(obj: Any) -> V1OwnerReference:
        meta = obj.metadata if hasattr(obj, "metadata") else None
        name, uid = (meta.name, meta.uid) if meta else (obj["metadata"]["name"], obj["metadata"]["uid"])
        kind = obj.kind if meta else obj["kind"]
        version = obj.api_version if meta else obj["apiVersion"]
        return V1OwnerReference(api_version=version, kind=kind, name=name, uid=uid, controller=True)

    cpu_job = job("etl", gpus=0, parallelism=1, deadline=3600)
    assert (await reviewed(admission, admission_review(cpu_job)))["allowed"] is True  # asks for no GPU: no decision
    forged = pod("etl-x", containers=[container(gpus=8)], deadline=3600, owner=owned_by(cpu_job), annotations=H100)
    answer = await reviewed(admission, admission_review(forged))
    assert answer["allowed"] is True and answer["status"]["message"].startswith("budgetgate: admitted"), answer
    assert (await admission.client.get(f"/v1/admissions/{forged.metadata.uid}")).json()["projected_gpu_hours"] == 8.0  # reserved as a run
    # An admitted Job's pods pass on it, and so do those of a Job run under an annotated run id.
    for parent in (
        job("train", gpus=2, parallelism=2, deadline=3600, annotations=H100),
        job("tuned", gpus=2, parallelism=1, deadline=3600, annotations={**H100, "budgetgate.io/run-id": "flyte/vision/exec-9/n0"}),
    ):
        assert (await reviewed(admission, admission_review(parent)))["allowed"] is True
        child = pod(f"{parent.metadata.name}-0", containers=[container(gpus=2)], owner=owned_by(parent))  # no deadline of its own: never mapped
        passed = await reviewed(admission, admission_review(child, user=JOB_CONTROLLER))
        assert passed["allowed"] is True and "which was admitted for it" in passed["status"]["message"], passed
    # A JobSet's Job passes on the JobSet and is remembered, so its pods pass on it in turn.
    suite = jobset("suite", [(1, job_spec(gpus=1, parallelism=1, deadline=3600))], annotations=H100)
    assert (await reviewed(admission, admission_review(suite)))["allowed"] is True
    member = job("suite-rj-0-0", gpus=1, parallelism=1, deadline=3600)
    member.metadata.owner_references = [owned_by(suite)]
    assert (await reviewed(admission, admission_review(member, user=JOBSET_CONTROLLER)))["allowed"] is True
    grandchild = pod("suite-rj-0-0-a", containers=[container(gpus=1)], owner=owned_by(member))
    assert "which was admitted for it" in (await reviewed(admission, admission_review(grandchild, user=JOB_CONTROLLER)))["status"]["message"]
    # The children were let through on their owners' decisions: none has one of its own.
    for let_through in (member, grandchild):
        assert (await admission.client.get(f"/v1/admissions/{let_through.metadata.uid}")).status_code == 404
    # A UID alone proves nothing: an owner named by an admitted Pod's UID (a Pod owns no Job's
    # pods), or by an admitted Job's UID in another namespace, is no admitted owner.
    lone = pod("lone", containers=[container(gpus=1)], deadline=3600, annotations=H100)
    assert (await reviewed(admission, admission_review(lone)))["allowed"] is True
    as_job = V1OwnerReference(api_version="batch/v1", kind="Job", name="lone", uid=lone.metadata.uid, controller=True)
    elsewhere = pod("borrow", containers=[container(gpus=8)], deadline=3600, owner=owned_by(member), annotations=H100)
    elsewhere.metadata.namespace = "vision-dev"
    for forged in (pod("via-pod", containers=[container(gpus=8)], deadline=3600, owner=as_job, annotations=H100), elsewhere):
        answer = await reviewed(admission, admission_review(forged, user=JOB_CONTROLLER))
        assert "which was admitted for it" not in answer["status"]["message"], answer
        assert (await admission.client.get(f"/v1/admissions/{forged.metadata.uid}")).status_code == 200  # decided as a run of its own
    # A forged owner naming a run that was never admitted, with no deadline of its own, is
    # denied naming what to add rather than let through.
    ghost = V1OwnerReference(api_version="batch/v1", kind="Job", name="ghost", uid="00000000-dead-beef-0000-000000000000", controller=True)
    denied = await reviewed(admission, admission_review(pod("ghost-0", containers=[container(gpus=8)], owner=ghost)))
    assert denied["allowed"] is False and denied["status"]["code"] == 422 and "projected runtime" in denied["status"]["message"], denied


async def test_a_child_of_an_admitted_owner_passes_only_when_a_trusted_controller_creates_it(admission) -> None:
    # An ownerReference is its creator's to write: a tenant's Pod naming an admitted Job ran 8
    # GPUs beside the Job's own pods, on the Job's one reservation.
    parent = job("train", gpus=2, parallelism=1, deadline=3600, annotations=H100)
    assert (await reviewed(admission, admission_review(parent)))["allowed"] is True
    owner = V1OwnerReference(api_version="batch/v1", kind="Job", name="train", uid=parent.metadata.uid, controller=True)
    own = pod("train-0", containers=[container(gpus=2)], owner=owner)
    passed = await reviewed(admission, admission_review(own, user="system:kube-controller-manager"))
    assert passed["allowed"] is True and "which was admitted for it" in passed["status"]["message"], passed
    extra = pod("train-extra", containers=[container(gpus=8)], deadline=3600, owner=owner, annotations=H100)
    answer = await reviewed(admission, admission_review(extra, user="mallory@example.com"))
    assert "which was admitted for it" not in answer["status"]["message"], answer
    assert any(
        w.startswith("budgetgate: created by 'mallory@example.com', not a TRUSTED_CREATORS controller") and not w.endswith("...")
        for w in answer.get("warnings", [])
    ), answer
    decision = (await admission.client.get(f"/v1/admissions/{extra.metadata.uid}")).json()
    assert decision["projected_gpu_hours"] == 8.0  # reserved as a run of its own
    # Without a deadline of its own it cannot be decided, and is denied rather than let through.
    bare = pod("train-bare", containers=[container(gpus=8)], owner=owner)
    denied = await reviewed(admission, admission_review(bare, user="mallory@example.com"))
    assert denied["allowed"] is False and denied["status"]["code"] == 422, denied


async def test_an_update_raising_the_gpus_is_denied_and_others_pass(admission, pg_dsn) -> None:
    obj = as_json(job(gpus=8, parallelism=1, deadline=3600, annotations=H100))
    assert (await reviewed(admission, admission_review(obj)))["allowed"] is True
    held = await held_in_postgres(pg_dsn)
    scaled = {**obj, "spec": {**obj["spec"], "parallelism": 16}}
    answer = await reviewed(admission, admission_review(scaled, operation="UPDATE", old=obj))
    assert answer["allowed"] is False and answer["status"]["code"] == 403
    assert "8 nvidia.com/gpu" in answer["status"]["message"] and "to 128" in answer["status"]["message"] and "create a new Job" in answer["status"]["message"]
    suspended = {**obj, "spec": {**obj["spec"], "suspend": True, "parallelism": 0}}
    assert (await reviewed(admission, admission_review(suspended, operation="UPDATE", old=obj)))["allowed"] is True
    assert await held_in_postgres(pg_dsn) == held  # neither reserved nor released anything


async def test_over_budget_is_denied_with_the_reason_and_reserves_nothing(admission, pg_dsn) -> None:
    obj = jobset("sweep", [(4, job_spec(gpus=8, parallelism=2, deadline=10 * 3600))], annotations=H100)  # 64 GPUs × 10 h > 500
    answer = await reviewed(admission, admission_review(obj))
    assert answer["allowed"] is False and answer["status"]["code"] == 403
    decision = (await admission.client.get(f"/v1/admissions/{obj['metadata']['uid']}")).json()
    assert decision["decision"] == "DENY" and answer["status"]["message"] == f"budgetgate: {decision['reason']}"
    assert await held_in_postgres(pg_dsn) == {}


async def test_delay_is_a_denial_saying_when_to_retry(admission_factory, pg_dsn) -> None:
    await apply_policies(pg_dsn, {"b.yaml": budget_yaml("held", limit="gpu_hours: 20", on_exhausted="delay")}, sha="d" * 40)
    server = await admission_factory()
    await server.wait_ready()
    first = await reviewed(server, admission_review(job(gpus=8, deadline=2 * 3600, labels={"team": "vision"})))
    assert first["allowed"] is True  # 16 of 20 GPU-hours: the next one must wait for the window
    answer = await reviewed(server, admission_review(job(gpus=8, deadline=2 * 3600, labels={"team": "vision"})))
    assert answer["allowed"] is False and (answer["status"]["code"], answer["status"]["reason"]) == (429, "TooManyRequests")
    assert "details" not in answer["status"]  # no retryAfterSeconds: client-go would sleep it out in the call
    assert "retry at or after 20" in answer["status"]["message"] and "budgetgate.io/attempt=2" in answer["status"]["message"]


async def test_a_dry_run_is_quoted_and_reserves_nothing(admission, pg_dsn) -> None:
    obj = job(gpus=8, deadline=3600, annotations=H100)
    dry = await reviewed(admission, admission_review(obj, dry_run=True))
    assert (await admission.client.get(f"/v1/admissions/{obj.metadata.uid}")).status_code == 404
    assert await held_in_postgres(pg_dsn) == {}
    # The dry run answered what the real review then decides, saying it would reserve: it reserved nothing.
    real = await reviewed(admission, admission_review(obj))
    assert dry["allowed"] is real["allowed"] is True
    said, reason = dry["status"]["message"], real["status"]["message"].removeprefix("budgetgate: ")
    assert reason.startswith("admitted: reserved on ") and "reserved on" not in said
    assert said == "budgetgate (dry run, nothing reserved): would be admitted: would reserve on " + reason.removeprefix("admitted: reserved on ")


async def test_what_cannot_be_mapped_is_denied_naming_the_fix_and_other_objects_pass(admission) -> None:
    answer = await reviewed(admission, admission_review(job(gpus=1)))  # no deadline, annotation or default
    assert answer["allowed"] is False and "budgetgate.io/projected-runtime-hours" in answer["status"]["message"]
    unchanged = job(gpus=1, deadline=60)
    update = await reviewed(admission, admission_review(unchanged, operation="UPDATE", old=unchanged))
    assert update["allowed"] is True
    bad = await admission.client.post(URL, json={"kind": "Pod"})
    assert bad.status_code == 400 and bad.headers["content-type"] == "application/problem+json"


async def test_fails_closed_by_default_and_open_when_configured(admission_factory, monkeypatch) -> None:
    closed = await admission_factory()  # no policy bundle applied: it cannot decide
    answer = await reviewed(closed, admission_review(job(gpus=1, deadline=60)))
    assert answer["allowed"] is False and answer["status"]["code"] == 503 and "cannot decide" in answer["status"]["message"]
    assert answer["status"]["reason"] == "ServiceUnavailable"
    monkeypatch.setenv("BUDGETGATE_KUBERNETES_FAIL_OPEN", "true")
    opened = await admission_factory()
    answer = await reviewed(opened, admission_review(job(gpus=1, deadline=60)))
    assert answer["allowed"] is True and "fail open" in answer["warnings"][0] and len(answer["warnings"][0]) <= 120


async def test_namespace_default_runtime_from_the_environment(admission_factory, pg_dsn, monkeypatch) -> None:
    await apply_policies(pg_dsn, example_policies(), sha="e" * 40)
    monkeypatch.setenv("BUDGETGATE_KUBERNETES_NAMESPACE_RUNTIME_HOURS", '{"vision-prod": 2.5}')
    server = await admission_factory()
    await server.wait_ready()
    obj = job(gpus=4, annotations=H100)
    assert (await reviewed(server, admission_review(obj)))["allowed"] is True
    assert (await server.client.get(f"/v1/admissions/{obj.metadata.uid}")).json()["projected_gpu_hours"] == 10.0


async def test_served_over_tls_as_the_deployment_runs_it(settings, pg_dsn, tmp_path) -> None:
    """`python -m budgetgate.services.admission --ssl-certfile … --ssl-keyfile …`, as
    deploy/kubernetes/webhook runs it, answers an AdmissionReview over HTTPS."""
    await apply_policies(pg_dsn, example_policies(), sha="e" * 40)
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)  # fmt: skip
    port = free_port()
    env = {**os.environ, **{f"BUDGETGATE_{k.upper()}": str(v) for k, v in settings.model_dump().items() if v is not None}, "BUDGETGATE_HOME": str(tmp_path)}
    command = [sys.executable, "-m", "budgetgate.services.admission", "--port", str(port), "--ssl-certfile", str(cert), "--ssl-keyfile", str(key)]
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        token = await issue(pg_dsn, Role.SUBMITTER)
        async with httpx.AsyncClient(
            base_url=f"https://127.0.0.1:{port}", verify=ssl.create_default_context(cafile=str(cert)), timeout=10, headers=bearer(token)
        ) as client:

            async def ready() -> bool:
                assert process.poll() is None, process.stderr.read().decode() if process.stderr else "exited"
                try:
                    return (await client.get("/readyz")).status_code == 200
                except httpx.TransportError:
                    return False

            await wait_for(ready, what="admission serving HTTPS")
            answer = (await client.post(URL, json=admission_review(job(gpus=8, deadline=3600, annotations=H100)))).json()["response"]
            assert answer["allowed"] is True
        # An idle connection outlives uvicorn's own 5 s keep-alive (the API server's webhook client
        # keeps them 90 s): a request on it after 6 s idle is answered on the same connection.
        reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=ssl.create_default_context(cafile=str(cert)))
        try:
            for pause in (0, 6):
                await asyncio.sleep(pause)
                writer.write(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
                await writer.drain()
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=10)
                assert head.startswith(b"HTTP/1.1 200"), head
                length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:"))
                await reader.readexactly(length)
        finally:
            writer.close()
        with pytest.raises(httpx.TransportError):  # plain HTTP is not served
            async with httpx.AsyncClient(timeout=5) as plain:
                await plain.get(f"http://127.0.0.1:{port}/healthz")
    finally:
        process.terminate()
        process.wait(timeout=20)
        if process.stderr:
            process.stderr.close()


async def test_a_submitter_limited_to_namespaces_submits_only_within_them(admission, pg_dsn) -> None:
    # The webhook checked the role and then decided whatever namespace and labels the review
    # named: a submitter limited to vision-* reserved against another team's budgets through it.
    limited = bearer(await issue(pg_dsn, Role.SUBMITTER, namespaces=["vision-*"]))
    elsewhere = admission_review(job(gpus=8, deadline=3600, annotations=H100))
    elsewhere["request"]["namespace"] = elsewhere["request"]["object"]["metadata"]["namespace"] = "nlp-prod"
    answer = (await admission.client.post(URL, json=elsewhere, headers=limited)).json()["response"]
    assert answer["allowed"] is False and answer["status"]["code"] == 403 and "vision-*" in answer["status"]["message"]
    assert await held_in_postgres(pg_dsn) == {}
    assert (await admission.client.get(f"/v1/admissions/{elsewhere['request']['object']['metadata']['uid']}")).status_code == 404
    within = admission_review(job(gpus=8, deadline=3600, annotations=H100))
    assert (await admission.client.post(URL, json=within, headers=limited)).json()["response"]["allowed"] is True


PYTHON = ("object has no attribute", "unsupported operand", "NoneType", "not subscriptable", "not iterable", "invalid literal", "Traceback")


@pytest.mark.parametrize(
    ("body", "field", "says"),
    [
        (b"[" * 60_000, "", "invalid body: is not JSON"),  # deeper than the JSON parser goes (the whole body is at fault: no field)
        (b"{", "", "invalid body: is not JSON"),
        (b'{"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {"operation": "CREATE"}}', "request.uid", "non-empty string"),
        (b'{"apiVersion": "admission.k8s.io/v1", "kind": "Pod", "request": {"uid": "u"}}', "kind", "must be AdmissionReview"),
        (b'{"kind": "AdmissionReview", "request": {"uid": "u", "operation": "CREATE", "kind": "Job"}}', "apiVersion", "admission.k8s.io/v1"),
    ],
)
async def test_what_is_not_a_v1_review_with_a_uid_is_a_400_naming_the_field(admission, body: bytes, field: str, says: str) -> None:
    answer = await admission.client.post(URL, content=body, headers={"content-type": "application/json"})
    assert answer.status_code == 400 and answer.headers["content-type"] == "application/problem+json", answer.text
    problem = answer.json()
    assert [e["field"] for e in problem["errors"]] == [field] and says in problem["detail"], problem


async def test_a_v1beta1_review_is_a_400_naming_the_version_answered_and_decides_nothing(admission, pg_dsn) -> None:
    # A v1beta1 review was decided and answered as v1 (which an API server that sent v1beta1
    # cannot read): an 8-GPU Job reserved and was admitted through it.
    old = admission_review(job(gpus=8, deadline=3600, annotations=H100))
    old["apiVersion"] = "admission.k8s.io/v1beta1"
    answer = await admission.client.post(URL, json=old)
    assert answer.status_code == 400 and answer.headers["content-type"] == "application/problem+json", answer.text
    problem = answer.json()
    assert problem["errors"][0]["field"] == "apiVersion" and "only admission.k8s.io/v1 AdmissionReviews" in problem["detail"]
    assert "'admission.k8s.io/v1beta1'" in problem["detail"] and 'admissionReviewVersions must be ["v1"]' in problem["detail"]
    assert await held_in_postgres(pg_dsn) == {}
    assert (await admission.client.get(f"/v1/admissions/{old['request']['object']['metadata']['uid']}")).status_code == 404


@pytest.mark.parametrize("operation", ["CREATE", "UPDATE"])
async def test_a_create_or_update_without_its_object_is_refused_with_a_decision_of_nobody(admission, pg_dsn, operation: str) -> None:
    obj = job(gpus=8, deadline=3600, annotations=H100)
    review = admission_review(obj, operation=operation, old=obj)
    review["request"]["object"] = None
    answer = await reviewed(admission, review)
    assert answer["allowed"] is False and answer["status"]["code"] == 422, answer
    assert answer["status"]["message"].startswith("budgetgate: request.object is missing: ") and operation in answer["status"]["message"]
    assert await held_in_postgres(pg_dsn) == {}
    assert (await admission.client.get(f"/v1/admissions/{obj.metadata.uid}")).status_code == 404


@pytest.mark.parametrize(
    ("path", "value", "says"),
    [
        (("spec", "parallelism"), "4", "spec.parallelism must be a whole number (0 or more), got '4'"),
        (("spec", "activeDeadlineSeconds"), "3600", "spec.activeDeadlineSeconds must be a whole number of seconds above 0, got '3600'"),
        (("spec", "template", "spec", "containers"), "trainer", "spec.template.spec.containers must be a list, got 'trainer'"),
        (("spec", "template", "spec", "containers", 0, "resources", "limits", "nvidia.com/gpu"), "abc",
         "spec.template.spec.containers[0].resources.limits['nvidia.com/gpu'] must be a whole number, got 'abc'"),
        (("metadata", "labels"), ["team"], "metadata.labels must be an object of strings, got a list"),
        (("metadata", "annotations"), "budgetgate.io/flavor=h100", "metadata.annotations must be an object of strings"),
        (("metadata",), "train", "metadata must be an object, got 'train'"),
    ],
)  # fmt: skip
async def test_a_malformed_object_is_refused_naming_the_field_in_words(admission, pg_dsn, path: tuple[Any, ...], value: Any, says: str) -> None:
    review = admission_review(job(gpus=8, parallelism=1, deadline=3600, annotations=H100))
    node = review["request"]["object"]
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    answer = await reviewed(admission, review)
    assert answer["allowed"] is False and (answer["status"]["code"], answer["status"]["reason"]) == (422, "Invalid"), answer
    assert says in answer["status"]["message"] and not any(text in answer["status"]["message"] for text in PYTHON), answer
    assert await held_in_postgres(pg_dsn) == {}


async def test_every_field_of_a_job_given_a_wrong_type_is_answered_in_words(admission) -> None:
    # Every field of the review, each replaced by a string and by a list, as dry runs (nothing
    # reserved whatever is admitted): each is answered as a review, allowed or refused in words.
    base = admission_review(job(gpus=8, parallelism=2, completions=4, deadline=3600, annotations=H100), dry_run=True)

    def paths(value: Any, at: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        inner = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else []
        return [p for key, v in inner for p in paths(v, (*at, key))] + ([at] if at else [])

    answered = 0
    for path in paths(base["request"]):
        if path in (("uid",), ("dryRun",)):
            continue
        for value in ("abc", ["x"]):
            review = json.loads(json.dumps(base))
            node = review["request"]
            for key in path[:-1]:
                node = node[key]
            node[path[-1]] = value
            answer = await reviewed(admission, review)
            message = answer.get("status", {}).get("message", "")
            assert not any(text in message for text in PYTHON), (path, value, message)
            answered += 1
    assert answered > 80


async def test_a_resent_run_asking_for_more_is_refused_naming_what_changed(admission, pg_dsn) -> None:
    # A run admitted for 1 GPU, resent as attempt 2 for 500 GPUs for 100 h: the webhook answered
    # the stored ALLOW, and the API server created the 500-GPU Job on it.
    run = {**H100, "budgetgate.io/run-id": "flyte/vision/exec-resend/n0"}
    first = await reviewed(admission, admission_review(job("small", gpus=1, parallelism=1, deadline=3600, annotations=run)))
    assert first["allowed"] is True
    held = await held_in_postgres(pg_dsn)
    bigger = job("big", gpus=500, parallelism=1, deadline=100 * 3600, annotations={**run, "budgetgate.io/attempt": "2"})
    answer = await reviewed(admission, admission_review(bigger))
    assert answer["allowed"] is False and (answer["status"]["code"], answer["status"]["reason"]) == (409, "Conflict"), answer
    message = answer["status"]["message"]
    assert "resources.gpus: 1 → 500" in message and "projected_runtime_hours: 1.0 → 100.0" in message and "new run id" in message, message
    assert "budgetgate.io/run-id" in message, message  # how a Kubernetes object takes a new run id
    assert await held_in_postgres(pg_dsn) == held
    # The same object sent again is the same request: let through on its decision, as before.
    again = await reviewed(admission, admission_review(job("small", gpus=1, parallelism=1, deadline=3600, annotations={**run, "budgetgate.io/attempt": "2"})))
    assert again["allowed"] is True and await held_in_postgres(pg_dsn) == held


KUEUE = "system:serviceaccount:kueue-system:kueue-controller-manager"


def queued(name: str, *, suspend: bool = True, **spec: Any) -> dict[str, Any]:
    """A Job labelled for Kueue's queue team-a, created suspended (as Kueue's own webhook makes it)."""
    obj = as_json(job(name, **spec))
    obj["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] = "team-a"
    obj["spec"]["suspend"] = suspend
    return obj


def owner_of(obj: dict[str, Any]) -> V1OwnerReference:
    return V1OwnerReference(api_version=obj["apiVersion"], kind=obj["kind"], name=obj["metadata"]["name"], uid=obj["metadata"]["uid"], controller=True)


async def test_a_job_queued_in_kueue_is_left_to_kueue_and_its_pods_pass_on_it(admission, pg_dsn) -> None:
    obj = queued("kueued", gpus=8, parallelism=2, deadline=3600, annotations=H100)
    answer = await reviewed(admission, admission_review(obj))
    assert answer["allowed"] is True and answer["status"]["message"].startswith("budgetgate: not decided here (left to Kueue: Job kueued"), answer
    assert "budgetgate's AdmissionCheck" in answer["status"]["message"]
    assert (await admission.client.get(f"/v1/admissions/{obj['metadata']['uid']}")).status_code == 404
    assert await held_in_postgres(pg_dsn) == {}
    # Only Kueue resumes it (after its checks, budgetgate's among them).
    resumed = {**obj, "spec": {**obj["spec"], "suspend": False}}
    refused = await reviewed(admission, admission_review(resumed, operation="UPDATE", old=obj))
    assert refused["allowed"] is False and (refused["status"]["code"], refused["status"]["reason"]) == (403, "Forbidden")
    assert "only Kueue resumes it" in refused["status"]["message"], refused
    by_kueue = await reviewed(admission, admission_review(resumed, operation="UPDATE", old=obj, user=KUEUE))
    assert by_kueue["allowed"] is True, by_kueue
    # Its pods are Kueue's run: the Job controller's pass on the Job, undecided ...
    own = pod("kueued-0", containers=[container(gpus=8)], owner=owner_of(obj))
    passed = await reviewed(admission, admission_review(own, user=JOB_CONTROLLER))
    assert passed["allowed"] is True and "which was admitted for it" in passed["status"]["message"], passed
    assert (await admission.client.get(f"/v1/admissions/{own.metadata.uid}")).status_code == 404
    # ... and a tenant's naming it is a run of its own.
    extra = pod("kueued-extra", containers=[container(gpus=8)], deadline=3600, owner=owner_of(obj), annotations=H100)
    decided = await reviewed(admission, admission_review(extra, user="mallory@example.com"))
    assert decided["allowed"] is True and (await admission.client.get(f"/v1/admissions/{extra.metadata.uid}")).status_code == 200


async def test_the_kueue_label_alone_is_no_way_around_budgets(admission, pg_dsn) -> None:
    # Labelled but not suspended: it would run before Kueue admitted anything. Decided here.
    running = queued("unsuspended", suspend=False, gpus=8, deadline=3600, annotations=H100)
    answer = await reviewed(admission, admission_review(running))
    assert answer["allowed"] is True and answer["status"]["message"].startswith("budgetgate: admitted"), answer
    assert any("not suspended" in w for w in answer["warnings"]) and all(len(w) <= 120 for w in answer["warnings"])
    assert (await admission.client.get(f"/v1/admissions/{running['metadata']['uid']}")).json()["projected_gpu_hours"] == 8.0
    # Suspended and labelled, then unlabelled to be resumed without Kueue: the label may not go.
    obj = queued("sneaky", gpus=8, deadline=3600, annotations=H100)
    assert (await reviewed(admission, admission_review(obj)))["allowed"] is True
    unlabelled = {**obj, "metadata": {**obj["metadata"], "labels": {k: v for k, v in obj["metadata"]["labels"].items() if not k.startswith("kueue.")}}}
    refused = await reviewed(admission, admission_review(unlabelled, operation="UPDATE", old=obj))
    assert refused["allowed"] is False and "may change but not go" in refused["status"]["message"], refused
    # A dry run of a queued Job is not remembered: a pod naming it is decided on its own.
    dry = queued("dry", gpus=8, deadline=3600, annotations=H100)
    assert (await reviewed(admission, admission_review(dry, dry_run=True)))["allowed"] is True
    child = pod("dry-0", containers=[container(gpus=8)], deadline=3600, owner=owner_of(dry), annotations=H100)
    assert "which was admitted for it" not in (await reviewed(admission, admission_review(child, user=JOB_CONTROLLER)))["status"]["message"]


async def _decision_count(dsn: str, run_id: str) -> int:
    conn = await asyncpg.connect(dsn)
    try:
        return await conn.fetchval("SELECT count(*) FROM decisions WHERE run_id = $1", run_id)
    finally:
        await conn.close()


async def test_a_flyteworkflow_is_decided_as_its_flyte_run_and_flytepropellers_pods_pass_on_it(admission, pg_dsn) -> None:
    # `pyflyte run --remote`, the console, a schedule: no preflight ran. FlyteAdmin creates the
    # FlyteWorkflow, decided here as the preflight would have named it.
    workflow = flyte_workflow("a0c1e2d3f4a5b6c7d8e9")
    run_id = flyte_run_id("vision", "production", "a0c1e2d3f4a5b6c7d8e9")
    answer = await reviewed(admission, flyte_review(workflow))
    assert answer["allowed"] is True and answer["status"]["message"].startswith("budgetgate: admitted"), answer
    decision = (await admission.client.get(f"/v1/admissions/{run_id}")).json()
    assert (decision["decision"], decision["projected_gpu_hours"], decision["attempt"]) == ("ALLOW", 19.5, 1)
    held = await held_in_postgres(pg_dsn)
    # flytepropeller's pods name it "flyteworkflow" as their owner: they pass on its decision.
    pod_obj = flyte_pod(workflow)
    passed = await reviewed(admission, admission_review(pod_obj, user=FLYTEPROPELLER))
    assert passed["allowed"] is True and "created by FlyteWorkflow a0c1e2d3f4a5b6c7d8e9, which was admitted for it" in passed["status"]["message"], passed
    assert (await admission.client.get(f"/v1/admissions/{pod_obj['metadata']['uid']}")).status_code == 404
    # The API server retrying the FlyteWorkflow's call is answered from its decision.
    again = await reviewed(admission, flyte_review(workflow))
    assert again["allowed"] is True and "not decided again" in again["status"]["message"], again
    assert await held_in_postgres(pg_dsn) == held and await _decision_count(pg_dsn, run_id) == 1
    # A tenant's pod naming the FlyteWorkflow is no pod of flytepropeller's: decided on its own.
    forged = flyte_pod(workflow)
    forged["metadata"]["annotations"] = {"budgetgate.io/projected-runtime-hours": "1", **H100}
    own = await reviewed(admission, admission_review(forged, user="mallory@example.com"))
    assert "which was admitted for it" not in own["status"]["message"], own
    assert (await admission.client.get(f"/v1/admissions/{forged['metadata']['uid']}")).json()["projected_gpu_hours"] == 4.0


async def test_a_flyteworkflow_runs_on_its_preflights_decision_without_a_second(admission, pg_dsn) -> None:
    # The preflight projected from flytekit's templates (here 8 GPUs for 6 h): the FlyteWorkflow's
    # own projection differs (4 GPUs, 4.875 h). Submitted again it would be a 409 'changed';
    # it runs on the preflight's decision instead, and nothing is reserved twice.
    execution = "b1d2e3f4a5b6c7d8e9f0"
    run_id = flyte_run_id("vision", "production", execution)
    preflight = await admission.client.post("/v1/admissions", json=submission(run_id=run_id, job={"namespace": "vision-prod", "name": "training.train_wf"}))
    assert preflight.status_code == 200 and preflight.json()["decision"] == "ALLOW", preflight.text
    held = await held_in_postgres(pg_dsn)
    workflow = flyte_workflow(execution)
    answer = await reviewed(admission, flyte_review(workflow))
    assert answer["allowed"] is True and answer["status"]["message"].startswith(
        f"budgetgate: not decided again (run {run_id} already has a decision (attempt 1, decision {preflight.json()['decision_id']})"
    ), answer
    assert await held_in_postgres(pg_dsn) == held and await _decision_count(pg_dsn, run_id) == 1
    assert "which was admitted for it" in (await reviewed(admission, admission_review(flyte_pod(workflow), user=FLYTEPROPELLER)))["status"]["message"]
    # Offloaded (FlyteAdmin's useOffloadedWorkflowClosure): nothing to project, the decision suffices.
    offloaded = flyte_workflow(execution)
    for field in ("spec", "tasks"):
        del offloaded[field]
    offloaded["workflowClosureReference"] = "s3://flyte/metadata/closure.pb"
    assert (await reviewed(admission, flyte_review(offloaded)))["allowed"] is True
    # Created by someone else than FlyteAdmin, it is a submission like any: another request of
    # the run is a 409 naming what changed.
    other = await reviewed(admission, flyte_review(flyte_workflow(execution), user="mallory@example.com"))
    assert other["allowed"] is False and other["status"]["code"] == 409 and "resources.gpus: 8 → 4" in other["status"]["message"], other
    assert await held_in_postgres(pg_dsn) == held and await _decision_count(pg_dsn, run_id) == 1


async def test_a_flyteworkflow_refused_by_its_preflight_or_offloaded_without_one_is_denied(admission, pg_dsn) -> None:
    # Denied by the preflight (over budget), then launched all the same: denied with that decision.
    execution = "c2e3f4a5b6c7d8e9f0a1"
    run_id = flyte_run_id("vision", "production", execution)
    denied = await admission.client.post(
        "/v1/admissions", json=submission(run_id=run_id, resources={"gpus": 64, "nodes": 8, "flavor": "h100"}, projected_runtime_hours=10.0)
    )
    assert denied.json()["decision"] == "DENY", denied.text
    answer = await reviewed(admission, flyte_review(flyte_workflow(execution)))
    assert answer["allowed"] is False and answer["status"]["code"] == 403 and answer["status"]["message"] == f"budgetgate: {denied.json()['reason']}"
    assert await _decision_count(pg_dsn, run_id) == 1
    # Decided in another namespace than the one Flyte runs it in: refused, nothing decided.
    elsewhere = "d3f4a5b6c7d8e9f0a1b2"
    moved = await admission.client.post("/v1/admissions", json=submission(run_id=flyte_run_id("vision", "production", elsewhere), namespace="vision-dev"))
    assert moved.json()["decision"] == "ALLOW", moved.text
    refused = await reviewed(admission, flyte_review(flyte_workflow(elsewhere)))
    assert refused["allowed"] is False and refused["status"]["code"] == 409 and "another namespace than 'vision-prod'" in refused["status"]["message"]
    # Offloaded with no decision: nothing to project it from, refused naming the field and the setting.
    offloaded = flyte_workflow("e4a5b6c7d8e9f0a1b2c3")
    for field in ("spec", "tasks"):
        del offloaded[field]
    offloaded["workflowClosureReference"] = "s3://flyte/metadata/closure.pb"
    answer = await reviewed(admission, flyte_review(offloaded))
    assert answer["allowed"] is False and answer["status"]["code"] == 422, answer
    assert "workflowClosureReference" in answer["status"]["message"] and "useOffloadedWorkflowClosure" in answer["status"]["message"]
    assert await _decision_count(pg_dsn, flyte_run_id("vision", "production", "e4a5b6c7d8e9f0a1b2c3")) == 0
    # Its status updates are not decided (the configuration does not even send them).
    update = await reviewed(admission, flyte_review(flyte_workflow(execution), operation="UPDATE"))
    assert update["allowed"] is True and "only CREATE is" in update["status"]["message"]
