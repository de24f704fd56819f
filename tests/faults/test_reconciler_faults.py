"""The reconciler killed (SIGKILL) mid-stream and started again: no event lost, none applied twice;
and Redis invalidated under it is rebuilt from Postgres with every settlement in it."""

from __future__ import annotations

import asyncio
import signal
from datetime import UTC, datetime, timedelta

import asyncpg

from tests.support.admission import apply_policies, budget_yaml
from tests.support.reconciler import H, counts, ledger_in_postgres, lifecycle, start_reconciler, usage, wait_caught_up
from tests.support.reconciler import feed, reconciler_factory  # noqa: F401 - pytest fixtures
from tests.support.clock import this_month
from tests.support.waiting import wait_for
from budgetgate.ledger import transaction
from budgetgate.runtime.redis_client import connect

RUNS = 40


async def test_killed_mid_stream_and_restarted_loses_nothing_applies_nothing_twice(admission_factory, feed, settings, pg_dsn, tmp_path) -> None:  # noqa: F811
    await apply_policies(pg_dsn, {"b.yaml": budget_yaml("k", limit="gpu_hours: 100000")}, sha="f" * 40)
    server = await admission_factory()
    await server.wait_ready()
    for i in range(RUNS):
        answer = await server.submit(run_id=f"k{i}", labels={"team": "vision"}, resources={"gpus": 8}, projected_runtime_hours=10.0)
        assert answer.json()["decision"] == "ALLOW"
    start = this_month(timedelta(hours=5))
    messages = []
    for i in range(RUNS):
        messages += [lifecycle(f"k{i}", "STARTED", start), usage(f"k{i}", "1", start + timedelta(hours=1), 4 + i % 5)]
        messages += [usage(f"k{i}", "2", start + timedelta(hours=2), 8 + i % 5), lifecycle(f"k{i}", "COMPLETED", start + timedelta(hours=2))]
    log = tmp_path / "reconciler.log"
    first = start_reconciler(settings, log)
    # The first half goes out while the first reconciler runs, the rest only after it was
    # killed, so the kill always interrupts the stream, however fast the reconciler is.
    half = len(messages) // 2
    try:
        sending = asyncio.create_task(feed.send(*messages[:half]))

        async def some_done() -> bool:
            final, _, _ = await counts(pg_dsn)
            return final >= 3

        await wait_for(some_done, timeout=60, what="a few runs settled")
        first.send_signal(signal.SIGKILL)
        first.wait(10)
        await sending
        final_at_kill, _, _ = await counts(pg_dsn)
        assert final_at_kill < RUNS, "the kill came too late to interrupt anything"
        await feed.send(*messages[half:])
    finally:
        if first.poll() is None:
            first.kill()
    [key] = await ledger_in_postgres(pg_dsn)
    expected = {key: (0, sum((8 + i % 5) * H for i in range(RUNS)))}
    second = start_reconciler(settings, log)
    try:

        async def all_done() -> bool:
            final, inbox, _ = await counts(pg_dsn)
            return final == RUNS and inbox == len(messages) and (await ledger_in_postgres(pg_dsn)) == expected

        await wait_for(all_done, timeout=90, what="every run settled after the restart")
    finally:
        second.send_signal(signal.SIGTERM)
        second.wait(20)
    final, inbox, facts = await counts(pg_dsn)
    assert inbox == facts == len(messages)
    ledger = await ledger_in_postgres(pg_dsn)
    assert ledger == expected

    client = connect(settings.redis_url)
    try:
        reserved, consumed = await client.hmget(f"{{{settings.redis_prefix}}}:l:{key}", "reserved", "consumed")
    finally:
        await client.aclose()
    assert (int(reserved), int(consumed)) == ledger[key]


async def test_redis_invalidated_mid_stream_is_rebuilt_with_every_settlement(admission_factory, reconciler_factory, feed, pg_dsn) -> None:  # noqa: F811
    await invalidated_mid_stream(admission_factory, reconciler_factory, feed, pg_dsn)


