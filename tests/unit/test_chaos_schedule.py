"""The campaign's plan is drawn from its seed alone: same seed, same operations and faults."""

from __future__ import annotations

from collections import Counter

import pytest

from budgetgate.chaos.schedule import FAULT_KINDS, plan


def test_the_same_seed_plans_the_same_operations_and_faults() -> None:
    first, again = plan(42, 120.0), plan(42, 120.0)
    assert first.operations == again.operations
    assert first.faults == again.faults
    assert first.budgets == again.budgets
    assert first.fingerprint() == again.fingerprint()


def test_another_seed_plans_another_campaign() -> None:
    a, b = plan(1, 120.0), plan(2, 120.0)
    assert a.fingerprint() != b.fingerprint()
    assert [o.params.get("body") for o in a.operations[:5]] != [o.params.get("body") for o in b.operations[:5]]
    assert [(f.kind, f.at) for f in a.faults] != [(f.kind, f.at) for f in b.faults]


def test_the_plan_has_every_kind_of_operation() -> None:
    kinds = Counter(o.kind for o in plan(3, 300.0).operations)
    for kind in ("submit", "retry", "conflict", "lifecycle", "sample", "policy-apply", "tenant-override", "pool-allocate", "pool-release"):
        assert kinds[kind] > 0, kind
    samples = [o for o in plan(3, 300.0).operations if o.kind == "sample"]
    assert any(o.params.get("resend") for o in samples), "duplicate samples"
    assert any(o.params.get("late_by") for o in samples), "late samples"


def test_a_short_campaign_still_injects_every_fault_kind() -> None:
    faults = plan(5, 240.0).faults
    assert set(FAULT_KINDS) <= {f.kind for f in faults}
    assert all(0 < f.at < 240.0 * 0.85 for f in faults)
    assert all(a.at + a.duration <= b.at for a, b in zip(faults, faults[1:], strict=False)), "one fault at a time"


def test_operations_are_in_time_order_within_the_campaign() -> None:
    p = plan(9, 60.0)
    times = [o.at for o in p.operations]
    assert times == sorted(times)
    assert max(times) <= 60.0
    assert [o.index for o in p.operations] == list(range(len(p.operations)))


def test_every_run_ends_after_it_starts() -> None:
    started: dict[str, float] = {}
    for op in plan(11, 90.0).operations:
        if op.kind == "lifecycle" and op.params["type"] == "STARTED":
            started[op.params["run_id"]] = op.at
        elif op.kind == "lifecycle":
            assert op.at >= started[op.params["run_id"]]


def test_a_fault_kind_can_be_chosen_and_unknown_ones_are_refused() -> None:
    assert {f.kind for f in plan(1, 120.0, fault_kinds=("redis-flushall",)).faults} == {"redis-flushall"}
    assert plan(1, 120.0, faults=False).faults == ()
    with pytest.raises(ValueError, match="unknown fault kind"):
        plan(1, 60.0, fault_kinds=("power-cut",))
    with pytest.raises(ValueError, match="positive"):
        plan(1, 0.0)
