"""Budgets attached to accounts of the tree, on a real admission server with Postgres and Redis:
a run charges its own account's budget and every budgeted account above it, all or none, each
filed under `account=<id>`; a run of another branch charges only the common ancestor."""

from __future__ import annotations

import asyncpg

from tests.support.accounts import account_budget, account_tree
from tests.support.admission import apply_policies, held_in_postgres, reserved_in_redis

GPU_HOUR = 3_600_000  # the ledger's unit: milli-GPU-seconds

TREE = account_tree() + account_budget("research-month", "research", 12) + account_budget("alice-month", "alice", 10)


def run(run_id: str, namespace: str, gpus: int, **labels: str) -> dict[str, object]:
    return {
        "run_id": run_id,
        "attempt": 1,
        "namespace": namespace,
        "labels": labels,
        "resources": {"gpus": gpus, "nodes": 1, "flavor": "h100"},
        "projected_runtime_hours": 1.0,
    }


async def ledger_keys(dsn: str) -> dict[str, str]:
    conn = await asyncpg.connect(dsn)
    try:
        return {r["policy_id"]: r["ledger_key"] for r in await conn.fetch("SELECT policy_id, ledger_key FROM ledger_entries")}
    finally:
        await conn.close()


async def test_a_run_charges_its_account_and_every_budgeted_account_above_it_all_or_none(admission_factory, pg_dsn) -> None:
    await apply_policies(pg_dsn, {"accounts.yaml": TREE}, sha="a" * 40)
    server = await admission_factory()
    await server.wait_ready()

    first = (await server.client.post("/v1/admissions", json=run("alice-1", "vision", 8, team="vision", user="alice"))).json()
    assert first["decision"] == "ALLOW", first
    assert {e["policy_id"]: e["scope_id"] for e in first["evaluations"]} == {"research-month": "account=research", "alice-month": "account=alice"}
    keys = await ledger_keys(pg_dsn)
    assert await held_in_postgres(pg_dsn) == {keys["research-month"]: 8 * GPU_HOUR, keys["alice-month"]: 8 * GPU_HOUR}

    # nlp has no budget of its own: the department's 4 remaining GPU-hours refuse 5.
    refused = (await server.client.post("/v1/admissions", json=run("nlp-1", "nlp", 5))).json()
    assert refused["decision"] == "DENY" and "research-month" in refused["reason"], refused
    # alice has 2 left of her own: 3 is refused, and nothing is held on the department for it.
    over = (await server.client.post("/v1/admissions", json=run("alice-2", "vision", 3, team="vision", user="alice"))).json()
    assert over["decision"] == "DENY" and "alice-month" in over["reason"], over
    assert await held_in_postgres(pg_dsn) == {keys["research-month"]: 8 * GPU_HOUR, keys["alice-month"]: 8 * GPU_HOUR}
    # bob is in vision but not alice: only the department is charged.
    bob = (await server.client.post("/v1/admissions", json=run("bob-1", "vision", 4, team="vision", user="bob"))).json()
    assert bob["decision"] == "ALLOW" and [e["policy_id"] for e in bob["evaluations"]] == ["research-month"], bob
    held = {keys["research-month"]: 12 * GPU_HOUR, keys["alice-month"]: 8 * GPU_HOUR}
    assert await held_in_postgres(pg_dsn) == held
    assert await reserved_in_redis(server) == held
    # A run no account covers is charged nothing.
    outside = (await server.client.post("/v1/admissions", json=run("x-1", "elsewhere", 64))).json()
    assert outside["decision"] == "ALLOW" and outside["evaluations"] == []
