"""Properties of metering normalization: duplicates, resends and reordering of a consistent
sample stream give the same usage as the clean stream, and no stream at all can make a run's
cumulative go down or its deltas disagree with it."""

from __future__ import annotations

import dataclasses
import math
import uuid
from collections import defaultdict
from datetime import UTC, datetime, timedelta
from decimal import ROUND_HALF_UP
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from budgetgate.core.metering import (
    EARLIEST,
    MAX_SECONDS,
    Accepted,
    Capacity,
    Counters,
    Duplicate,
    RawSample,
    Rejected,
    Rejection,
    Sample,
    Tolerance,
    UsageBound,
    _validate_each,
    assess_batch,
    milli,
    normalize,
    usage_event_id,
    validate,
)
from budgetgate.core.units import to_decimal
from budgetgate.services.metering_ingest.codecs import raw_sample
from budgetgate.v1.metering_pb2 import MeteringSample

pytestmark = pytest.mark.property

START = datetime(2025, 3, 1, tzinfo=UTC)


@st.composite
def clean_run(draw: st.DrawFn, run_id: str) -> list[Sample]:
    """One run's samples as a healthy exporter sends them: later times, counters never lower."""
    minutes = sorted(draw(st.sets(st.integers(0, 10_000), min_size=1, max_size=12)))
    gpu = node = 0
    samples = []
    for index, minute in enumerate(minutes):
        gpu += draw(st.integers(0, 10**9))
        node += draw(st.integers(0, 10**7))
        samples.append(Sample(run_id, f"{run_id}/s{index}", START + timedelta(minutes=minute), Counters(gpu, node)))
    return samples


@st.composite
def clean_stream(draw: st.DrawFn) -> list[Sample]:
    runs = draw(st.integers(1, 3))
    return [s for r in range(runs) for s in draw(clean_run(f"run-{r}"))]


@st.composite
def messy(draw: st.DrawFn, clean: list[Sample]) -> list[Sample]:
    """The clean stream as it arrives: some samples repeated, some resent under a new sample id,
    and everything in any order."""
    repeated = draw(st.lists(st.sampled_from(clean), max_size=len(clean) * 2))
    resent = [
        Sample(s.run_id, f"{s.sample_id}/resent{k}", s.observed_at, s.counters, s.exporter)
        for k, s in enumerate(draw(st.lists(st.sampled_from(clean), max_size=len(clean))))
    ]
    return draw(st.permutations(clean + repeated + resent))


def per_run(outcomes: list[Accepted | Duplicate | Rejected]) -> dict[str, list[Accepted]]:
    accepted: dict[str, list[Accepted]] = defaultdict(list)
    for outcome in outcomes:
        if isinstance(outcome, Accepted):
            accepted[outcome.sample.run_id].append(outcome)
    return accepted


def recorded(store, run_id: str) -> list[tuple[datetime, Counters]]:  # type: ignore[no-untyped-def]
    return [(k.observed_at, k.counters) for k in store.recorded(run_id)]


@settings(max_examples=300)
@given(data=st.data())
def test_duplicates_resends_and_reordering_give_the_clean_usage(data: st.DataObject) -> None:
    clean = data.draw(clean_stream())
    arriving = data.draw(messy(clean))
    clean_store, clean_outcomes = normalize(clean)
    store, outcomes = normalize(arriving)

    assert not [o for o in outcomes if isinstance(o, Rejected)]
    runs = {s.run_id for s in clean}
    for run_id in runs:
        last = max((s for s in clean if s.run_id == run_id), key=lambda s: s.observed_at)
        assert store.cumulative(run_id) == clean_store.cumulative(run_id) == last.counters
        assert recorded(store, run_id) == recorded(clean_store, run_id)
    # Every clean sample is recorded exactly once, whatever arrived how often.
    assert sum(isinstance(o, Accepted) for o in outcomes) == len(clean) == sum(isinstance(o, Accepted) for o in clean_outcomes)


