"""AdmissionReviews around objects built with the official `kubernetes` client's models, as the
API server sends them (the object in its JSON form); JobSets, RayJobs and RayClusters, which the
client has no models for, built from its pod templates."""

from __future__ import annotations

import base64
import copy
import json
import uuid
from pathlib import Path
from typing import Any

import jsonpatch

from kubernetes.client import (
    ApiClient,
    V1Container,
    V1JobSpec,
    V1Job,
    V1ObjectMeta,
    V1OwnerReference,
    V1Pod,
    V1PodSpec,
    V1PodTemplateSpec,
    V1ResourceRequirements,
)

GROUPS = {
    "Pod": ("", "v1", "pods"),
    "Job": ("batch", "v1", "jobs"),
    "JobSet": ("jobset.x-k8s.io", "v1alpha2", "jobsets"),
    "RayJob": ("ray.io", "v1", "rayjobs"),
    "RayCluster": ("ray.io", "v1", "rayclusters"),
}
VISION = {"team": "vision", "cost-center": "1042", "environment": "prod"}


def as_json(obj: Any) -> Any:
    """The object as the API server serializes it (camelCase, no nulls)."""
    return ApiClient().sanitize_for_serialization(obj)


def container(name: str = "trainer", *, gpus: int | None = None, limits_only: bool = True, sidecar: bool = False) -> V1Container:
    """`sidecar`: a native sidecar (an init container with restartPolicy Always)."""
    asks = {"nvidia.com/gpu": str(gpus), "cpu": "8"} if gpus is not None else {"cpu": "1"}
    resources = V1ResourceRequirements(limits=asks) if limits_only else V1ResourceRequirements(requests=asks, limits=asks)
    return V1Container(name=name, image="registry.example/trainer:1", resources=resources, restart_policy="Always" if sidecar else None)


def meta(
    name: str,
    *,
    namespace: str = "vision-prod",
    labels: dict[str, str] | None = None,
    annotations: dict[str, str] | None = None,
    owner: V1OwnerReference | None = None,
) -> V1ObjectMeta:
    return V1ObjectMeta(
        name=name, namespace=namespace, uid=str(uuid.uuid4()), labels=VISION if labels is None else labels, annotations=annotations,
        owner_references=[owner] if owner else None,
    )  # fmt: skip


def pod(name: str = "train-0", *, containers: list[V1Container], init: list[V1Container] | None = None, deadline: int | None = None, **kwargs: Any) -> V1Pod:
    return V1Pod(
        api_version="v1",
        kind="Pod",
        metadata=meta(name, **kwargs),
        spec=V1PodSpec(containers=containers, init_containers=init, active_deadline_seconds=deadline, restart_policy="Never"),
    )


def job_spec(
    *, gpus: int, parallelism: int | None = None, completions: int | None = None, deadline: int | None = None, pod_deadline: int | None = None
) -> V1JobSpec:
    """`deadline`: the Job's activeDeadlineSeconds; `pod_deadline`: its pod template's."""
    template = V1PodTemplateSpec(spec=V1PodSpec(containers=[container(gpus=gpus)], restart_policy="Never", active_deadline_seconds=pod_deadline))
    return V1JobSpec(template=template, parallelism=parallelism, completions=completions, active_deadline_seconds=deadline)


def job(name: str = "train-resnet", **spec: Any) -> V1Job:
    labels, annotations = spec.pop("labels", None), spec.pop("annotations", None)
    return V1Job(api_version="batch/v1", kind="Job", metadata=meta(name, labels=labels, annotations=annotations), spec=job_spec(**spec))


def jobset(name: str, replicated: list[tuple[int, V1JobSpec]], *, annotations: dict[str, str] | None = None) -> dict[str, Any]:
    return {
        "apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet", "metadata": as_json(meta(name, annotations=annotations)),
        "spec": {"replicatedJobs": [{"name": f"rj-{i}", "replicas": n, "template": {"spec": as_json(spec)}} for i, (n, spec) in enumerate(replicated)]},
    }  # fmt: skip


