"""Several admission instances on one Redis that was restored from an older snapshot or emptied:
one instance rebuilds it from Postgres, the others wait for that rebuild instead of answering 503,
and a rebuilder that dies mid-rebuild holds the others only until its Postgres session ends."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import asyncpg
import httpx
import redis.asyncio as aioredis

from tests.support.admission import GPU_HOUR, apply_policies, budget_yaml, held_in_postgres, reserved_in_redis, restart_from_snapshot, submission
from tests.support.metering import metric
from tests.support.waiting import wait_for
from budgetgate.runtime import redis_client

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
        await asyncio.sleep(delay)  # the slowness simulated: a big ledger takes a while to write
        if until is not None:
            await until.wait()
        async for key in scan(*args, **kwargs):
            yield key

    client.scan_iter = scan_iter


async def test_two_instances_on_a_restored_redis_wait_for_one_rebuild_and_never_over_admit(admission_factory, killable_redis, pg_dsn) -> None:
    # 25 ALLOW, SAVE, 25 more ALLOW, Redis restarted from the old dump.rdb (its "loaded" marker
    # and the first 25 reservations only), then a burst at both instances at once.
    await apply_policies(pg_dsn, {"b.yaml": budget_yaml("two", limit="gpu_hours: 150")}, sha="8" * 40)
    # Waiting up to 30 s for the rebuild, not 5: the claim is that every submission waits for
    # the one rebuild and is decided, and 200 of them behind a slowed rebuild took more than 5 s
    # on a loaded CI machine (2026-12-01).
    servers = [await admission_factory(redis_url=killable_redis.url, pg_pool_max=30, rebuild_wait_seconds=30) for _ in range(2)]
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


async def _rebuilder_pid(conn: asyncpg.Connection) -> int | None:
    """The Postgres backend holding the ledger lock exclusively (a rebuild)."""
    return await conn.fetchval(
        "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND classid = 7301 AND objid = 0 AND mode = 'ExclusiveLock' AND granted AND database = "
        "(SELECT oid FROM pg_database WHERE datname = current_database())"
    )


async def _waiting_for_ledger_lock(conn: asyncpg.Connection) -> bool:
    return bool(
        await conn.fetchval(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND classid = 7301 AND NOT granted AND database = "
            "(SELECT oid FROM pg_database WHERE datname = current_database())"
        )
    )


async def test_a_rebuilder_that_dies_mid_rebuild_holds_the_others_only_until_its_session_ends(admission_factory, settings, pg_dsn) -> None:
    await apply_policies(pg_dsn, {"b.yaml": budget_yaml("dies", limit="gpu_hours: 30")}, sha="9" * 40)
    # No readiness upkeep during the test (it would rebuild a lost ledger on its own tick): the
    # rebuild is the one the stalled instance's submission starts.
    quiet = {"policy_refresh_seconds": 60}
    stalled = await admission_factory(**quiet)
    impatient = await admission_factory(rebuild_wait_seconds=0.5, **quiet)
    patient = await admission_factory(rebuild_wait_seconds=60, **quiet)
    for server in (stalled, impatient, patient):
        await server.wait_ready()
    assert decisions([await patient.client.post("/v1/admissions", json=one_gpu_hour(f"early-{i}")) for i in range(10)]) == ["ALLOW"] * 10
    before = [await rebuilds(s) for s in (stalled, impatient, patient)]

    # Redis emptied; the stalled instance is elected to rebuild it and stops mid-rebuild.
    entered, resume = asyncio.Event(), asyncio.Event()
    slowed(stalled, resume, entered=entered)
    redis = redis_client.connect(settings.redis_url)
    conn = await asyncpg.connect(pg_dsn)
    try:
        await redis.delete(*[key async for key in redis.scan_iter(match=f"{stalled.rt.ledger.tag}:*")])
        first = asyncio.create_task(stalled.client.post("/v1/admissions", json=one_gpu_hour("stalled")))
        await asyncio.wait_for(entered.wait(), timeout=30)
        assert await _rebuilder_pid(conn) is not None

        # Past its wait, an instance answers 503 with Retry-After, saying why; nothing is held.
        refused = [await impatient.client.post("/v1/admissions", json=one_gpu_hour(f"refused-{i}")) for i in range(3)]
        assert [r.status_code for r in refused] == [503] * 3
        assert all(r.headers.get("Retry-After") and "rebuilt from Postgres" in r.json()["detail"] for r in refused), [r.json() for r in refused]

        # Within its wait, an instance waits; the rebuilder dies (its session ends, as when its
        # process is killed) and the waiting instance takes over, rebuilds and decides.
        waiting = [asyncio.create_task(patient.client.post("/v1/admissions", json=one_gpu_hour(f"waited-{i}"))) for i in range(10)]
        await wait_for(lambda: _waiting_for_ledger_lock(conn), what="the patient instance waiting for the rebuild")
        assert await conn.fetchval("SELECT pg_terminate_backend($1)", await _rebuilder_pid(conn))
        assert decisions(list(await asyncio.gather(*waiting))) == ["ALLOW"] * 10

        # The dead rebuilder's process goes on: none of its writes lands on the newer copy.
        resume.set()
        assert (await first).status_code == 503
    finally:
        resume.set()
        await redis.aclose()
        await conn.close()
    held = await held_in_postgres(pg_dsn)
    assert list(held.values()) == [20 * GPU_HOUR]
    assert await reserved_in_redis(patient) == held
    # 10 GPU-hours are left of 30: exactly 10 more are admitted.
    after = [await patient.client.post("/v1/admissions", json=one_gpu_hour(f"after-{i}")) for i in range(15)]
    assert decisions(after) == ["ALLOW"] * 10 + ["DENY"] * 5
    assert list((await held_in_postgres(pg_dsn)).values()) == [30 * GPU_HOUR]
    made = [await rebuilds(s) - b for s, b in zip((stalled, impatient, patient), before, strict=True)]
    assert made == [0, 0, 1]