@st.composite
def any_stream(draw: st.DrawFn) -> list[Sample]:
    """Samples with no promise at all: counters may go down, ids and times may collide."""
    sample = st.builds(
        Sample,
        run_id=st.sampled_from(["a", "b"]),
        sample_id=st.sampled_from([f"s{i}" for i in range(8)]),
        observed_at=st.integers(0, 20).map(lambda m: START + timedelta(minutes=m)),
        counters=st.builds(Counters, st.integers(0, 50), st.integers(0, 50)),
    )
    return draw(st.lists(sample, max_size=40))


@settings(max_examples=300)
@given(stream=any_stream())
def test_no_stream_lowers_a_cumulative_or_breaks_the_delta_sum(stream: list[Sample]) -> None:
    store, outcomes = normalize(stream)
    for run_id, accepted in per_run(outcomes).items():
        cumulatives = [a.cumulative for a in accepted]
        assert all(earlier.gpu <= later.gpu and earlier.node <= later.node for earlier, later in zip(cumulatives, cumulatives[1:], strict=False))
        total = Counters(sum(a.delta.gpu for a in accepted), sum(a.delta.node for a in accepted))
        assert total == cumulatives[-1] == store.cumulative(run_id)
        assert all(a.delta.gpu >= 0 and a.delta.node >= 0 for a in accepted)
        assert all(a.delta == Counters() for a in accepted if a.late)
        # A sample that was the newest when it came carries the new cumulative as its own
        # counters; a late one lies below it.
        assert all(a.cumulative == a.sample.counters for a in accepted if not a.late)
        assert all(a.cumulative.covers(a.sample.counters) for a in accepted)
        # What is recorded stays consistent: ordered by time, neither counter ever goes down.
        counters = [k.counters for k in store.recorded(run_id)]
        assert all(later.covers(earlier) for earlier, later in zip(counters, counters[1:], strict=False))
        assert store.cumulative(run_id) == counters[-1]


@settings(max_examples=300)
@given(data=st.data())
def test_a_batch_judged_together_gives_what_one_by_one_gives(data: st.DataObject) -> None:
    """assess_batch against the views recorded before the batch == applying the batch's samples
    one by one (whatever was recorded before, with duplicates, resends, reorderings and
    regressions inside the batch)."""
    stream = data.draw(messy(data.draw(clean_stream())))
    stream += data.draw(
        st.lists(
            st.builds(
                lambda s, g: Sample(s.run_id, f"{s.sample_id}/odd", s.observed_at + timedelta(seconds=30), Counters(g, 0)),
                st.sampled_from(stream),
                st.integers(0, 10**10),
            ),
            max_size=3,
        )
    )
    split = data.draw(st.integers(0, len(stream)))
    before, batch = stream[:split], stream[split:]
    one_by_one, _ = normalize(before)
    together, _ = normalize(before)
    views = [(sample, together.view(sample)) for sample in batch]
    expected = [_outcome(one_by_one, sample) for sample in batch]
    assert [_shape(o) for o in assess_batch(views)] == [_shape(o) for o in expected]


def _outcome(store, sample: Sample) -> Accepted | Duplicate | Rejected:  # type: ignore[no-untyped-def]
    try:
        return store.apply(sample)
    except Rejected as exc:
        return exc


def _shape(outcome: Accepted | Duplicate | Rejected) -> tuple[object, ...]:
    if isinstance(outcome, Rejected):
        return ("rejected", outcome.reason, str(outcome))
    if isinstance(outcome, Duplicate):
        return ("duplicate", outcome.sample, outcome.of)
    return ("accepted", outcome.sample, outcome.cumulative, outcome.delta, outcome.late)


