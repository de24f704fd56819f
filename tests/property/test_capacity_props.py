"""The capacity model's arithmetic: linear in the platform's size, never planning a part busier
than its headroom, and unknown costs staying unknown."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from budgetgate.benchmark.capacity import Costs, Load, UnitCost, plan

us = st.floats(min_value=0.0, max_value=50_000.0, allow_nan=False)
maybe_us = st.one_of(st.none(), us)
costs = st.builds(
    Costs,
    decision=st.builds(UnitCost, us, maybe_us, maybe_us, maybe_us),
    sample=st.builds(UnitCost, us, maybe_us, maybe_us, maybe_us),
    record=st.one_of(st.none(), st.builds(UnitCost, us, us, us, us)),
)
loads = st.builds(
    Load,
    utilization=st.floats(0.05, 1.0),
    gpus_per_run=st.floats(0.5, 64.0),
    submissions_per_s_per_1000_gpus=st.floats(0.01, 100.0),
    sample_seconds=st.floats(1.0, 600.0),
    headroom=st.floats(0.1, 1.0),
    min_replicas=st.integers(1, 5),
)


@given(costs, loads, st.integers(1, 1_000_000))
def test_a_plan_is_linear_in_gpus_and_keeps_every_part_within_its_headroom(c: Costs, load: Load, gpus: int) -> None:
    one, two = plan(gpus, c, load), plan(2 * gpus, c, load)
    for part in ("admission", "metering", "reconciler", "postgres", "redis", "broker"):
        a, b = getattr(one, part), getattr(two, part)
        assert (a.cores_busy is None) == (b.cores_busy is None) == (a.units is None)
        if a.cores_busy is None:
            continue
        assert abs(b.cores_busy - 2 * a.cores_busy) <= 1e-9 * max(1.0, b.cores_busy)
        assert b.units >= a.units >= 1
        # What is planned holds the busy cores at the headroom or below.
        assert a.units * load.headroom >= a.cores_busy - 1e-9
    for name in ("admission", "metering", "reconciler"):
        need = getattr(one, name)
        assert need.units is None or need.units >= load.min_replicas
    assert one.complete == (c.record is not None)


@given(costs, loads)
def test_an_unknown_cost_is_never_planned_as_free(c: Costs, load: Load) -> None:
    p = plan(10_000, c, load)
    if c.decision.postgres is None or c.sample.postgres is None:
        assert p.postgres.cores_busy is None and p.postgres.units is None
    if c.record is None:
        assert p.reconciler.cores_busy is None
