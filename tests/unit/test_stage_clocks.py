"""Where a submission's time goes (services/admission/stages.py), without servers: the stages
follow each other and add up to the submission's time in the service, the sampler times one
submission per interval, the histogram is exported on /metrics by stage, and the benchmark reads
each stage's count and percentiles back from it (budgetgate.benchmark.breakdown)."""

from __future__ import annotations

import pytest

from budgetgate.benchmark import breakdown
from budgetgate.runtime.telemetry import setup_telemetry
from budgetgate.services.admission.metrics import Metrics
from budgetgate.services.admission.stages import STAGES, BatchClock, StageClock, StageSampler


def _timed(received: float) -> StageClock:
    """A submission received at `received` (s) whose batch started 3 ms later."""
    batch = BatchClock(started=received + 0.003, ended=received + 0.010, postgres_read=0.002, redis=0.001, postgres_write=0.0035)
    return StageClock(received, read=received + 0.0005, planned=received + 0.0007, batch=batch)


def test_the_stages_follow_each_other_and_add_up_to_the_time_in_the_service() -> None:
    clock = _timed(100.0)

    stages = clock.stages(answered=100.0105)

    assert stages is not None and tuple(stages) == STAGES
    assert stages == pytest.approx(
        {
            "body_and_auth": 0.0005,
            "plan": 0.0002,
            "batch_wait": 0.0023,
            "postgres_read": 0.002,
            "redis": 0.001,
            "decide": 0.0005,  # the batch's 7 ms less its 6.5 ms on Postgres and Redis
            "postgres_write": 0.0035,  # the write and its commit: one statement
            "answer": 0.0005,
        }
    )
    assert sum(stages.values()) == pytest.approx(0.0105)


def test_a_submission_that_never_reached_a_batch_has_no_stages() -> None:
    assert StageClock(1.0, read=1.1).stages(answered=1.2) is None  # refused before it was planned
    assert StageClock(1.0, read=1.1, planned=1.2).stages(answered=1.3) is None  # its batch failed before it ended


def test_the_sampler_times_one_submission_per_interval() -> None:
    every = StageSampler(0.0)
    assert all(every.clock(t) is not None for t in (1.0, 1.0, 1.0))
    sampler = StageSampler(0.5)
    timed = [t for t in (10.0, 10.1, 10.4, 10.5, 10.6, 12.0) if sampler.clock(t) is not None]
    assert timed == [10.0, 10.5, 12.0]


def test_the_stages_are_exported_by_stage_and_read_back_by_the_benchmark() -> None:
    telemetry = setup_telemetry(service_name="stages-test", otlp_endpoint=None)
    metrics = Metrics.create(telemetry.meter("budgetgate.admission"), lambda: None, stage_interval=0.0)
    before = breakdown.parse(telemetry.metrics_text().decode())
    for i in range(100):
        clock = metrics.stage_clock(float(i))
        assert clock is not None
        filled = _timed(float(i))
        clock.read, clock.planned, clock.batch = filled.read, filled.planned, filled.batch
        metrics.observe_stages(clock, answered=i + 0.0105)
    metrics.observe_stages(StageClock(500.0, read=500.1), answered=500.2)  # never decided: not counted

    text = telemetry.metrics_text().decode()
    [counted] = [line for line in text.splitlines() if line.startswith("budgetgate_admission_stage_seconds_count") and 'stage="postgres_read"' in line]
    assert counted.endswith(" 100.0")
    found = {s.name: s for s in breakdown.between(before, breakdown.parse(text))}
    assert tuple(found) == STAGES
    assert {s.count for s in found.values()} == {100}
    read = found["postgres_read"]  # every one 2 ms: in the bucket (1.5 ms, 2 ms]
    assert read.mean_ms == pytest.approx(2.0) and 1.5 < read.p50_ms <= 2.0 and 1.5 < read.p99_ms <= 2.0
    assert found["batch_wait"].mean_ms == pytest.approx(2.3)


def test_percentiles_are_read_off_the_buckets_as_prometheus_does() -> None:
    # 50 submissions under 1 ms, 50 between 1 and 2 ms, none above.
    cumulative = [(0.001, 50.0), (0.002, 100.0), (float("inf"), 100.0)]
    before = ({"plan": [(0.001, 10.0), (0.002, 10.0), (float("inf"), 10.0)]}, {"plan": 0.005})
    after = ({"plan": [(b, c + 10.0) for b, c in cumulative]}, {"plan": 0.005 + 0.1})

    [plan] = breakdown.between(before, after)

    assert plan.count == 100 and plan.mean_ms == pytest.approx(1.0)
    assert plan.p50_ms == pytest.approx(1.0)  # the 50th is the last of the first bucket
    assert plan.p99_ms == pytest.approx(1.98)  # 49/50 of the way through the second
    above = breakdown.between(({}, {}), ({"answer": [(0.001, 0.0), (float("inf"), 4.0)]}, {"answer": 1.0}))
    assert above[0].p99_ms == pytest.approx(1.0)  # past the highest bound: that bound, never a guess
