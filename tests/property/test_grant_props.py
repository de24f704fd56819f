"""The arithmetic of grants, for any sequence of them: a window's limit is the policy's plus what
was granted and never goes below zero; a grant that would take it there is refused and changes
nothing; each grant's `before` is the previous one's `after`; the plan reserves against exactly
that limit; and another window is untouched."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest
from hypothesis import given
from hypothesis import strategies as st

from budgetgate.core.evaluation import Resources, Submission, plan
from budgetgate.core.grants import Grant, InvalidGrant, amount_of, ask, by_window
from budgetgate.core.loader import build_bundle, parse_text
from budgetgate.core.units import MILLI_PER_HOUR, Unit, from_amount

pytestmark = pytest.mark.property

HARD = """apiVersion: budgetgate/v1
kind: BudgetPolicy
metadata: {id: gpu/physics}
spec:
  scope: {namespace: physics, labels: {team: physics}}
  window: {fiscal_year: {start_month: 4}, timezone: Europe/Berlin}
  limit: {gpu_hours: 100}
  enforcement: hard
"""
BUNDLE = build_bundle(parse_text(HARD, "h.yaml"), git_sha="a" * 40)
LIMIT = 100 * MILLI_PER_HOUR
NOW = datetime(2026, 7, 14, 9, 30, tzinfo=UTC)

# Hours as finance writes them: whole, halves, and to the thousandth, either way.
hours = st.decimals(min_value=-300, max_value=300, places=3, allow_nan=False, allow_infinity=False)


def _granted(grants: list[Grant]):  # type: ignore[no-untyped-def]
    return replace(BUNDLE, grants=by_window(grants), override_revision=len(grants))


@given(asked=st.lists(hours, max_size=12))
def test_the_limit_is_the_policys_plus_the_grants_made_and_never_below_zero(asked: list[Decimal]) -> None:
    made: list[Grant] = []
    for figure in asked:
        bundle = _granted(made)
        policy = bundle.policies[0]
        amount = amount_of(Unit.GPU_HOURS, figure) if figure else 0
        try:
            checked = ask(bundle, policy_id=policy.id, scope_id=None, window=None, value=figure, reason="r", now=NOW)
        except InvalidGrant as exc:
            # Refused only for a zero, or for taking more than the window has.
            assert exc.field == "amount"
            assert amount == 0 or LIMIT + sum(g.amount for g in made) + amount < 0
            continue
        key = checked.ledger_key
        assert checked.limit_before == bundle.limit_of(policy, key) == LIMIT + sum(g.amount for g in made)
        assert checked.limit_after == checked.limit_before + amount >= 0
        if made:
            assert checked.limit_before == made[-1].limit_after
        made.append(
            Grant(len(made) + 1, policy.id, policy.scope.scope_id, Unit.GPU_HOURS, key, checked.window.start, checked.window.end,
                  checked.amount, checked.limit_before, checked.limit_after, "actor", "r", NOW)
        )  # fmt: skip
    bundle = _granted(made)
    # A run is judged against exactly that limit in this window, and against the policy's own in the next.
    here = plan(bundle, Submission("r", "physics", {"team": "physics"}, Resources(gpus=1), Decimal(1), NOW))
    assert here.charges[0].policy.limit.amount == LIMIT + sum(g.amount for g in made) >= 0
    assert here.granted == ({here.charges[0].ledger_key: (LIMIT, tuple(made))} if made else {})
    later = plan(bundle, Submission("r", "physics", {"team": "physics"}, Resources(gpus=1), Decimal(1), NOW + timedelta(days=366)))
    assert later.charges[0].policy.limit.amount == LIMIT and later.granted == {}


@given(figure=hours)
def test_a_grant_is_the_figure_asked_to_the_ledgers_unit(figure: Decimal) -> None:
    if figure == 0:
        with pytest.raises(InvalidGrant):
            amount_of(Unit.GPU_HOURS, figure)
        return
    amount = amount_of(Unit.GPU_HOURS, figure)
    assert from_amount(Unit.GPU_HOURS, amount) == figure  # thousandths of an hour are whole ledger units
    assert (amount > 0) == (figure > 0)
