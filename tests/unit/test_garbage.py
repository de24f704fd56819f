"""The garbage collector's policy for service processes: thresholds from the settings, passes and
pause seconds counted per generation, served on /metrics and read back by the benchmarks."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
from pydantic import ValidationError

from budgetgate.runtime import garbage
from budgetgate.benchmark import cpu, pauses
from budgetgate.runtime.settings import ServingSettings
from budgetgate.runtime.telemetry import setup_telemetry


@pytest.fixture
def collector_restored() -> Iterator[None]:
    """The test process's collector as it was: thresholds, and nothing left frozen."""
    before = gc.get_threshold()
    try:
        yield
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)


def test_each_pass_is_counted_in_its_generation_with_its_seconds() -> None:
    counted = garbage.collections()
    passes, seconds = list(counted.passes), list(counted.seconds)

    gc.collect(0)
    gc.collect(2)

    assert counted.passes[0] >= passes[0] + 1
    assert counted.passes[2] >= passes[2] + 1
    assert counted.seconds[2] > seconds[2]


def test_counting_is_installed_once_per_process() -> None:
    first = garbage.collections()
    assert garbage.collections() is first
    assert sum(callback is first for callback in gc.callbacks) == 1


def test_settle_freezes_what_exists_and_sets_the_thresholds(collector_restored: None) -> None:
    gc.unfreeze()
    assert gc.get_freeze_count() == 0
    garbage.settle((12_345, 6, 7))

    assert gc.get_threshold() == (12_345, 6, 7)
    assert gc.get_freeze_count() > 0


def test_the_thresholds_are_set_as_a_json_list(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("BUDGETGATE_GC_THRESHOLDS", raising=False)
    assert ServingSettings().gc_thresholds == garbage.THRESHOLDS
    monkeypatch.setenv("BUDGETGATE_GC_THRESHOLDS", "[700, 10, 10]")
    assert ServingSettings().gc_thresholds == (700, 10, 10)

    monkeypatch.setenv("BUDGETGATE_GC_THRESHOLDS", "[-1, 10, 10]")
    with pytest.raises(ValidationError, match="gc_thresholds"):
        ServingSettings()
    monkeypatch.setenv("BUDGETGATE_GC_THRESHOLDS", "[700, 10]")
    with pytest.raises(ValidationError, match="gc_thresholds"):
        ServingSettings()


def test_metrics_serve_the_collections_and_the_benchmarks_read_them_back() -> None:
    telemetry = setup_telemetry(service_name="test-service", otlp_endpoint=None)
    try:
        gc.collect(1)
        counted = garbage.collections()
        read = pauses.parse(telemetry.metrics_text().decode(), cpu_seconds=10.0)
    finally:
        telemetry.shutdown()

    # Read after the passes above, so at least what the process had counted by then.
    assert read.passes[1] >= 1 and read.passes[1] <= counted.passes[1]
    assert 0 < sum(read.seconds) <= sum(counted.seconds)
    assert read.share == pytest.approx(sum(read.seconds) / 10.0)
    assert read.as_json()["passes"]["middle"] == read.passes[1]
    assert "passes (young" in read.line() and "of its 10.00 s CPU" in read.line()


def test_the_collector_figures_are_held_against_the_process_cpu_read_as_the_cpu_meter_reads_it() -> None:
    spent = cpu.process_seconds(os.getpid())
    assert spent is not None and spent > 0
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    assert cpu.process_seconds(gone.pid) is None  # ended: nothing to read, not zero


def test_a_service_without_the_figures_is_told_apart() -> None:
    with pytest.raises(ValueError, match="no garbage collector figures"):
        pauses.parse("# HELP up up\n# TYPE up gauge\nup 1.0\n", cpu_seconds=1.0)
