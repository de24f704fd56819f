"""Where a GPU's run comes from and how much of a GPU it is (pure, recorded pages): the run label
first, a hashed one resolved through the pod's annotation and never published; MIG instances as
their compute slices' fraction of the GPU; a time-sliced GPU split between the pods sharing it;
a pod that ended charged up to its end, not past it."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from budgetgate.core import metering as metering_rules
from budgetgate.platforms.dcgm import Meter, ScrapeError, claims, holdings, pod_end, pods_named
from budgetgate.platforms.mig_slices import MigProfileError, instance_share
from budgetgate.platforms.run_labels import RUN_ANNOTATION, RUN_LABEL, run_label_value

PAGES = Path(__file__).resolve().parents[1] / "fixtures" / "dcgm"
T0 = datetime(2026, 7, 14, 9, 0, tzinfo=UTC)
SWEEP = "flyte/nlp/sweep-7/n0"  # not a label value: the pods carry its hash, and the id whole in their annotation
SWEEP_JOB_UID = "6b7c8d9e-0f1a-4b2c-9d3e-4f5a6b7c8d02"
FINETUNE_JOB_UID = "5a6b7c8d-9e0f-4a1b-8c2d-3e4f5a6b7c01"


def page(name: str) -> str:
    return (PAGES / name).read_text()


def pod(name: str, namespace: str, *, labels: dict[str, str] | None = None, annotations: dict[str, str] | None = None, **status: Any) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "namespace": namespace, "uid": f"uid-{name}", "labels": labels or {}, "annotations": annotations or {}},
        "status": {"phase": "Running", **status},
    }


def sweep_pod(**status: Any) -> dict[str, Any]:
    return pod(
        "sweep-7-0-q4m9z",
        "nlp-prod",
        labels={RUN_LABEL: run_label_value(SWEEP), "batch.kubernetes.io/controller-uid": SWEEP_JOB_UID},
        annotations={RUN_ANNOTATION: SWEEP},
        **status,
    )


def mig_pods(**sweep_status: Any) -> dict[tuple[str, str], dict[str, Any]]:
    found = {
        ("nlp-prod", "finetune-0-7xk2p"): pod("finetune-0-7xk2p", "nlp-prod", labels={RUN_LABEL: "exp-42"}),
        ("nlp-prod", "finetune-1-r8d3w"): pod("finetune-1-r8d3w", "nlp-prod", labels={RUN_LABEL: "exp-42"}),
        ("nlp-prod", "eval-0-m2n7c"): pod("eval-0-m2n7c", "nlp-prod", labels={RUN_LABEL: "exp-43"}),
        ("nlp-prod", "sweep-7-0-q4m9z"): sweep_pod(**sweep_status),
    }
    return found


# -- 1. the run label first; a hashed one resolved, never published ------------------------------


def test_an_annotated_jobs_pods_are_metered_under_the_annotated_run_id_not_the_jobs_uid() -> None:
    held = holdings([page("node-e-mig.prom")], pods=mig_pods())
    assert sorted(held) == sorted(["exp-42", "exp-43", SWEEP])
    assert FINETUNE_JOB_UID not in held and SWEEP_JOB_UID not in held  # the Jobs' controller-uid labels come after the run label
    assert not any(run_id.startswith("bg-") for run_id in held)


def test_a_hashed_run_label_is_never_the_run_id() -> None:
    # Without the Kubernetes API the hash cannot be taken back: the GPU is charged to nobody, and
    # its pod named with the reason (not to the Job's UID, which would be another run's id).
    held = holdings([page("node-e-mig.prom")])
    assert sorted(held) == ["exp-42", "exp-43"] and held.unresolved == {"nlp-prod/sweep-7-0-q4m9z"}
    assert "not looked up through the Kubernetes API" in held.why["nlp-prod/sweep-7-0-q4m9z"]
    # An annotation that does not hash to the label names no run either.
    forged = mig_pods()
    forged[("nlp-prod", "sweep-7-0-q4m9z")]["metadata"]["annotations"][RUN_ANNOTATION] = "nlp/other"
    held = holdings([page("node-e-mig.prom")], pods=forged)
    assert SWEEP not in held and "nlp/other" not in held and held.unresolved == {"nlp-prod/sweep-7-0-q4m9z"}
    assert "does not hash to it" in held.why["nlp-prod/sweep-7-0-q4m9z"]


@pytest.mark.parametrize("run_id", ["nlp/sweep 7", "nlp/sweep-7\n"], ids=["a-space", "a-trailing-newline"])
def test_a_run_id_metering_ingest_would_refuse_is_not_published(run_id: str) -> None:
    # An annotation is free text: a run id with a space, or a newline after it, would have its
    # sample refused, and with it every sample of the same publish. Its pod is named instead,
    # with the reason.
    assert not metering_rules.is_run_id(run_id)  # the rule metering-ingest applies
    pods = mig_pods()
    pods[("nlp-prod", "sweep-7-0-q4m9z")]["metadata"]["annotations"][RUN_ANNOTATION] = run_id
    pods[("nlp-prod", "sweep-7-0-q4m9z")]["metadata"]["labels"][RUN_LABEL] = run_label_value(run_id)
    page_with = page("node-e-mig.prom").replace(run_label_value(SWEEP), run_label_value(run_id))
    held = holdings([page_with], pods=pods)
    assert sorted(held) == ["exp-42", "exp-43"] and "is not one metering-ingest accepts" in held.why["nlp-prod/sweep-7-0-q4m9z"]


def test_the_run_label_comes_before_a_relabel_and_the_uids() -> None:
    labelled = "\n".join(
        line.replace('team="nlp"', 'budgetgate_io_run_id="bert-run-1",team="nlp"') if "train-bert-0" in line else line
        for line in page("node-c-pod-labels.prom").splitlines()
    )
    held = holdings([labelled], run_id_label="team")
    assert sorted(held) == sorted(["bert-run-1", "nlp"])  # GPUs 0-1 by the run label, GPU 2 (no run label) by the relabel


def test_a_pods_labels_from_the_api_stand_in_for_those_the_page_lacks() -> None:
    # node C's page has the Jobs' controller-uid labels but no run label (an exporter filtering
    # pod labels, say); the pods looked up carry it, and it comes first.
    names = pods_named(claims(page("node-c-pod-labels.prom")))
    assert names == {("nlp-prod", "train-bert-0-x7k2p"), ("nlp-prod", "pretrain-workers-0-0-q9w8e")}
    pods = {key: pod(key[1], key[0], labels={RUN_LABEL: f"run-of-{key[1]}"}) for key in names}
    held = holdings([page("node-c-pod-labels.prom")], pods=pods)
    assert sorted(held) == ["run-of-pretrain-workers-0-0-q9w8e", "run-of-train-bert-0-x7k2p"]


# -- 2. MIG instances: their compute slices' fraction of the GPU ---------------------------------


def test_mig_instances_are_metered_as_their_fraction_of_the_gpu() -> None:
    held = holdings([page("node-e-mig.prom")], pods=mig_pods())
    # exp-42: the 3g.40gb and a 1g.10gb instance of GPU 0, by DCGM_FI_PROF_GR_ENGINE_ACTIVE (no GPU_UTIL under MIG).
    assert held["exp-42"].gpu_count == pytest.approx(4 / 7) and len(held["exp-42"].gpus) == 2
    assert held[SWEEP].gpu_count == pytest.approx(2 / 7)
    assert held["exp-43"].gpus == {"GPU-1c2d3e4f-5061-4728-9bac-d1e2f3041b02": 1.0}  # the node's whole GPU, by GPU_UTIL
    assert held.idle == 1  # the second 1g.10gb instance
    assert {h for r in held.values() for h in r.hosts} == {"gpu-node-e"}
    meter = Meter()
    meter.observe(T0, {"e": held})
    later = {u.run_id: u for u in meter.observe(T0 + timedelta(seconds=70), {"e": held})}
    assert later["exp-42"].gpu_seconds == pytest.approx(40.0) and later[SWEEP].gpu_seconds == pytest.approx(20.0)
    assert later["exp-42"].node_seconds == pytest.approx(70.0)


def test_a_mig_instance_without_a_sample_to_read_fails_the_page() -> None:
    with pytest.raises(ScrapeError, match=r"MIG instance GPU-0b1c2d3e-4f50-4617-8a9b-c0d1e2f30a01/gi1\b.*DCGM_FI_PROF_GR_ENGINE_ACTIVE"):
        holdings([page("node-e-mig-without-prof.prom")])


def test_an_exporters_gpu_util_of_a_mig_instance_is_read() -> None:
    # Some exporter versions (3.3 among them) wrote DCGM_FI_DEV_GPU_UTIL for instances too, as 0, labelled alike.
    lines = page("node-e-mig.prom").splitlines()
    clocks = [line for line in lines if line.startswith("DCGM_FI_DEV_SM_CLOCK{") and "GPU_I_ID" in line]
    instances = [line.replace("DCGM_FI_DEV_SM_CLOCK", "DCGM_FI_DEV_GPU_UTIL").rsplit(" ", 1)[0] + " 0" for line in clocks]
    old = []
    for line in lines:
        if not line.startswith(("DCGM_FI_PROF_GR_ENGINE_ACTIVE{", "DCGM_FI_DEV_FB_USED{")):
            old.append(line)
        if line == "# TYPE DCGM_FI_DEV_GPU_UTIL gauge":
            old.extend(instances)
    held = holdings(["\n".join(old) + "\n"], pods=mig_pods())
    assert held["exp-42"].gpu_count == pytest.approx(4 / 7) and held[SWEEP].gpu_count == pytest.approx(2 / 7)


@pytest.mark.parametrize(
    ("model", "profile", "share"),
    [
        ("NVIDIA A100-SXM4-80GB", "3g.40gb", 3 / 7),
        ("NVIDIA A100 80GB PCIe", "7g.79gb", 1.0),  # the memory part varies: only the compute slices count
        ("NVIDIA H100 80GB HBM3", "1g.10gb+me", 1 / 7),
        ("NVIDIA H200", "2g.35gb", 2 / 7),
        ("NVIDIA-H100-NVL", "4g.47gb", 4 / 7),
        ("NVIDIA A30", "1g.6gb", 1 / 4),
        ("NVIDIA A30", "2g.12gb", 2 / 4),
    ],
)
def test_a_mig_profiles_share_is_its_compute_slices_of_the_models(model: str, profile: str, share: float) -> None:
    assert instance_share(model, profile) == pytest.approx(share)


@pytest.mark.parametrize(
    ("model", "profile", "names"),
    [
        ("NVIDIA L40S", "1g.12gb", "'NVIDIA L40S'"),
        ("NVIDIA A100-SXM4-40GB", "<<<NULL>>>", "'<<<NULL>>>'"),
        ("NVIDIA A30", "7g.24gb", "'7g.24gb' has 7 compute slices, but a 'NVIDIA A30' has 4"),
    ],
)
def test_an_unknown_model_or_profile_is_an_error_naming_it(model: str, profile: str, names: str) -> None:
    with pytest.raises(MigProfileError, match=names.replace("(", r"\(")):
        instance_share(model, profile)
    assert instance_share("NVIDIA L40S", "1g.12gb", {"L40S": 4}) == 0.25  # an operator's own table
    line = page("node-e-mig.prom").replace("NVIDIA A100-SXM4-80GB", model).replace('GPU_I_PROFILE="3g.40gb"', f'GPU_I_PROFILE="{profile}"')
    with pytest.raises(ScrapeError, match=names.replace("(", r"\(")):
        holdings([line], pods=mig_pods())


# -- 3. time-slicing: a GPU split between the pods sharing it -------------------------------------


def serving_pods() -> dict[tuple[str, str], dict[str, Any]]:
    runs = {"chat-a-0": "chat-a", "chat-a-1": "chat-a", "chat-b-0": "chat-b", "chat-b-1": "chat-b"}
    return {("serving", name): pod(name, "serving", labels={RUN_LABEL: run}) for name, run in runs.items()}


def test_a_time_sliced_gpu_is_split_between_the_pods_sharing_it() -> None:
    held = holdings([page("node-d-time-sliced.prom")], pods=serving_pods())
    gpu0, gpu1 = "GPU-2d3e4f50-6172-4839-8acb-e2f304152c01", "GPU-3e4f5061-7283-494a-9bdc-f30415263d02"
    # GPU 0 is shared by three pods (one of chat-a, two of chat-b): a third each; GPU 1 by one pod.
    assert held["chat-a"].gpus == pytest.approx({gpu0: 1 / 3, gpu1: 1.0})
    assert held["chat-b"].gpus == pytest.approx({gpu0: 2 / 3})
    assert sum(h.gpu_count for h in held.values()) == pytest.approx(2.0)  # two GPUs held, not four
    assert held.idle == 1  # GPU 2; the exporter's copy of GPU 0 naming no pod is not an idle GPU


def test_a_time_sliced_gpu_without_the_api_is_not_named_by_the_pods_own_uid() -> None:
    # The exporter writes no pod labels in that mode, only the pod's UID: a Job's pod would be
    # charged to its own UID. Without the pod from the API, only a relabel or the template names it.
    assert sorted(holdings([page("node-d-time-sliced.prom")], run_id_template=None)) == []
    assert sorted(holdings([page("node-d-time-sliced.prom")])) == ["serving/chat-a-0", "serving/chat-a-1", "serving/chat-b-0", "serving/chat-b-1"]


# -- 4d. a pod that ended while the kubelet still reports it --------------------------------------


def test_an_ended_pods_gpus_are_charged_up_to_its_end_not_past_it() -> None:
    finished = T0 + timedelta(seconds=40)
    ended = {"phase": "Succeeded", "containerStatuses": [{"name": "trainer", "state": {"terminated": {"exitCode": 0, "finishedAt": "2026-07-14T09:00:40Z"}}}]}
    assert pod_end(sweep_pod(**ended)) == (True, finished)
    assert pod_end(sweep_pod()) == (False, None)
    meter = Meter()
    meter.observe(T0, {"e": holdings([page("node-e-mig.prom")], pods=mig_pods())})
    meter.observe(T0 + timedelta(seconds=30), {"e": holdings([page("node-e-mig.prom")], pods=mig_pods())})
    # At 60 s the exporter still shows the sweep's instance; the API says its pod finished at 40 s.
    at_60 = holdings([page("node-e-mig.prom")], pods=mig_pods(**ended))
    assert at_60.gone == {"nlp-prod/sweep-7-0-q4m9z"} and at_60[SWEEP].gpus == {}
    usage = {u.run_id: u for u in meter.observe(T0 + timedelta(seconds=60), {"e": at_60})}
    assert usage[SWEEP].gpu_seconds == pytest.approx(40 * 2 / 7) and usage[SWEEP].node_seconds == pytest.approx(40.0)
    assert SWEEP not in meter.last
    # Reported again while the kubelet still lists it: charged nothing more.
    again = {u.run_id: u for u in meter.observe(T0 + timedelta(seconds=90), {"e": holdings([page("node-e-mig.prom")], pods=mig_pods(**ended))})}
    assert again[SWEEP].gpu_seconds == pytest.approx(40 * 2 / 7)
    assert again["exp-42"].gpu_seconds == pytest.approx(90 * 4 / 7)


def test_a_deleted_pod_still_reported_holds_nothing() -> None:
    pods: dict[tuple[str, str], dict[str, Any] | None] = dict(mig_pods())
    pods[("nlp-prod", "sweep-7-0-q4m9z")] = None
    held = holdings([page("node-e-mig.prom")], pods=pods)
    assert SWEEP not in held and held.gone == {"nlp-prod/sweep-7-0-q4m9z"}


def test_a_pod_not_looked_up_is_not_taken_for_deleted() -> None:
    pods = mig_pods()
    del pods[("nlp-prod", "eval-0-m2n7c")]  # not asked for: its own labels on the page name its run
    held = holdings([page("node-e-mig.prom")], pods=pods)
    assert "exp-43" in held and held.gone == frozenset()
    del pods[("nlp-prod", "sweep-7-0-q4m9z")]
    unknown = holdings([page("node-e-mig.prom")], pods=pods)
    assert SWEEP not in unknown and "not looked up through the Kubernetes API" in unknown.why["nlp-prod/sweep-7-0-q4m9z"]
