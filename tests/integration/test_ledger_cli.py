"""`budgetgate ledger rebuild-redis` and `ledger check`: Redis rebuilt from Postgres after a loss
or a drift, as docs/operations.md tells an operator to do after a restore; the drift check (the
reconciler's too) compares quota counters and pool tokens as well as budgets."""

from __future__ import annotations

import subprocess
from collections.abc import Iterable
from pathlib import Path

import asyncpg

from budgetgate.ledger.redis_ledger import RedisLedger
from budgetgate.ledger.redis_sync import LedgerSync
from tests.support.cli import budgetgate_on
from tests.support.quotas import BIG_BUDGET, POOLS, QUOTA, physics, started
from budgetgate.runtime import redis_client
from tests.support.admission import decision_of
from tests.support.policy_repos import commit, repo  # noqa: F401 - pytest fixtures
from tests.support.sharded import organisations_yaml


async def _budgetgate(tmp_path: Path, settings, *args: str) -> subprocess.CompletedProcess[str]:  # type: ignore[no-untyped-def]
    # cwd: no checkout's .budgetgate/dev.json may choose the servers.
    return await budgetgate_on(settings, *args, cwd=tmp_path)


async def test_rebuild_redis_restores_a_lost_ledger_and_repairs_drift(admission, settings, tmp_path: Path) -> None:
    for n in range(2):
        answer = (await admission.submit(run_id=f"ledger-cli/{n}")).json()
        assert answer["decision"] == "ALLOW", answer
    before = await admission.rt.ledger.all_readings()
    holds = await admission.rt.ledger.run_holds()
    assert before and set(holds) == {"ledger-cli/0", "ledger-cli/1"}
    await admission.stop()  # nothing else may rebuild Redis behind the command's back

    client = redis_client.connect(settings.redis_url)
    ledger = RedisLedger(client, prefix=settings.redis_prefix)
    try:
        await client.delete(*[key async for key in client.scan_iter(match=f"*{settings.redis_prefix}*")])
        assert not await ledger.is_loaded()
        lost = await _budgetgate(tmp_path, settings, "ledger", "check")
        assert lost.returncode == 1 and "does not hold the ledger" in lost.stdout, lost

        rebuilt = await _budgetgate(tmp_path, settings, "ledger", "rebuild-redis")
        assert rebuilt.returncode == 0, rebuilt.stderr
        assert f"{len(before)} ledger key(s), 2 run(s)" in rebuilt.stdout, rebuilt.stdout
        assert await ledger.is_loaded()
        assert await ledger.all_readings() == before
        assert await ledger.run_holds() == holds

        # A drift: Redis counts consumption Postgres never recorded.
        key = next(iter(before))
        await ledger.consume({key: 1_000})
        drifted = await _budgetgate(tmp_path, settings, "ledger", "check")
        assert drifted.returncode == 1 and f"ledger key {key}" in drifted.stdout, drifted
        assert (await _budgetgate(tmp_path, settings, "ledger", "rebuild-redis")).returncode == 0
        assert await ledger.all_readings() == before
        clean = await _budgetgate(tmp_path, settings, "ledger", "check")
        assert clean.returncode == 0 and "Redis matches Postgres" in clean.stdout, clean
    finally:
        await client.aclose()


