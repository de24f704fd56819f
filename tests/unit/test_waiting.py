"""Runs refused for now (core/waiting.py): what they wait for, and how the limits that refused
them stand against figures as they are now."""

from __future__ import annotations

from datetime import UTC, datetime

from budgetgate.core.evaluation import Reading, ledger_key
from budgetgate.core.loader import build_bundle, parse_text
from budgetgate.core.quotas import Holdings
from budgetgate.core.waiting import BUDGET, QUOTA, BudgetNeed, WaitingRun, budget_needs, current_keys, judge, waiting_for
from budgetgate.core.windows import window_at

H = 3_600_000
NOW = datetime(2026, 7, 14, 9, 30, tzinfo=UTC)
DOCS = """apiVersion: budgetgate/v1
kind: BudgetPolicy
metadata: {id: physics-gpus}
spec:
  scope: {namespace: physics, labels: {team: physics}}
  window: {calendar: month}
  limit: {gpu_hours: 100}
  enforcement: hard
  on_exhausted: delay
---
apiVersion: budgetgate/v1
kind: Quota
metadata: {id: tenant-physics}
spec: {tenant: physics, max_nodes: 10, max_gpus: 64}
---
apiVersion: budgetgate/v1
kind: Quota
metadata: {id: sensitive}
spec: {sensitive_pool_size: 16}
"""
BUNDLE = build_bundle(parse_text(DOCS, "p.yaml"), git_sha="a" * 40)


def run(kind: str, *, needs: tuple[BudgetNeed, ...] = (), labels: dict[str, str] | None = None, gpus: int = 8, nodes: int = 2) -> WaitingRun:
    return WaitingRun("r", 1, "d", kind, "physics", labels or {"team": "physics"}, gpus, nodes, needs, NOW)


def test_what_a_decision_leaves_its_run_waiting_for() -> None:
    assert waiting_for("DELAY", "budget 'x' has no room") == BUDGET
    assert waiting_for("DENY", 'allocation rejected: tenant "physics" would exceed max_nodes quota (current: 9, requested: 2, limit: 10)') == QUOTA
    assert waiting_for("DENY", "allocation rejected: sensitive workloads would exceed sensitive_pool_size (current: 12, requested: 8, limit: 16 gpus)") == QUOTA
    assert waiting_for("DENY", "missing labels: team") is None
    assert waiting_for("DENY", "budget 'x' is exhausted") is None
    assert waiting_for("ALLOW", "admitted") is None


def test_the_needs_are_the_hard_budgets_that_refused() -> None:
    evaluations = [("a", "gpu_hours", "hard", "DELAY", 8 * H), ("b", "gpu_hours", "soft", "ALLOW", 8 * H), ("c", "cost", "hard", "ALLOW", 5)]
    assert budget_needs(evaluations) == (BudgetNeed("a", "gpu_hours", 8 * H),)


def test_a_budget_wait_is_judged_in_the_current_window_with_the_limit_now() -> None:
    waiting = run(BUDGET, needs=(BudgetNeed("physics-gpus", "gpu_hours", 8 * H),))
    [key] = current_keys(waiting, BUNDLE, NOW).values()
    policy = BUNDLE.policies[0]
    assert key == ledger_key(policy, window_at(policy.window, NOW))
    full = judge(waiting, BUNDLE, now=NOW, ledger={key: Reading(100 * H, 40 * H, 55 * H)}, tenant_held=Holdings(), sensitive_held=Holdings())
    [limit] = full.limiting
    assert (limit.kind, limit.limit, limit.used, limit.requested, limit.fits, full.fits) == ("budget", 100 * H, 95 * H, 8 * H, False, False)
    assert full.describe() == "budget 'physics-gpus' (gpu_hours): 95 of 100 used, needs 8: does not fit"
    room = judge(waiting, BUNDLE, now=NOW, ledger={key: Reading(100 * H, 0, 92 * H)}, tenant_held=Holdings(), sensitive_held=Holdings())
    assert room.fits and room.limiting[0].reserved == 0 and room.limiting[0].consumed == 92 * H
    # A key with no row yet (a new window) is empty.
    assert judge(waiting, BUNDLE, now=NOW, ledger={}, tenant_held=Holdings(), sensitive_held=Holdings()).fits


def test_a_budget_that_no_longer_refuses_limits_nothing() -> None:
    gone = run(BUDGET, needs=(BudgetNeed("removed-policy", "gpu_hours", 8 * H), BudgetNeed("physics-gpus", "node_hours", H)))
    found = judge(gone, BUNDLE, now=NOW, ledger={}, tenant_held=Holdings(), sensitive_held=Holdings())
    assert found.limiting == () and found.fits and current_keys(gone, BUNDLE, NOW) == {}


def test_a_quota_wait_is_judged_on_what_the_tenant_and_sensitive_work_hold_now() -> None:
    waiting = run(QUOTA, labels={"team": "physics", "sensitive": "true"}, gpus=8, nodes=2)
    assert waiting.sensitive(BUNDLE) and not run(QUOTA).sensitive(BUNDLE)
    found = judge(waiting, BUNDLE, now=NOW, ledger={}, tenant_held=Holdings(gpus=40, nodes=9, allocations=3), sensitive_held=Holdings(gpus=4))
    assert [(limit.name, limit.used, limit.limit, limit.requested, limit.fits) for limit in found.limiting] == [
        ("max_gpus", 40, 64, 8, True),
        ("max_nodes", 9, 10, 2, False),
        ("sensitive_pool_size", 4, 16, 8, True),
    ]
    assert not found.fits
    assert 'tenant "physics" max_nodes: 9 of 10 held, needs 2: does not fit' in found.describe()
    later = judge(waiting, BUNDLE, now=NOW, ledger={}, tenant_held=Holdings(gpus=40, nodes=8, allocations=3), sensitive_held=Holdings(gpus=4))
    assert later.fits


def test_a_wait_is_judged_on_the_limit_with_the_windows_grants() -> None:
    from dataclasses import replace

    from budgetgate.core.grants import by_window
    from budgetgate.core.policy import Grant
    from budgetgate.core.units import Unit

    waiting = run(BUDGET, needs=(BudgetNeed("physics-gpus", "gpu_hours", 8 * H),))
    [key] = current_keys(waiting, BUNDLE, NOW).values()
    policy = BUNDLE.policies[0]
    grant = Grant(5, policy.id, policy.scope.scope_id, Unit.GPU_HOURS, key, NOW, NOW, 10 * H, 100 * H, 110 * H, "token:finance", "committee", NOW)
    granted = replace(BUNDLE, grants=by_window([grant]), override_revision=5)
    ledger = {key: Reading(110 * H, 40 * H, 55 * H)}
    found = judge(waiting, granted, now=NOW, ledger=ledger, tenant_held=Holdings(), sensitive_held=Holdings())
    assert found.fits and found.describe() == "budget 'physics-gpus' (gpu_hours): 95 of 110 used, needs 8: fits"
    # Without the grant the same figures do not fit.
    assert not judge(waiting, BUNDLE, now=NOW, ledger=ledger, tenant_held=Holdings(), sensitive_held=Holdings()).fits
