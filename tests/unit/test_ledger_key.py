"""LedgerKey: the one place a ledger key is written and read."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from hypothesis import given
from hypothesis import strategies as st

from budgetgate.core.ledger_key import MAX_AMOUNT, AmountOutOfRange, LedgerKey, checked
from budgetgate.core.policy import BudgetPolicy, Enforcement, Limit, OnExhausted, Scope
from budgetgate.core.sources import Source
from budgetgate.core.units import Unit
from budgetgate.core.windows import WindowSpec, window_at


@given(
    scope=st.text(min_size=1).filter(lambda s: s.strip() == s and s),
    unit=st.sampled_from(["gpu_hours", "node_hours", "wall_hours", "cost"]),
    rolling=st.booleans(),
    day=st.integers(0, 3000),
)
def test_a_key_reads_back_as_written_whatever_its_scope(scope: str, unit: str, rolling: bool, day: int) -> None:
    at = datetime.fromordinal(datetime(2020, 1, 1).toordinal() + day).replace(tzinfo=UTC)
    window = window_at(WindowSpec(rolling_days=30) if rolling else WindowSpec(calendar="month"), at)
    key = LedgerKey(scope, window.key, unit)
    assert LedgerKey.parse(str(key)) == key
    assert key.rolling is rolling
    if not rolling:
        assert key.window() == window


def test_text_that_is_no_key_is_refused() -> None:
    for text in ("", "a|b", "|w|u", "s||u"):
        with pytest.raises(ValueError):
            LedgerKey.parse(text)


def test_amounts_are_bounded_both_ways() -> None:
    assert checked(MAX_AMOUNT, "x") == MAX_AMOUNT and checked(-MAX_AMOUNT, "x") == -MAX_AMOUNT
    for amount in (MAX_AMOUNT + 1, -MAX_AMOUNT - 1):
        with pytest.raises(AmountOutOfRange):
            checked(amount, "x")


@given(
    namespaces=st.frozensets(st.text(alphabet="abc-", min_size=1, max_size=5), max_size=3),
    labels=st.dictionaries(st.sampled_from(["team", "cost-center", "env"]), st.text(alphabet="xyz1", min_size=1, max_size=4), max_size=3),
    unit=st.sampled_from(list(Unit)),
    rolling=st.booleans(),
)
def test_the_key_text_of_a_policy_is_the_key_written_out(namespaces: frozenset[str], labels: dict[str, str], unit: Unit, rolling: bool) -> None:
    """The per-decision shortcut writes what `str(LedgerKey.of(...))` writes, and the scope id is
    the one the scope's predicates give, whichever order they were given in."""
    spec = WindowSpec(rolling_days=30) if rolling else WindowSpec(calendar="month")
    policy = BudgetPolicy(
        id="p",
        scope=Scope(namespaces=namespaces, labels=dict(reversed(list(labels.items())))),
        window=spec,
        limit=Limit(unit, 10, "USD" if unit is Unit.COST else None),
        enforcement=Enforcement.HARD,
        on_exhausted=OnExhausted.DENY,
        source=Source("t.yaml", 1),
    )
    window = window_at(spec, datetime(2026, 7, 14, tzinfo=UTC))
    assert LedgerKey.text_of(policy, window) == str(LedgerKey.of(policy, window))
    assert policy.scope.scope_id == Scope(namespaces=namespaces, labels=labels).scope_id
    assert LedgerKey.parse(LedgerKey.text_of(policy, window)).scope_id == policy.scope.scope_id