@settings(max_examples=2000)
@given(
    st.one_of(
        st.floats(min_value=0, max_value=1e13),
        st.integers(0, 10**9).flatmap(lambda n: st.integers(0, 6).map(lambda d: n / 10**d)),
        st.decimals(min_value=0, max_value=10**9, places=4).map(float),
        st.integers(0, 2**31 * 2000).map(lambda n: n / 2000),  # ties (x.xxx5) and not, up to and past 2**30 s
        st.floats(min_value=2**30 - 1, max_value=2**30 + 1),  # where milli stops taking the arithmetic way
    )
)
def test_milli_reads_the_shortest_decimal_as_decimal_does(seconds: float) -> None:
    exact = int((to_decimal(seconds) * 1000).to_integral_value(rounding=ROUND_HALF_UP))
    assert milli(seconds) == exact


@settings(max_examples=1000)
@given(st.text(max_size=40), st.text(max_size=40))
def test_usage_event_id_is_the_uuid5_of_run_and_sample(run_id: str, sample_id: str) -> None:
    assert usage_event_id(run_id, sample_id) == str(uuid.uuid5(uuid.UUID("6c1f3c52-5f0e-4b8e-9a59-0d8f4e3c9b21"), f"usage\x00{run_id}\x00{sample_id}"))


@given(st.integers(-62_135_596_800, 253_402_300_799), st.integers(0, 999_999_999))
def test_observed_at_is_read_as_timestamp_to_datetime_reads_it(seconds: int, nanos: int) -> None:
    # Any valid Timestamp from 2000-01-01 on reads as ToDatetime reads it; before, it is refused.
    message = MeteringSample(run_id="r", sample_id="s")
    message.observed_at.seconds, message.observed_at.nanos = seconds, nanos
    if message.observed_at.ToDatetime(tzinfo=UTC) < EARLIEST:
        with pytest.raises(Rejected, match="observed_at is not a time from 2000-01-01"):
            raw_sample(message)
    else:
        assert raw_sample(message).observed_at == message.observed_at.ToDatetime(tzinfo=UTC)


# validate's one expression reads ids with string methods where _validate_each uses regexes:
# texts where the two could part (non-ASCII, printable or not; a trailing newline; a lone
# space; C1 controls, which the regexes let through; lengths at and past the limits).
_TRICKY = ["", "r", "run-1", "a b", " ", "x" * 253, "x" * 254, "x" * 256, "x" * 257, "é", "s\x00", "\x7f", "r\n", "\n", "r\x85", "r\u2028", "r\xa0", "r\ud800"]
_TEXT = st.one_of(st.sampled_from(_TRICKY), st.text(max_size=12), st.text(st.characters(max_codepoint=0x2030), max_size=12))
_SECONDS = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, -0.0, -1.0, 480.0, 0.0005, MAX_SECONDS, MAX_SECONDS - 0.001, float(2**53 - 64) / 1000, 1e15, 1e16]),
    st.integers(0, 10**13).map(float),
)
_NOW = datetime(2025, 3, 1, 12, tzinfo=UTC)


@settings(max_examples=2000)
@given(
    st.builds(
        RawSample,
        run_id=_TEXT,
        sample_id=_TEXT,
        observed_at=st.one_of(
            st.none(),
            st.datetimes(),  # no time zone
            st.integers(-600, 600).map(lambda s: _NOW + timedelta(seconds=s)),
            st.datetimes(timezones=st.just(UTC)),
        ),
        gpu_seconds=_SECONDS,
        node_seconds=_SECONDS,
        exporter=_TEXT,
    )
)
def test_validate_decides_as_every_check_on_its_own_does(raw: RawSample) -> None:
    """validate's one-expression way for the usual sample gives what checking each field on
    its own gives (the same sample, or the same problems), for any sample."""
    got = _validated(lambda: validate(raw, now=_NOW, max_skew=timedelta(minutes=5)))
    assert got == _validated(lambda: _validate_each(raw, now=_NOW, max_skew=timedelta(minutes=5)))


