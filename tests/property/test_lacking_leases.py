"""Which escrow leases a refused reservation gets refilled (services.admission.admitter.lacking_leases),
over any readings of a decision's limits on a ledger of several shards: its tenant's own budget,
its lease of a budget tenants share, its tenant's quota and its lease of the sensitive pool. A
refill is asked exactly when every limit that lacked room is a lease, for exactly those leases,
each as its script read it; a limit a refill cannot grow (the tenant's own budget or quota) means
no refill at all."""

from __future__ import annotations

from datetime import UTC, datetime

from hypothesis import given
from hypothesis import strategies as st

from budgetgate.contracts.admission import AdmissionRequest
from budgetgate.core.escrow import Lease
from budgetgate.core.loader import build_bundle, parse_text
from budgetgate.decisions.deciding import prepare
from budgetgate.ledger.escrow_leases import BudgetBook, CounterBook
from budgetgate.ledger.redis_ledger import ReserveResult
from budgetgate.services.admission.admitter import lacking_leases
from tests.support.admission import budget_yaml, submission

GPU_HOUR = 3_600_000
QUOTA = "apiVersion: budgetgate/v1\nkind: Quota\nmetadata: {id: q}\nspec: {tenant: vision, max_gpus: 16}\n"
SENSITIVE = "apiVersion: budgetgate/v1\nkind: Quota\nmetadata: {id: sensitive}\nspec: {sensitive_pool_size: 32}\n"
BUNDLE = build_bundle(
    parse_text(
        "\n---\n".join([
            budget_yaml("own", namespace="ml", labels="{team: vision}", limit="gpu_hours: 100"),
            budget_yaml("everyone", namespace="ml", labels="{}", limit="gpu_hours: 1000"),
            QUOTA,
            SENSITIVE,
        ]),
        "policies.yaml",
    ),
    git_sha="a" * 40,
)  # fmt: skip
LABELS = {"team": "vision", "sensitive": "true"}
REQUEST = AdmissionRequest.model_validate(
    submission(run_id="r", namespace="ml", labels=LABELS, resources={"gpus": 4, "nodes": 1}, projected_runtime_hours=1.0, job=None)
)
PREPARED = prepare(BUNDLE, REQUEST, datetime.now(UTC), tenant_label="team", leased=True)


@given(
    own_used=st.integers(0, 110),  # GPU-hours of the tenant's own budget of 100 reserved or consumed
    lease=st.tuples(st.integers(0, 20), st.integers(0, 20)),  # its lease of the shared budget: size, used (GPU-hours)
    quota_held=st.integers(0, 16),  # GPUs the tenant holds of its quota of 16
    sensitive=st.tuples(st.integers(0, 12), st.integers(0, 12)),  # its lease of the sensitive pool: size, held (GPUs)
)
def test_a_refill_is_asked_exactly_when_only_leases_lack_room_and_for_those(
    own_used: int, lease: tuple[int, int], quota_held: int, sensitive: tuple[int, int]
) -> None:
    plan, asks = PREPARED.plan, PREPARED.asks
    assert [c.root for c in plan.charges] == [None, "vision"] or [c.root for c in plan.charges] == ["vision", None]
    readings, sizes = [], []
    for c in plan.charges:
        if c.root is None:
            readings.append((own_used * GPU_HOUR, 0))
            sizes.append(None)
        else:
            readings.append((lease[1] * GPU_HOUR, 0))
            sizes.append(lease[0] * GPU_HOUR)
    assert [(c.name, c.lease) for c in asks.counters] == [("t:vision", False), ("sensitive@vision", True)]
    result = ReserveResult(
        "REJECTED",
        readings=tuple(readings),
        sizes=tuple(sizes),
        counters=((quota_held, 1, 1), (sensitive[1], 1, 1)),
        counter_sizes=(None, sensitive[0]),
    )
    found = lacking_leases(BUNDLE, plan, asks, result, chunk_share=0.02)

    own_short = own_used + 4 > 100
    quota_short = quota_held + 4 > 16
    lease_short = lease[1] + 4 > lease[0]
    sensitive_short = sensitive[1] + 4 > sensitive[0]
    if own_short or quota_short or not (lease_short or sensitive_short):
        assert found == []
        return
    expected = set()
    if lease_short:
        budget = next(c for c in plan.charges if c.root is not None).budget_key
        expected.add((BudgetBook(budget), "vision", 4 * GPU_HOUR, Lease(lease[0] * GPU_HOUR, lease[1] * GPU_HOUR, 0)))
    if sensitive_short:
        expected.add((CounterBook("sensitive", "gpus", 32), "vision", 4, Lease(sensitive[0], sensitive[1])))
    assert {(lack.book, lack.root, lack.amount, lack.seen) for lack in found} == expected
    assert all(lack.chunk >= 1 for lack in found)