async def test_check_compares_quota_counters_and_pool_tokens_and_the_reconciler_repairs_them(admission_factory, settings, pg_dsn, tmp_path: Path) -> None:
    files = {"q.yaml": QUOTA.format(limits="max_concurrent_allocations: 5"), "b.yaml": BIG_BUDGET, "p.yaml": POOLS.format(child=5, parent=5, cap=5)}
    server = await started(admission_factory, pg_dsn, files)
    answer = (await server.client.post("/v1/admissions", json=physics("pooled", pool_token={"namespace": "snowflake:wh-1", "project": "physics"}))).json()
    assert answer["decision"] == "ALLOW", answer
    granted = await server.client.post("/v1/pools/snowflake:wh-1/allocations", json={"token": "job-1", "project": "etl"})
    assert granted.json()["status"] == "Granted", granted.text
    await server.stop()  # nothing else may change or rebuild Redis meanwhile

    pool = await asyncpg.create_pool(pg_dsn, min_size=1, max_size=2)
    client = redis_client.connect(settings.redis_url)
    ledger = RedisLedger(client, prefix=settings.redis_prefix)
    sync = LedgerSync(pool, ledger)
    counter, leases = ledger.keys.counter("t:physics"), ledger.keys.pool("snowflake:wh-1")[0]
    lease = int(await client.zscore(leases, "job-1") or 0)
    tampering = {
        "a counter counting a run Postgres saw end": (lambda: client.hincrby(counter, "allocations", 1), "counters", "t:physics"),
        "a counter of a tenant Postgres holds nothing for": (
            lambda: client.hset(ledger.keys.counter("t:ghost"), mapping={"gpus": 8, "nodes": 1, "allocations": 1}),
            "counters",
            "t:ghost",
        ),
        "a grant Redis lost": (lambda: client.zrem(leases, "job-1"), "pools", "snowflake:wh-1"),
        "a renewal Redis lost": (lambda: client.zadd(leases, {"job-1": lease - 600_000}), "pools", "snowflake:wh-1"),
    }
    try:
        assert (await sync.check_drift(repair=False)).clean  # type: ignore[union-attr]
        for what, (tamper, field, name) in tampering.items():
            await tamper()
            drift = await sync.check_drift(repair=False)
            assert drift is not None and set(getattr(drift, field)) == {name} and not drift.keys and not drift.runs, (what, drift)
            if field == "counters":
                shown = await _budgetgate(tmp_path, settings, "ledger", "check")
                assert shown.returncode == 1 and f"quota counter {name}" in shown.stdout, (what, shown)
            # The reconciler's periodic check repairs it by rebuilding Redis from Postgres.
            repaired = await sync.check_drift(repair=True)
            assert repaired is not None and repaired.repaired, what
            assert (await sync.check_drift(repair=False)).clean, what  # type: ignore[union-attr]
        clean = await _budgetgate(tmp_path, settings, "ledger", "check")
        assert clean.returncode == 0 and "Redis matches Postgres" in clean.stdout, clean
    finally:
        await client.aclose()
        await pool.close()


class _LostMidway(RedisLedger):
    """A Redis that loses everything (a restart without persistence) once the check has begun."""

    async def readings(self, ledger_keys: Iterable[str]) -> dict[str, tuple[int, int]]:
        await self.client.delete(*[key async for key in self.client.scan_iter(match=f"{self.tag}*")])
        return await super().readings(ledger_keys)


async def test_a_ledger_lost_during_the_check_is_not_reported_as_matching(admission, settings, pg_dsn) -> None:
    assert decision_of(await admission.submit(run_id="lost-midway")) == "ALLOW"
    await admission.stop()  # it would rebuild Redis as soon as it noticed
    pool = await asyncpg.create_pool(pg_dsn, min_size=1, max_size=2)
    client = redis_client.connect(settings.redis_url)
    try:
        assert (await LedgerSync(pool, RedisLedger(client, prefix=settings.redis_prefix)).check_drift(repair=False)).clean  # type: ignore[union-attr]
        assert await LedgerSync(pool, _LostMidway(client, prefix=settings.redis_prefix)).check_drift(repair=False) is None
    finally:
        await client.aclose()
        await pool.close()


async def test_roots_reads_the_tree_of_a_policy_folders_commit_and_refuses_a_tenant_under_two_organisations(repo: Path, settings, tmp_path: Path) -> None:
    """`budgetgate ledger roots --policies DIR`: the organisations of the tree DIR's commit holds
    (uncommitted edits are not read), each tenant's move named; a tree placing one tenant under
    two organisations is refused with both named, and nothing is pinned."""
    sha = commit(repo, {"accounts.yaml": organisations_yaml({"team-0": "acme", "team-1": "globex"})})
    (repo / "accounts.yaml").write_text(organisations_yaml({"team-0": "initech"}))  # not committed
    shown = await _budgetgate(tmp_path, settings, "ledger", "roots", "--policies", str(repo))
    assert shown.returncode == 0, shown.stderr
    assert f"the account tree of bundle {sha} (team label): 2 tenant(s) move" in shown.stdout, shown.stdout
    assert "team-0: its own root -> organisation acme" in shown.stdout and "team-1: its own root -> organisation globex" in shown.stdout
    assert "initech" not in shown.stdout

    torn = "---\n".join(
        f"apiVersion: budgetgate/v1\nkind: Account\nmetadata: {{id: {doc}}}\nspec: {spec}\n"
        for doc, spec in [
            ("acme", "{level: organisation}"),
            ("globex", "{level: organisation}"),
            ("acme-vision", "{level: team, parent: acme, scope: {namespace: ml, labels: {team: vision}}}"),
            ("globex-vision", "{level: team, parent: globex, scope: {namespace: cv, labels: {team: vision}}}"),
        ]
    )
    commit(repo, {"accounts.yaml": torn})
    refused = await _budgetgate(tmp_path, settings, "ledger", "roots", "--policies", str(repo), "--apply")
    assert refused.returncode == 1 and "team=vision under acme and globex" in refused.stderr, refused
    conn = await asyncpg.connect(settings.postgres_dsn)
    try:
        assert await conn.fetchval("SELECT count(*) FROM ledger_roots") == 0
    finally:
        await conn.close()
