"""Reconciliation as a fold: a run's running state plus one fact gives the new state plus the
change to its charges, at a cost that does not grow with the run's history.

The rules are those of `budgetgate.core.reconciliation` (its module docstring); `settle` there
recomputes a whole run from all its facts and stays as the oracle the fold is tested against
and as a repair tool, never on the hot path.

- **Samples** sit on a line ordered by (observed_at, sample_id). Each row keeps the running
  maxima (high-water marks) of the counters through it, so a sample's increment is its high-water
  mark minus its predecessor's. A sample appended at the end touches no other row; a late sample
  changes the increments of the rows after it only until a row's high-water marks come out
  unchanged (for rising counters: the next row). `Reflow` says which increments changed.
- **Metered charges** move by the difference each changed increment makes, on the key and
  bucket of its time (`charges`).
- **Lifecycle facts** are few per run (one per admission and end): the timeline is rebuilt from
  them, and with it the charges that come from time alone (wall time, the provisional tail),
  which `settle_state` returns whole.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

from budgetgate.core.ledger_key import checked
from budgetgate.core.policy import BudgetPolicy, PolicyBundle
from budgetgate.core.reconciliation import RunFacts, Rules, Settlement, UsageFact, bucket_of, review_at, standing, timeline, unconfirmed, unit_amount
from budgetgate.core.units import Unit
from budgetgate.core.windows import Window

Highs = tuple[int, int]  # (gpu, node) milli-hours
_ZERO: Highs = (0, 0)


@dataclass(frozen=True, slots=True)
class MeterRow:
    """One sample on the run's line, with the high-water marks of the counters through it."""

    at: datetime
    sample_id: str
    gpu: int
    node: int
    gpu_high: int = 0
    node_high: int = 0

    @property
    def key(self) -> tuple[datetime, str]:
        return (self.at, self.sample_id)

    @property
    def highs(self) -> Highs:
        return (self.gpu_high, self.node_high)


@dataclass(frozen=True, slots=True)
class IncrementChange:
    """The usage attributed to the instant `at` went from `before` to `after` (gpu, node)."""

    at: datetime
    before: Highs
    after: Highs


@dataclass(frozen=True, slots=True)
class Reflow:
    """What placing (or removing) one sample changed: rows with new high-water marks, changed
    increments, and `carry` = (old, new) marks to continue with when the rows given ran out
    before the change settled (None once it has)."""

    rows: tuple[MeterRow, ...] = ()
    changes: tuple[IncrementChange, ...] = ()
    carry: tuple[Highs, Highs] | None = None


def insert_sample(sample: UsageFact, *, before: Highs, after: Iterable[MeterRow]) -> Reflow:
    """Place a new sample after a row with marks `before`, ahead of the rows `after` (in order)."""
    high = (max(before[0], sample.gpu), max(before[1], sample.node))
    row = MeterRow(sample.observed_at, sample.sample_id, sample.gpu, sample.node, *high)
    rest = reflow((before, high), after)
    return Reflow((row, *rest.rows), (IncrementChange(row.at, _ZERO, _minus(high, before)), *rest.changes), rest.carry)


def remove_sample(row: MeterRow, *, before: Highs, after: Iterable[MeterRow]) -> Reflow:
    """Take a row off the line (a sample replaced by a higher reading under the same id)."""
    rest = reflow((row.highs, before), after)
    return Reflow(rest.rows, (IncrementChange(row.at, _minus(row.highs, before), _ZERO), *rest.changes), rest.carry)


def reflow(carry: tuple[Highs, Highs], after: Iterable[MeterRow]) -> Reflow:
    """Carry a change of the predecessor's marks (old → new) through the rows `after`."""
    old_prev, new_prev = carry
    rows, changes = [], []
    for row in after:
        if old_prev == new_prev:
            return Reflow(tuple(rows), tuple(changes))
        high = (max(new_prev[0], row.gpu), max(new_prev[1], row.node))
        was, now = _minus(row.highs, old_prev), _minus(high, new_prev)
        if was != now:
            changes.append(IncrementChange(row.at, was, now))
        if high != row.highs:
            rows.append(replace(row, gpu_high=high[0], node_high=high[1]))
        old_prev, new_prev = row.highs, high
    return Reflow(tuple(rows), tuple(changes), None if old_prev == new_prev else (old_prev, new_prev))


