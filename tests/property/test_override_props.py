"""The arithmetic of overrides and of an external remaining budget, for any figures: an external
figure equal to the ledger's own changes nothing, less room never lowers the penalty, and a
budget override's limit is the figure asked for, to the ledger's unit."""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Decimal

from hypothesis import given
from hypothesis import strategies as st

from budgetgate.core.accounting import EXTERNAL, BudgetSource, with_external
from budgetgate.core.evaluation import Reading, Resources, Submission, plan
from budgetgate.core.loader import build_bundle, parse_text
from budgetgate.core.overrides import Override
from budgetgate.core.quotas import soft_penalty
from budgetgate.core.units import MILLI_PER_HOUR, Unit, from_amount

SOFT = """apiVersion: budgetgate/v1
kind: BudgetPolicy
metadata: {id: soft}
spec:
  scope: {labels: {team: physics}}
  window: {calendar: week}
  limit: {gpu_hours: 1000}
  enforcement: soft
"""
BUNDLE = build_bundle(parse_text(SOFT, "s.yaml"), git_sha="a" * 40)
LIMIT = 1000 * MILLI_PER_HOUR
amounts = st.integers(min_value=0, max_value=2 * LIMIT)


def _plan(gpus: int):  # type: ignore[no-untyped-def]
    at = datetime(2026, 7, 14, tzinfo=UTC)
    return plan(BUNDLE, Submission("r", "physics", {"team": "physics"}, Resources(gpus=gpus), Decimal(1), at))


def _utilization(the_plan, readings) -> float:  # type: ignore[no-untyped-def]
    [charge] = the_plan.charges
    r = readings[charge.ledger_key]
    return (r.reserved + r.consumed + charge.amount) / r.limit


@given(reserved=amounts, consumed=amounts, gpus=st.integers(min_value=0, max_value=64))
def test_an_external_figure_equal_to_the_ledgers_changes_nothing(reserved: int, consumed: int, gpus: int) -> None:
    the_plan = _plan(gpus)
    key = the_plan.charges[0].ledger_key
    ledger = {key: Reading(LIMIT, reserved, consumed)}
    same = with_external(the_plan, ledger, BudgetSource("soft", EXTERNAL, LIMIT - reserved - consumed))
    assert same[key].remaining == ledger[key].remaining  # type: ignore[index]
    assert _utilization(the_plan, same) == _utilization(the_plan, ledger)


@given(remaining=st.integers(min_value=-LIMIT, max_value=2 * LIMIT), less=st.integers(min_value=0, max_value=LIMIT), gpus=st.integers(1, 64))
def test_less_room_by_the_accounting_system_never_lowers_the_penalty(remaining: int, less: int, gpus: int) -> None:
    the_plan = _plan(gpus)
    key = the_plan.charges[0].ledger_key
    ledger = {key: Reading(LIMIT, 0, 0)}
    more = with_external(the_plan, ledger, BudgetSource("soft", EXTERNAL, remaining))
    fewer = with_external(the_plan, ledger, BudgetSource("soft", EXTERNAL, remaining - less))
    assert fewer[key].remaining == remaining - less  # type: ignore[index]
    assert soft_penalty([_utilization(the_plan, fewer)]) >= soft_penalty([_utilization(the_plan, more)])


@given(hours=st.decimals(min_value=Decimal("0.001"), max_value=Decimal(10**9), places=3))
def test_a_budget_override_sets_the_limit_asked_for(hours: Decimal) -> None:
    amount = Override(float(hours), None, "soft").amount(Unit.GPU_HOURS)
    # float at the API's edge, then exact to the ledger's unit (a thousandth of a GPU-second).
    assert abs(from_amount(Unit.GPU_HOURS, amount) - hours) <= Decimal(1) / MILLI_PER_HOUR
