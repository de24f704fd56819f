"""Kubernetes objects (built with the official client's models) to submissions, and decisions
to AdmissionReview answers: budgetgate/platforms/kubernetes.py, without servers."""

from __future__ import annotations

import copy

import pytest
from kubernetes.client import V1OwnerReference

from budgetgate.platforms.kubernetes import Mapping, Owned, Refuse, Skip, Submit, Unmappable, decided, submission
from tests.support.kubernetes import admission_review, as_json, container, job, job_spec, jobset, pod, raycluster, rayjob


def submitted(obj, mapping: Mapping = Mapping()):  # type: ignore[no-untyped-def]
    found = submission(admission_review(obj), mapping)
    assert isinstance(found, Submit), found
    return found.request


def test_a_pod_sums_its_containers_gpus_and_takes_its_deadline() -> None:
    request = submitted(pod(containers=[container("a", gpus=2), container("b", gpus=1, limits_only=False), container("sidecar")], deadline=7200))
    assert (request.resources.gpus, request.resources.nodes, request.projected_runtime_hours) == (3, 1, 2.0)
    assert request.namespace == "vision-prod" and request.labels == {"team": "vision", "cost-center": "1042", "environment": "prod"}
    assert request.job is not None and request.job.name == "train-0"


def test_an_init_container_counts_when_it_asks_for_more_than_the_containers() -> None:
    request = submitted(pod(containers=[container(gpus=1)], init=[container("warmup", gpus=4)], deadline=3600))
    assert request.resources.gpus == 4


def test_native_sidecars_hold_their_gpus_beside_the_containers() -> None:
    # Kubernetes' effective request: max(containers + sidecars, each init container + the sidecars started before it).
    beside = submitted(pod(containers=[container(gpus=2)], init=[container("proxy", gpus=1, sidecar=True)], deadline=60))
    assert beside.resources.gpus == 3
    ordered = [container("before", gpus=4), container("proxy", gpus=2, sidecar=True), container("after", gpus=3)]
    assert submitted(pod(containers=[container(gpus=1)], init=ordered, deadline=60)).resources.gpus == 5  # "after" beside the sidecar


def test_a_job_multiplies_by_parallelism_capped_by_completions() -> None:
    assert submitted(job(gpus=8, parallelism=4, deadline=21600)).resources.gpus == 32
    capped = submitted(job(gpus=8, parallelism=4, completions=2, deadline=21600))
    assert (capped.resources.gpus, capped.resources.nodes, capped.projected_runtime_hours) == (16, 2, 6.0)


def test_a_pod_deadline_runs_once_per_wave_of_the_job() -> None:
    # 10 completions, 4 at a time: 3 waves of pods, each up to the pod's 1 h deadline.
    waves = submitted(job(gpus=2, parallelism=4, completions=10, pod_deadline=3600))
    assert (waves.resources.gpus, waves.projected_runtime_hours) == (8, 3.0)
    assert submitted(job(gpus=2, parallelism=4, pod_deadline=3600)).projected_runtime_hours == 1.0  # a work queue: one wave
    assert submitted(job(gpus=2, parallelism=4, completions=10, deadline=7200, pod_deadline=3600)).projected_runtime_hours == 2.0  # the Job's own governs
    obj = jobset("waves", [(1, job_spec(gpus=1, parallelism=2, completions=6, pod_deadline=600)), (1, job_spec(gpus=1, deadline=1200))])
    assert submitted(obj).projected_runtime_hours == 0.5  # 3 waves × 10 min beats the other job's 20 min


def test_a_jobset_sums_its_replicated_jobs() -> None:
    obj = jobset("llm", [(2, job_spec(gpus=8, parallelism=4, deadline=3600)), (1, job_spec(gpus=1, deadline=7200))])
    request = submitted(obj)
    assert (request.resources.gpus, request.resources.nodes, request.projected_runtime_hours) == (2 * 4 * 8 + 1, 9, 2.0)


def test_a_rayjob_counts_head_and_workers_times_hosts() -> None:
    request = submitted(rayjob("tune", head_gpus=0, workers=[(2, 2, 4), (1, 1, 1)], deadline=1800))
    assert (request.resources.gpus, request.resources.nodes, request.projected_runtime_hours) == (2 * 2 * 4 + 1, 6, 0.5)


