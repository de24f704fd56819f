"""DCGM exporter scrapes to cumulative GPU- and node-seconds per run (pure, recorded pages)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from budgetgate.platforms.dcgm import Holdings, Meter, holdings, sample_id

PAGES = Path(__file__).resolve().parents[1] / "fixtures" / "dcgm"
T0 = datetime(2026, 7, 14, 9, 0, tzinfo=UTC)
FLYTE = "flyte/vision/exec-7f3a/n0"


def page(name: str) -> str:
    return (PAGES / name).read_text()


def scrape(**pages: str) -> dict[str, Holdings]:
    """What each exporter's page (exporter → recorded page) holds."""
    return {exporter: holdings([page(name)]) for exporter, name in pages.items()}


def test_allocated_gpus_by_run_across_nodes() -> None:
    held = holdings([page("node-a.prom"), page("node-b.prom")])
    assert sorted(held) == [FLYTE, "vision-prod/train-resnet-0"]  # idle GPUs charge nobody
    assert len(held["vision-prod/train-resnet-0"].gpus) == 4 and held["vision-prod/train-resnet-0"].hosts == {"gpu-node-a"}
    # The run-id label wins over namespace/pod, so one run's pods on two nodes are one run.
    assert len(held[FLYTE].gpus) == 4 and held[FLYTE].hosts == {"gpu-node-a", "gpu-node-b"}


def test_run_id_template_and_label_are_configurable() -> None:
    held = holdings([page("node-a.prom")], run_id_label="no-such-label", run_id_template="k8s/{namespace}/{pod}")
    assert sorted(held) == ["k8s/flyte-vision/exec-7f3a-n0-worker-0", "k8s/vision-prod/train-resnet-0"]


def test_not_prometheus_text_is_an_error() -> None:
    with pytest.raises(ValueError):
        holdings(['DCGM_FI_DEV_GPU_UTIL{gpu="0" 5\n'])


def test_gpu_seconds_are_allocated_time_by_the_trapezoid_rule() -> None:
    meter = Meter()
    both = scrape(a="node-a.prom", b="node-b.prom")
    first = meter.observe(T0, both)
    assert {u.run_id: u.gpu_seconds for u in first} == {FLYTE: 0.0, "vision-prod/train-resnet-0": 0.0}
    second = {u.run_id: u for u in meter.observe(T0 + timedelta(seconds=15), both)}
    assert second[FLYTE].gpu_seconds == 60.0 and second[FLYTE].node_seconds == 30.0  # 4 GPUs, 2 nodes × 15 s
    ended = {u.run_id: u for u in meter.observe(T0 + timedelta(seconds=30), scrape(a="node-a-train-ended.prom", b="node-b.prom"))}
    # Held at one end of the interval only: half of it.
    assert ended["vision-prod/train-resnet-0"].gpu_seconds == 60.0 + 30.0
    assert ended[FLYTE].gpu_seconds == 120.0
    later = {u.run_id for u in meter.observe(T0 + timedelta(seconds=45), scrape(a="node-a-train-ended.prom", b="node-b.prom"))}
    assert later == {FLYTE}  # reported once more after it ended, then no longer


def test_a_gap_longer_than_max_gap_is_not_counted_and_state_survives_a_restart() -> None:
    meter = Meter(max_gap=timedelta(minutes=1))
    held = scrape(b="node-b.prom")
    meter.observe(T0, held)
    meter.observe(T0 + timedelta(seconds=10), held)
    restarted = Meter.restored(meter.state(), max_gap=timedelta(minutes=1))
    assert restarted.observe(T0 + timedelta(seconds=20), held)[0].gpu_seconds == 40.0
    assert restarted.observe(T0 + timedelta(minutes=30), held)[0].gpu_seconds == 40.0  # the exporter was unreachable
    with pytest.raises(ValueError):
        restarted.observe(T0, held)


def test_sample_ids_repeat_for_the_same_scrape() -> None:
    assert sample_id("dcgm", T0) == sample_id("dcgm", T0) != sample_id("dcgm", T0 + timedelta(milliseconds=1))


def test_labelled_only_skips_pods_without_the_run_id_label() -> None:
    assert sorted(holdings([page("node-a.prom")], run_id_template=None)) == [FLYTE]
