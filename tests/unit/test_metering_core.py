"""The metering core without servers: validation, normalization, and each verdict of `assess`."""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta

import pytest

from budgetgate.core.metering import (
    DEFAULT_USAGE_TOLERANCE,
    Accepted,
    Capacity,
    Counters,
    Duplicate,
    MemoryUsage,
    RawSample,
    Rejected,
    Rejection,
    RunView,
    Sample,
    MAX_MILLI,
    Tolerance,
    UsageBound,
    assess,
    assess_batch,
    milli,
    reason_code,
    usage_event_id,
    validate,
)

NOW = datetime(2025, 3, 1, 12, 0, tzinfo=UTC)
SKEW = timedelta(minutes=5)


def raw(**overrides: object) -> RawSample:
    values: dict[str, object] = {"run_id": "run-1", "sample_id": "s1", "observed_at": NOW, "gpu_seconds": 3600.0, "node_seconds": 450.0, "exporter": "dcgm"}
    values.update(overrides)
    return RawSample(**values)  # type: ignore[arg-type]


def sample(sample_id: str, minute: int, gpu: int, node: int = 0, run_id: str = "run-1") -> Sample:
    return Sample(run_id, sample_id, NOW + timedelta(minutes=minute), Counters(gpu, node))


def test_one_gpu_hour_is_3_600_000() -> None:
    assert validate(raw(gpu_seconds=3600.0), now=NOW, max_skew=SKEW).counters.gpu == 3_600_000


@pytest.mark.parametrize(("seconds", "expected"), [(0.0, 0), (1.0005, 1001), (1.0004, 1000), (0.1, 100), (2.5e-4, 0), (5e-4, 1)])
def test_milli_rounds_half_up_from_the_shortest_decimal(seconds: float, expected: int) -> None:
    assert milli(seconds) == expected


@pytest.mark.parametrize(
    ("overrides", "reason", "field"),
    [
        ({"gpu_seconds": -1.0}, Rejection.NEGATIVE, "gpu_seconds"),
        ({"node_seconds": -0.5}, Rejection.NEGATIVE, "node_seconds"),
        ({"gpu_seconds": math.nan}, Rejection.NOT_FINITE, "gpu_seconds"),
        ({"node_seconds": math.inf}, Rejection.NOT_FINITE, "node_seconds"),
        ({"gpu_seconds": 2e15}, Rejection.OUT_OF_RANGE, "gpu_seconds"),
        # Accepted up to 1e15 s once; the ledger's integers (2**53 - 1 milli-seconds) end far below.
        ({"node_seconds": 1e14}, Rejection.OUT_OF_RANGE, "node_seconds"),
        ({"gpu_seconds": (2**53) / 1000}, Rejection.OUT_OF_RANGE, "gpu_seconds"),
        ({"run_id": ""}, Rejection.MISSING_FIELD, "run_id"),
        ({"run_id": "has space"}, Rejection.INVALID_FIELD, "run_id"),
        ({"run_id": "x" * 257}, Rejection.INVALID_FIELD, "run_id"),
        ({"sample_id": ""}, Rejection.MISSING_FIELD, "sample_id"),
        ({"sample_id": "a\x00b"}, Rejection.INVALID_FIELD, "sample_id"),
        ({"exporter": "e\nx"}, Rejection.INVALID_FIELD, "exporter"),
        ({"observed_at": None}, Rejection.MISSING_FIELD, "observed_at"),
        ({"observed_at": datetime(2025, 3, 1)}, Rejection.INVALID_FIELD, "observed_at"),
        ({"observed_at": NOW + SKEW + timedelta(seconds=1)}, Rejection.FUTURE_TIMESTAMP, "observed_at"),
    ],
)
def test_each_bad_field_is_named_with_its_reason(overrides: dict[str, object], reason: Rejection, field: str) -> None:
    with pytest.raises(Rejected) as caught:
        validate(raw(**overrides), now=NOW, max_skew=SKEW)
    assert [(p.reason, p.field) for p in caught.value.problems] == [(reason, field)]
    assert str(caught.value).startswith(f"{reason}: ")


