"""Tenant overrides on a bundle, without servers: what they change, what they refuse, and the
rule a Git apply follows; and reading an accounting system's answers."""

from __future__ import annotations

from dataclasses import replace

import httpx
import pytest

from budgetgate.core.loader import build_bundle, parse_text
from budgetgate.core.overrides import InvalidOverride, OverrideSet, TenantOverrides, after_apply, effective, from_json, to_json, updated
from budgetgate.core.units import MILLI_PER_HOUR, Unit
from budgetgate.core.policy_plan import override_changes
from budgetgate.services.admission.accounting_source import BadAnswer, NoFigure, read

QUOTA = "apiVersion: budgetgate/v1\nkind: Quota\nmetadata: {{id: q}}\nspec: {{tenant: physics, {limits}}}\n"
CLUSTER = "apiVersion: budgetgate/v1\nkind: Cluster\nmetadata: {id: c}\nspec: {gpus: 100}\n"
SOFT = """apiVersion: budgetgate/v1
kind: BudgetPolicy
metadata: {{id: {id}}}
spec:
  scope: {{labels: {{team: physics{extra}}}}}
  window: {{calendar: week}}
  limit: {{gpu_hours: {hours}}}
  enforcement: soft
"""


def bundle(*texts: str, sha: str = "a" * 40):  # type: ignore[no-untyped-def]
    return build_bundle([d for i, t in enumerate(texts) for d in parse_text(t, f"f{i}.yaml")], git_sha=sha)


def overrides(revision: int, **fields) -> OverrideSet:  # type: ignore[no-untyped-def]
    return OverrideSet(revision, {"physics": TenantOverrides("physics", fields, revision)})


def test_overrides_replace_quotas_and_soft_limits_and_name_their_revision() -> None:
    git = bundle(QUOTA.format(limits="max_nodes: 10"), SOFT.format(id="soft", extra="", hours=1000))
    fields = updated({}, {"max_nodes": 5, "max_gpus": 64, "gpu_hours_budget": 12.5}, git, "physics", label="team")
    assert fields["max_nodes"].git == 10 and fields["max_gpus"].git is None and fields["gpu_hours_budget"].policy_id == "soft"
    found = effective(git, overrides(7, **fields))
    quota = found.quota_for("physics")
    assert (quota.max_nodes, quota.max_gpus, quota.id) == (5, 64, "q")
    assert found.policies[0].limit.amount == 12.5 * MILLI_PER_HOUR and found.override_revision == 7 and found.git_sha == git.git_sha
    # A tenant without a Quota document gets one from its overrides alone.
    other = effective(git, OverrideSet(3, {"chemistry": TenantOverrides("chemistry", updated({}, {"max_gpus": 2}, git, "chemistry", label="team"), 3)}))
    assert other.quota_for("chemistry").max_gpus == 2
    assert from_json(to_json(fields)) == fields
    assert updated(fields, {"max_nodes": None}, git, "physics", label="team").keys() == {"max_gpus", "gpu_hours_budget"}


@pytest.mark.parametrize(
    ("texts", "changes", "field", "words"),
    [
        ((QUOTA.format(limits="max_nodes: 10"),), {"gpu_hours_budget": 5}, "gpu_hours_budget", "no soft gpu_hours budget"),
        ((SOFT.format(id="a", extra="", hours=1), SOFT.format(id="b", extra=", x: y", hours=2)), {"gpu_hours_budget": 5}, "gpu_hours_budget", "2 soft"),
        ((QUOTA.format(limits="max_nodes: 10"),), {"burst_allowance": 2}, "burst_allowance", "fair_share_target"),
        ((QUOTA.format(limits="max_nodes: 10"),), {"fair_share_target": 0.5}, "fair_share_target", "Cluster"),
        ((SOFT.format(id="soft", extra="", hours=1000),), {"gpu_hours_budget": 1e-7}, "gpu_hours_budget", "would be a limit of 0"),
    ],
)
def test_an_override_that_cannot_apply_names_its_field(texts, changes, field, words) -> None:
    with pytest.raises(InvalidOverride, match=words) as caught:
        updated({}, changes, bundle(*texts), "physics", label="team")
    assert caught.value.field == field


