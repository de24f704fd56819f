"""A reconciler that died between a settlement's Redis script and its Postgres commit left Redis
ahead of Postgres; the next reconciler repairs Redis before it settles anything."""

from __future__ import annotations

from budgetgate.ledger.redis_ledger import KeyChange
from tests.integration.test_reconciler import H, ledger_in_postgres, ledger_in_redis, reconciler_factory, wait_for  # noqa: F401 - fixture
from tests.support.admission import apply_policies, budget_yaml


async def test_redis_ahead_of_postgres_is_repaired_before_settling(admission_factory, reconciler_factory, pg_dsn) -> None:  # noqa: F811
    await apply_policies(pg_dsn, {"b.yaml": budget_yaml("r", limit="gpu_hours: 1000")}, sha="a" * 40)
    server = await admission_factory()
    await server.wait_ready()
    answer = (await server.submit(run_id="half-settled", labels={"team": "vision"}, resources={"gpus": 8}, projected_runtime_hours=10.0)).json()
    assert answer["decision"] == "ALLOW"
    truth = await ledger_in_postgres(pg_dsn)
    [key] = truth
    assert truth[key] == (80 * H, 0)
    # What a reconciler killed after its Redis script, before its commit, leaves behind.
    await server.rt.ledger.settle(run_id="half-settled", decision_id=answer["decision_id"], changes=[KeyChange(key, reserved=-80 * H, consumed=30 * H, held=0)], drop_run=True, now_ms=0)
    assert (await server.rt.ledger.readings([key]))[key] == (0, 30 * H)

    reconciler = await reconciler_factory(drift_check_seconds=0)  # only the start-up repair may act

    async def repaired() -> bool:
        return await ledger_in_redis(reconciler) == truth

    await wait_for(repaired, timeout=30, what="Redis rebuilt from Postgres at start-up")
    assert reconciler.stats.repairs == 1
    assert set(await reconciler.ledger.run_holds()) == {"half-settled"}