def test_every_bad_field_of_one_sample_is_reported() -> None:
    with pytest.raises(Rejected) as caught:
        validate(raw(run_id="", gpu_seconds=-1.0, node_seconds=math.nan), now=NOW, max_skew=SKEW)
    assert {p.field for p in caught.value.problems} == {"run_id", "gpu_seconds", "node_seconds"}


def test_the_largest_counter_the_ledger_holds_is_accepted() -> None:
    # 9007199254740.991 s is no float; the float just below it is the largest counter there is.
    sample = validate(raw(gpu_seconds=9_007_199_254_740.99), now=NOW, max_skew=SKEW)
    assert sample.counters.gpu == 9_007_199_254_740_990 <= MAX_MILLI == 2**53 - 1
    with pytest.raises(Rejected, match="out_of_range"):
        validate(raw(gpu_seconds=9_007_199_254_740.992), now=NOW, max_skew=SKEW)


def test_a_sample_within_the_skew_is_accepted() -> None:
    assert validate(raw(observed_at=NOW + SKEW), now=NOW, max_skew=SKEW).observed_at == NOW + SKEW


def test_reason_code_reads_the_code_a_reason_starts_with() -> None:
    assert reason_code("counter_regression: went down") is Rejection.COUNTER_REGRESSION
    assert reason_code("not a valid budgetgate.v1.MeteringSample in protobuf JSON") is Rejection.UNPARSEABLE


def test_in_order_samples_raise_the_cumulative_by_their_delta() -> None:
    store = MemoryUsage()
    first = store.apply(sample("a", 0, 1000, 10))
    second = store.apply(sample("b", 1, 2500, 10))
    assert isinstance(first, Accepted) and isinstance(second, Accepted)
    assert (first.cumulative, first.delta, first.late) == (Counters(1000, 10), Counters(1000, 10), False)
    assert (second.cumulative, second.delta, second.late) == (Counters(2500, 10), Counters(1500, 0), False)


def test_a_late_sample_is_recorded_with_delta_zero_and_keeps_the_cumulative() -> None:
    store = MemoryUsage()
    store.apply(sample("a", 0, 1000))
    store.apply(sample("c", 10, 5000))
    late = store.apply(sample("b", 5, 3000))
    assert isinstance(late, Accepted)
    assert (late.cumulative, late.delta, late.late) == (Counters(5000, 0), Counters(0, 0), True)
    assert [k.sample_id for k in store.recorded("run-1")] == ["a", "b", "c"]
    assert store.usage_through("run-1", NOW + timedelta(minutes=7)) == Counters(3000, 0)


def test_the_same_sample_again_is_a_duplicate() -> None:
    store = MemoryUsage()
    store.apply(sample("a", 0, 1000))
    assert store.apply(sample("a", 0, 1000)) == Duplicate(sample("a", 0, 1000), of="a")


def test_a_resend_under_a_new_id_is_a_duplicate_of_the_recorded_sample() -> None:
    store = MemoryUsage()
    store.apply(sample("a", 0, 1000))
    outcome = store.apply(sample("a-resent", 0, 1000))
    assert isinstance(outcome, Duplicate) and outcome.of == "a"
    assert [k.sample_id for k in store.recorded("run-1")] == ["a"]


@pytest.mark.parametrize("other", [sample("a", 0, 999), sample("a", 1, 1000), sample("b", 0, 1001)])
def test_same_id_or_same_time_with_other_values_is_a_conflict(other: Sample) -> None:
    store = MemoryUsage()
    store.apply(sample("a", 0, 1000))
    with pytest.raises(Rejected) as caught:
        store.apply(other)
    assert caught.value.reason is Rejection.CONFLICT
    assert store.cumulative("run-1") == Counters(1000, 0)


def test_a_counter_going_down_at_a_later_time_is_a_regression() -> None:
    store = MemoryUsage()
    store.apply(sample("a", 0, 1000, 50))
    with pytest.raises(Rejected) as caught:
        store.apply(sample("b", 1, 1200, 40))
    assert caught.value.reason is Rejection.COUNTER_REGRESSION
    assert caught.value.problems[0].field == "node_seconds"
    assert store.cumulative("run-1") == Counters(1000, 50)


