"""The admission benchmark's workloads: the shared scenario adds one budget every submission
falls under, above what the team budgets fit together, so the team budgets still decide."""

from __future__ import annotations

import math

import pytest

from budgetgate.benchmark import workload
from budgetgate.core.loader import build_bundle, parse_text


@pytest.mark.parametrize("scenario", ["hot", "spread", "shared"])
def test_every_scenario_is_a_valid_bundle_and_only_shared_has_the_budget_every_submission_falls_under(scenario: str) -> None:
    work = workload.build(scenario, requests=100, warmup=10, budgets=5, allow_fraction=0.8, tag="t")
    bundle = build_bundle(parse_text(workload.policy_yaml(work.budgets, work.shared_gpu_hours), "p.yaml"), git_sha="a" * 40)
    shared = [p for p in bundle.policies if p.id == workload.SHARED_ID]
    assert len(bundle.policies) == len(work.budgets) + len(shared)
    if scenario != "shared":
        assert work.shared_gpu_hours is None and shared == []
        return
    team_hours = sum(b.limit_gpu_hours for b in work.budgets)
    assert work.shared_gpu_hours == math.ceil(workload.SHARED_HEADROOM * team_hours) > team_hours
    [policy] = shared
    assert policy.scope.matches("bench-003", {"team": "team-003", "environment": "prod"})  # every submission's labels
    assert "one they share" in work.description
