"""Metering samples to usage: validation, normalization and deduplication, without I/O.

An exporter reports, per run, the GPU-seconds and node-seconds used since the run started, as
of a time (`observed_at`). Counters are cumulative, so a lost or repeated sample loses nothing:
the next one carries the total. What one sample means, given what is known about its run:

- **Normalized** amounts are integers of milli-unit-seconds: seconds × 1000, rounded half up
  (one GPU-hour = 3,600,000).
- **Consistent**: the accepted samples of a run, ordered by observed_at, never lower either
  counter. A sample that would break this is rejected as a `counter_regression`, whichever
  side of a recorded sample it falls on: what is recorded stays, it may have been announced.
- **Duplicates** change nothing: the same sample id again with the same values, or another
  sample id with the same observed_at and the same counters (a resend under a new id). The
  same sample id, or the same observed_at, with other values is a `conflict`.
- **Cumulative** of a run is its high-water mark: the largest counters of any accepted sample,
  which (the samples being consistent) are those of its latest. It never goes down.
- **Delta** of an accepted sample is how much it raised the cumulative (after − before).
  The deltas of a run sum to its cumulative, whatever order they are added in.
- **Late** samples (observed_at before the run's latest) fall between two known samples, so
  their delta is 0 and the cumulative stays. They are recorded and announced like any other,
  with their own counters beside the cumulative, so usage can be attributed to windows by
  observed_at (see `MemoryUsage.usage_through`). A reader of usage.records.v1 thus sees per run
  the cumulative never falling, deltas summing to it, and each record's own counters a true
  point of the run's usage at its observed_at.
- **Possible**: a run cannot have used more than its GPUs (nodes) × the time since it could have
  started. It starts after its decision, so as of observed_at it used at most `gpus` ×
  (observed_at − its earliest decided_at), `gpus` being the most any decision of the run (any
  attempt) asked for; a sample above that, plus a `Tolerance` (a ratio, and a fixed slack for
  the clocks of exporter and admission), is rejected as `impossible_usage` and never charged
  (`UsageBound`). Without a known capacity (no decision names a count) there is no bound.
"""

from __future__ import annotations

import bisect
import hashlib
import math
import re
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from decimal import ROUND_HALF_UP, Decimal
from enum import StrEnum
from typing import NamedTuple

from budgetgate.core.units import to_decimal

MILLI_PER_SECOND = 1000
# The largest amount the ledger holds in one figure, in its unit (milli-unit-seconds): Postgres
# bigint and Redis HINCRBY are int64, and below 2**53 a figure is also exact as a Lua number and
# in JSON. The same bound as the ledger core's MAX_AMOUNT. A counter above it (285,000 GPU-years
# in one run) is a unit mistake, and would jam every consumer after this one: rejected at ingest.
MAX_MILLI = 2**53 - 1
MAX_SECONDS = MAX_MILLI / MILLI_PER_SECOND
# Below this many seconds milli() cannot pass MAX_MILLI, whatever the rounding: no need to check.
_SAFE_SECONDS = (MAX_MILLI - 64) / MILLI_PER_SECOND
# Whole floats below this are printed digit for digit by repr (from 1e16 on, with an exponent).
_WHOLE_EXACT = 1e15
# milli's arithmetic way: below this many seconds, unless within this much of a tie.
_FAST_BELOW = float(2**30)
_TIE_MARGIN = 0.001
MAX_ID_CHARS = 256
# Metering as a max-register: of a run's samples consumed in one poll, those of one quarter hour
# (UTC) are one point, the latest of them (metering_place_batch, migration 0046). Every instant
# usage is attributed at falls on a quarter hour: window boundaries (calendar windows in any
# time zone of today, whose offsets are whole quarter hours; rolling windows' hour buckets) and
# rate cards' effective_from (`on_fold_boundary`, checked when a bundle is loaded).
FOLD = timedelta(minutes=15)
MAX_EXPORTER_CHARS = 253
# The earliest time budgetgate takes for an observation or a lifecycle event: no fleet it
# meters reported before it, and a zero value (the Unix epoch, Go's zero time 0001-01-01) would
# otherwise be charged to a window decades old, or overflow the window arithmetic.
EARLIEST = datetime(2000, 1, 1, tzinfo=UTC)
# Run ids are those admission accepts, else the run could never be known (`is_run_id`).
_RUN_ID = re.compile(rf"[\x21-\x7e]{{1,{MAX_ID_CHARS}}}")
# Postgres text cannot hold NUL, and control characters in an id are a bug upstream.
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
# Namespace of the event ids derived from (run id, sample id), so that reprocessing a sample
# yields the same event id and consumers of usage.records.v1 deduplicate it.
_EVENT_NAMESPACE = uuid.UUID("6c1f3c52-5f0e-4b8e-9a59-0d8f4e3c9b21")
_USAGE_PREFIX = _EVENT_NAMESPACE.bytes + b"usage\x00"
# A hex digit of a uuid5's 17th place: its top two bits set to the variant's 10.
_VARIANT_DIGIT = {digit: "89ab"[int(digit, 16) & 0b11] for digit in "0123456789abcdef"}