def test_a_late_sample_above_a_later_one_is_a_regression_too() -> None:
    store = MemoryUsage()
    store.apply(sample("a", 0, 1000))
    store.apply(sample("c", 10, 2000))
    with pytest.raises(Rejected) as caught:
        store.apply(sample("b", 5, 2500))
    assert caught.value.reason is Rejection.COUNTER_REGRESSION
    assert [k.sample_id for k in store.recorded("run-1")] == ["a", "c"]


def test_runs_are_independent() -> None:
    store = MemoryUsage()
    store.apply(sample("a", 0, 5000, run_id="r1"))
    assert isinstance(store.apply(sample("a", 1, 10, run_id="r2")), Accepted)
    assert store.cumulative("r2") == Counters(10, 0)


def test_usage_event_id_is_stable_and_distinct_per_sample() -> None:
    assert usage_event_id("r", "s") == usage_event_id("r", "s")
    assert len({usage_event_id("r", "s"), usage_event_id("r", "t"), usage_event_id("q", "s")}) == 3


# The usage bound: what a run can physically have used since its earliest decision.

SLACK = timedelta(seconds=300)
TOLERANCE = Tolerance.of(DEFAULT_USAGE_TOLERANCE, slack=SLACK)


def bounded(gpus: int | None = 4, nodes: int | None = 1, *, since: datetime = NOW, tolerance: Tolerance = TOLERANCE) -> MemoryUsage:
    return MemoryUsage({"run-1": UsageBound(Capacity(gpus, nodes, since), tolerance)})


def test_the_reported_sample_30_gpu_hours_of_a_4_gpu_run_30_s_after_its_decision_is_impossible() -> None:
    store = bounded(gpus=4, nodes=1, since=NOW - timedelta(seconds=30))
    reported = Sample("run-1", "s1", NOW, Counters(milli(30 * 3600.0), milli(30.0)))
    with pytest.raises(Rejected) as caught:
        store.apply(reported)
    [problem] = caught.value.problems
    assert (problem.reason, problem.field) == (Rejection.IMPOSSIBLE_USAGE, "gpu_seconds")
    # The figures: the sample's GPU-seconds, the run's GPUs, the time since its earliest decision, the bound.
    assert str(caught.value) == (
        "impossible_usage: run 'run-1' reported 108000 GPU-seconds in sample 's1' at 2025-03-01T12:00:00+00:00, 30s after its earliest "
        "decision (2025-03-01T11:59:30+00:00); with at most 4 GPUs it can have used at most 1386 GPU-seconds by then "
        "(4 GPUs x max(0, 30s + 300s clock slack) x (1 + 0.05 tolerance)), so the sample is not charged"
    )
    assert store.recorded("run-1") == [] and store.cumulative("run-1") == Counters()
    # What the run can have used by then is accepted: 4 GPUs x 30 s.
    assert isinstance(store.apply(Sample("run-1", "s2", NOW, Counters(120_000, 30_000))), Accepted)


def test_the_bound_is_exact_to_the_milli_second() -> None:
    bound = UsageBound(Capacity(3, 2, NOW), Tolerance.of(0.1, slack=timedelta(seconds=1)))
    at = NOW + timedelta(seconds=10, microseconds=1)
    # 3 GPUs x 11.000001 s x 1.1 = 36.3000033 GPU-seconds: 36300 milli-seconds, rounded down.
    assert bound.allowed(3, at) == 36_300
    assert bound.allows(Sample("run-1", "s", at, Counters(36_300, 0)))
    assert not bound.allows(Sample("run-1", "s", at, Counters(36_301, 0)))
    # Nodes by their own count: 2 x 11.000001 x 1.1 = 24.2000022.
    assert bound.allows(Sample("run-1", "s", at, Counters(0, 24_200)))
    assert [p.field for p in bound.problems(Sample("run-1", "s", at, Counters(36_301, 24_201)))] == ["gpu_seconds", "node_seconds"]