def ray_cluster_spec(*, head_gpus: int, workers: list[tuple[int, int, int]], max_replicas: int = 10, autoscaling: bool = False) -> dict[str, Any]:
    """A rayClusterSpec; `workers`: (replicas, numOfHosts, GPUs per pod) per worker group."""

    def template(gpus: int) -> dict[str, Any]:
        return as_json(V1PodTemplateSpec(spec=V1PodSpec(containers=[container("ray", gpus=gpus)])))

    spec: dict[str, Any] = {
        "headGroupSpec": {"rayStartParams": {}, "template": template(head_gpus)},
        "workerGroupSpecs": [
            {"groupName": f"g{i}", "replicas": r, "minReplicas": 0, "maxReplicas": max_replicas, "numOfHosts": h, "rayStartParams": {}, "template": template(g)}
            for i, (r, h, g) in enumerate(workers)
        ],
    }
    if autoscaling:
        spec["enableInTreeAutoscaling"] = True
    return spec


def rayjob(name: str, *, head_gpus: int, workers: list[tuple[int, int, int]], deadline: int | None = None, **cluster: Any) -> dict[str, Any]:
    """`workers`: (replicas, numOfHosts, GPUs per pod) per worker group; `cluster`: ray_cluster_spec's other arguments."""
    spec: dict[str, Any] = {"entrypoint": "python train.py", "rayClusterSpec": ray_cluster_spec(head_gpus=head_gpus, workers=workers, **cluster)}
    if deadline:
        spec["activeDeadlineSeconds"] = deadline
    return {"apiVersion": "ray.io/v1", "kind": "RayJob", "metadata": as_json(meta(name)), "spec": spec}


def raycluster(name: str, *, owner: V1OwnerReference | None = None, annotations: dict[str, str] | None = None, **cluster: Any) -> dict[str, Any]:
    """A RayCluster (its spec a rayClusterSpec, made by ray_cluster_spec from `cluster`)."""
    metadata = as_json(meta(name, owner=owner, annotations=annotations))
    return {"apiVersion": "ray.io/v1", "kind": "RayCluster", "metadata": metadata, "spec": ray_cluster_spec(**cluster)}


JOB_CONTROLLER = "system:serviceaccount:kube-system:job-controller"  # who creates a Job's pods (kube-controller-manager)
JOBSET_CONTROLLER = "system:serviceaccount:jobset-system:jobset-controller-manager"


def admission_review(
    obj: Any, *, operation: str = "CREATE", dry_run: bool = False, uid: str | None = None, old: Any = None, user: str = "alice@example.com"
) -> dict[str, Any]:
    """The AdmissionReview the API server sends for `user` creating `obj` (a model or a dict),
    or updating `old` to `obj`."""
    body = obj if isinstance(obj, dict) else as_json(obj)
    group, version, resource = GROUPS[body["kind"]]
    return {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": uid or str(uuid.uuid4()),
            "kind": {"group": group, "version": version, "kind": body["kind"]},
            "resource": {"group": group, "version": version, "resource": resource},
            "requestKind": {"group": group, "version": version, "kind": body["kind"]},
            "namespace": body["metadata"].get("namespace", "vision-prod"),
            "operation": operation,
            "userInfo": {"username": user, "groups": ["system:authenticated"]},
            "object": body,
            "name": body["metadata"].get("name"),
            "oldObject": None if old is None else old if isinstance(old, dict) else as_json(old),
            "dryRun": dry_run,
            "options": {"apiVersion": "meta.k8s.io/v1", "kind": "UpdateOptions" if operation == "UPDATE" else "CreateOptions"},
        },
    }


# A CREATE as the two webhooks see it: mutated before the API server assigns the UID, validated after.


def unstored(obj: Any) -> dict[str, Any]:
    """`obj` as a mutating webhook sees it: no UID yet."""
    body = copy.deepcopy(obj if isinstance(obj, dict) else as_json(obj))
    body["metadata"].pop("uid", None)
    return body


async def mutated(server, obj: dict[str, Any], **review: Any) -> tuple[dict[str, Any], dict[str, Any]]:  # type: ignore[no-untyped-def]
    """The mutating webhook's answer for creating `obj`, and `obj` as the API server patches it."""
    sent = admission_review(obj, **review)
    answer = await server.client.post("/v1/kubernetes/mutate", json=sent)
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert (body["apiVersion"], body["kind"], body["response"]["uid"]) == ("admission.k8s.io/v1", "AdmissionReview", sent["request"]["uid"])
    response = body["response"]
    assert response["allowed"] is True  # it never denies
    if "patch" not in response:
        assert "patchType" not in response
        return response, obj
    assert response["patchType"] == "JSONPatch"
    return response, jsonpatch.apply_patch(obj, json.loads(base64.b64decode(response["patch"])))


