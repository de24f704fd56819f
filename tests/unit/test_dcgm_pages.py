"""DCGM exporter pages that must not read as "no GPU held", and the run ids a page names by
default (pure, recorded pages): an empty page or one without the GPU metric is a scrape error;
GPUs no run is named for are counted; Jobs and JobSets are named as budgetgate's webhook names them."""

from __future__ import annotations

from pathlib import Path

import pytest

from budgetgate.platforms.dcgm import ScrapeError, holdings

PAGES = Path(__file__).resolve().parents[1] / "fixtures" / "dcgm"
FLYTE = "flyte/vision/exec-7f3a/n0"
JOB_UID = "3c1f9a2e-7b4d-4e8a-9f60-1d2c3b4a5e6f"  # the Job train-bert: the run id the webhook and the Kueue controller give it
JOBSET_UID = "2b3c4d5e-6f70-4182-93a4-b5c6d7e8f901"


def page(name: str) -> str:
    return (PAGES / name).read_text()


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("", "has no DCGM_FI_DEV_GPU_UTIL sample (it is empty)"),
        (page("node-c-without-util.prom"), "has no DCGM_FI_DEV_GPU_UTIL sample (the exporter does not collect that field)"),
        ("# HELP DCGM_FI_DEV_GPU_UTIL GPU utilization (in %).\n# TYPE DCGM_FI_DEV_GPU_UTIL gauge\n", "has no DCGM_FI_DEV_GPU_UTIL sample"),
        ("<html><body>502 Bad Gateway</body></html>", "is not Prometheus text"),
    ],
)
def test_a_page_that_cannot_say_who_holds_the_gpus_fails_the_scrape(text: str, says: str) -> None:
    with pytest.raises(ScrapeError, match=r"exporter page 2 of 2 ") as failed:
        holdings([page("node-b.prom"), text])
    assert says in str(failed.value)


def test_jobs_and_jobsets_are_named_by_their_uids_from_the_exporters_pod_labels() -> None:
    held = holdings([page("node-c-pod-labels.prom")])
    assert sorted(held) == sorted([JOB_UID, JOBSET_UID])  # the JobSet's UID wins over its child Job's, and a Job's over its pod's own
    assert len(held[JOB_UID].gpus) == 2 and held[JOB_UID].hosts == {"gpu-node-c"} and len(held[JOBSET_UID].gpus) == 1
    assert held.idle == 1 and held.unmapped == frozenset()
    # A run-id label, where there is one, comes first.
    assert sorted(holdings([page("node-c-pod-labels.prom")], run_id_label="team")) == ["nlp"]


def test_gpus_no_run_is_named_for_are_counted() -> None:
    both = holdings([page("node-a.prom"), page("node-b.prom")])
    assert both.idle == 2 and both.unmapped == frozenset()  # node A's GPUs 6 and 7
    labelled = holdings([page("node-a.prom")], run_id_template=None)
    assert sorted(labelled) == [FLYTE] and labelled.unmapped == {"vision-prod/train-resnet-0"}
    assert sorted(holdings([page("node-c-pod-labels.prom")], run_id_template=None)) == sorted([JOB_UID, JOBSET_UID])


def test_a_pod_that_is_a_run_of_its_own_is_named_by_its_own_uid() -> None:
    # The webhook gives a bare Pod, or a ReplicaSet's replica, its own UID as run id: without
    # pod_uid among the labels read, its GPUs were charged to {namespace}/{pod}, which no
    # decision names. A Job's pods still go to the Job (its label comes first).
    bare = (
        page("node-c-pod-labels.prom")
        .replace('batch_kubernetes_io_controller_uid="3c1f9a2e-7b4d-4e8a-9f60-1d2c3b4a5e6f",', "")
        .replace('controller_uid="3c1f9a2e-7b4d-4e8a-9f60-1d2c3b4a5e6f",', "")
    )
    held = holdings([bare])
    assert sorted(held) == sorted(["e4d3c2b1-a098-4f7e-8d6c-5b4a39281700", JOBSET_UID]) and len(held["e4d3c2b1-a098-4f7e-8d6c-5b4a39281700"].gpus) == 2