def test_node_seconds_are_bounded_by_nodes() -> None:
    store = bounded(gpus=8, nodes=2, since=NOW - timedelta(hours=1))
    with pytest.raises(Rejected) as caught:
        store.apply(sample("a", 0, 1000, node=milli(3 * 3600.0)))  # 3 node-hours in an hour on 2 nodes
    assert [(p.reason, p.field) for p in caught.value.problems] == [(Rejection.IMPOSSIBLE_USAGE, "node_seconds")]
    assert "with at most 2 nodes it can have used at most 8190 node-seconds" in str(caught.value)  # 2 x 3900 s x 1.05


def test_a_sample_before_the_decision_less_the_slack_can_have_used_nothing() -> None:
    store = bounded(since=NOW + timedelta(minutes=10))
    assert isinstance(store.apply(sample("zero", 0, 0, 0)), Accepted)  # nothing used yet is possible
    with pytest.raises(Rejected, match=r"impossible_usage: .* -540s after its earliest decision .* at most 0 GPU-seconds"):
        store.apply(sample("some", 1, 1))


def test_within_the_slack_before_the_decision_is_possible() -> None:
    # The exporter's clock may be behind admission's: 100 s before the decision is 200 s of slack.
    store = bounded(gpus=1, since=NOW + timedelta(seconds=100))
    assert isinstance(store.apply(sample("a", 0, 200_000)), Accepted)


def test_a_cpu_only_run_can_use_no_gpu() -> None:
    store = bounded(gpus=0, nodes=1, since=NOW - timedelta(days=1))
    assert isinstance(store.apply(sample("a", 0, 0, node=milli(3600.0))), Accepted)
    with pytest.raises(Rejected, match="impossible_usage"):
        store.apply(sample("b", 1, 1, node=milli(3600.0)))


def test_no_count_no_bound() -> None:
    # A run whose decisions name no GPU count (none of admission's) has no bound on GPU-seconds.
    store = bounded(gpus=None, nodes=1, since=NOW)
    assert isinstance(store.apply(sample("a", 0, milli(1e9))), Accepted)
    assert isinstance(MemoryUsage().apply(sample("a", 0, milli(1e9), node=milli(1e9))), Accepted)


def test_the_same_sample_again_is_still_a_duplicate_and_a_conflict_still_a_conflict() -> None:
    store = bounded(gpus=1, since=NOW - timedelta(hours=1))
    store.apply(sample("a", 0, 1000))
    assert isinstance(store.apply(sample("a", 0, 1000)), Duplicate)
    with pytest.raises(Rejected) as caught:
        store.apply(sample("a", 0, milli(1e6)))  # same id, other values: a conflict first
    assert caught.value.reason is Rejection.CONFLICT


def test_assess_batch_holds_the_bound_for_every_sample_of_the_batch() -> None:
    bound = UsageBound(Capacity(1, 1, NOW), TOLERANCE)
    view = RunView(bound=bound)
    ok, too_much, later = sample("a", 1, 60_000), sample("b", 2, milli(1e6)), sample("c", 3, 120_000)
    outcomes = assess_batch([(ok, view), (too_much, view), (later, view)])
    assert [type(o) for o in outcomes] == [Accepted, Rejected, Accepted]
    assert isinstance(outcomes[1], Rejected) and outcomes[1].reason is Rejection.IMPOSSIBLE_USAGE


def test_assess_without_a_bound_is_as_before() -> None:
    assert isinstance(assess(sample("a", 0, milli(1e9)), RunView()), Accepted)


@pytest.mark.parametrize("ratio", [-0.01, math.nan, math.inf])
def test_a_tolerance_is_a_finite_ratio_at_least_zero(ratio: float) -> None:
    with pytest.raises(ValueError, match="usage tolerance ratio"):
        Tolerance.of(ratio, slack=SLACK)


def test_a_tolerance_has_no_negative_slack() -> None:
    with pytest.raises(ValueError, match="cannot be negative"):
        Tolerance.of(0.05, slack=timedelta(seconds=-1))


def test_the_tolerance_ratio_is_kept_in_parts_per_million() -> None:
    assert Tolerance.of(0.05, slack=SLACK).ppm == 50_000
    assert Tolerance.of(0.0000004, slack=SLACK).ppm == 0
    assert str(Tolerance.of(1.25, slack=SLACK).ratio) == "1.25"