def test_a_validated_sample_is_the_dataclass_built_from_its_fields() -> None:
    """validate's way for the usual sample sets the fields in the instances' dicts: the objects
    are equal, hashed, shown, replaced, ordered and frozen as those the dataclasses build."""
    got = validate(RawSample("run-1", "s-1", _NOW, 480.0, 60.5, "dcgm"), now=_NOW, max_skew=timedelta(minutes=5))
    built = Sample("run-1", "s-1", _NOW, Counters(480_000, 60_500), "dcgm")
    assert type(got) is Sample and type(got.counters) is Counters
    assert (got, hash(got), repr(got)) == (built, hash(built), repr(built))
    assert dataclasses.replace(got, sample_id="s-2") == dataclasses.replace(built, sample_id="s-2")
    assert got.counters < Counters(480_000, 60_501) and got.counters.covers(Counters(1, 1))
    with pytest.raises(dataclasses.FrozenInstanceError):
        got.run_id = "run-2"  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        got.counters.gpu = 0  # type: ignore[misc]


@pytest.mark.parametrize("field", ["run_id", "sample_id", "exporter"])
@pytest.mark.parametrize("text", _TRICKY)
def test_validate_reads_each_tricky_id_as_every_check_on_its_own_does(field: str, text: str) -> None:
    """The same, for each of those texts in each id, every other field valid (so the text alone
    decides which way the sample takes)."""
    raw = RawSample("run-1", "s-1", _NOW, 480.0, 60.0, "dcgm")._replace(**{field: text})
    got = _validated(lambda: validate(raw, now=_NOW, max_skew=timedelta(minutes=5)))
    assert got == _validated(lambda: _validate_each(raw, now=_NOW, max_skew=timedelta(minutes=5)))


@settings(max_examples=1000)
@given(run_id=_TEXT, sample_id=_TEXT, exporter=_TEXT)
def test_validate_reads_ids_as_every_check_on_its_own_does(run_id: str, sample_id: str, exporter: str) -> None:
    """The same, for any ids, every other field valid."""
    raw = RawSample(run_id, sample_id, _NOW, 480.0, 60.0, exporter)
    got = _validated(lambda: validate(raw, now=_NOW, max_skew=timedelta(minutes=5)))
    assert got == _validated(lambda: _validate_each(raw, now=_NOW, max_skew=timedelta(minutes=5)))


def _validated(check):  # type: ignore[no-untyped-def]
    try:
        return check()
    except Rejected as exc:
        return [(p.reason, p.field, p.message) for p in exc.problems]


# The usage bound: no sample above what its run can have used is ever accepted, and samples
# within it are judged as if there were no bound.

_TOLERANCES = st.builds(
    Tolerance,
    ppm=st.one_of(st.just(0), st.just(50_000), st.integers(0, 2_000_000)),
    slack=st.one_of(st.just(timedelta(0)), st.just(timedelta(seconds=300)), st.integers(0, 10**9).map(lambda us: timedelta(microseconds=us))),
)
_CAPACITIES = st.builds(
    Capacity,
    gpus=st.one_of(st.none(), st.integers(0, 16), st.integers(0, 1_000_000)),
    nodes=st.one_of(st.none(), st.integers(1, 4), st.integers(1, 100_000)),
    since=st.integers(-30 * 60 * 10**6, 30 * 60 * 10**6).map(lambda us: START + timedelta(microseconds=us)),
)