def test_an_autoscaled_ray_cluster_counts_each_group_at_its_max_replicas() -> None:
    request = submitted(rayjob("tune", head_gpus=1, workers=[(1, 2, 4)], max_replicas=8, autoscaling=True, deadline=3600))
    assert (request.resources.gpus, request.resources.nodes) == (1 + 8 * 2 * 4, 1 + 8 * 2)
    fixed = submitted(rayjob("tune", head_gpus=1, workers=[(1, 2, 4)], max_replicas=8, deadline=3600))
    assert fixed.resources.gpus == 1 + 1 * 2 * 4


def test_a_ray_cluster_created_directly_is_a_submission_and_one_of_a_rayjob_is_not() -> None:
    annotated = {"budgetgate.io/projected-runtime-hours": "2"}
    request = submitted(raycluster("serve", head_gpus=0, workers=[(2, 1, 4)], max_replicas=3, autoscaling=True, annotations=annotated))
    assert (request.resources.gpus, request.resources.nodes, request.projected_runtime_hours) == (3 * 4, 4, 2.0)
    parent = V1OwnerReference(api_version="ray.io/v1", kind="RayJob", name="tune", uid="5e4d3c2b-0000-1111-2222-333344445555", controller=True)
    owned = submission(admission_review(raycluster("tune-raycluster", head_gpus=0, workers=[(2, 1, 4)], owner=parent)))
    # Its pods are let through on it in turn.
    assert owned == Owned(parent.uid, "RayJob", "tune", "created by RayJob tune, which was admitted for it", owns=True)


def test_runtime_falls_back_to_the_annotation_then_the_namespace_default() -> None:
    annotated = submitted(job(gpus=1, annotations={"budgetgate.io/projected-runtime-hours": "1.5"}))
    assert annotated.projected_runtime_hours == 1.5
    mapping = Mapping(namespace_runtime_hours={"vision-prod": 12.0}, default_runtime_hours=1.0)
    assert submitted(job(gpus=1), mapping).projected_runtime_hours == 12.0
    with pytest.raises(Unmappable, match="budgetgate.io/projected-runtime-hours"):
        submission(admission_review(job(gpus=1)))
    with pytest.raises(Unmappable, match="positive"):
        submission(admission_review(job(gpus=1, annotations={"budgetgate.io/projected-runtime-hours": "-3"})))


def test_run_id_from_the_annotation_else_the_object_never_its_owner() -> None:
    obj = job(gpus=1, deadline=60, annotations={"budgetgate.io/run-id": "flyte/vision/exec-1/n0", "budgetgate.io/attempt": "3", "budgetgate.io/flavor": "h100"})
    request = submitted(obj)
    assert (request.run_id, request.attempt, request.resources.flavor) == ("flyte/vision/exec-1/n0", 3, "h100")
    plain = job(gpus=1, deadline=60)
    assert submitted(plain).run_id == plain.metadata.uid
    # The replicas of a ReplicaSet share their owner: each is a run of its own, not a replay of the first.
    owner = V1OwnerReference(api_version="apps/v1", kind="ReplicaSet", name="infer-5d8f", uid="0f9e8d7c-1111-2222-3333-444455556666", controller=True)
    replicas = [pod(f"infer-5d8f-{i}", containers=[container(gpus=1)], deadline=60, owner=owner) for i in range(2)]
    assert [submitted(p).run_id for p in replicas] == [p.metadata.uid for p in replicas]


def test_children_of_admitted_kinds_are_owned_and_cpu_only_work_is_skipped() -> None:
    parent = V1OwnerReference(api_version="batch/v1", kind="Job", name="train-resnet", uid="9a8b7c6d-0000-1111-2222-333344445555", controller=True)
    child = admission_review(pod(containers=[container(gpus=8)], deadline=60, owner=parent))
    assert submission(child) == Owned(parent.uid, "Job", "train-resnet", "created by Job train-resnet, which was admitted for it", owns=False)
    # Its owner never admitted (the webhook finds no decision for it): a run of its own.
    own = submission(child, own_run=True)
    assert isinstance(own, Submit) and own.request.run_id == child["request"]["object"]["metadata"]["uid"] and own.request.resources.gpus == 8
    assert isinstance(submission(admission_review(pod(containers=[container()], deadline=60))), Skip)
    cpu = submitted(pod(containers=[container()], deadline=60), Mapping(submit_cpu_only=True))
    assert cpu.resources.gpus == 0 and cpu.resources.nodes == 1
    created = pod(containers=[container(gpus=1)], deadline=60)
    assert isinstance(submission(admission_review(created, operation="UPDATE", old=created)), Skip)  # a Pod's GPUs cannot change


