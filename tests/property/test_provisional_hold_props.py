"""Provisional holds (budgetgate.core.reconciliation): a run the Kubernetes validating webhook
admitted is given back after the provisional hold unless a fact confirms its object; confirmed,
it follows the start deadline as any run, and STORED changes nothing else."""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from budgetgate.core.reconciliation import NOT_STARTED, STORED, settle
from tests.property.test_reconciliation_props import BUNDLE, GPU, RULES, T0, clean_streams, ev, facts, fold_all, key, messy, sample

pytestmark = pytest.mark.property

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
