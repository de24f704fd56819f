"""A hypothesis state machine over interleavings of submissions (one at a time and in concurrent
bursts), run ends, quota changes and Redis losses, on real Postgres and Redis: no hard quota is
ever exceeded, and Redis's counters always equal what Postgres holds."""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, datetime

import asyncpg
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule, run_state_machine_as_test

from budgetgate.ledger.concurrency_holds import end_run_holds
from budgetgate.ledger.queries import sql
from budgetgate.ledger.sharded import ShardedLedger
from budgetgate.services.admission.admitter import Admitter
from budgetgate.policies.policy_store import PolicyStore
from budgetgate.contracts.admission import AdmissionRequest
from tests.support.admission import apply_policies, budget_yaml
from budgetgate.runtime import redis_client

LIMITS = st.tuples(st.integers(0, 24), st.integers(0, 10), st.integers(0, 5))


def quota(tenant: str, limits: tuple[int, int, int]) -> str:
    gpus, nodes, allocations = limits
    return f"""apiVersion: budgetgate/v1
kind: Quota
metadata: {{id: q-{tenant}}}
spec: {{tenant: {tenant}, max_gpus: {gpus}, max_nodes: {nodes}, max_concurrent_allocations: {allocations}}}
"""


def make_machine(pg_dsn: str, redis_url: str, redis_prefix: str) -> type[RuleBasedStateMachine]:
    class QuotaMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.loop = asyncio.new_event_loop()
            self.tenant = f"t{uuid.uuid4().hex[:10]}"
            self.held: dict[str, tuple[int, int]] = {}  # run id → (gpus, nodes)
            self.limits = (0, 0, 0)
            self.run(self._connect())

        def run(self, coroutine):  # type: ignore[no-untyped-def]
            return self.loop.run_until_complete(coroutine)

        async def _connect(self) -> None:
            self.pool = await asyncpg.create_pool(pg_dsn, min_size=1, max_size=12)
            self.client = redis_client.connect(redis_url)
            ledgers = ShardedLedger(self.pool, self.client, prefix=f"{redis_prefix}-{self.tenant}")
            self.ledger, self.sync = ledgers.single, ledgers.sync_of(ledgers.single)
            self.policies = PolicyStore(self.pool)
            self.admitter = Admitter(pool=self.pool, ledgers=ledgers, policies=self.policies)

        async def _apply(self, limits: tuple[int, int, int]) -> None:
            files = {
                "q.yaml": quota(self.tenant, limits),
                "b.yaml": budget_yaml(f"b-{self.tenant}", namespace="physics", labels=f"{{team: {self.tenant}}}", limit="gpu_hours: 1000000"),
            }
            await apply_policies(pg_dsn, files, sha=uuid.uuid4().hex + "00000000")
            await self.policies.refresh()
            self.limits = limits

        def fits(self, gpus: int, nodes: int, held: dict[str, tuple[int, int]] | None = None) -> bool:
            held = self.held if held is None else held
            used_gpus = sum(g for g, _ in held.values())
            used_nodes = sum(n for _, n in held.values())
            max_gpus, max_nodes, max_allocations = self.limits
            return used_gpus + gpus <= max_gpus and used_nodes + nodes <= max_nodes and len(held) + 1 <= max_allocations

        async def _submit(self, gpus: int, nodes: int) -> tuple[str, dict]:  # type: ignore[type-arg]
            run_id = f"{self.tenant}/{uuid.uuid4().hex[:8]}"
            body = AdmissionRequest(
                run_id=run_id, namespace="physics", labels={"team": self.tenant}, resources={"gpus": gpus, "nodes": nodes}, projected_runtime_hours=1.0
            )
            return run_id, await self.admitter.admit(body, now=datetime.now(UTC))

        @initialize(limits=LIMITS)
        def start(self, limits: tuple[int, int, int]) -> None:
            self.run(self._apply(limits))

        @rule(gpus=st.integers(1, 8), nodes=st.integers(1, 4))
        def submit(self, gpus: int, nodes: int) -> None:
            expected = self.fits(gpus, nodes)
            run_id, answer = self.run(self._submit(gpus, nodes))
            assert (answer["decision"] == "ALLOW") == expected, answer["reason"]
            if expected:
                self.held[run_id] = (gpus, nodes)
            else:
                assert answer["reason"].startswith(f'allocation rejected: tenant "{self.tenant}" would exceed ')

        @rule(count=st.integers(2, 12), gpus=st.integers(1, 4))
        def burst(self, count: int, gpus: int) -> None:

            async def together() -> list[tuple[str, dict]]:  # type: ignore[type-arg]
                return await asyncio.gather(*(self._submit(gpus, 1) for _ in range(count)))

            answers = self.run(together())
            admitted = [run_id for run_id, a in answers if a["decision"] == "ALLOW"]
            # Whatever the interleaving, exactly as many as fit one after another are admitted.
            room, simulated = 0, dict(self.held)
            while room < count and self.fits(gpus, 1, simulated):
                simulated[f"probe-{room}"] = (gpus, 1)
                room += 1
            assert len(admitted) == room
            for run_id in admitted:
                self.held[run_id] = (gpus, 1)

        @precondition(lambda self: bool(self.held))
        @rule(data=st.data())
        def end(self, data: st.DataObject) -> None:
            run_id = data.draw(st.sampled_from(sorted(self.held)))

            async def end_it() -> None:
                async with self.pool.acquire() as conn, conn.transaction():
                    await conn.execute(sql("lock_ledger_shared"), 0)
                    await end_run_holds(conn, self.ledger, run_id)

            self.run(end_it())
            del self.held[run_id]

        @rule(limits=LIMITS)
        def change_quota(self, limits: tuple[int, int, int]) -> None:
            # Lowering below use preempts nothing: the model keeps every held run.
            self.run(self._apply(limits))

        @rule()
        def lose_redis(self) -> None:
            async def flush() -> None:
                keys = [k async for k in self.client.scan_iter(match=f"{self.ledger.tag}:*")]
                if keys:
                    await self.client.delete(*keys)

            self.run(flush())

        @invariant()
        def redis_and_postgres_agree_with_the_model(self) -> None:
            async def read() -> tuple[dict[bytes, bytes], tuple[int, int, int] | None, bool]:
                counter = await self.client.hgetall(self.ledger.keys.counter(f"t:{self.tenant}"))
                row = await self.pool.fetchrow(
                    "SELECT coalesce(sum(gpus), 0) AS g, coalesce(sum(nodes), 0) AS n, count(*) AS a FROM run_holds WHERE state = 'held' AND tenant = $1",
                    self.tenant,
                )
                return counter, (row["g"], row["n"], row["a"]), await self.ledger.is_loaded()

            counter, in_postgres, loaded = self.run(read())
            model = (sum(g for g, _ in self.held.values()), sum(n for _, n in self.held.values()), len(self.held))
            assert in_postgres == model
            if loaded:  # a missing counter means nothing is held
                assert tuple(int(counter.get(f, 0)) for f in (b"gpus", b"nodes", b"allocations")) == model

        def teardown(self) -> None:
            async def close() -> None:
                await self.client.aclose()
                await self.pool.close()

            self.run(close())
            self.loop.close()

    return QuotaMachine


def test_no_interleaving_exceeds_a_hard_quota(pg_dsn: str, redis_url: str, redis_prefix: str) -> None:
    machine = make_machine(pg_dsn, redis_url, redis_prefix)
    run_state_machine_as_test(
        machine,
        settings=settings(max_examples=25, stateful_step_count=15, deadline=None, suppress_health_check=list(HealthCheck)),
    )
