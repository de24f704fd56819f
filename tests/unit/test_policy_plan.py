"""The plan `policy diff` and `policy apply` print: what changes against the active bundle."""

from __future__ import annotations

from budgetgate.core.loader import build_bundle, parse_text
from budgetgate.core.policy import PolicyBundle
from budgetgate.core.policy_plan import emptiness, plan

BUDGET = """\
apiVersion: budgetgate/v1
kind: BudgetPolicy
metadata: {{id: {id}}}
spec:
  scope: {{namespace: ns-{id}}}
  window: {{calendar: month}}
  limit: {{{limit}}}
  enforcement: {enforcement}
"""
QUOTA = "apiVersion: budgetgate/v1\nkind: Quota\nmetadata: {{id: q}}\nspec: {{tenant: physics, max_gpus: {gpus}}}\n"
POOL = "apiVersion: budgetgate/v1\nkind: ResourcePool\nmetadata: {id: pool}\nspec: {namespace: snowflake, quota: 5}\n"


def bundle(*texts: str, sha: str = "s") -> PolicyBundle:
    return build_bundle([d for i, t in enumerate(texts) for d in parse_text(t, f"{i}.yaml")], git_sha=sha)


def budget(policy_id: str, limit: str = "gpu_hours: 100", enforcement: str = "hard") -> str:
    return BUDGET.format(id=policy_id, limit=limit, enforcement=enforcement)


def test_changes_name_before_and_after() -> None:
    old = bundle(budget("a"), budget("b"), QUOTA.format(gpus=8))
    new = bundle(budget("a", limit="gpu_hours: 150.5", enforcement="soft"), budget("c", limit="node_hours: 3"), QUOTA.format(gpus=16), POOL)
    assert [str(c) for c in plan(old, new)] == [
        "~ budget a: limit 100 gpu-hours; enforcement hard -> limit 150.5 gpu-hours; enforcement soft",
        "- budget b: 100 gpu-hours per month (UTC) on ns=ns-b, hard, on exhausted deny",
        "+ budget c: 3 node-hours per month (UTC) on ns=ns-c, hard, on exhausted deny",
        "+ pool pool: namespace snowflake, quota 5, lease_seconds 3600",
        "~ quota q: max_gpus 8 -> max_gpus 16",
    ]
    assert plan(new, new) == []
    assert [c.action for c in plan(None, old)] == ["added"] * 3


def test_an_empty_bundle_or_one_without_budgets_is_flagged() -> None:
    active = bundle(budget("a"))
    assert emptiness(active, bundle(), 0) == "the bundle holds no budgetgate documents"
    assert emptiness(active, bundle(QUOTA.format(gpus=1)), 1) == "the bundle removes every budget (1 active)"
    assert emptiness(None, bundle(QUOTA.format(gpus=1)), 1) is None
    assert emptiness(active, bundle(budget("b")), 1) is None