@settings(max_examples=2000)
@given(capacity=_CAPACITIES, tolerance=_TOLERANCES, after=st.integers(-(10**12), 10**13))
def test_the_bound_is_units_times_the_time_since_the_decision_with_the_tolerance_rounded_down(capacity: Capacity, tolerance: Tolerance, after: int) -> None:
    bound = UsageBound(capacity, tolerance)
    at = capacity.since + timedelta(microseconds=after)
    seconds = max(Fraction(after, 10**6) + Fraction(tolerance.slack // timedelta(microseconds=1), 10**6), Fraction(0))
    for units in (capacity.gpus, capacity.nodes):
        expected = None if units is None else math.floor(units * seconds * 1000 * (1 + Fraction(tolerance.ppm, 10**6)))
        assert bound.allowed(units, at) == expected


@st.composite
def bounded_stream(draw: st.DrawFn) -> tuple[list[Sample], dict[str, UsageBound]]:
    """Samples of runs with a bound (or none), their counters anywhere from nothing to far above
    it, many just at it, with duplicates, resends and regressions among them."""
    bounds = {run: UsageBound(draw(_CAPACITIES), draw(_TOLERANCES)) for run in draw(st.sets(st.sampled_from(["a", "b", "c"]), min_size=1))}
    runs = sorted(bounds) + ["free"]  # "free": a run without a bound

    @st.composite
    def one(draw: st.DrawFn) -> Sample:
        run = draw(st.sampled_from(runs))
        at = START + timedelta(seconds=draw(st.integers(-3600, 4 * 3600)), microseconds=draw(st.integers(0, 999_999)))
        bound = bounds.get(run)
        counters = []
        for units in (bound.capacity.gpus, bound.capacity.nodes) if bound else (None, None):
            most = bound.allowed(units, at) if bound else None
            near = st.integers(max(most - 2, 0), most + 2) if most is not None else st.integers(0, 10**9)
            counters.append(draw(st.one_of(near, st.integers(0, 10**12), st.just(0))))
        return Sample(run, f"s{draw(st.integers(0, 12))}", at, Counters(*counters))

    samples = draw(st.lists(one(), max_size=40))
    samples += draw(st.lists(st.sampled_from(samples), max_size=10)) if samples else []
    return draw(st.permutations(samples)), bounds


@settings(max_examples=300)
@given(stream=bounded_stream())
def test_no_sample_above_its_runs_bound_is_ever_accepted(stream: tuple[list[Sample], dict[str, UsageBound]]) -> None:
    samples, bounds = stream
    store, outcomes = normalize(samples, bounds)
    for sample, outcome in zip(samples, outcomes, strict=True):
        bound = bounds.get(sample.run_id)
        if bound is not None and not bound.allows(sample):
            assert not isinstance(outcome, Accepted)
        if isinstance(outcome, Rejected) and outcome.reason is Rejection.IMPOSSIBLE_USAGE:
            assert bound is not None and not bound.allows(sample)
            assert {p.field for p in outcome.problems} == {p.field for p in bound.problems(sample)}
    for run_id, bound in bounds.items():
        assert all(bound.allows(Sample(run_id, k.sample_id, k.observed_at, k.counters)) for k in store.recorded(run_id))


@settings(max_examples=300)
@given(stream=bounded_stream())
def test_samples_within_the_bound_are_judged_as_without_one(stream: tuple[list[Sample], dict[str, UsageBound]]) -> None:
    """A sample above the bound changes nothing: the stream gives what it gives without them and
    without any bound, sample for sample, and the same usage."""
    samples, bounds = stream
    store, outcomes = normalize(samples, bounds)
    within = [s for s in samples if s.run_id not in bounds or bounds[s.run_id].allows(s)]
    free_store, free_outcomes = normalize(within)
    assert [_shape(o) for o, s in zip(outcomes, samples, strict=True) if s in within] == [_shape(o) for o in free_outcomes]
    for run_id in {s.run_id for s in samples}:
        assert recorded(store, run_id) == recorded(free_store, run_id)
        assert store.cumulative(run_id) == free_store.cumulative(run_id)


@settings(max_examples=200)
@given(stream=bounded_stream(), data=st.data())
def test_a_bounded_batch_judged_together_gives_what_one_by_one_gives(stream: tuple[list[Sample], dict[str, UsageBound]], data: st.DataObject) -> None:
    samples, bounds = stream
    split = data.draw(st.integers(0, len(samples)))
    before, batch = samples[:split], samples[split:]
    one_by_one, _ = normalize(before, bounds)
    together, _ = normalize(before, bounds)
    expected = [_outcome(one_by_one, sample) for sample in batch]
    assert [_shape(o) for o in assess_batch((sample, together.view(sample)) for sample in batch)] == [_shape(o) for o in expected]
