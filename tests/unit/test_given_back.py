"""An operator's release of a run whose settlement keeps failing (run_state.given_back): what it
holds is given back, nothing it was charged moves, and time reviews it no more."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from budgetgate.core.policy import BudgetPolicy, Enforcement, Limit, OnExhausted, Scope, Source
from budgetgate.core.reconciliation import CALENDAR_BUCKET, COMPLETED, STARTED, LifecycleFact, Reservation, RunFacts
from budgetgate.core.run_state import RunState, given_back
from budgetgate.core.units import Unit
from budgetgate.core.windows import WindowSpec

H = 3_600_000
T0 = datetime(2026, 3, 2, 9, 0, tzinfo=UTC)
GPU = BudgetPolicy(
    id="gpu", scope=Scope(labels={"team": "vision"}), window=WindowSpec(calendar="month"), limit=Limit(Unit.GPU_HOURS, 1000 * H, None),
    enforcement=Enforcement.HARD, on_exhausted=OnExhausted.DENY, source=Source("t.yaml", 1),
)  # fmt: skip


def _run(*events: LifecycleFact, released: bool = False) -> RunFacts:
    return RunFacts(
        run_id="r", admitted_at=T0, reservations=(Reservation(GPU, "k", 10 * H),), gpus=1, nodes=1, projected_gpu=10 * H,
        events=frozenset(events), released=released,
    )  # fmt: skip


STARTED_AT = LifecycleFact("s", STARTED, T0)
ENDED = LifecycleFact("e", COMPLETED, T0 + timedelta(hours=1))
USED = RunState(gpu=2 * H, node=0, covered=T0 + timedelta(minutes=30), used={"gpu": 11 * H})
TIMED = {("w", CALENDAR_BUCKET): 7}


def test_an_open_run_gives_back_its_hold_and_keeps_its_charges() -> None:
    last = {"final": False, "provisional": False, "released": False, "wall": 60_000, "actual_gpu": 2 * H}
    result = given_back(_run(STARTED_AT, ENDED), USED, TIMED, last=last)
    assert result.held == {"k": 0} and result.released and not result.final
    assert result.consumed == TIMED and result.review_at is None
    assert (result.phase, result.ended_at, result.final_state) == ("ended", ENDED.at, None)  # ended, not reconciled: no final state
    assert (result.wall, result.actual_gpu, result.metered_gpu, result.projected_gpu) == (60_000, 2 * H, 2 * H, 10 * H)
    assert result.over_running  # 11 used of 10 admitted


def test_a_run_never_settled_is_given_back_as_admitted() -> None:
    result = given_back(_run(), RunState(), {}, last=None)
    assert (result.phase, result.released, result.final, result.wall, result.actual_gpu) == ("admitted", True, False, 0, 0)
    assert result.held == {"k": 0} and result.consumed == {} and not result.over_running


def test_a_final_run_stays_final_and_is_not_released() -> None:
    last = {"final": True, "provisional": True, "released": False, "wall": 60_000, "actual_gpu": 3 * H}
    result = given_back(_run(STARTED_AT, ENDED), USED, TIMED, last=last)
    assert result.final and result.provisional and not result.released
    assert (result.final_state, result.actual_gpu) == (COMPLETED, 3 * H)