def scaled(obj, path: str, value: int):  # type: ignore[no-untyped-def]
    """An UPDATE of `obj` (a dict) setting the spec field at `path` (dotted, list indexes as numbers) to `value`."""
    new = copy.deepcopy(obj)
    *parents, last = path.split(".")
    node = new["spec"]
    for key in parents:
        node = node[int(key)] if key.isdigit() else node[key]
    node[last] = value
    return admission_review(new, operation="UPDATE", old=obj)


@pytest.mark.parametrize(
    ("obj", "path", "value", "before", "after"),
    [
        (as_json(job(gpus=8, parallelism=1, deadline=60)), "parallelism", 16, 8, 128),
        (as_json(job(gpus=8, parallelism=0, deadline=60)), "parallelism", 1, 0, 8),  # skipped at creation as asking for no GPU
        (jobset("llm", [(2, job_spec(gpus=8, parallelism=1, deadline=60))]), "replicatedJobs.0.replicas", 4, 16, 32),
        (rayjob("tune", head_gpus=0, workers=[(1, 1, 4)], deadline=60), "rayClusterSpec.workerGroupSpecs.0.replicas", 3, 4, 12),
        (raycluster("serve", head_gpus=0, workers=[(1, 1, 4)], max_replicas=2, autoscaling=True), "workerGroupSpecs.0.maxReplicas", 10, 8, 40),
    ],
)
def test_an_update_that_raises_the_gpus_is_refused_naming_both_counts(obj, path: str, value: int, before: int, after: int) -> None:  # type: ignore[no-untyped-def]
    refused = submission(scaled(obj, path, value))
    assert isinstance(refused, Refuse), refused
    assert f"{before} nvidia.com/gpu" in refused.reason and f"to {after}" in refused.reason and "create a new" in refused.reason


def test_other_updates_pass_without_a_decision() -> None:
    obj = as_json(job(gpus=8, parallelism=4, deadline=60))
    assert isinstance(submission(scaled(obj, "parallelism", 2)), Skip)  # scaled down
    assert isinstance(submission(scaled(obj, "suspend", True)), Skip)  # Kueue suspending it
    relabelled = copy.deepcopy(obj)
    relabelled["metadata"]["labels"] = {"team": "vision", "priority": "low"}
    assert isinstance(submission(admission_review(relabelled, operation="UPDATE", old=obj)), Skip)
    ray = raycluster("serve", head_gpus=0, workers=[(1, 1, 4)], max_replicas=5, autoscaling=True)
    assert isinstance(submission(scaled(ray, "workerGroupSpecs.0.replicas", 5)), Skip)  # the autoscaler, within maxReplicas


def test_a_gpu_resource_name_is_configurable_and_quantities_are_whole() -> None:
    obj = pod(containers=[container(gpus=2)], deadline=60)
    assert isinstance(submission(admission_review(obj), Mapping(gpu_resource="amd.com/gpu")), Skip)
    broken = admission_review(obj)
    broken["request"]["object"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] = "500m"
    with pytest.raises(Unmappable, match="whole number"):
        submission(broken)


def answer(decision: str, **extra: object) -> dict[str, object]:
    return {"run_id": "r", "attempt": 1, "decision": decision, "reason": f"{decision.lower()} because", "evaluations": [], **extra}


def test_decisions_become_admission_reviews() -> None:
    allowed = decided("u1", answer("ALLOW", priority_penalty=0.42, evaluations=[{"policy_id": "org", "enforcement": "dry-run", "decision": "DENY"}]))
    assert allowed["response"]["uid"] == "u1" and allowed["response"]["allowed"] is True
    assert any("0.42" in w for w in allowed["response"]["warnings"]) and any("org would DENY" in w for w in allowed["response"]["warnings"])
    denied = decided("u2", answer("DENY"))["response"]
    assert (denied["allowed"], denied["status"]["code"], denied["status"]["message"]) == (False, 403, "budgetgate: deny because")
    assert "warnings" not in denied
    delayed = decided(
        "u3", answer("DELAY", evaluations=[{"policy_id": "p", "enforcement": "hard", "decision": "DELAY", "next_eligible_time": "2026-08-01T00:00:00Z"}])
    )
    message = delayed["response"]["status"]["message"]
    assert delayed["response"]["allowed"] is False and "retry at or after 2026-08-01T00:00:00Z" in message and "budgetgate.io/attempt=2" in message