@dataclass(frozen=True, slots=True)
class RunState:
    """A run's metered side as folded so far."""

    gpu: int = 0  # metered totals: the high-water marks of the counters
    node: int = 0
    covered: datetime | None = None  # the latest sample time seen
    used: Mapping[str, int] = field(default_factory=dict)  # metered usage per policy id, in its unit


@dataclass(frozen=True, slots=True)
class Charges:
    """How a fold step moves the run's metered charges."""

    deltas: Mapping[tuple[str, datetime], int]  # per (ledger key, bucket)
    windows: Mapping[str, tuple[BudgetPolicy, Window]]


def fold(state: RunState, sample: UsageFact, step: Reflow, *, run: RunFacts, bundle: PolicyBundle | None) -> tuple[RunState, Charges]:
    """State + one placed sample → new state + the change to the run's metered charges."""
    moved = charges(step.changes, run=run, bundle=bundle)
    used = dict(state.used)
    for reservation in run.reservations:
        pid = reservation.policy.id
        used[pid] = checked(used.get(pid, 0) + moved.used.get(pid, 0), f"usage of policy {pid!r}")
    gpu = checked(state.gpu + sum(c.after[0] - c.before[0] for c in step.changes), "metered GPU usage")
    node = checked(state.node + sum(c.after[1] - c.before[1] for c in step.changes), "metered node usage")
    covered = sample.observed_at if state.covered is None else max(state.covered, sample.observed_at)
    return RunState(gpu, node, covered, used), Charges(moved.deltas, moved.windows)


@dataclass(frozen=True, slots=True)
class _Moved:
    deltas: dict[tuple[str, datetime], int]
    used: dict[str, int]
    windows: dict[str, tuple[BudgetPolicy, Window]]


def charges(changes: Iterable[IncrementChange], *, run: RunFacts, bundle: PolicyBundle | None) -> _Moved:
    """The metered charges' change, per key and bucket and per policy, from changed increments."""
    deltas: dict[tuple[str, datetime], int] = defaultdict(int)
    used: dict[str, int] = defaultdict(int)
    windows: dict[str, tuple[BudgetPolicy, Window]] = {}
    changes = list(changes)
    for reservation in run.reservations:
        policy = reservation.policy
        unit = policy.limit.unit
        if unit is Unit.WALL_HOURS:
            continue
        for change in changes:
            delta = unit_amount(unit, *change.after, change.at, run, bundle) - unit_amount(unit, *change.before, change.at, run, bundle)
            if delta:
                key, bucket, window = bucket_of(reservation, change.at)
                windows.setdefault(key, (policy, window))
                deltas[(key, bucket)] += delta
                used[policy.id] += delta
    return _Moved({k: checked(d, f"charge on {k[0]}") for k, d in deltas.items() if d}, dict(used), windows)


def settle_state(run: RunFacts, state: RunState, *, bundle: PolicyBundle | None, rules: Rules, now: datetime) -> Settlement:
    """The run's settlement from its folded state and its lifecycle facts (`run.samples` unused).

    `consumed` holds only the charges known from time alone (wall time, the provisional tail);
    the metered charges are the sum of the fold's deltas, kept by the caller.
    """
    line = timeline(run.events, gpus=run.gpus, nodes=run.nodes, ends_after=run.ends_after)
    st = standing(
        line,
        state.covered,
        admitted_at=run.admitted_at,
        released=run.released,
        rules=rules,
        now=now,
        unconfirmed=unconfirmed(run, state.covered),
        metered_through=run.metered_through,
    )
    consumed: dict[tuple[str, datetime], int] = defaultdict(int)
    windows: dict[str, tuple[BudgetPolicy, Window]] = {}
    used: dict[str, int] = {}
    held: dict[str, int] = {}
    for reservation in run.reservations:
        policy = reservation.policy
        total = state.used.get(policy.id, 0)
        for at, amount in _timed_usage(policy.limit.unit, st, run, bundle):
            if amount <= 0:
                continue
            key, bucket, window = bucket_of(reservation, at)
            windows.setdefault(key, (policy, window))
            consumed[(key, bucket)] += amount
            total += amount
        used[policy.id] = checked(total, f"usage of policy {policy.id!r}")
        held[reservation.ledger_key] = 0 if (st.final or st.released) else max(0, reservation.admitted - total)
    tail_gpu = sum(ms * gpus for _, ms, gpus, _ in st.tail)
    return Settlement(
        held=held,
        consumed=dict(consumed),
        windows=windows,
        phase=line.phase,
        final=st.final,
        provisional=st.provisional,
        released=st.released,
        over_running=any(used[r.policy.id] > r.admitted for r in run.reservations),
        wall=sum(ms for _, ms in st.wall),
        metered_gpu=state.gpu,
        actual_gpu=checked(state.gpu + tail_gpu, "actual GPU usage"),
        projected_gpu=run.projected_gpu,
        ended_at=line.ended_at,
        final_state=line.final_state,
        review_at=review_at(line, run, rules, now, st),
        used=used,
        release_reason=st.release_reason,
        unconfirmed=st.unconfirmed,
    )