async def validated(server, obj: dict[str, Any], **review: Any) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    answer = await server.client.post("/v1/kubernetes/admission-review", json=admission_review(obj, **review))
    assert answer.status_code == 200, answer.text
    return answer.json()["response"]


def stored(obj: dict[str, Any]) -> dict[str, Any]:
    """`obj` as the API server stores it: with its UID."""
    return {**obj, "metadata": {**obj["metadata"], "uid": str(uuid.uuid4())}}


def pod_of(owner: dict[str, Any], name: str, template: dict[str, Any]) -> dict[str, Any]:
    """The Pod a controller makes from `template` for `owner` (its labels and annotations)."""
    made = as_json(pod(name, containers=[container(gpus=1)]))
    made["metadata"]["labels"] = dict(template["metadata"].get("labels") or {})
    made["metadata"]["annotations"] = dict(template["metadata"].get("annotations") or {})
    made["spec"] = copy.deepcopy(template["spec"])
    made["metadata"]["ownerReferences"] = [
        as_json(
            V1OwnerReference(api_version=owner["apiVersion"], kind=owner["kind"], name=owner["metadata"]["name"], uid=owner["metadata"]["uid"], controller=True)
        )
    ]
    return unstored(made)


FLYTE_FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "flyte"
FLYTEADMIN = "system:serviceaccount:flyte:flyteadmin"  # who creates FlyteWorkflows (the flyte-core chart's account)
FLYTEPROPELLER = "system:serviceaccount:flyte:flytepropeller"  # who creates their pods


def flyte_workflow(execution: str | None = None, *, namespace: str = "vision-prod", uid: str | None = None) -> dict[str, Any]:
    """tests/fixtures/flyte/flyteworkflow.json (its README says what it runs), as execution
    `execution` (its name and execution-id label) in `namespace`, with `uid` (a fresh one unless
    given: the API server gives it on storing, so a mutating webhook's review has none: uid="")."""
    obj = json.loads((FLYTE_FIXTURES / "flyteworkflow.json").read_text())
    if execution is not None:
        obj["metadata"]["name"] = execution
        obj["metadata"]["labels"]["execution-id"] = execution
        obj["executionId"]["name"] = execution
    obj["metadata"]["namespace"] = namespace
    if uid != "":
        obj["metadata"]["uid"] = uid or str(uuid.uuid4())
    return obj


def flyte_pod(workflow: dict[str, Any]) -> dict[str, Any]:
    """tests/fixtures/flyte/flyteworkflow-pod.json: the pod flytepropeller creates for the `train`
    node of `workflow`, owned by it and carrying its labels and annotations."""
    pod_obj = json.loads((FLYTE_FIXTURES / "flyteworkflow-pod.json").read_text())
    meta, owner_meta = pod_obj["metadata"], workflow["metadata"]
    name = owner_meta["name"]
    meta["name"], meta["namespace"], meta["uid"] = f"{name}-n1-0", owner_meta["namespace"], str(uuid.uuid4())
    meta["labels"] = {**owner_meta["labels"], "node-id": "n1", "task-name": "training-train", "interruptible": "false"}
    meta["annotations"] = {**(owner_meta.get("annotations") or {}), **meta["annotations"]}
    meta["ownerReferences"][0].update(name=name, uid=owner_meta.get("uid", ""))
    return pod_obj


def flyte_review(obj: dict[str, Any], *, operation: str = "CREATE", dry_run: bool = False, user: str = FLYTEADMIN) -> dict[str, Any]:
    """The AdmissionReview the API server sends for `user` creating a FlyteWorkflow: named by its
    CRD's kind (FlyteWorkflow), whatever the body's kind (flytepropeller writes "flyteworkflow")."""
    review = admission_review({**obj, "kind": "Pod"}, operation=operation, dry_run=dry_run, user=user)
    request = review["request"]
    request["object"] = obj
    request["kind"] = request["requestKind"] = {"group": "flyte.lyft.com", "version": "v1alpha1", "kind": "FlyteWorkflow"}
    request["resource"] = {"group": "flyte.lyft.com", "version": "v1alpha1", "resource": "flyteworkflows"}
    return review