async def test_redis_invalidated_mid_stream_with_settlements_ended_late(admission_factory, reconciler_factory, feed, pg_dsn, monkeypatch) -> None:  # noqa: F811
    # A settlement's decreases reach Redis only after its commit (settle_end.lua, run by
    # transaction._end once the transaction is over): for that moment Postgres has given a run's
    # reservation back and Redis still holds it. Checked at that moment, Redis once read a whole
    # run's reservation (80 GPU-hours) above Postgres (a CI failure); here every second half
    # comes late, so that the checks meet the moment every time, and must wait it out.
    end = transaction._end

    async def late(ledger, parked, *, committed):  # type: ignore[no-untyped-def]
        if committed and parked:
            await asyncio.sleep(0.5)
        await end(ledger, parked, committed=committed)

    monkeypatch.setattr(transaction, "_end", late)
    await invalidated_mid_stream(admission_factory, reconciler_factory, feed, pg_dsn)


async def invalidated_mid_stream(admission_factory, reconciler_factory, feed, pg_dsn) -> None:  # type: ignore[no-untyped-def]  # noqa: F811
    await apply_policies(pg_dsn, {"b.yaml": budget_yaml("r", limit="gpu_hours: 100000")}, sha="9" * 40)
    server = await admission_factory()
    await server.wait_ready()
    for i in range(10):
        assert (await server.submit(run_id=f"r{i}", labels={"team": "vision"}, resources={"gpus": 8}, projected_runtime_hours=10.0)).json()[
            "decision"
        ] == "ALLOW"
    reconciler = await reconciler_factory()
    start = this_month(timedelta(hours=5))
    for i in range(10):
        await feed.send(
            lifecycle(f"r{i}", "STARTED", start),
            usage(f"r{i}", "1", start + timedelta(hours=1), 5),
            lifecycle(f"r{i}", "COMPLETED", start + timedelta(hours=1)),
        )
        if i == 4:
            await reconciler.redis.delete(reconciler.ledger.marker)  # as a failed commit does
    [key] = await ledger_in_postgres(pg_dsn)

    async def settled_everything() -> bool:
        return (await ledger_in_postgres(pg_dsn))[key] == (0, 50 * H)

    await wait_for(settled_everything, what="all ten settled")
    # Postgres shows the last settlements before Redis does: each one's decreases (the
    # reservation given back) are parked in Redis until just after its commit (settle_begin.lua),
    # so Redis is compared once no settlement is parked any more.
    await wait_caught_up(reconciler)
    assert await reconciler.ledger.is_loaded()
    assert await reconciler.ledger.all_readings() == await ledger_in_postgres(pg_dsn)
    assert (await reconciler.sync.check_drift(repair=False)).clean


