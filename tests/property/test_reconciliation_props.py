"""The reconciliation rules (budgetgate.core.reconciliation): arithmetic, window splitting, wall
time, and the same ledger whatever the order, duplication or lateness of events and samples; and
provisional holds: a run the Kubernetes validating webhook admitted is given back after the
provisional hold unless a fact confirms its object, and STORED changes nothing else."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from budgetgate.core.evaluation import ledger_key
from budgetgate.core.ledger_key import MAX_AMOUNT, AmountOutOfRange
from budgetgate.core.policy import BudgetPolicy, Enforcement, Limit, OnExhausted, PolicyBundle, Rate, RateCard, Scope, Source
from budgetgate.core.reconciliation import (
    CALENDAR_BUCKET,
    NOT_STARTED,
    STORED,
    COMPLETED,
    EVICTED,
    READMITTED,
    STARTED,
    LifecycleFact,
    Reservation,
    Rules,
    RunFacts,
    UsageFact,
    settle,
)
from budgetgate.core.run_state import RunState, SampleLine, fold, settle_state
from budgetgate.core.units import Unit, cost_micros, hours_amount
from budgetgate.core.windows import WindowSpec, window_at

pytestmark = pytest.mark.property

H = 3_600_000
T0 = datetime(2026, 3, 31, 20, 0, tzinfo=UTC)  # four hours before April begins
RULES = Rules(start_deadline=timedelta(hours=2), provisional_grace=timedelta(minutes=10), metering_tolerance=timedelta(seconds=60))


def policy(pid: str, unit: Unit, *, limit: int = 1000 * H, window: WindowSpec | None = None) -> BudgetPolicy:
    return BudgetPolicy(
        id=pid,
        scope=Scope(labels={"team": "vision"}),
        window=window or WindowSpec(calendar="month"),
        limit=Limit(unit, limit, "USD" if unit is Unit.COST else None),
        enforcement=Enforcement.HARD,
        on_exhausted=OnExhausted.DENY,
        source=Source("t.yaml", 1),
    )


GPU = policy("gpu", Unit.GPU_HOURS)
NODE = policy("node", Unit.NODE_HOURS)
WALL = policy("wall", Unit.WALL_HOURS, window=WindowSpec(rolling_days=90))
COST = policy("cost", Unit.COST, limit=10**12)
BUNDLE = PolicyBundle(git_sha="s", policies=(GPU, NODE, WALL, COST), rate_cards=(RateCard("r", "USD", (Rate("h100", Decimal("3.933")),), Source("r.yaml", 1)),))


def facts(events=(), samples=(), *, gpus: int = 8, hours: int = 6, released: bool = False, policies=(GPU, NODE, WALL, COST)) -> RunFacts:  # type: ignore[no-untyped-def]
    amounts = {
        Unit.GPU_HOURS: hours_amount(gpus, hours),
        Unit.NODE_HOURS: hours_amount(1, hours),
        Unit.WALL_HOURS: hours_amount(1, hours),
        Unit.COST: cost_micros(hours_amount(gpus, hours), Decimal("3.933")),
    }
    reservations = tuple(Reservation(p, ledger_key(p, window_at(p.window, T0)), amounts[p.limit.unit]) for p in policies)
    return RunFacts(
        run_id="r",
        admitted_at=T0,
        reservations=reservations,
        gpus=gpus,
        nodes=1,
        projected_gpu=hours_amount(gpus, hours),
        flavor="h100",
        events=frozenset(events),
        samples=frozenset(samples),
        released=released,
    )


def ev(kind: str, minutes: float, eid: str | None = None, gpus: int = 0) -> LifecycleFact:
    return LifecycleFact(eid or f"{kind}-{minutes}", kind, T0 + timedelta(minutes=minutes), gpus=gpus)


def sample(minutes: float, gpu_hours: float, node_hours: float = 0.0) -> UsageFact:
    return UsageFact(f"s-{minutes}", T0 + timedelta(minutes=minutes), int(gpu_hours * H), int(node_hours * H))


def key(p: BudgetPolicy, at: datetime = T0) -> str:
    return ledger_key(p, window_at(p.window, at))


# --- the acceptance example ------------------------------------------------------------------


def test_48_projected_16_metered_completed_leaves_16_consumed_0_reserved() -> None:
    run = facts([ev(STARTED, 0), ev(COMPLETED, 120)], [sample(60, 8), sample(120, 16)], policies=(GPU,))
    result = settle(run, bundle=BUNDLE, rules=RULES, now=T0 + timedelta(minutes=121))
    assert result.final and not result.provisional
    assert result.held == {key(GPU): 0}
    assert result.consumed_by_key() == {key(GPU): 16 * H}
    assert result.actual_gpu == 16 * H and result.error_gpu == -32 * H


def test_running_charge_is_max_of_reservation_and_metered() -> None:
    under = settle(facts([ev(STARTED, 0)], [sample(60, 16)], policies=(GPU,)), bundle=BUNDLE, rules=RULES, now=T0 + timedelta(minutes=61))
    assert under.held[key(GPU)] == 32 * H and under.consumed_by_key()[key(GPU)] == 16 * H
    assert not under.over_running
    over = settle(facts([ev(STARTED, 0)], [sample(60, 50)], policies=(GPU,)), bundle=BUNDLE, rules=RULES, now=T0 + timedelta(minutes=61))
    assert over.held[key(GPU)] == 0 and over.consumed_by_key()[key(GPU)] == 50 * H
    assert over.over_running


def test_month_boundary_splits_by_sample_time() -> None:
    run = facts([ev(STARTED, 0), ev(COMPLETED, 360)], [sample(180, 24), sample(360, 48)], policies=(GPU,))
    result = settle(run, bundle=BUNDLE, rules=RULES, now=T0 + timedelta(hours=7))
    march, april = key(GPU), key(GPU, T0 + timedelta(hours=5))
    assert march != april
    assert result.consumed_by_key() == {march: 24 * H, april: 24 * H}
    assert set(result.windows) == {march, april}


def test_metering_lag_keeps_the_reservation_then_goes_provisional_then_corrects() -> None:
    events = [ev(STARTED, 0, gpus=4), ev(COMPLETED, 120)]
    lagging = facts(events, [sample(30, 2)], policies=(GPU,))
    in_grace = settle(lagging, bundle=BUNDLE, rules=RULES, now=T0 + timedelta(minutes=125))
    assert not in_grace.final and in_grace.held[key(GPU)] == 46 * H
    assert in_grace.review_at == T0 + timedelta(minutes=130)
    after = settle(lagging, bundle=BUNDLE, rules=RULES, now=T0 + timedelta(minutes=131))
    # 2 GPU-hours metered in the first 30 minutes, then 4 bound GPUs × 90 minutes provisionally.
    assert after.final and after.provisional and after.held[key(GPU)] == 0
    assert after.consumed_by_key()[key(GPU)] == 2 * H + 6 * H
    corrected = settle(facts(events, [sample(30, 2), sample(120, 7)], policies=(GPU,)), bundle=BUNDLE, rules=RULES, now=T0 + timedelta(minutes=140))
    assert corrected.final and not corrected.provisional
    assert corrected.consumed_by_key()[key(GPU)] == 7 * H


def test_wall_time_accumulates_across_eviction_and_readmission() -> None:
    events = [ev(STARTED, 0), ev(EVICTED, 90), ev(READMITTED, 200), ev(STARTED, 210), ev(COMPLETED, 260)]
    result = settle(facts(events, [], policies=(WALL,)), bundle=BUNDLE, rules=RULES, now=T0 + timedelta(hours=6))
    assert result.wall == (90 + 60) * 60_000
    assert result.consumed_by_key() == {key(WALL): (90 + 60) * 60_000}
    running = settle(facts(events[:3], [], policies=(WALL,)), bundle=BUNDLE, rules=RULES, now=T0 + timedelta(minutes=230))
    assert running.phase == "running" and running.wall == (90 + 30) * 60_000
    assert running.held[key(WALL)] == 6 * H - running.wall
    assert running.review_at == T0 + timedelta(minutes=231)


def test_never_started_is_released_after_the_deadline_and_stays_released() -> None:
    waiting = settle(facts(policies=(GPU,)), bundle=BUNDLE, rules=RULES, now=T0 + timedelta(minutes=119))
    assert waiting.held[key(GPU)] == 48 * H and waiting.review_at == T0 + timedelta(hours=2)
    late = settle(facts(policies=(GPU,)), bundle=BUNDLE, rules=RULES, now=T0 + timedelta(hours=2))
    assert late.released and late.held[key(GPU)] == 0
    # A start reported after the release is charged for what it uses, nothing is held again.
    started_late = settle(facts([ev(STARTED, 150)], [sample(170, 3)], released=True, policies=(GPU,)), bundle=BUNDLE, rules=RULES, now=T0 + timedelta(hours=3))
    assert started_late.held[key(GPU)] == 0 and started_late.consumed_by_key()[key(GPU)] == 3 * H


def test_cancelled_before_start_holds_nothing_and_consumes_nothing() -> None:
    result = settle(facts([ev("CANCELLED", 5)], policies=(GPU, COST)), bundle=BUNDLE, rules=RULES, now=T0 + timedelta(minutes=6))
    assert result.final and set(result.held.values()) == {0} and result.consumed == {}


def test_a_refused_attempts_end_does_not_end_the_attempt_admitted_after_it() -> None:
    # Attempt 1 DELAYed and cancelled while it waited; attempt 2 admitted at T0 and started: the
    # cancellation ended the run, which then held nothing while it ran and was never charged
    # wall time.
    cancelled, started = ev("CANCELLED", -30), ev(STARTED, 10)
    afresh = replace(facts([cancelled, started], [sample(70, 6)], policies=(GPU, WALL)), ends_after=T0)
    result = settle(afresh, bundle=BUNDLE, rules=RULES, now=T0 + timedelta(minutes=70))
    assert not result.final and result.held[key(GPU)] == 42 * H and result.consumed_by_key()[key(GPU)] == 6 * H
    assert result.consumed_by_key()[key(WALL)] == hours_amount(1, 1)
    # A run with no refused attempt before it (ends_after None) still ends at its first end.
    once = settle(facts([cancelled, started], policies=(GPU,)), bundle=BUNDLE, rules=RULES, now=T0 + timedelta(minutes=70))
    assert once.final and once.held[key(GPU)] == 0
    # After the admitting decision an end is the run's own, whichever attempt came before.
    ended = replace(facts([cancelled, started, ev("CANCELLED", 40)], policies=(GPU,)), ends_after=T0)
    assert settle(ended, bundle=BUNDLE, rules=RULES, now=T0 + timedelta(minutes=70)).final
    # And so is an end after a start, even dated before the admitting decision: a platform's clock
    # a little behind, or times in whole seconds (ignored, the run never ended and held for ever).
    early = replace(facts([ev(STARTED, -60), ev(COMPLETED, -0.5)], policies=(GPU,)), ends_after=T0)
    assert settle(early, bundle=BUNDLE, rules=RULES, now=T0 + timedelta(minutes=70)).final


def test_cost_is_priced_per_increment_and_rolling_usage_is_bucketed_by_hour() -> None:
    result = settle(
        facts([ev(STARTED, 0), ev(COMPLETED, 120)], [sample(60, 8), sample(120, 16)], policies=(COST, WALL)),
        bundle=BUNDLE,
        rules=RULES,
        now=T0 + timedelta(hours=3),
    )
    assert result.consumed_by_key()[key(COST)] == 2 * cost_micros(8 * H, Decimal("3.933"))
    wall_buckets = {bucket: amount for (k, bucket), amount in result.consumed.items() if k == key(WALL)}
    assert wall_buckets == {T0: H, T0 + timedelta(hours=1): H}
    assert all(bucket == CALENDAR_BUCKET for (k, bucket) in result.consumed if k == key(COST))


# --- properties ------------------------------------------------------------------------------


@st.composite
def clean_streams(draw):  # type: ignore[no-untyped-def]
    """A plausible run: starts, maybe gets evicted and re-admitted, maybe ends; cumulative samples."""
    t = 0.0
    events = []
    for admission in range(draw(st.integers(1, 3))):
        t += draw(st.floats(0, 120))
        events.append(ev(STARTED if admission == 0 else READMITTED, t, gpus=draw(st.sampled_from([0, 4, 8]))))
        t += draw(st.floats(0, 300))
        if admission < 2 and draw(st.booleans()):
            events.append(ev(EVICTED, t))
        else:
            break
    if draw(st.booleans()):
        events.append(ev(draw(st.sampled_from([COMPLETED, "FAILED", "CANCELLED"])), t + draw(st.floats(0, 30))))
    samples, cumulative = [], 0.0
    for _ in range(draw(st.integers(0, 12))):
        cumulative += draw(st.floats(0, 10))
        samples.append(sample(draw(st.floats(0, t + 60)), cumulative, cumulative / 8))
    samples.sort(key=lambda s: s.observed_at)
    # Counters only grow: re-derive values so they rise with time.
    samples = [UsageFact(s.sample_id, s.observed_at, int((i + 1) * H * 0.7), int((i + 1) * H * 0.1)) for i, s in enumerate(samples)]
    return events, samples


def messy(draw, items: list) -> list:  # type: ignore[no-untyped-def, type-arg]
    """The same items, shuffled, some sent two or three times."""
    copies = [item for item in items for _ in range(draw(st.integers(1, 3)))]
    return draw(st.permutations(copies))


@settings(max_examples=300, deadline=None)
@given(stream=clean_streams(), data=st.data(), minutes_later=st.floats(0, 900))
def test_duplicated_reordered_late_streams_settle_like_the_clean_one(stream, data, minutes_later) -> None:  # type: ignore[no-untyped-def]
    events, samples = stream
    now = T0 + timedelta(minutes=600 + minutes_later)
    clean = settle(facts(events, samples), bundle=BUNDLE, rules=RULES, now=now)
    shuffled = settle(facts(messy(data.draw, events), messy(data.draw, samples)), bundle=BUNDLE, rules=RULES, now=now)
    assert shuffled == clean


@settings(max_examples=300, deadline=None)
@given(stream=clean_streams(), minutes_later=st.floats(0, 900))
def test_charge_is_max_of_reservation_and_usage_until_final_then_usage(stream, minutes_later) -> None:  # type: ignore[no-untyped-def]
    events, samples = stream
    run = facts(events, samples)
    result = settle(run, bundle=BUNDLE, rules=RULES, now=T0 + timedelta(minutes=600 + minutes_later))
    for amount in result.consumed.values():
        assert amount > 0
    for reservation in run.reservations:
        used = result.used[reservation.policy.id]
        held = result.held[reservation.ledger_key]
        if result.final or result.released:
            assert held == 0
        else:
            assert held + used == max(reservation.admitted, used)
    # Every GPU milli-hour metered is charged exactly once, across however many windows.
    gpu_total = sum(amount for (k, _), amount in result.consumed.items() if k.endswith("|gpu_hours"))
    assert gpu_total == result.actual_gpu
    assert result.actual_gpu >= result.metered_gpu == (max((s.gpu for s in samples), default=0))


@settings(max_examples=200, deadline=None)
@given(stream=clean_streams())
def test_wall_time_is_the_sum_of_running_stretches(stream) -> None:  # type: ignore[no-untyped-def]
    events, _ = stream
    now = T0 + timedelta(days=1)
    result = settle(facts(events, []), bundle=BUNDLE, rules=RULES, now=now)
    ordered = sorted(events, key=lambda e: (e.at, {STARTED: 0, EVICTED: 1, READMITTED: 2}.get(e.kind, 3)))
    expected, since = 0, None
    for e in ordered:
        if e.kind in (STARTED, READMITTED) and since is None:
            since = e.at
        elif e.kind != STARTED and e.kind != READMITTED and since is not None:
            expected += int((e.at - since) / timedelta(milliseconds=1))
            since = None
        if e.kind in (COMPLETED, "FAILED", "CANCELLED"):
            break
    else:
        if since is not None:
            expected += int((now - since) / timedelta(milliseconds=1))
    assert abs(result.wall - expected) <= 24  # hour pieces round each to the millisecond


def fold_all(run: RunFacts, facts_in_order: list, now: datetime):  # type: ignore[no-untyped-def, type-arg]
    """Fold lifecycle facts and samples one at a time, as the reconciler does, into a settlement
    whose `consumed` is the whole ledger (the fold's metered deltas plus the timed charges)."""
    line, state = SampleLine(), RunState()
    metered: dict = defaultdict(int)  # type: ignore[type-arg]
    events: set = set()  # type: ignore[type-arg]
    windows: dict = {}  # type: ignore[type-arg]
    for fact in facts_in_order:
        if isinstance(fact, LifecycleFact):
            events.add(fact)
            continue
        state, moved = fold(state, fact, line.add(fact), run=run, bundle=BUNDLE)
        for key, delta in moved.deltas.items():
            metered[key] += delta
        windows.update(moved.windows)
    result = settle_state(replace(run, events=frozenset(events), samples=frozenset()), state, bundle=BUNDLE, rules=RULES, now=now)
    consumed = defaultdict(int, metered)
    for key, amount in result.consumed.items():
        consumed[key] += amount
    return replace(result, consumed={k: v for k, v in consumed.items() if v}, windows={**windows, **result.windows}), line


@settings(max_examples=400, deadline=None)
@given(stream=clean_streams(), data=st.data(), minutes_later=st.floats(0, 900), released=st.booleans(), afresh=st.booleans())
def test_folding_facts_in_any_order_with_duplicates_gives_the_whole_run_ledger(stream, data, minutes_later, released, afresh) -> None:  # type: ignore[no-untyped-def]
    events, samples = stream
    if afresh:  # admitted after a refused attempt, whose cancellation came before the admission
        events = [ev("CANCELLED", -data.draw(st.floats(0.5, 60)), "refused-end"), *events]
    now = T0 + timedelta(minutes=600 + minutes_later)
    ends_after = T0 if afresh else None
    oracle = settle(replace(facts(events, samples, released=released), ends_after=ends_after), bundle=BUNDLE, rules=RULES, now=now)
    folded, line = fold_all(replace(facts(released=released), ends_after=ends_after), messy(data.draw, [*events, *samples]), now)
    if afresh:  # and it changed nothing: the same ledger as without it
        assert oracle == settle(facts([e for e in events if e.event_id != "refused-end"], samples, released=released), bundle=BUNDLE, rules=RULES, now=now)
    assert folded.consumed == oracle.consumed
    assert {k: w for k, w in folded.windows.items() if k in oracle.windows} == oracle.windows
    assert replace(folded, consumed={}, windows={}) == replace(oracle, consumed={}, windows={})
    # The line's own marks are the running maxima of its samples, in order.
    high = (0, 0)
    for row in line.rows:
        high = (max(high[0], row.gpu), max(high[1], row.node))
        assert row.highs == high


@st.composite
def wild_samples(draw):  # type: ignore[no-untyped-def]
    """Counters that fall as well as rise (resets, resends), repeated ids with other readings."""
    ids = [f"s{i}" for i in range(draw(st.integers(1, 8)))]
    return [
        UsageFact(
            draw(st.sampled_from(ids)),
            T0 + timedelta(minutes=draw(st.integers(0, 400))),
            draw(st.integers(0, 50)) * H // 10,
            draw(st.integers(0, 50)) * H // 10,
        )
        for _ in range(draw(st.integers(0, 16)))
    ]


@settings(max_examples=400, deadline=None)
@given(samples=wild_samples(), data=st.data())
def test_folding_counters_that_reset_and_ids_that_repeat_gives_the_whole_run_ledger(samples, data) -> None:  # type: ignore[no-untyped-def]
    events = [ev(STARTED, 0), ev(COMPLETED, 420)]
    now = T0 + timedelta(hours=12)
    oracle = settle(facts(events, samples), bundle=BUNDLE, rules=RULES, now=now)
    folded, _line = fold_all(facts(), data.draw(st.permutations([*events, *samples])), now)
    assert folded.consumed == oracle.consumed
    assert replace(folded, consumed={}, windows={}) == replace(oracle, consumed={}, windows={})


def test_an_appended_sample_touches_no_other_row() -> None:
    line = SampleLine()
    for i in range(50):
        line.add(sample(i, i + 1, 0))
    step = line.add(sample(60, 100, 0))
    assert len(step.rows) == 1 and len(step.changes) == 1
    late = line.add(UsageFact("late", T0 + timedelta(minutes=10.5), int(11.5 * H), 0))
    assert len(late.changes) == 2  # its own increment and the next row's, nothing further


def test_an_amount_beyond_the_ledger_range_is_refused() -> None:
    run = facts()
    with pytest.raises(AmountOutOfRange):
        fold(RunState(), UsageFact("big", T0, MAX_AMOUNT + 1, 0), SampleLine().add(UsageFact("big", T0, MAX_AMOUNT + 1, 0)), run=run, bundle=BUNDLE)


# --- provisional holds (the Kubernetes validating webhook's) -----------------------------------


PROVISIONAL = replace(RULES, provisional_hold=timedelta(minutes=2))


def provisional(events=(), samples=()):  # type: ignore[no-untyped-def]
    return replace(facts(events, samples, policies=(GPU,)), provisional=True)


def test_an_unconfirmed_provisional_hold_is_given_back_after_the_provisional_hold() -> None:
    waiting = settle(provisional(), bundle=BUNDLE, rules=PROVISIONAL, now=T0 + timedelta(seconds=119))
    assert waiting.held[key(GPU)] == 48 * 3_600_000 and not waiting.released and waiting.unconfirmed
    assert waiting.review_at == T0 + timedelta(minutes=2)  # not the start deadline (2 h)
    lapsed = settle(provisional(), bundle=BUNDLE, rules=PROVISIONAL, now=T0 + timedelta(minutes=2))
    assert lapsed.released and lapsed.held[key(GPU)] == 0 and not lapsed.unconfirmed
    assert lapsed.release_reason is not None and lapsed.release_reason.startswith("the object was never stored")
    assert lapsed.review_at is None
    # Given back once, it stays given back (the settler marks the run released): no reason again.
    again = settle(replace(provisional(), released=True), bundle=BUNDLE, rules=PROVISIONAL, now=T0 + timedelta(minutes=3))
    assert again.released and again.release_reason is None


def test_a_stored_object_keeps_the_hold_to_the_start_deadline() -> None:
    stored = provisional([ev(STORED, 0.5)])
    kept = settle(stored, bundle=BUNDLE, rules=PROVISIONAL, now=T0 + timedelta(minutes=30))
    assert not kept.released and not kept.unconfirmed and kept.held[key(GPU)] == 48 * 3_600_000
    assert kept.review_at == T0 + RULES.start_deadline
    late = settle(stored, bundle=BUNDLE, rules=PROVISIONAL, now=T0 + RULES.start_deadline)
    assert late.released and late.release_reason == NOT_STARTED


@pytest.mark.parametrize("confirming", [[ev("STARTED", 1)], [ev("EVICTED", 1)], [ev("COMPLETED", 1)]])
def test_any_platform_fact_confirms(confirming) -> None:  # type: ignore[no-untyped-def]
    result = settle(provisional(confirming), bundle=BUNDLE, rules=PROVISIONAL, now=T0 + timedelta(minutes=5))
    assert not result.unconfirmed and result.release_reason is None


def test_a_usage_sample_confirms() -> None:
    metered = settle(provisional([], [sample(1, 0.5)]), bundle=BUNDLE, rules=PROVISIONAL, now=T0 + timedelta(minutes=5))
    assert not metered.released and not metered.unconfirmed


def test_the_provisional_hold_applies_only_to_provisional_runs() -> None:
    plain = settle(facts(policies=(GPU,)), bundle=BUNDLE, rules=PROVISIONAL, now=T0 + timedelta(minutes=30))
    assert not plain.released and not plain.unconfirmed and plain.review_at == T0 + RULES.start_deadline


@settings(max_examples=300, deadline=None)
@given(stream=clean_streams(), data=st.data(), minutes_later=st.floats(0, 900), stored_at=st.floats(-5, 600))
def test_stored_changes_nothing_but_confirmation(stream, data, minutes_later, stored_at) -> None:  # type: ignore[no-untyped-def]
    """STORED anywhere in any stream settles as the stream without it; a provisional run with any
    confirming fact settles as a run admitted for good."""
    events, samples = stream
    now = T0 + timedelta(minutes=minutes_later)
    rules = replace(RULES, provisional_hold=timedelta(minutes=data.draw(st.floats(0.5, 30))))
    plain = settle(facts(events, samples), bundle=BUNDLE, rules=rules, now=now)
    with_stored = [*events, ev(STORED, stored_at)]
    assert settle(facts(with_stored, samples), bundle=BUNDLE, rules=rules, now=now) == plain
    confirmed = settle(replace(facts(with_stored, samples), provisional=True), bundle=BUNDLE, rules=rules, now=now)
    assert confirmed == plain


@settings(max_examples=300, deadline=None)
@given(stream=clean_streams(), data=st.data(), minutes_later=st.floats(0, 30), keep=st.booleans())
def test_folding_a_provisional_run_gives_the_whole_run_settlement(stream, data, minutes_later, keep) -> None:  # type: ignore[no-untyped-def]
    """The reconciler's fold (settle_state) applies the provisional rule as `settle` does, whether
    facts confirm the run or not (keep=False: no facts at all)."""
    events, samples = stream if keep else ([], [])
    now = T0 + timedelta(minutes=minutes_later)
    oracle = settle(replace(facts(events, samples), provisional=True), bundle=BUNDLE, rules=PROVISIONAL, now=now)
    folded, _ = fold_all(replace(facts(), provisional=True), messy(data.draw, [*events, *samples]), now)
    assert folded.consumed == oracle.consumed
    assert replace(folded, consumed={}, windows={}) == replace(oracle, consumed={}, windows={})
    if not keep:
        assert oracle.released == (now >= T0 + PROVISIONAL.provisional_hold)
        assert oracle.unconfirmed == (now < T0 + PROVISIONAL.provisional_hold)


# --- usage accepted by metering-ingest but not yet at the reconciler (seed 20261131) ---------


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.floats(min_value=0.0, max_value=6.0, allow_nan=False), min_size=1, max_size=6),
    st.integers(min_value=0, max_value=5),
    st.integers(min_value=0, max_value=599),
)
def test_usage_still_in_flight_is_covered_by_what_stays_held_until_it_arrives(increments: list[float], received: int, after_end_s: int) -> None:
    # Samples one minute apart ending just before COMPLETED, cumulative; the reconciler has the
    # first `received` of them, metering-ingest accepted them all (`metered_through`).
    end_minute = 300
    times = [end_minute - len(increments) + i for i in range(len(increments))]
    cumulative = [sum(increments[: i + 1]) for i in range(len(increments))]
    everything = [sample(t, c) for t, c in zip(times, cumulative, strict=True)]
    folded = everything[: min(received, len(everything))]
    run = replace(facts([ev(STARTED, 0), ev(COMPLETED, end_minute)], folded, policies=(GPU,)), metered_through=everything[-1].observed_at)
    result = settle(run, bundle=BUNDLE, rules=RULES, now=T0 + timedelta(minutes=end_minute, seconds=after_end_s))
    total = everything[-1].gpu  # all the usage metering-ingest acknowledged (within the 48 GPU-hours reserved)
    consumed = sum(result.consumed_by_key().values())  # on whichever month's key it happened in
    if len(folded) < len(everything):
        assert not result.final  # within the provisional grace the end waits for it
        assert result.held[key(GPU)] + consumed >= total
    else:
        assert result.final and consumed == total
