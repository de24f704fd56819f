"""A reconciler that dies between the two halves of a settlement (before or after its Postgres
commit) never lets admission over-admit, and Redis converges on Postgres through another live
reconciler, with no restart and no rebuild."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

import asyncpg
import pytest

from budgetgate.core.reconciliation import Rules
from budgetgate.ledger.redis_ledger import RedisLedger
from budgetgate.ledger.sharded import ShardedLedger
from budgetgate.policies.policy_store import PolicyStore
from budgetgate.services.reconciler.settler import Settler
from tests.support.admission import apply_policies, budget_yaml, decision_of
from tests.support.reconciler import H, ledger_in_postgres, ledger_in_redis
from tests.support.reconciler import reconciler_factory  # noqa: F401 - pytest fixtures
from tests.support.waiting import wait_for


class Died(Exception):
    """This process is dead: it reaches Redis no more."""


class DyingLedger(RedisLedger):
    """The victim's Redis: it stops for good (as a killed process would) right after the half of
    a settlement named by `dies_after`, and reaches Redis no more."""

    def __init__(self, *args, dies_after: str, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.dies_after = dies_after
        self.dead = asyncio.Event()

    async def settle_begin(self, **kwargs) -> None:  # type: ignore[no-untyped-def, override]
        self._alive()
        await super().settle_begin(**kwargs)
        if self.dies_after == "begin":
            await self._die()

    async def settle_end(self, run_id: str, *, seq: int, committed: bool, token: str = "") -> bool:
        self._alive()
        if self.dies_after == "commit":
            await self._die()  # called after the commit: the second half never runs
        return await super().settle_end(run_id, seq=seq, committed=committed, token=token)

    async def invalidate(self, why: str) -> None:
        self._alive()

    async def _die(self) -> None:
        self.dead.set()
        await asyncio.Event().wait()

    def _alive(self) -> None:
        if self.dead.is_set():
            raise Died("the victim is dead")


async def _record_run_facts(dsn: str, run_id: str) -> None:
    """A run that completed using 30 of its 80 reserved GPU-hours, recorded but not yet marked."""
    start = datetime.now(UTC) - timedelta(hours=5)
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(
            "INSERT INTO lifecycle_events (event_id, run_id, kind, event_time) VALUES ($1, $2, 'STARTED', $3), ($4, $2, 'COMPLETED', $5)",
            f"{run_id}-s",
            run_id,
            start,
            f"{run_id}-c",
            start + timedelta(hours=4),
        )
        await conn.execute(
            "INSERT INTO run_samples (run_id, sample_id, observed_at, gpu, node) VALUES ($1, 'x', $2, $3, 0)", run_id, start + timedelta(hours=4), 30 * H
        )
    finally:
        await conn.close()


async def _execute(dsn: str, query: str) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(query)
    finally:
        await conn.close()


@pytest.mark.parametrize("dies_after", ["begin", "commit"])
async def test_a_reconciler_dying_mid_settlement_never_lets_admission_over_admit(dies_after, admission_factory, reconciler_factory, settings, pg_dsn) -> None:  # noqa: F811
    await apply_policies(pg_dsn, {"b.yaml": budget_yaml("cw", limit="gpu_hours: 100")}, sha="e" * 40)
    server = await admission_factory()
    await server.wait_ready()
    assert decision_of(await server.submit(run_id="victim", labels={"team": "vision"}, resources={"gpus": 8}, projected_runtime_hours=10.0)) == "ALLOW"
    [key] = await ledger_in_postgres(pg_dsn)
    survivor = await reconciler_factory(drift_check_seconds=0)
    await _record_run_facts(pg_dsn, "victim")

    pool = await asyncpg.create_pool(pg_dsn, min_size=1, max_size=2, server_settings={"application_name": "victim"})
    ledger = DyingLedger(survivor.redis, prefix=settings.redis_prefix, dies_after=dies_after)
    bundles = PolicyStore()
    async with pool.acquire() as conn:
        await bundles.refresh(conn)
    victim = Settler(pool=pool, ledgers=ShardedLedger.of(pool, ledger), bundles=bundles, rules=Rules())
    settling = asyncio.create_task(victim.settle("victim"))
    try:
        await asyncio.wait_for(ledger.dead.wait(), timeout=30)
        # The victim is gone between its halves; the survivor gets to its run only after the
        # in-between decision (settling first would rightly free the room).
        readings = (await survivor.ledger.readings([key]))[key]
        # Redis holds the increase (30 consumed) but not yet the release of the 80 reserved.
        assert readings == (80 * H, 30 * H)
        # Postgres says 20 (before the commit) or 70 (after) GPU-hours are free; Redis offers
        # fewer than either, so admission refuses what only the loosened ledger would allow.
        denied = (await server.submit(run_id="in-between", labels={"team": "vision"}, resources={"gpus": 1}, projected_runtime_hours=15.0)).json()
        assert denied["decision"] == "DENY"
        # Marked only now: marked before, the survivor's own tick (every 2 s) could settle it
        # ahead of the in-between decision on a loaded machine (CI once), which then fits.
        await _execute(pg_dsn, "INSERT INTO runs_to_settle (run_id) VALUES ('victim') ON CONFLICT DO NOTHING")
        survivor.wakeup.set()
        if dies_after == "begin":
            # A dead process's connection goes: Postgres rolls its transaction back.
            await _execute(pg_dsn, "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = 'victim'")

        async def converged() -> bool:
            return await ledger_in_redis(survivor) == await ledger_in_postgres(pg_dsn) == {key: (0, 30 * H)}

        await wait_for(converged, timeout=60, what="Redis converged on Postgres")
    finally:
        settling.cancel()
        await asyncio.gather(settling, return_exceptions=True)
        pool.terminate()
        await asyncio.sleep(0)  # let the terminated transports close
    assert await survivor.ledger.is_loaded() and survivor.stats.repairs == 0  # no rebuild
    assert await survivor.ledger.pending_settlements() == {}
    assert await survivor.ledger.run_holds() == {}
    assert (await server.submit(run_id="fits-now", labels={"team": "vision"}, resources={"gpus": 1}, projected_runtime_hours=60.0)).json()[
        "decision"
    ] == "ALLOW"
