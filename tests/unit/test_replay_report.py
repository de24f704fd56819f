"""Pieces of explain, replay and what-if without servers: periods, and how two answers differ."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import click
import pytest

from budgetgate.cli.explain import since
from budgetgate.decisions.explain import differences


def test_since_takes_periods_and_dates() -> None:
    now = datetime.now(UTC)
    assert abs(since("30d") - (now - timedelta(days=30))) < timedelta(seconds=5)
    assert abs(since("12h") - (now - timedelta(hours=12))) < timedelta(seconds=5)
    assert abs(since("2w") - (now - timedelta(days=14))) < timedelta(seconds=5)
    assert since("2026-01-01") == datetime(2026, 1, 1, tzinfo=UTC)
    assert since("2026-01-01T00:00:00+02:00").utcoffset() == timedelta(hours=2)
    with pytest.raises(click.BadParameter, match="30d"):
        since("last month")


def test_differences_name_each_field_decision_first() -> None:
    stored = {"reason": "a", "decision": "ALLOW", "evaluations": [{"remaining": 500.0, "limit": 500.0}], "replayed": True}
    recomputed = {"reason": "b", "decision": "DENY", "evaluations": [{"remaining": 452.0, "limit": 500.0}], "replayed": False}
    assert differences(stored, recomputed) == [
        "decision: stored 'ALLOW', recomputed 'DENY'",
        "reason: stored 'a', recomputed 'b'",
        "evaluations[0].remaining: stored 500.0, recomputed 452.0",
    ]
    assert differences(stored, stored) == []
    assert differences({"evaluations": [1]}, {"evaluations": [1, 2]}) == ["evaluations: stored [1], recomputed [1, 2]"]


def test_every_concurrency_refusal_names_its_limit_and_no_budget_reason_does() -> None:
    # What-if tells a decision a concurrency limit refused from the limit's own reason, which
    # replaced the budgets' (decisions/concurrency.py `refused`): each message must be told.
    from budgetgate.contracts.admission import AdmissionRequest
    from budgetgate.core.loader import build_bundle, parse_text
    from budgetgate.core.quotas import (
        Holdings,
        PoolOutcome,
        Request,
        SensitivePool,
        TenantQuota,
        concurrency_limit,
        pool_rejection,
        quota_violation,
        sensitive_violation,
    )
    from budgetgate.core.sources import Source
    from budgetgate.decisions.concurrency import asks, rejection
    from budgetgate.ledger.holds import PoolReading
    from budgetgate.ledger.redis_ledger import ReserveResult

    quota = TenantQuota("q", "vision", 8, 2, 1, None, None, Source("q.yaml", 1))
    for held, limit in ((Holdings(8, 0, 0), "max_gpus"), (Holdings(0, 2, 0), "max_nodes"), (Holdings(0, 0, 1), "max_concurrent_allocations")):
        reason = quota_violation("vision", quota, held, Request(1, 1))
        assert reason is not None and limit in reason and concurrency_limit(reason) == "tenant quota"
    sensitive = sensitive_violation(SensitivePool("s", 4, "gpus", "sensitive", "true", Source("s.yaml", 1)), Holdings(4, 0, 0), Request(1, 1))
    assert sensitive is not None and concurrency_limit(sensitive) == "sensitive pool"
    for check in ("EXHAUSTED", "CAP"):
        reason = pool_rejection([PoolOutcome("snowflake:wh-1", check, 1, 1)])
        assert reason is not None and concurrency_limit(reason) == "token pool"
    pool = "apiVersion: budgetgate/v1\nkind: ResourcePool\nmetadata: {id: wh}\nspec: {namespace: 'snowflake:wh-1', quota: 2, lease_seconds: 60}\n"
    bundle = build_bundle(parse_text(pool, "p.yaml"), git_sha="p" * 40)
    request = AdmissionRequest.model_validate(
        {"run_id": "r1", "namespace": "ns", "labels": {}, "resources": {"gpus": 1}, "projected_runtime_hours": 1, "pool_token": {"namespace": "snowflake:wh-1"}}
    )
    the_asks = asks(bundle, request, tenant_label="team", now=datetime.now(UTC))
    taken = rejection(bundle, request, the_asks, ReserveResult("REJECTED", pools=(PoolReading("TAKEN", 1, 0, 0),)))
    assert taken is not None and concurrency_limit(taken) == "token pool"
    for budgets in (
        "admitted: reserved on 1 budget",
        "denied: budget 'team' (scope x) has 0 GPU-hours",
        "delayed: budget 'team'",
        "denied: policy 'p' requires label team",
    ):
        assert concurrency_limit(budgets) is None