class Rejection(StrEnum):
    """Why a sample is refused; the code leads its dead-letter reason and labels the metric."""

    UNPARSEABLE = "unparseable"
    MISSING_FIELD = "missing_field"
    INVALID_FIELD = "invalid_field"
    NEGATIVE = "negative"
    NOT_FINITE = "not_finite"
    OUT_OF_RANGE = "out_of_range"
    FUTURE_TIMESTAMP = "future_timestamp"
    COUNTER_REGRESSION = "counter_regression"
    CONFLICT = "conflict"
    UNKNOWN_RUN = "unknown_run"
    # Kept pending for a sender limited to namespaces or tenants, and its run is not within them.
    OUT_OF_SCOPE = "out_of_scope"
    # More GPU- or node-seconds than the run's GPUs (nodes) could have used since its decision.
    IMPOSSIBLE_USAGE = "impossible_usage"


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a sample: the reason, the field it is about (if one), and what."""

    reason: Rejection
    field: str | None
    message: str

    def __str__(self) -> str:
        return f"{self.reason}: {self.message}"


class Rejected(ValueError):
    """A sample that will never be usable; `problems` lists every reason, the first one leads."""

    def __init__(self, *problems: Problem) -> None:
        assert problems, "a rejection needs a reason"
        super().__init__("; ".join(str(p) for p in problems))
        self.problems = problems

    @property
    def reason(self) -> Rejection:
        return self.problems[0].reason


def reason_code(text: str) -> Rejection:
    """The Rejection a dead-letter reason starts with; anything else could not be parsed."""
    try:
        return Rejection(text.split(":", 1)[0].strip())
    except ValueError:
        return Rejection.UNPARSEABLE


class RawSample(NamedTuple):
    """A sample as the exporter sent it, before any check (a tuple: one is made per sample)."""

    run_id: str
    sample_id: str
    observed_at: datetime | None
    gpu_seconds: float
    node_seconds: float
    exporter: str = ""


@dataclass(frozen=True, order=True)
class Counters:
    """Cumulative usage of a run in milli-unit-seconds."""

    gpu: int = 0
    node: int = 0

    def covers(self, other: Counters) -> bool:
        """Both counters at least those of `other`."""
        return self.gpu >= other.gpu and self.node >= other.node

    def high_water(self, other: Counters) -> Counters:
        if self.covers(other):
            return self
        return Counters(self.gpu if self.gpu > other.gpu else other.gpu, self.node if self.node > other.node else other.node)

    def minus(self, other: Counters) -> Counters:
        return Counters(self.gpu - other.gpu, self.node - other.node)


@dataclass(frozen=True)
class Sample:
    """A valid sample, its counters normalized to milli-unit-seconds."""

    run_id: str
    sample_id: str
    observed_at: datetime
    counters: Counters
    exporter: str = ""


def milli(seconds: float) -> int:
    """Seconds as integer milli-unit-seconds, rounded half up from the shortest decimal of
    `seconds` (1.0005 s → 1001)."""
    # A whole number of seconds below 10**15 is its own shortest decimal (exporters that count
    # whole seconds): no text needed.
    if type(seconds) is float and seconds.is_integer() and -_WHOLE_EXACT < seconds < _WHOLE_EXACT:
        return int(seconds) * MILLI_PER_SECOND
    # Below 2**30 s the float's own product is within 0.0008 of the shortest decimal's times
    # 1000, plus a half (the decimal is within half a unit in the last place of the float, the
    # product and the sum round by half a unit each: three units in the last place of 2**40 at
    # most). So unless that sum lies within 0.001 of a whole number, its floor is the decimal's
    # rounded half up. The rest (a tie such as 1.0005, about one sample in 500) reads the digits.
    if type(seconds) is float and 0.0 < seconds < _FAST_BELOW:
        shifted = seconds * MILLI_PER_SECOND + 0.5
        whole_milli = int(shifted)
        if _TIE_MARGIN < shifted - whole_milli < 1.0 - _TIE_MARGIN:
            return whole_milli
    # The same digits Decimal would use (repr is the shortest decimal), read without Decimal:
    # this runs twice per sample on the ingest path.
    text = repr(seconds)
    whole, dot, fraction = text.partition(".")
    if "e" in text or "n" in text or not dot:  # exponent, inf or nan: the exact way
        return int((to_decimal(seconds) * MILLI_PER_SECOND).to_integral_value(rounding=ROUND_HALF_UP))
    negative = whole.startswith("-")
    amount = int(whole.lstrip("-") + fraction[:3].ljust(3, "0")) + (len(fraction) > 3 and fraction[3] >= "5")
    return -amount if negative else amount


def validate(raw: RawSample, *, now: datetime, max_skew: timedelta) -> Sample:
    """The normalized sample, or Rejected naming every bad field.

    `now` and `max_skew` bound observed_at: a sample read further in the future than the
    clocks of exporter and service can disagree is a clock or unit bug, not usage.
    """
    run_id, sample_id, at, gpu, node, exporter = raw
    # The usual sample passes every check below in one expression (NaN fails each comparison);
    # anything else takes the way that names every problem. String methods stand in for the
    # regexes (a third of validate's instructions): printable ASCII without a space is
    # [\x21-\x7e], and a printable string holds no control character. What they turn away
    # (non-ASCII text, C1 controls, which _CONTROL lets through) is judged by the regexes
    # themselves.
    if (
        at is not None
        and at.tzinfo is not None
        and EARLIEST <= at <= now + max_skew
        and 0.0 <= gpu <= _SAFE_SECONDS
        and 0.0 <= node <= _SAFE_SECONDS
        and 0 < len(run_id) <= MAX_ID_CHARS
        and run_id.isascii()
        and run_id.isprintable()
        and " " not in run_id
        and sample_id
        and len(sample_id) <= MAX_ID_CHARS
        and len(exporter) <= MAX_EXPORTER_CHARS
        and sample_id.isprintable()
        and exporter.isprintable()
    ):
        return _valid_sample(run_id, sample_id, at, milli(gpu), milli(node), exporter)
    return _validate_each(raw, now=now, max_skew=max_skew)


_new = object.__new__


def _valid_sample(run_id: str, sample_id: str, at: datetime, gpu: int, node: int, exporter: str) -> Sample:
    """Sample(run_id, sample_id, at, Counters(gpu, node), exporter), its fields set in the
    instances' dicts: a frozen dataclass's __init__ sets each through object.__setattr__, 0.9 µs
    for the two per sample on the ingest path against 0.36 here (timeit). The same objects: equal,
    hashed and compared alike, `dataclasses.replace` and the freeze work on them as on any."""
    counters = _new(Counters)
    fields = counters.__dict__
    fields["gpu"] = gpu
    fields["node"] = node
    sample = _new(Sample)
    fields = sample.__dict__
    fields["run_id"] = run_id
    fields["sample_id"] = sample_id
    fields["observed_at"] = at
    fields["counters"] = counters
    fields["exporter"] = exporter
    return sample


def _validate_each(raw: RawSample, *, now: datetime, max_skew: timedelta) -> Sample:
    """`validate`, every check on its own, each problem named."""
    problems = [*_id_problems(raw), *_counter_problems("gpu_seconds", raw.gpu_seconds), *_counter_problems("node_seconds", raw.node_seconds)]
    if raw.observed_at is None:
        problems.append(Problem(Rejection.MISSING_FIELD, "observed_at", "observed_at is missing"))
    elif raw.observed_at.tzinfo is None:
        problems.append(Problem(Rejection.INVALID_FIELD, "observed_at", "observed_at has no time zone"))
    elif raw.observed_at < EARLIEST:
        problems.append(
            Problem(
                Rejection.INVALID_FIELD,
                "observed_at",
                f"observed_at {raw.observed_at.isoformat()} is before {EARLIEST.date().isoformat()}: no real sample's time",
            )
        )
    elif raw.observed_at > now + max_skew:
        problems.append(
            Problem(
                Rejection.FUTURE_TIMESTAMP,
                "observed_at",
                f"observed_at {raw.observed_at.isoformat()} is more than {max_skew.total_seconds():g}s after now ({now.isoformat()})",
            )
        )
    if problems:
        raise Rejected(*problems)
    assert raw.observed_at is not None
    return Sample(
        run_id=raw.run_id,
        sample_id=raw.sample_id,
        observed_at=raw.observed_at,
        counters=Counters(milli(raw.gpu_seconds), milli(raw.node_seconds)),
        exporter=raw.exporter,
    )


def is_run_id(text: str) -> bool:
    """Whether `text` can be a run's id: admission's rule (contracts.admission.RunId), 1 to
    MAX_ID_CHARS printable ASCII characters without spaces, the whole text (no newline after it), which
    metering, the lifecycle rules and the DCGM adapter all apply."""
    return _RUN_ID.fullmatch(text) is not None


def _id_problems(raw: RawSample) -> list[Problem]:
    problems = []
    if not raw.run_id:
        problems.append(Problem(Rejection.MISSING_FIELD, "run_id", "run_id is missing"))
    elif not is_run_id(raw.run_id):
        problems.append(Problem(Rejection.INVALID_FIELD, "run_id", f"run_id must be 1-{MAX_ID_CHARS} printable ASCII characters without spaces"))
    if not raw.sample_id:
        problems.append(Problem(Rejection.MISSING_FIELD, "sample_id", "sample_id is missing"))
    elif len(raw.sample_id) > MAX_ID_CHARS or _CONTROL.search(raw.sample_id):
        problems.append(Problem(Rejection.INVALID_FIELD, "sample_id", f"sample_id must be at most {MAX_ID_CHARS} characters without control characters"))
    if len(raw.exporter) > MAX_EXPORTER_CHARS or _CONTROL.search(raw.exporter):
        problems.append(Problem(Rejection.INVALID_FIELD, "exporter", f"exporter must be at most {MAX_EXPORTER_CHARS} characters without control characters"))
    return problems


def _counter_problems(name: str, value: float) -> list[Problem]:
    if not math.isfinite(value):
        return [Problem(Rejection.NOT_FINITE, name, f"{name} is {value!r}, not a finite number")]
    if value < 0:
        return [Problem(Rejection.NEGATIVE, name, f"{name} is {value!r}; cumulative usage cannot be negative")]
    # The float product is within a few units of the exact one: only near the bound is milli() needed.
    if value > MAX_SECONDS or (value * MILLI_PER_SECOND > MAX_MILLI - 64 and milli(value) > MAX_MILLI):
        return [Problem(Rejection.OUT_OF_RANGE, name, f"{name} is {value!r}, above the {MAX_MILLI} milli-seconds the ledger's integers hold")]
    return []


# The default of BUDGETGATE_METERING_USAGE_TOLERANCE: a sample may report up to this ratio more
# than its run's GPUs (nodes) × the time since its earliest decision (plus the clock slack).
DEFAULT_USAGE_TOLERANCE = 0.05
_PPM = 1_000_000
_MICROS = timedelta(microseconds=1)


@dataclass(frozen=True)
class Capacity:
    """What a run could have used, as its decisions say: the most GPUs and nodes any decision of
    the run (any attempt, any outcome) asked for, None when one of them names no count (then
    that counter has no bound), and the earliest decided_at (the run cannot have started before)."""

    gpus: int | None
    nodes: int | None
    since: datetime


@dataclass(frozen=True)
class Tolerance:
    """How far above the physical bound a sample may go: `ppm` parts per million of it, and
    `slack` more time (the clocks of the exporter, which stamps observed_at, and of admission,
    which stamps decided_at, may disagree by as much as the service allows a sample from the
    future: BUDGETGATE_MAX_FUTURE_SKEW_SECONDS)."""

    ppm: int
    slack: timedelta

    def __post_init__(self) -> None:
        if self.ppm < 0 or self.slack < timedelta(0):
            raise ValueError(f"a usage tolerance cannot be negative (ratio {self.ppm / _PPM}, slack {self.slack.total_seconds()}s)")

    @classmethod
    def of(cls, ratio: float, *, slack: timedelta) -> Tolerance:
        """The tolerance of `ratio` (0.05: 5 % above the bound) and `slack`."""
        if not math.isfinite(ratio) or ratio < 0:
            raise ValueError(f"a usage tolerance ratio must be a finite number at least 0, not {ratio!r}")
        return cls(round(ratio * _PPM), slack)

    @property
    def ratio(self) -> Decimal:
        return Decimal(self.ppm).scaleb(-6).normalize()


@dataclass(frozen=True)
class UsageBound:
    """The most a run can have used by a time, in milli-unit-seconds: per unit of capacity
    (a GPU, a node) the time since its earliest decision, plus the slack, plus the ratio:
    units × max(0, observed_at − since + slack) × (1 + ratio), rounded down. Exact integer
    arithmetic on microseconds, as metering_place_batch's comparison in Postgres (numeric)."""

    capacity: Capacity
    tolerance: Tolerance

    def span_micros(self, at: datetime) -> int:
        """Microseconds the run may have been running by `at`, the slack included (at least 0)."""
        return max((at - self.capacity.since) // _MICROS + self.tolerance.slack // _MICROS, 0)

    def allowed(self, units: int | None, at: datetime) -> int | None:
        """The most milli-unit-seconds `units` (GPUs or nodes) can have used by `at` (None: no bound)."""
        if units is None:
            return None
        # milli-unit-seconds = units x micros / 1000; x (1e6 + ppm) / 1e6.
        return units * self.span_micros(at) * (_PPM + self.tolerance.ppm) // (1000 * _PPM)

    def allows(self, sample: Sample) -> bool:
        """Whether `sample` is within the bound, both counters."""
        gpu, node = self.allowed(self.capacity.gpus, sample.observed_at), self.allowed(self.capacity.nodes, sample.observed_at)
        return (gpu is None or sample.counters.gpu <= gpu) and (node is None or sample.counters.node <= node)

    def problems(self, sample: Sample) -> list[Problem]:
        """Why `sample` reports more than its run can have used, per counter ([] when it does not)."""
        found = []
        for field_name, unit, used, units in (
            ("gpu_seconds", "GPU", sample.counters.gpu, self.capacity.gpus),
            ("node_seconds", "node", sample.counters.node, self.capacity.nodes),
        ):
            most = self.allowed(units, sample.observed_at)
            if most is not None and used > most:
                found.append(Problem(Rejection.IMPOSSIBLE_USAGE, field_name, self._message(sample, unit, used, units, most)))
        return found

    def _message(self, sample: Sample, unit: str, used: int, units: int | None, most: int) -> str:
        since = self.capacity.since
        elapsed = Decimal((sample.observed_at - since) // _MICROS).scaleb(-6).normalize()
        slack = Decimal(self.tolerance.slack // _MICROS).scaleb(-6).normalize()
        return (
            f"run {sample.run_id!r} reported {_seconds(used)} {unit}-seconds in sample {sample.sample_id!r} at {sample.observed_at.isoformat()}, "
            f"{elapsed:f}s after its earliest decision ({since.isoformat()}); with at most {units} {unit}s it can have used at most "
            f"{_seconds(most)} {unit}-seconds by then ({units} {unit}s x max(0, {elapsed:f}s + {slack:f}s clock slack) x (1 + {self.tolerance.ratio:f} "
            f"tolerance)), so the sample is not charged"
        )


def _seconds(milli_seconds: int) -> str:
    """Milli-unit-seconds as seconds, digit for digit (108000000 -> '108000', 1386 -> '1.386')."""
    return f"{Decimal(milli_seconds).scaleb(-3).normalize():f}"


@dataclass(frozen=True)
class Known:
    """An accepted sample of a run, as recorded."""

    sample_id: str
    observed_at: datetime
    counters: Counters


@dataclass(frozen=True)
class RunView:
    """What `assess` needs to know about a sample's run (a store answers it in one look-up)."""

    cumulative: Counters = Counters()
    latest: datetime | None = None
    same_id: Known | None = None  # a recorded sample with the same sample id
    same_time: Known | None = None  # a recorded sample with the same observed_at
    before: Known | None = None  # the latest recorded sample observed before it
    after: Known | None = None  # the earliest recorded sample observed after it
    bound: UsageBound | None = None  # the most the run can have used by a time (None: no bound known)


@dataclass(frozen=True)
class Accepted:
    """A sample to record: the run's cumulative after it, and how much it raised it."""

    sample: Sample
    cumulative: Counters
    delta: Counters
    late: bool  # observed before the run's latest sample: recorded, delta 0


@dataclass(frozen=True)
class Duplicate:
    """A sample already known (`of` is the recorded sample id): nothing to do."""

    sample: Sample
    of: str


def assess(sample: Sample, run: RunView) -> Accepted | Duplicate:
    """What `sample` does to its run; raises Rejected for a conflict or a counter regression."""
    if run.same_id is not None:
        if run.same_id.observed_at == sample.observed_at and run.same_id.counters == sample.counters:
            return Duplicate(sample, of=run.same_id.sample_id)
        raise Rejected(
            Problem(
                Rejection.CONFLICT,
                "sample_id",
                f"sample {sample.sample_id!r} of run {sample.run_id!r} was recorded before with other values ({_describe(run.same_id)})",
            )
        )
    if run.same_time is not None:
        if run.same_time.counters == sample.counters:
            return Duplicate(sample, of=run.same_time.sample_id)
        raise Rejected(
            Problem(
                Rejection.CONFLICT,
                "observed_at",
                f"run {sample.run_id!r} already has sample {run.same_time.sample_id!r} at {sample.observed_at.isoformat()} with "
                f"other counters ({_describe(run.same_time)})",
            )
        )
    if run.bound is not None and (impossible := run.bound.problems(sample)):
        raise Rejected(*impossible)
    if run.before is not None and not sample.counters.covers(run.before.counters):
        raise Rejected(
            Problem(
                Rejection.COUNTER_REGRESSION,
                _lower_field(sample.counters, run.before.counters),
                f"counters of run {sample.run_id!r} went down: {_describe(run.before)}, then {_describe_sample(sample)}",
            )
        )
    if run.after is not None and not run.after.counters.covers(sample.counters):
        raise Rejected(
            Problem(
                Rejection.COUNTER_REGRESSION,
                _lower_field(run.after.counters, sample.counters),
                f"counters of run {sample.run_id!r} would go down: {_describe_sample(sample)}, then {_describe(run.after)} (recorded earlier)",
            )
        )
    cumulative = run.cumulative.high_water(sample.counters)
    late = run.latest is not None and sample.observed_at < run.latest
    return Accepted(sample, cumulative=cumulative, delta=cumulative.minus(run.cumulative), late=late)


def assess_batch(batch: Iterable[tuple[Sample, RunView]]) -> list[Accepted | Duplicate | Rejected]:
    """`assess` for samples taken together, in order: each comes with the view of its run as
    recorded before the batch, and the samples accepted earlier in the batch count as recorded
    (two samples of one run in one batch judge each other). Gives what assessing and recording
    them one by one would; a rejection is returned, not raised, and the batch goes on."""
    runs: dict[str, _Batched] = {}
    outcomes: list[Accepted | Duplicate | Rejected] = []
    for sample, recorded in batch:
        run = runs.setdefault(sample.run_id, _Batched())
        try:
            outcome = assess(sample, run.view(sample, recorded))
        except Rejected as exc:
            outcomes.append(exc)
            continue
        if isinstance(outcome, Accepted):
            run.add(outcome)
        outcomes.append(outcome)
    return outcomes


@dataclass
class _Batched:
    """The samples of one run accepted so far in a batch."""

    samples: list[Known] = field(default_factory=list)  # sorted by observed_at
    times: list[datetime] = field(default_factory=list)  # their observed_at, for bisect
    by_id: dict[str, Known] = field(default_factory=dict)
    cumulative: Counters = Counters()

    def view(self, sample: Sample, recorded: RunView) -> RunView:
        """`recorded` with the batch's accepted samples added."""
        if not self.samples:
            return recorded
        times = self.times
        at = bisect.bisect_left(times, sample.observed_at)
        same_time = self.samples[at] if at < len(times) and times[at] == sample.observed_at else None
        after = at + 1 if same_time is not None else at
        return RunView(
            cumulative=recorded.cumulative.high_water(self.cumulative),
            latest=times[-1] if recorded.latest is None else max(recorded.latest, times[-1]),
            same_id=recorded.same_id or self.by_id.get(sample.sample_id),
            same_time=recorded.same_time or same_time,
            before=_nearest(recorded.before, self.samples[at - 1] if at > 0 else None, latest=True),
            after=_nearest(recorded.after, self.samples[after] if after < len(times) else None, latest=False),
            bound=recorded.bound,
        )

    def add(self, accepted: Accepted) -> None:
        sample = accepted.sample
        known = Known(sample.sample_id, sample.observed_at, sample.counters)
        at = bisect.bisect_right(self.times, sample.observed_at)
        self.samples.insert(at, known)
        self.times.insert(at, sample.observed_at)
        self.by_id[sample.sample_id] = known
        self.cumulative = self.cumulative.high_water(sample.counters)


def _nearest(a: Known | None, b: Known | None, *, latest: bool) -> Known | None:
    """Of two neighbours on one side of a sample, the one closer to it."""
    if a is None or b is None:
        return a or b
    return max(a, b, key=lambda k: k.observed_at) if latest else min(a, b, key=lambda k: k.observed_at)


def _lower_field(later: Counters, earlier: Counters) -> str:
    return "gpu_seconds" if later.gpu < earlier.gpu else "node_seconds"


def pending_conflict(kept: Sample, sample: Sample) -> Problem | None:
    """Why `sample` contradicts `kept`, the sample of its id kept pending before (its run has no
    decision yet), if it does; the same point again is a resend, kept once."""
    if (kept.observed_at, kept.counters) == (sample.observed_at, sample.counters):
        return None
    return Problem(
        Rejection.CONFLICT, "sample_id", f"sample {sample.sample_id!r} of run {sample.run_id!r} is kept pending with other values ({_describe_sample(kept)})"
    )


def _describe(known: Known) -> str:
    return f"{known.sample_id!r} at {known.observed_at.isoformat()}: gpu {known.counters.gpu}, node {known.counters.node} milli-seconds"


def _describe_sample(sample: Sample) -> str:
    return _describe(Known(sample.sample_id, sample.observed_at, sample.counters))


def fold_start(at: datetime) -> datetime:
    """The start of the quarter hour (UTC, `FOLD`) holding `at`, in UTC: the span whose samples
    of a run in one poll are one point (metering_place_batch's date_bin, from the same origin)."""
    return (at - (at - EARLIEST) % FOLD).astimezone(UTC)


def on_fold_boundary(at: datetime) -> bool:
    """Whether `at` starts a quarter hour (UTC), where usage is known exactly however many of a
    run's samples a poll made one point (`FOLD`)."""
    return fold_start(at) == at


def usage_event_id(run_id: str, sample_id: str) -> str:
    """The event id of the usage record of a sample: the same every time it is processed
    (uuid5 in `_EVENT_NAMESPACE`, built without uuid.UUID: this runs once per sample)."""
    text = hashlib.sha1(_USAGE_PREFIX + f"{run_id}\x00{sample_id}".encode()).hexdigest()
    # The first 16 bytes of the digest, with the version (5) and the RFC 4122 variant set in
    # place: the version is the 13th hex digit, the variant the top two bits of the 17th.
    return f"{text[:8]}-{text[8:12]}-5{text[13:16]}-{_VARIANT_DIGIT[text[16]]}{text[17:20]}-{text[20:32]}"


def sample_event_id(run_id: str, sample_id: str) -> str:
    """An event id for a sample that came without one (over HTTP)."""
    return str(uuid.uuid5(_EVENT_NAMESPACE, f"sample\x00{run_id}\x00{sample_id}"))


@dataclass
class _Run:
    samples: list[Known] = field(default_factory=list)  # sorted by observed_at
    cumulative: Counters = Counters()


class MemoryUsage:
    """The usage store in memory: the reference the Postgres store must agree with, and what
    tests of the normalization use without a server. `bounds`: the UsageBound of each run that
    has one (its decisions' capacity, with the tolerance)."""

    def __init__(self, bounds: Mapping[str, UsageBound] | None = None) -> None:
        self._runs: dict[str, _Run] = {}
        self._bounds = dict(bounds or {})

    def view(self, sample: Sample) -> RunView:
        """The RunView of `sample`'s run."""
        run = self._runs.get(sample.run_id, _Run())
        times = [k.observed_at for k in run.samples]
        at = bisect.bisect_left(times, sample.observed_at)
        same_time = run.samples[at] if at < len(times) and times[at] == sample.observed_at else None
        after_index = at + 1 if same_time is not None else at
        return RunView(
            cumulative=run.cumulative,
            latest=times[-1] if times else None,
            same_id=next((k for k in run.samples if k.sample_id == sample.sample_id), None),
            same_time=same_time,
            before=run.samples[at - 1] if at > 0 else None,
            after=run.samples[after_index] if after_index < len(times) else None,
            bound=self._bounds.get(sample.run_id),
        )

    def apply(self, sample: Sample) -> Accepted | Duplicate:
        """Assess `sample` and record it if accepted; raises Rejected like `assess`."""
        outcome = assess(sample, self.view(sample))
        if isinstance(outcome, Accepted):
            run = self._runs.setdefault(sample.run_id, _Run())
            bisect.insort(run.samples, Known(sample.sample_id, sample.observed_at, sample.counters), key=lambda k: k.observed_at)
            run.cumulative = outcome.cumulative
        return outcome

    def set_bound(self, run_id: str, bound: UsageBound | None) -> None:
        """Judge the run's samples from now on by `bound` (a later decision asked for more, say)."""
        if bound is None:
            self._bounds.pop(run_id, None)
        else:
            self._bounds[run_id] = bound

    def cumulative(self, run_id: str) -> Counters:
        """The run's high-water mark (zero for a run without samples)."""
        run = self._runs.get(run_id)
        return run.cumulative if run else Counters()

    def recorded(self, run_id: str) -> list[Known]:
        """The run's accepted samples, by observed_at."""
        run = self._runs.get(run_id)
        return list(run.samples) if run else []

    def usage_through(self, run_id: str, at: datetime) -> Counters:
        """The run's usage as of `at`: the counters of its latest sample observed at or before it."""
        known = [k for k in self.recorded(run_id) if k.observed_at <= at]
        return known[-1].counters if known else Counters()


def normalize(samples: Iterable[Sample], bounds: Mapping[str, UsageBound] | None = None) -> tuple[MemoryUsage, list[Accepted | Duplicate | Rejected]]:
    """Apply `samples` in order to an empty store (with the runs' `bounds`): the store, and each
    sample's outcome."""
    store = MemoryUsage(bounds)
    outcomes: list[Accepted | Duplicate | Rejected] = []
    for sample in samples:
        try:
            outcomes.append(store.apply(sample))
        except Rejected as exc:
            outcomes.append(exc)
    return store, outcomes
