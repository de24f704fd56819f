"""The sharded ledger's tests' setting: six tenants on three shards, each with a 20 GPU-hour budget
of its own and a quota, submitting 8 GPU-hour runs (tests/integration/test_sharded_*.py)."""

from __future__ import annotations

from datetime import datetime, timedelta

import asyncpg

from budgetgate.core.shards import Shards
from budgetgate.ledger.queries import sql
from tests.support.reconciler import lifecycle, usage
from tests.support.admission import apply_policies, budget_yaml, reserved_in_redis, submission

SHARDS = 3
TENANTS = [f"team-{i}" for i in range(6)]
GPU_HOUR = 3_600_000
QUOTA = """apiVersion: budgetgate/v1
kind: Quota
metadata: {{id: quota-{tenant}}}
spec: {{tenant: {tenant}, max_gpus: 1000}}
"""


def policies() -> dict[str, str]:
    files = {f"{t}.yaml": budget_yaml(f"budget-{t}", namespace="ml", labels=f"{{team: {t}}}", limit="gpu_hours: 20") for t in TENANTS}
    return files | {f"quota-{t}.yaml": QUOTA.format(tenant=t) for t in TENANTS}


def ran_half_an_hour(run_id: str, start: datetime) -> tuple[object, ...]:
    """The feed of a run that started at `start` on its 8 GPUs, used 4 GPU-hours in half an hour
    and completed."""
    end = start + timedelta(minutes=30)
    return lifecycle(run_id, "STARTED", start, gpus=8), usage(run_id, "s1", end, gpu_hours=4.0), lifecycle(run_id, "COMPLETED", end)


def organisations_yaml(orgs: dict[str, str]) -> str:
    """An account tree placing each tenant (a team account scoped by its label) under its organisation."""
    docs = [f"apiVersion: budgetgate/v1\nkind: Account\nmetadata: {{id: {o}}}\nspec: {{level: organisation}}\n" for o in sorted(set(orgs.values()))]
    docs += [
        f"apiVersion: budgetgate/v1\nkind: Account\nmetadata: {{id: {o}-{t}}}\n"
        f"spec: {{level: team, parent: {o}, scope: {{namespace: ml, labels: {{team: {t}}}}}}}\n"
        for t, o in sorted(orgs.items())
    ]
    return "---\n".join(docs)


def run(tenant: str, n: int) -> dict[str, object]:
    return submission(
        run_id=f"{tenant}/run-{n}", namespace="ml", labels={"team": tenant}, resources={"gpus": 8, "nodes": 1}, projected_runtime_hours=1.0, job=None
    )


async def held_in_redis(server) -> dict[str, int]:  # type: ignore[no-untyped-def]
    """What Redis holds reserved, by ledger key, every shard's, as held_in_postgres lists it (keys
    holding nothing left out: a lease whose every decision was refused is still loaded)."""
    return {key: reserved for key, reserved in (await reserved_in_redis(server)).items() if reserved}


async def each_shard_holds_its_tenants_alone(server, held: dict[str, int], shards: Shards) -> None:  # type: ignore[no-untyped-def]
    """Every shard holds the ledger keys (of `held`, by key) and quota counters of the tenants
    `shards` places on it, and no other's."""
    for ledger in server.rt.ledgers:
        mine = [t for t in TENANTS if shards.of_root(t) == ledger.shard]
        keys = {k.decode().split(":l:", 1)[1] async for k in ledger.client.scan_iter(match=f"{ledger.tag}:l:*")}
        assert keys == {k for k in held if any(f"team={t}|" in k for t in mine)}, f"shard {ledger.shard} holds another root's keys"
        counters = {k.decode().split(":q:", 1)[1] async for k in ledger.client.scan_iter(match=f"{ledger.tag}:q:*")}
        assert counters == {f"t:{t}" for t in mine}


async def ledger_figures(dsn: str) -> dict[str, tuple[int, int]]:
    """Postgres's (reserved, consumed) of every ledger key."""
    conn = await asyncpg.connect(dsn)
    try:
        return {r["ledger_key"]: (r["reserved"], r["consumed"]) for r in await conn.fetch(sql("all_ledger_figures"))}
    finally:
        await conn.close()


async def sharded_admission(admission_factory, pg_dsn):  # type: ignore[no-untyped-def]
    await apply_policies(pg_dsn, policies(), sha="5" * 40)
    server = await admission_factory(ledger_shards=SHARDS, pg_pool_max=30)
    await server.wait_ready()
    return server