async def test_a_read_only_redis_is_an_outage_never_a_refusal_of_the_runs(admission_factory, reconciler_factory, feed, pg_dsn, killable_redis) -> None:  # noqa: F811
    # A Redis turned into a replica (as a demoted primary after a failover is) answers every
    # write with READONLY, a ResponseError: once counted as a refusal of each run, so a failover
    # longer than `settle_tries` passes dead-lettered every run it caught.
    await apply_policies(pg_dsn, {"b.yaml": budget_yaml("ro", limit="gpu_hours: 100000")}, sha="a" * 40)
    server = await admission_factory(redis_url=killable_redis.url)
    await server.wait_ready()
    for i in range(3):
        assert (await server.submit(run_id=f"ro{i}", labels={"team": "vision"}, resources={"gpus": 8}, projected_runtime_hours=10.0)).json()[
            "decision"
        ] == "ALLOW"
    reconciler = await reconciler_factory(redis_url=killable_redis.url, settle_tries=2)
    [key] = await ledger_in_postgres(pg_dsn)
    await reconciler.redis.execute_command("REPLICAOF", "127.0.0.1", "1")  # no such primary: it stays read-only
    start = this_month(timedelta(hours=5))
    for i in range(3):
        end = start + timedelta(hours=1)
        await feed.send(lifecycle(f"ro{i}", "STARTED", start), usage(f"ro{i}", "1", end, 5), lifecycle(f"ro{i}", "COMPLETED", end))

    async def failed_passes() -> bool:
        return reconciler.stats.errors >= 3  # more passes than settle_tries failed meanwhile

    await wait_for(failed_passes, what="settlement passes failing on the read-only Redis")
    conn = await asyncpg.connect(pg_dsn)
    try:
        assert await conn.fetchval("SELECT count(*) FROM settlement_failures") == 0
    finally:
        await conn.close()
    assert reconciler.stats.dead_letters == 0
    await reconciler.redis.execute_command("REPLICAOF", "NO", "ONE")

    async def settled_everything() -> bool:
        return (await ledger_in_postgres(pg_dsn))[key] == (0, 15 * H)

    await wait_for(settled_everything, what="all three settled once Redis takes writes again")

    # Redis follows: a settlement's reservation comes off Redis after its commit (settle_end),
    # and a try that failed on the read-only Redis, which could not invalidate it either, is
    # repaired by the drift check. Read right after Postgres's commit, Redis once still held one
    # run's reservation (a CI run on 2026-12-01).
    async def redis_follows() -> bool:
        return await reconciler.ledger.all_readings() == await ledger_in_postgres(pg_dsn)

    await wait_for(redis_follows, timeout=60, what="Redis holding what Postgres holds")


async def test_a_run_that_ends_holding_quota_with_usage_in_a_new_window_settles(admission_factory, reconciler_factory, feed, pg_dsn) -> None:  # noqa: F811
    # The settlement that sees a run end gives its quota holds back in Redis first; when its
    # usage lands in a window no admission opened (its key in neither store yet), the try rolls
    # back and invalidates Redis, and loading the new key then failed on the invalidated ledger:
    # the pass failed, the next rebuilt (still without that key), gave the holds back again and
    # failed the same way, for ever: the run's reservation never ended, Redis was invalidated
    # every pass.
    quota = "apiVersion: budgetgate/v1\nkind: Quota\nmetadata: {id: tenant-vision}\nspec: {tenant: vision, max_gpus: 64}\n"
    daily = budget_yaml("q", limit="gpu_hours: 100000", window="{calendar: day}")
    await apply_policies(pg_dsn, {"b.yaml": daily, "q.yaml": quota}, sha="b" * 40)
    server = await admission_factory()
    await server.wait_ready()
    answer = await server.submit(run_id="held", labels={"team": "vision"}, resources={"gpus": 8}, projected_runtime_hours=10.0)
    assert answer.json()["decision"] == "ALLOW"
    conn = await asyncpg.connect(pg_dsn)
    try:
        assert await conn.fetchval("SELECT count(*) FROM run_holds WHERE run_id = 'held'") == 1  # it holds quota
    finally:
        await conn.close()
    [today] = await ledger_in_postgres(pg_dsn)
    start = datetime.now(UTC) - timedelta(hours=30)  # yesterday's window, which no admission opened
    end = start + timedelta(hours=1)
    # All facts there before the reconciler starts: its first settlement sees the run end.
    await feed.send(lifecycle("held", "STARTED", start, gpus=8), usage("held", "1", end, 8), lifecycle("held", "COMPLETED", end))
    reconciler = await reconciler_factory()

    async def settled() -> bool:
        ledger = await ledger_in_postgres(pg_dsn)
        return len(ledger) == 2 and ledger[today][0] == 0 and sum(consumed for _, consumed in ledger.values()) == 8 * H

    await wait_for(settled, what="the run settled", timeout=30)
    assert await reconciler.ledger.is_loaded()
    assert await reconciler.ledger.all_readings() == await ledger_in_postgres(pg_dsn)
