"""The two measures' thresholds and a budget's state, by exact integer arithmetic."""

from __future__ import annotations

from fractions import Fraction

from hypothesis import given
from hypothesis import strategies as st

from budgetgate.core.thresholds import THRESHOLDS, budget_state, crossed

amounts = st.integers(min_value=0, max_value=10**15)


@given(amounts, st.integers(min_value=1, max_value=10**15))
def test_a_threshold_is_crossed_exactly_when_the_amount_reaches_its_share(amount: int, limit: int) -> None:
    assert crossed(amount, limit) == [t for t in THRESHOLDS if Fraction(amount, limit) >= Fraction(t, 100)]
    assert crossed(amount, limit) == sorted(crossed(amount, limit))


def test_boundaries() -> None:
    assert crossed(79_999, 100_000) == [] and crossed(80_000, 100_000) == [80] and crossed(100_000, 100_000) == [80, 100]
    assert crossed(5, 0) == []  # a budget of no limit never alerts


@given(amounts, amounts, st.integers(min_value=1, max_value=10**15), st.booleans())
def test_the_state_follows_the_two_measures(reserved: int, consumed: int, limit: int, held: bool) -> None:
    state = budget_state(reserved=reserved, consumed=consumed, limit=limit, held=held)
    if held:
        assert state == "held"
    elif consumed >= limit:
        assert state == "exhausted"
    elif reserved + consumed >= limit:
        assert state == "full"
    else:
        assert state == ("alerting" if (reserved + consumed) * 100 >= 80 * limit else "ok")
