"""Quota arithmetic: the exact rejection message, the penalty curve, fair share, pools."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st

from budgetgate.core.decay import Decayed, steady_amount
from budgetgate.core.policy import Source, pool_chain
from budgetgate.core.quotas import (
    Cluster,
    Holdings,
    PoolOutcome,
    Request,
    SensitivePool,
    TenantQuota,
    fair_share,
    pool_rejection,
    priority_penalty,
    quota_violation,
    sensitive_violation,
    soft_penalty,
)

SRC = Source("q.yaml", 1)
PHYSICS = TenantQuota("tenant-physics", "physics", 1600, 200, 50, 0.25, 1.5, SRC)


def test_the_exact_rejection_message() -> None:
    reason = quota_violation("physics", PHYSICS, Holdings(gpus=100, nodes=195, allocations=3), Request(gpus=8, nodes=10))
    assert reason == 'allocation rejected: tenant "physics" would exceed max_nodes quota (current: 195, requested: 10, limit: 200)'


def test_each_limit_in_turn() -> None:
    assert (
        quota_violation("physics", PHYSICS, Holdings(1599, 0, 0), Request(2, 1))
        == 'allocation rejected: tenant "physics" would exceed max_gpus quota (current: 1599, requested: 2, limit: 1600)'
    )
    assert quota_violation("physics", PHYSICS, Holdings(0, 0, 50), Request(1, 1)).startswith(
        'allocation rejected: tenant "physics" would exceed max_concurrent_allocations quota (current: 50, requested: 1, limit: 50)'
    )
    assert quota_violation("physics", PHYSICS, Holdings(1592, 190, 49), Request(8, 10)) is None


def test_a_lowered_quota_rejects_until_usage_drops_and_says_why() -> None:
    lowered = TenantQuota("q", "physics", None, 100, None, None, None, SRC)
    reason = quota_violation("physics", lowered, Holdings(nodes=150), Request(gpus=1, nodes=1))
    assert reason is not None and reason.startswith(
        'allocation rejected: tenant "physics" would exceed max_nodes quota (current: 150, requested: 1, limit: 100)'
    )
    assert "wait for running work" in reason and "tenant admin" in reason


def test_sensitive_pool() -> None:
    pool = SensitivePool("s", 64, "gpus", "sensitive", "true", SRC)
    assert pool.covers({"sensitive": "true"}) and not pool.covers({"sensitive": "false"})
    assert (
        sensitive_violation(pool, Holdings(gpus=60), Request(8, 1))
        == "allocation rejected: sensitive workloads would exceed sensitive_pool_size (current: 60, requested: 8, limit: 64 gpus)"
    )
    assert sensitive_violation(pool, Holdings(gpus=56), Request(8, 1)) is None


@pytest.mark.parametrize(
    ("utilization", "expected"),
    [(0.0, 0.0), (0.79, 0.0), (0.80, 0.0), (0.90, 0.45), (1.00, 0.9), (1.50, 0.999326)],
)
def test_penalty_curve(utilization: float, expected: float) -> None:
    assert priority_penalty(utilization) == pytest.approx(expected, abs=1e-6)


def test_penalty_is_close_to_one_beyond_the_budget() -> None:
    assert 0.99 < priority_penalty(1.5) < 1.0
    assert priority_penalty(float("inf")) == 1.0


@given(st.floats(min_value=0, max_value=10), st.floats(min_value=0, max_value=10))
def test_penalty_is_monotone_and_bounded(a: float, b: float) -> None:
    low, high = sorted((a, b))
    assert 0.0 <= priority_penalty(low) <= priority_penalty(high) <= 1.0


def test_worse_of_rule() -> None:
    # GPU-hours 90 % used, node-hours 120 % used: the node-hour budget drives the penalty.
    assert soft_penalty([0.9, 1.2]) == priority_penalty(1.2)
    assert soft_penalty([0.5, 0.7]) == 0.0
    assert soft_penalty([]) == 0.0


def test_fair_share_below_and_above_target() -> None:
    cluster = Cluster("c", 2048, None, SRC)
    below = fair_share(PHYSICS, cluster, Holdings(gpus=256), Request(64, 8))
    assert below is not None and below.share == 0.125 and below.deficit == 0.125 and not below.preemptible
    above = fair_share(PHYSICS, cluster, Holdings(gpus=600), Request(64, 8))
    assert above is not None and above.deficit < 0 and above.preemptible and above.burst_limit == 0.375


def test_fair_share_measures_the_deficit_on_decayed_usage() -> None:
    cluster, week = Cluster("c", 2048, None, SRC), timedelta(days=7)
    # Holding nothing now, but 512 GPUs steadily until lately: the raw share says 0, the decayed
    # share remembers the quarter of the cluster, so the tenant is at its target, not below it.
    usage = Decayed(steady_amount(512, week), datetime(2026, 7, 1, tzinfo=UTC), week)
    share = fair_share(PHYSICS, cluster, Holdings(gpus=0), Request(64, 8), usage)
    assert share is not None and share.share == 0.0 and share.decayed_share == 0.25 and share.half_life_hours == 168.0
    assert share.deficit == 0.0 and not share.preemptible  # preemptible follows what is held, raw
    idle = fair_share(PHYSICS, cluster, Holdings(gpus=0), Request(64, 8), Decayed.empty(week, usage.reckoned))
    assert idle is not None and idle.decayed_share == 0.0 and idle.deficit == 0.25
    raw = fair_share(PHYSICS, cluster, Holdings(gpus=0), Request(64, 8))
    assert raw is not None and raw.decayed_share is None and raw.half_life_hours is None and raw.deficit == 0.25


def test_pool_chain_and_rejections() -> None:
    assert pool_chain("qubole:cluster-abc") == ["qubole:cluster-abc", "qubole"]
    assert pool_rejection([PoolOutcome("a", "OK", 1, 5)]) is None
    assert pool_rejection([PoolOutcome("a:b", "CAP", 1, 5), PoolOutcome("a", "EXHAUSTED", 9, 9)]) == 'token pool "a" is exhausted (used: 9, quota: 9)'
    assert "cap is reached" in pool_rejection([PoolOutcome("a", "CAP", 1, 5)])