def test_git_apply_keeps_what_git_left_alone_and_clears_what_it_changed() -> None:
    old = bundle(QUOTA.format(limits="max_nodes: 10, max_gpus: 80, fair_share_target: 0.2"), CLUSTER, SOFT.format(id="soft", extra="", hours=1000))
    fields = updated({}, {"max_nodes": 5, "max_gpus": 8, "gpu_hours_budget": 50, "burst_allowance": 2}, old, "physics", label="team")
    new = bundle(QUOTA.format(limits="max_nodes: 10, max_gpus: 40, fair_share_target: 0.2"), CLUSTER, sha="b" * 40)
    fates = {f.field: f for f in after_apply(overrides(4, **fields), new)}
    assert (fates["max_nodes"].kept, fates["max_nodes"].why) == (True, "Git unchanged at 10")
    assert (fates["max_gpus"].kept, fates["max_gpus"].why) == (False, "Git changes it: 80 -> 40")
    assert not fates["gpu_hours_budget"].kept and "no longer has soft gpu_hours budget 'soft'" in fates["gpu_hours_budget"].why
    assert fates["burst_allowance"].kept
    lines = [str(c) for c in override_changes(fates.values())]
    assert "= override physics max_nodes: 5 (kept: Git unchanged at 10)" in lines
    # Without the Cluster, a kept fair-share override no longer validates: the tenant's go.
    bare = bundle(QUOTA.format(limits="max_nodes: 10, max_gpus: 80"), sha="c" * 40)
    assert not any(f.kept for f in after_apply(overrides(4, **fields), bare))


@pytest.mark.parametrize("recorded_label", [True, False])
def test_a_budget_override_does_not_follow_its_policy_onto_another_tenant(recorded_label: bool) -> None:
    old = bundle(SOFT.format(id="soft", extra="", hours=1000))
    fields = updated({}, {"gpu_hours_budget": 50}, old, "physics", label="team")
    assert fields["gpu_hours_budget"].label == "team"
    if not recorded_label:  # an override stored before the label was
        fields = {"gpu_hours_budget": replace(fields["gpu_hours_budget"], label=None)}
    # Same id, unit, enforcement and limit: only the tenant its scope requires changed.
    moved = bundle(SOFT.format(id="soft", extra="", hours=1000).replace("team: physics", "team: chemistry"), sha="b" * 40)
    [fate] = after_apply(overrides(4, **fields), moved)
    assert not fate.kept and fate.why == "Git re-scoped budget 'soft' to team=chemistry"
    # Another label beside the tenant's leaves it the tenant's budget: kept.
    narrowed = bundle(SOFT.format(id="soft", extra=", tier: gold", hours=1000), sha="c" * 40)
    [fate] = after_apply(overrides(4, **fields), narrowed)
    assert fate.kept and fate.why == "Git unchanged at 1000"


def test_a_budget_override_is_rounded_down_like_a_git_limit() -> None:
    fields = updated({}, {"gpu_hours_budget": 1.9999999999}, bundle(SOFT.format(id="soft", extra="", hours=1000)), "physics", label="team")
    assert fields["gpu_hours_budget"].amount(Unit.GPU_HOURS) == 7_199_999


def test_an_override_keeps_its_tenant_label_through_storage() -> None:
    fields = updated({}, {"gpu_hours_budget": 50}, bundle(SOFT.format(id="soft", extra="", hours=1000)), "physics", label="team")
    stored = to_json(fields)
    assert stored["gpu_hours_budget"]["label"] == "team"
    assert from_json(stored) == fields


def _answer(status: int, content: bytes) -> httpx.Response:
    return httpx.Response(status, content=content, request=httpx.Request("GET", "http://accounting/api/budgets/physics/"))


@pytest.mark.parametrize(
    ("status", "content", "expected"),
    [
        (200, b'{"remaining_budget": 12.5}', 12.5 * MILLI_PER_HOUR),
        (200, b'{"remaining_budget": "1000.00"}', 1000 * MILLI_PER_HOUR),
        (200, b'{"remaining_budget": -3}', -3 * MILLI_PER_HOUR),
        (200, b'{"remaining_budget": "ten"}', BadAnswer),
        (200, b'{"remaining_budget": Infinity}', BadAnswer),
        (200, b'{"remaining_budget": 1e300}', BadAnswer),
        (200, b'{"remaining_budget": null}', BadAnswer),
        (200, b'[{"remaining_budget": 1}]', BadAnswer),
        (503, b"{}", BadAnswer),
        (404, b"{}", NoFigure),
    ],
)
def test_reading_a_remaining_budget(status, content, expected) -> None:
    if isinstance(expected, type):
        with pytest.raises(expected):
            read(_answer(status, content))
    else:
        assert read(_answer(status, content)) == expected
