"""`budgetgate ledger rebuild-redis` and `ledger check`: Redis rebuilt from Postgres after a loss
or a drift, as docs/operations.md tells an operator to do after a restore."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import redis.asyncio as aioredis

from budgetgate.ledger.redis_ledger import RedisLedger


async def _budgetgate(tmp_path: Path, settings, *args: str) -> subprocess.CompletedProcess[str]:  # type: ignore[no-untyped-def]
    env = {k: v for k, v in os.environ.items() if not k.startswith("BUDGETGATE_")}
    env.update(BUDGETGATE_POSTGRES_DSN=settings.postgres_dsn, BUDGETGATE_REDIS_URL=settings.redis_url, BUDGETGATE_REDIS_PREFIX=settings.redis_prefix)
    # cwd: no checkout's .budgetgate/dev.json may choose the servers.
    command = [sys.executable, "-m", "budgetgate.cli.main", *args]
    return await asyncio.to_thread(subprocess.run, command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


async def test_rebuild_redis_restores_a_lost_ledger_and_repairs_drift(admission, settings, tmp_path: Path) -> None:
    for n in range(2):
        answer = (await admission.submit(run_id=f"ledger-cli/{n}")).json()
        assert answer["decision"] == "ALLOW", answer
    before = await admission.rt.ledger.all_readings()
    holds = await admission.rt.ledger.run_holds()
    assert before and set(holds) == {"ledger-cli/0", "ledger-cli/1"}
    await admission.stop()  # nothing else may rebuild Redis behind the command's back

    client = aioredis.from_url(settings.redis_url)
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
