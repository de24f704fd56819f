"""The metering core without servers: validation, normalization, and each verdict of `assess`."""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta

import pytest

from budgetgate.core.metering import (
    Accepted,
    Counters,
    Duplicate,
    MemoryUsage,
    RawSample,
    Rejected,
    Rejection,
    Sample,
    MAX_MILLI,
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
