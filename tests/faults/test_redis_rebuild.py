"""Several admission instances on one Redis that was restored from an older snapshot or emptied:
one instance rebuilds it from Postgres, the others wait for that rebuild instead of answering 503."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import redis.asyncio as aioredis

from tests.support.admission import GPU_HOUR, apply_policies, budget_yaml, held_in_postgres, reserved_in_redis, restart_from_snapshot, submission
from tests.support.metering import metric

REBUILDS = "budgetgate_redis_rebuilds_total"


def one_gpu_hour(run_id: str) -> dict[str, object]:
    return submission(run_id=run_id, labels={"team": "vision"}, resources={"gpus": 1}, projected_runtime_hours=1.0)


async def rebuilds(server) -> float:  # type: ignore[no-untyped-def]
    """How many rebuilds of the Redis ledger the instance made, by its /metrics."""
    return metric((await server.client.get("/metrics")).text, REBUILDS)


def decisions(answers: list[httpx.Response]) -> list[str]:
    return [a.json()["decision"] if a.status_code == 200 else str(a.status_code) for a in answers]


def slowed(server, until: asyncio.Event | None = None, *, entered: asyncio.Event | None = None, delay: float = 0.0) -> None:  # type: ignore[no-untyped-def]
    """Make the instance's rebuilds slow (a big ledger takes a while to write) or stall: the
    SCAN of the keys to replace, which only a rebuild runs in admission, first sets `entered`,
    then waits `delay` seconds and for `until`."""
    client = server.rt.ledger.client
    scan = client.scan_iter

    async def scan_iter(*args: object, **kwargs: object) -> AsyncIterator[bytes]:
        if entered is not None:
            entered.set()
        await asyncio.sleep(delay)
        if until is not None:
            await until.wait()
        async for key in scan(*args, **kwargs):
            yield key

    client.scan_iter = scan_iter


async def test_two_instances_on_a_restored_redis_wait_for_one_rebuild_and_never_over_admit(admission_factory, killable_redis, pg_dsn) -> None:
    # 25 ALLOW, SAVE, 25 more ALLOW, Redis restarted from the old dump.rdb (its "loaded" marker
    # and the first 25 reservations only), then a burst at both instances at once.
    await apply_policies(pg_dsn, {"b.yaml": budget_yaml("two", limit="gpu_hours: 150")}, sha="8" * 40)
    servers = [await admission_factory(redis_url=killable_redis.url, pg_pool_max=30) for _ in range(2)]
    for server in servers:
        await server.wait_ready()

    async def burst(name: str, count: int) -> list[httpx.Response]:
        return list(await asyncio.gather(*(servers[i % 2].client.post("/v1/admissions", json=one_gpu_hour(f"{name}-{i}")) for i in range(count))))

    assert decisions(await burst("first", 25)) == ["ALLOW"] * 25
    assert await servers[0].rt.redis.save()
    assert decisions(await burst("second", 25)) == ["ALLOW"] * 25
    before = [await rebuilds(s) for s in servers]

    await restart_from_snapshot(killable_redis, *servers)
    restored = aioredis.from_url(killable_redis.url)
    try:
        assert await restored.exists(servers[0].rt.ledger.marker)  # it passes for loaded
    finally:
        await restored.aclose()
    for server in servers:
        slowed(server, delay=0.5)

    answers = await burst("burst", 200)
    # Every submission waited for the one rebuild and was decided: no 503, and exactly the
    # 100 GPU-hours left were admitted, never the 125 the snapshot showed.
    assert [a.status_code for a in answers] == [200] * 200, {a.json().get("detail") for a in answers if a.status_code != 200}
    assert sorted(decisions(answers)) == ["ALLOW"] * 100 + ["DENY"] * 100
    held = await held_in_postgres(pg_dsn)
    assert list(held.values()) == [150 * GPU_HOUR]
    assert await reserved_in_redis(servers[0]) == held
    made = [await rebuilds(s) - b for s, b in zip(servers, before, strict=True)]
    assert sorted(made) == [0, 1], made  # one rebuild, by one instance