def given_back(run: RunFacts, state: RunState, timed: Mapping[tuple[str, datetime], int], *, last: Mapping[str, Any] | None) -> Settlement:
    """The run's settlement with what it holds given back and nothing else moved: an operator's
    release of a run whose settlement keeps failing. Its charges stay as last settled (`state`,
    and `timed`: those from time alone), no fact recorded since is folded in, and time reviews it
    no more; `last` is its last settlement (run_settlements), None if it has none. Where it stands
    comes from its lifecycle. A run not yet final is released (its facts to come are settled as
    any released run's: charged as consumed, never held again); a final one holds nothing."""
    line = timeline(run.events, gpus=run.gpus, nodes=run.nodes, ends_after=run.ends_after)
    final = bool(last and last["final"])
    used = dict(state.used)
    return Settlement(
        held=dict.fromkeys((r.ledger_key for r in run.reservations), 0),
        consumed=dict(timed),
        windows={},
        phase=line.phase,
        final=final,
        provisional=bool(last and last["provisional"]),
        released=run.released or not final,
        over_running=any(used.get(r.policy.id, 0) > r.admitted for r in run.reservations),
        wall=last["wall"] if last else 0,
        metered_gpu=state.gpu,
        actual_gpu=last["actual_gpu"] if last else state.gpu,
        projected_gpu=run.projected_gpu,
        ended_at=line.ended_at,
        final_state=line.final_state if final else None,
        review_at=None,
        used=used,
    )


def _timed_usage(unit: Unit, st, run: RunFacts, bundle: PolicyBundle | None) -> list[tuple[datetime, int]]:  # type: ignore[no-untyped-def]
    """Usage known from time alone, in `unit`: wall time, or the provisional tail."""
    if unit is Unit.WALL_HOURS:
        return list(st.wall)
    return [(at, unit_amount(unit, ms * gpus, ms * nodes, at, run, bundle)) for at, ms, gpus, nodes in st.tail]


class SampleLine:
    """A run's sample line in memory: for the repair path (a whole run folded at once) and tests.
    A sample id seen again counts once, keeping its highest reading, as `increments` does."""

    def __init__(self) -> None:
        self.rows: list[MeterRow] = []
        self._keys: list[tuple[datetime, str]] = []
        self._by_id: dict[str, MeterRow] = {}

    def add(self, sample: UsageFact) -> Reflow:
        seen = self._by_id.get(sample.sample_id)
        if seen is None:
            return self._insert(sample)
        if (sample.gpu, sample.node, sample.observed_at) <= (seen.gpu, seen.node, seen.at):
            return Reflow()
        out = self._remove(seen)
        into = self._insert(sample)
        return Reflow(into.rows, out.changes + into.changes)

    def _insert(self, sample: UsageFact) -> Reflow:
        i = bisect.bisect_left(self._keys, (sample.observed_at, sample.sample_id))
        step = insert_sample(sample, before=self.rows[i - 1].highs if i else _ZERO, after=self.rows[i:])
        self.rows.insert(i, step.rows[0])
        self._keys.insert(i, step.rows[0].key)
        self._put(step.rows[1:], i + 1)
        self._by_id[sample.sample_id] = self.rows[i]
        return step

    def _remove(self, row: MeterRow) -> Reflow:
        i = bisect.bisect_left(self._keys, row.key)
        step = remove_sample(row, before=self.rows[i - 1].highs if i else _ZERO, after=self.rows[i + 1 :])
        del self.rows[i], self._keys[i]
        del self._by_id[row.sample_id]
        self._put(step.rows, i)
        return step

    def _put(self, rows: Iterable[MeterRow], start: int) -> None:
        for row in rows:
            i = bisect.bisect_left(self._keys, row.key, lo=start)
            self.rows[i] = row
            self._by_id[row.sample_id] = row


def _minus(a: Highs, b: Highs) -> Highs:
    return (a[0] - b[0], a[1] - b[1])
