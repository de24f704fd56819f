"""Reconciliation rules: from what a run reserved, its lifecycle events and its usage samples to
what it is charged on each ledger key. Pure: the reconciler loads a run's facts, calls `settle`,
and applies the difference from what the ledger already holds for the run.

The facts are sets: `settle` sorts them itself, so duplicated, reordered and late events and
samples give the same answer as the clean sequence. The rules:

- **Running.** A run's charge on each budget is max(reservation, metered so far): metered usage
  is consumed (on the window it happened in), and the reservation shrinks by it but never below
  zero. A run metered past its reservation is over-running and eats into the remaining budget.
- **Ended** (COMPLETED, FAILED, CANCELLED). The reservation is replaced by the metered actual.
  Metering is complete when a sample was observed no earlier than `metering_tolerance` before
  the run stopped running, and no sample metering-ingest has accepted for the run is still on its
  way to the reconciler (`RunFacts.metered_through`: accepted usage not yet folded would be
  charged after the rest of the reservation was given back, and that room given to another run
  meanwhile: the fault campaign's seed 20261131). Until then the reservation stays as the upper bound; after
  `provisional_grace` the running time no sample covers is charged provisionally as bound GPUs
  (nodes) × that time, and replaced by the samples when they arrive.
- **Windows.** A sample's increment over the previous sample is usage at the sample's time, and
  lands on the ledger key of the window containing that time (a run crossing a month boundary
  is split by its sample timestamps). Wall time and provisional usage, known as intervals, are
  split at hour boundaries. Rolling windows keep usage in hour buckets, so it can age out.
- **Wall time** is the time between STARTED (or READMITTED) and EVICTED or the end, summed over
  every admission of the workload.
- **Never started.** A run not running (never started, or evicted and not re-admitted) for
  `start_deadline` gives its reservation back; later usage is still charged as consumed.
- **Provisional.** A run admitted provisionally (by the Kubernetes validating webhook, before the
  API server stored the object: a later webhook, a ResourceQuota or a name already taken may still
  refuse it) gives its reservation back `provisional_hold` after its admission unless the platform
  confirmed the object: STORED (the object exists), any start, eviction or end, or a usage sample. Confirmed, it
  follows the start deadline as any run.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from budgetgate.core.escrow import LEASE_SEPARATOR, lease_key, lease_of
from budgetgate.core.evaluation import ledger_key
from budgetgate.core.policy import BudgetPolicy, PolicyBundle
from budgetgate.core.units import MILLI_PER_HOUR, Unit, cost_micros
from budgetgate.core.windows import Window, window_at

STARTED, COMPLETED, FAILED, CANCELLED, EVICTED, READMITTED = "STARTED", "COMPLETED", "FAILED", "CANCELLED", "EVICTED", "READMITTED"
# The platform stored the run's object: confirms a provisional hold, changes nothing else.
STORED = "STORED"
LIFECYCLE_KINDS = (STARTED, COMPLETED, FAILED, CANCELLED, EVICTED, READMITTED, STORED)
TERMINAL = frozenset({COMPLETED, FAILED, CANCELLED})
# What shows the run's object exists (confirming a provisional hold): any fact the platform reports.
CONFIRMING = frozenset({STORED, STARTED, READMITTED, EVICTED}) | TERMINAL
NOT_STARTED = "not running within the start deadline"
# Several transitions at one instant happen in this order: a run started and evicted in the
# same second ran for zero seconds, rather than never stopping.
_SAME_INSTANT = {STARTED: 0, EVICTED: 1, READMITTED: 2, COMPLETED: 3, FAILED: 3, CANCELLED: 3}
# Calendar windows need no time buckets: the ledger key already names the window.
CALENDAR_BUCKET = datetime(1970, 1, 1, tzinfo=UTC)
_HOUR = timedelta(hours=1)


@dataclass(frozen=True, slots=True)
class LifecycleFact:
    event_id: str
    kind: str
    at: datetime
    gpus: int = 0  # bound resources, when the platform reported them (STARTED, READMITTED)
    nodes: int = 0


@dataclass(frozen=True, slots=True)
class UsageFact:
    """A usage record: cumulative GPU and node milli-hours of a run as of `observed_at`."""

    sample_id: str
    observed_at: datetime
    gpu: int
    node: int


@dataclass(frozen=True, slots=True)
class Reservation:
    """What admission reserved for the run on one ledger key, under one policy."""

    policy: BudgetPolicy
    ledger_key: str
    admitted: int


@dataclass(frozen=True, slots=True)
class RunFacts:
    run_id: str
    admitted_at: datetime
    reservations: tuple[Reservation, ...]
    gpus: int  # as requested; STARTED may report what was really bound
    nodes: int
    projected_gpu: int
    flavor: str | None = None
    region: str | None = None
    events: frozenset[LifecycleFact] = frozenset()
    samples: frozenset[UsageFact] = frozenset()
    released: bool = False  # the reservation was already given back (never started in time)
    # Admitted afresh after a refused attempt (DELAY, DENY): a terminal event dated before this
    # (the admitting decision's time) and before any start ended that attempt, cancelled while it
    # waited, not this one.
    ends_after: datetime | None = None
    # Admitted provisionally (the Kubernetes validating webhook): given back `provisional_hold`
    # after admission unless a fact confirms the object was stored.
    provisional: bool = False
    # The latest observation of a sample metering-ingest has accepted for the run, as Postgres
    # knows it (its usage may not have reached the reconciler yet); None: none known.
    metered_through: datetime | None = None


@dataclass(frozen=True, slots=True)
class Rules:
    start_deadline: timedelta = timedelta(hours=1)
    provisional_grace: timedelta = timedelta(minutes=10)
    metering_tolerance: timedelta = timedelta(seconds=60)
    # How often a running run's wall time is brought up to date when a wall-hours budget applies.
    wall_refresh: timedelta = timedelta(minutes=1)
    # A provisional admission whose object no fact confirms is given back this long after it.
    provisional_hold: timedelta = timedelta(minutes=2)


@dataclass(frozen=True, slots=True)
class Interval:
    """One stretch of running, [start, end); end None while it still runs."""

    start: datetime
    end: datetime | None
    gpus: int
    nodes: int


@dataclass(frozen=True, slots=True)
class Timeline:
    intervals: tuple[Interval, ...]
    phase: str  # admitted (never started) | running | evicted | ended
    ended_at: datetime | None = None
    final_state: str | None = None
    last_change: datetime | None = None


@dataclass(frozen=True, slots=True)
class Settlement:
    """What a run is charged now: held reservation per key, consumption per key and bucket."""

    held: Mapping[str, int]
    consumed: Mapping[tuple[str, datetime], int]
    windows: Mapping[str, tuple[BudgetPolicy, Window]]
    phase: str
    final: bool
    provisional: bool
    released: bool
    over_running: bool
    wall: int  # wall milli-hours, across all admissions
    metered_gpu: int
    actual_gpu: int  # metered, plus the provisional part when there is one
    projected_gpu: int
    ended_at: datetime | None
    final_state: str | None
    review_at: datetime | None  # when time alone changes this settlement next; None = never
    used: Mapping[str, int] = field(default_factory=dict)  # per policy id, in its unit
    # Why the run's holds were given back now (None: they were not, or were before).
    release_reason: str | None = None
    # A provisional admission still waiting for its object to be confirmed.
    unconfirmed: bool = False

    @property
    def error_gpu(self) -> int:
        """Reservation-to-actual error: actual − projected, in GPU milli-hours."""
        return self.actual_gpu - self.projected_gpu

    def consumed_by_key(self) -> dict[str, int]:
        totals: dict[str, int] = defaultdict(int)
        for (key, _bucket), amount in self.consumed.items():
            totals[key] += amount
        return dict(totals)


def timeline(events: Iterable[LifecycleFact], *, gpus: int, nodes: int, ends_after: datetime | None = None) -> Timeline:
    """The run's stretches of running, from its lifecycle events in time order.

    A start while running and an eviction while not running are repeats and change nothing;
    the first terminal event ends the run and anything later is ignored. A terminal event dated
    before `ends_after` (see RunFacts) while the run has not started ended a refused attempt of
    the run, which never starts, and is ignored too; once the run started, an end is its own,
    whatever its date (a platform's clock a little behind budgetgate's, or times in seconds).
    """
    running: tuple[datetime, int, int] | None = None
    intervals: list[Interval] = []
    started = False
    last_change: datetime | None = None
    for event in sorted(set(events), key=lambda e: (e.at, _SAME_INSTANT.get(e.kind, 9), e.event_id)):
        if event.kind in (STARTED, READMITTED):
            gpus, nodes = event.gpus or gpus, event.nodes or nodes
            if running is None:
                running, started, last_change = (event.at, gpus, nodes), True, event.at
        elif event.kind == EVICTED:
            if running is not None:
                intervals.append(Interval(running[0], event.at, running[1], running[2]))
                running, last_change = None, event.at
        elif event.kind in TERMINAL:
            if ends_after is not None and event.at < ends_after and not started:
                continue
            if running is not None:
                intervals.append(Interval(running[0], event.at, running[1], running[2]))
            return Timeline(tuple(intervals), "ended", event.at, event.kind, event.at)
    if running is not None:
        intervals.append(Interval(running[0], None, running[1], running[2]))
        return Timeline(tuple(intervals), "running", last_change=last_change)
    return Timeline(tuple(intervals), "evicted" if started else "admitted", last_change=last_change)


def increments(samples: Iterable[UsageFact]) -> list[tuple[datetime, int, int]]:
    """Usage between consecutive samples, at the later sample's time: (at, gpu, node).

    Counters are cumulative, so a sample lower than an earlier one (a reset or a resend of an
    old reading) adds nothing; a sample id seen twice counts once.
    """
    by_id: dict[str, UsageFact] = {}
    for sample in samples:
        seen = by_id.get(sample.sample_id)
        if seen is None or (sample.gpu, sample.node, sample.observed_at) > (seen.gpu, seen.node, seen.observed_at):
            by_id[sample.sample_id] = sample
    gpu_high = node_high = 0
    result = []
    for sample in sorted(by_id.values(), key=lambda s: (s.observed_at, s.sample_id)):
        gpu, node = max(gpu_high, sample.gpu), max(node_high, sample.node)
        if gpu > gpu_high or node > node_high:
            result.append((sample.observed_at, gpu - gpu_high, node - node_high))
        gpu_high, node_high = gpu, node
    return result


def hour_pieces(start: datetime, end: datetime) -> list[tuple[datetime, int]]:
    """[start, end) cut at UTC hour boundaries: (piece start, milliseconds in it)."""
    pieces = []
    at = start
    while at < end:
        boundary = at.astimezone(UTC).replace(minute=0, second=0, microsecond=0) + _HOUR
        stop = min(boundary, end)
        pieces.append((at, _epoch_ms(stop) - _epoch_ms(at)))
        at = stop
    return pieces


def settle(facts: RunFacts, *, bundle: PolicyBundle | None, rules: Rules, now: datetime) -> Settlement:
    """The run's charges now, by the rules in this module's docstring."""
    line = timeline(facts.events, gpus=facts.gpus, nodes=facts.nodes, ends_after=facts.ends_after)
    metered = increments(facts.samples)
    covered = max((s.observed_at for s in facts.samples), default=None)
    st = standing(
        line,
        covered,
        admitted_at=facts.admitted_at,
        released=facts.released,
        rules=rules,
        now=now,
        unconfirmed=unconfirmed(facts, covered),
        metered_through=facts.metered_through,
    )
    wall, tail, final, provisional, released, idle_since = st.wall, st.tail, st.final, st.provisional, st.released, st.idle_since

    held: dict[str, int] = {}
    consumed: dict[tuple[str, datetime], int] = defaultdict(int)
    windows: dict[str, tuple[BudgetPolicy, Window]] = {}
    used: dict[str, int] = {}
    for reservation in facts.reservations:
        policy = reservation.policy
        total = 0
        for at, amount in _usage(policy.limit.unit, metered, wall, tail, facts, bundle):
            if amount <= 0:
                continue
            window = window_at(policy.window, at)
            key = ledger_key(policy, window)
            windows.setdefault(key, (policy, window))
            bucket = at.astimezone(UTC).replace(minute=0, second=0, microsecond=0) if policy.window.rolling else CALENDAR_BUCKET
            consumed[(key, bucket)] += amount
            total += amount
        used[policy.id] = total
        held[reservation.ledger_key] = 0 if (final or released) else max(0, reservation.admitted - total)
    metered_gpu = sum(g for _, g, _ in metered)
    tail_gpu = sum(ms * gpus for _, ms, gpus, _ in tail)
    return Settlement(
        held=held,
        consumed=dict(consumed),
        windows=windows,
        phase=line.phase,
        final=final,
        provisional=provisional,
        released=released,
        over_running=any(used[r.policy.id] > r.admitted for r in facts.reservations),
        wall=sum(ms for _, ms in wall),
        metered_gpu=metered_gpu,
        actual_gpu=metered_gpu + tail_gpu,
        projected_gpu=facts.projected_gpu,
        ended_at=line.ended_at,
        final_state=line.final_state,
        review_at=_review_at(line, facts, rules, now, final=final, released=released, idle_since=idle_since, st=st),
        used=used,
        release_reason=st.release_reason,
        unconfirmed=st.unconfirmed,
    )


@dataclass(frozen=True, slots=True)
class Standing:
    """Where a run stands from its lifecycle and how far metering covers it, before any amount."""

    wall: list[tuple[datetime, int]]  # wall time, cut at hours
    tail: list[tuple[datetime, int, int, int]]  # provisional running time no sample covers
    final: bool
    provisional: bool
    released: bool
    idle_since: datetime
    release_reason: str | None = None  # why the holds are given back now (None: not now)
    unconfirmed: bool = False  # a provisional admission not confirmed yet (nor given back)
    confirm_by: datetime | None = None  # when an unconfirmed one is given back


def unconfirmed(facts: RunFacts, covered: datetime | None) -> bool:
    """Whether the run was admitted provisionally and no fact shows its object exists yet: no
    lifecycle event, and no usage sample (`covered`, the latest sample's time: a metered run runs)."""
    return facts.provisional and covered is None and not any(e.kind in CONFIRMING for e in facts.events)


def standing(
    line: Timeline,
    covered: datetime | None,
    *,
    admitted_at: datetime,
    released: bool,
    rules: Rules,
    now: datetime,
    unconfirmed: bool = False,
    metered_through: datetime | None = None,
) -> Standing:
    """The time-driven half of the rules: completeness, finality, release, wall time, the tail.
    `unconfirmed`: a provisional admission no fact confirmed (see `unconfirmed`);
    `metered_through`: see RunFacts (a sample accepted later than `covered` is still on its way)."""
    wall = [(at, ms) for iv in line.intervals for at, ms in hour_pieces(iv.start, _end(iv, now))]
    stopped = max((_end(iv, now) for iv in line.intervals), default=None)
    in_flight = metered_through is not None and (covered is None or metered_through > covered)
    complete = stopped is None or (covered is not None and covered >= stopped - rules.metering_tolerance and not in_flight)
    ended = line.phase == "ended"
    assert line.ended_at is None or ended
    final = ended and (complete or now >= line.ended_at + rules.provisional_grace)  # type: ignore[operator]
    provisional = final and not complete
    tail = _uncovered(line.intervals, covered, now) if provisional else []
    idle_since = line.last_change or admitted_at
    release_due = line.phase in ("admitted", "evicted") and now >= idle_since + rules.start_deadline
    waiting = unconfirmed and line.phase == "admitted" and not released
    confirm_by = admitted_at + rules.provisional_hold if waiting else None
    lapsed = confirm_by is not None and now >= confirm_by
    reason = None
    if not released and lapsed:
        reason = f"the object was never stored: no platform fact confirmed it within the provisional hold ({rules.provisional_hold.total_seconds():g} s)"
    elif not released and release_due:
        reason = NOT_STARTED
    return Standing(wall, tail, final, provisional, released or release_due or lapsed, idle_since, reason, waiting and not lapsed, confirm_by)


def unit_amount(unit: Unit, gpu: int, node: int, at: datetime, facts: RunFacts, bundle: PolicyBundle | None) -> int:
    """Metered usage of (gpu, node) milli-hours at `at`, in `unit` (wall hours are not metered)."""
    if unit is Unit.NODE_HOURS:
        return node
    if unit is Unit.GPU_HOURS:
        return gpu
    if unit is Unit.WALL_HOURS:
        return 0
    return _price(gpu, at, facts, bundle) if gpu else 0


def bucket_of(reservation: Reservation, at: datetime) -> tuple[str, datetime, Window]:
    """The ledger key and bucket the usage at `at` of a run's reservation lands on, and its
    window: its policy's key of the window holding `at`, or, for a reservation on an escrow lease
    (a budget tenants share, on a ledger of several shards), the same root's lease of it."""
    policy = reservation.policy
    window = window_at(policy.window, at)
    bucket = at.astimezone(UTC).replace(minute=0, second=0, microsecond=0) if policy.window.rolling else CALENDAR_BUCKET
    key = ledger_key(policy, window)
    lease = lease_of(reservation.ledger_key) if LEASE_SEPARATOR in reservation.ledger_key else None
    return (key if lease is None else lease_key(key, lease[1])), bucket, window


def review_at(line: Timeline, facts: RunFacts, rules: Rules, now: datetime, st: Standing) -> datetime | None:
    """When time alone changes the run's settlement next; None = never."""
    return _review_at(line, facts, rules, now, final=st.final, released=st.released, idle_since=st.idle_since, st=st)


def _usage(
    unit: Unit,
    metered: list[tuple[datetime, int, int]],
    wall: list[tuple[datetime, int]],
    tail: list[tuple[datetime, int, int, int]],
    facts: RunFacts,
    bundle: PolicyBundle | None,
) -> list[tuple[datetime, int]]:
    """Usage in `unit` at points in time: metered increments, then the provisional tail."""
    if unit is Unit.WALL_HOURS:
        return list(wall)  # wall time is known from the lifecycle alone: nothing provisional
    if unit is Unit.NODE_HOURS:
        return [(at, node) for at, _, node in metered] + [(at, ms * nodes) for at, ms, _, nodes in tail]
    gpu = [(at, g) for at, g, _ in metered] + [(at, ms * gpus) for at, ms, gpus, _ in tail]
    if unit is Unit.GPU_HOURS:
        return gpu
    return [(at, _price(amount, at, facts, bundle)) for at, amount in gpu]


def _price(gpu: int, at: datetime, facts: RunFacts, bundle: PolicyBundle | None) -> int:
    if bundle is None or facts.flavor is None:
        return 0
    # The rate in effect when the usage happened; admission only admits priced flavors, so the
    # rate at admission time stands in for usage dated before any rate card took effect.
    priced = bundle.rate_for(facts.flavor, facts.region, at) or bundle.rate_for(facts.flavor, facts.region, facts.admitted_at)
    return cost_micros(gpu, priced[0].rate_per_gpu_hour) if priced else 0


def _uncovered(intervals: Iterable[Interval], covered: datetime | None, now: datetime) -> list[tuple[datetime, int, int, int]]:
    """Running time after the last sample, cut at hours: (at, ms, gpus, nodes)."""
    pieces = []
    for iv in intervals:
        start = iv.start if covered is None else max(iv.start, covered)
        pieces += [(at, ms, iv.gpus, iv.nodes) for at, ms in hour_pieces(start, _end(iv, now))]
    return pieces


def _review_at(
    line: Timeline, facts: RunFacts, rules: Rules, now: datetime, *, final: bool, released: bool, idle_since: datetime, st: Standing
) -> datetime | None:
    if final:
        return None
    if line.phase == "ended":
        assert line.ended_at is not None
        return line.ended_at + rules.provisional_grace
    if line.phase in ("admitted", "evicted"):
        if released:
            return None
        deadline = idle_since + rules.start_deadline
        return min(deadline, st.confirm_by) if st.unconfirmed and st.confirm_by is not None else deadline
    if any(r.policy.limit.unit is Unit.WALL_HOURS for r in facts.reservations):
        return now + rules.wall_refresh
    return None


def _end(interval: Interval, now: datetime) -> datetime:
    return interval.end if interval.end is not None else max(now, interval.start)


def _epoch_ms(at: datetime) -> int:
    # Wall milli-hours are milliseconds: one hour is 3,600,000 of either. Pieces measured
    # between whole milliseconds since the epoch add up exactly to the stretch they cut.
    delta = at - _EPOCH
    return (delta.days * 86_400_000) + (delta.seconds * 1000) + delta.microseconds // 1000


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


assert MILLI_PER_HOUR == 3_600_000, "wall milli-hours are milliseconds only at this scale"
