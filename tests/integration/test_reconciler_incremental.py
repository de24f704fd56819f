"""The reconciler folds each new fact into a run's stored state: the ledger it reaches equals the
whole-run recomputation (the repair tool), and amounts beyond the ledger's range never jam it."""

from __future__ import annotations

import asyncio
import random

import pytest
from datetime import UTC, datetime, timedelta

import asyncpg

from budgetgate.core.ledger_key import MAX_AMOUNT
from budgetgate.v1 import usage_pb2
from tests.support.admission import apply_policies, budget_yaml, decision_of
from tests.support.pg_sessions import wait_done_or_blocked
from tests.support.reconciler import H, ledger_in_postgres, ledger_in_redis, lifecycle, run_charges, settled, ts, usage
from tests.support.reconciler import feed, reconciler_factory  # noqa: F401 - pytest fixtures
from tests.support.waiting import wait_for
from budgetgate.runtime import redis_client

BODY = {"labels": {"team": "vision"}, "resources": {"gpus": 8}, "projected_runtime_hours": 10.0}


async def _fetchval(dsn: str, query: str, *args: object) -> object:
    conn = await asyncpg.connect(dsn)
    try:
        return await conn.fetchval(query, *args)
    finally:
        await conn.close()


async def test_late_and_reordered_samples_fold_to_the_whole_run_ledger(admission_factory, reconciler_factory, feed, pg_dsn) -> None:
    await apply_policies(pg_dsn, {"b.yaml": budget_yaml("inc", limit="gpu_hours: 100000", window="{rolling_days: 30}")}, sha="c" * 40)
    server = await admission_factory()
    await server.wait_ready()
    assert decision_of(await server.submit(run_id="long", **BODY)) == "ALLOW"
    reconciler = await reconciler_factory()
    start = datetime.now(UTC) - timedelta(hours=6)
    samples = [usage("long", f"s{i:03}", start + timedelta(minutes=3 * i), 0.4 * i) for i in range(1, 101)]
    # In order first, then the rest shuffled, so most arrive late on a line already folded.
    await feed.send(lifecycle("long", "STARTED", start, gpus=8), *samples[:40])
    await wait_for(lambda: _folded(pg_dsn, "long", 40), what="first 40 samples folded")
    await feed.send(*random.Random(3).sample(samples[40:], 60), *samples[50:60])
    await wait_for(lambda: _folded(pg_dsn, "long", 100), what="all samples folded")
    incremental = await run_charges(pg_dsn, "long")
    assert sum(incremental.values()) == int(0.4 * 100 * H) and len(incremental) > 2  # hour buckets of a rolling window
    ledger = await ledger_in_postgres(pg_dsn)
    outcome = await reconciler.settler.repair("long")
    assert not outcome.changed  # the whole-run recomputation finds nothing to correct
    assert await run_charges(pg_dsn, "long") == incremental
    assert await ledger_in_postgres(pg_dsn) == ledger == await ledger_in_redis(reconciler)


async def _folded(dsn: str, run_id: str, count: int) -> bool:
    folded = await _fetchval(dsn, "SELECT count(*) FROM run_samples WHERE run_id = $1 AND gpu_high IS NOT NULL", run_id)
    waiting = await _fetchval(dsn, "SELECT count(*) FROM runs_to_settle WHERE run_id = $1", run_id)
    return folded == count and waiting == 0


async def test_amounts_beyond_the_ledger_range_are_dead_lettered_and_never_jam(admission_factory, reconciler_factory, feed, pg_dsn) -> None:
    await apply_policies(pg_dsn, {"b.yaml": budget_yaml("huge", limit="gpu_hours: 100")}, sha="d" * 40)
    server = await admission_factory()
    await server.wait_ready()
    for run_id in ("too-big", "half-1", "half-2", "normal"):
        assert decision_of(await server.submit(run_id=run_id, labels={"team": "vision"}, resources={"gpus": 1}, projected_runtime_hours=1.0)) == "ALLOW"
    reconciler = await reconciler_factory(settle_tries=2)
    start = datetime.now(UTC) - timedelta(hours=2)
    half = MAX_AMOUNT // 2 + 1
    too_big = usage_pb2.UsageRecord(
        event_id="big",
        event_time=ts(start),
        run_id="too-big",
        sample_id="x",
        observed_at=ts(start),
        gpu_milli_hours_observed=MAX_AMOUNT + 1,
        node_milli_hours_observed=0,
    )
    await feed.send(too_big)
    await feed.send(*(u for r in ("half-1", "half-2") for u in (lifecycle(r, "STARTED", start), _raw(r, start, half))))
    # One of the two halves fits; the other would take the key past the range and is set aside.
    await wait_for(
        lambda: _fetchval(pg_dsn, "SELECT count(*) = 1 FROM settlement_failures WHERE dead AND reason LIKE '%range%'"), what="a dead-lettered settlement"
    )
    assert await _fetchval(pg_dsn, "SELECT count(*) FROM run_samples WHERE run_id = 'too-big'") == 0  # poison, never recorded
    await feed.send(
        lifecycle("normal", "STARTED", start), usage("normal", "n", start + timedelta(hours=1), 1), lifecycle("normal", "COMPLETED", start + timedelta(hours=1))
    )
    await wait_for(lambda: _final(pg_dsn, "normal"), what="the run after the failure settled")
    assert await reconciler.ledger.is_loaded()  # a refusal never invalidates Redis
    assert reconciler.stats.dead_letters == 1
    assert await ledger_in_redis(reconciler) == await ledger_in_postgres(pg_dsn)
    dead = await _fetchval(pg_dsn, "SELECT run_id FROM settlement_failures WHERE dead")
    assert await _fetchval(pg_dsn, "SELECT count(*) FROM runs_to_settle WHERE run_id = $1", dead) == 1  # kept for an operator
    assert await _fetchval(pg_dsn, "SELECT attempts FROM settlement_failures WHERE run_id = $1", dead) == 2


async def test_a_settlement_forgets_failed_tries_made_before_a_restart(admission_factory, reconciler_factory, feed, pg_dsn) -> None:
    """Failed tries recorded by another reconciler (or this one before a restart) are forgotten
    once the run settles, so they never count towards dead-lettering a later failure; a dead
    run's stay for an operator."""
    await apply_policies(pg_dsn, {"b.yaml": budget_yaml("tries", limit="gpu_hours: 100")}, sha="f" * 40)
    server = await admission_factory()
    await server.wait_ready()
    for run_id in ("retried", "dead"):
        assert decision_of(await server.submit(run_id=run_id, labels={"team": "vision"}, resources={"gpus": 1}, projected_runtime_hours=1.0)) == "ALLOW"
    conn = await asyncpg.connect(pg_dsn)
    try:
        await conn.execute(
            "INSERT INTO settlement_failures (run_id, reason, dead, attempts) VALUES ('retried', 'earlier', false, 2), ('dead', 'earlier', true, 3)"
        )
    finally:
        await conn.close()
    await reconciler_factory(settle_tries=3)
    start = datetime.now(UTC) - timedelta(minutes=30)
    await feed.send(lifecycle("retried", "STARTED", start), lifecycle("dead", "STARTED", start))
    await wait_for(lambda: _fetchval(pg_dsn, "SELECT count(*) = 0 FROM settlement_failures WHERE run_id = 'retried'"), what="the earlier tries forgotten")
    assert await _fetchval(pg_dsn, "SELECT attempts FROM settlement_failures WHERE run_id = 'dead' AND dead") == 3


async def test_facts_dated_outside_the_accepted_times_are_dead_lettered_and_never_jam(admission_factory, reconciler_factory, feed, pg_dsn) -> None:
    # A lifecycle event with its time beyond what a datetime holds passed the rules and made
    # ToDatetime raise a plain ValueError, which the inbox took for an outage: the batch was
    # retried for ever and nothing after it was consumed. One dated at the Unix epoch (a zero
    # value) was charged to 1970's windows.
    await apply_policies(pg_dsn, {"b.yaml": budget_yaml("times", limit="gpu_hours: 100")}, sha="e" * 40)
    server = await admission_factory()
    await server.wait_ready()
    for run_id in ("far", "epoch", "after"):
        assert decision_of(await server.submit(run_id=run_id, labels={"team": "vision"}, resources={"gpus": 1}, projected_runtime_hours=1.0)) == "ALLOW"
    reconciler = await reconciler_factory()
    start = datetime.now(UTC) - timedelta(hours=2)
    far = lifecycle("far", "STARTED", start)
    far.event_time.seconds = 2**40
    epoch = usage("epoch", "zero", start, 1)
    epoch.observed_at.seconds = 0
    await feed.send(far, epoch)
    await feed.send(
        lifecycle("after", "STARTED", start), usage("after", "a", start + timedelta(hours=1), 1), lifecycle("after", "COMPLETED", start + timedelta(hours=1))
    )
    await wait_for(lambda: _final(pg_dsn, "after"), what="the run after the unusable facts settled")
    assert await _fetchval(pg_dsn, "SELECT count(*) FROM lifecycle_events WHERE run_id = 'far'") == 0
    assert await _fetchval(pg_dsn, "SELECT count(*) FROM run_samples WHERE run_id = 'epoch'") == 0
    assert await ledger_in_redis(reconciler) == await ledger_in_postgres(pg_dsn)


def _raw(run_id: str, start: datetime, gpu: int) -> usage_pb2.UsageRecord:
    at = ts(start + timedelta(minutes=30))
    return usage_pb2.UsageRecord(
        event_id=f"{run_id}-u", event_time=at, run_id=run_id, sample_id="h", observed_at=at, gpu_milli_hours_observed=gpu, node_milli_hours_observed=0
    )


async def _final(dsn: str, run_id: str) -> bool:
    row = await settled(dsn, run_id)
    return row is not None and row["final"]


async def test_the_settle_script_refuses_a_figure_beyond_the_range_and_changes_nothing(settings) -> None:

    from budgetgate.core.ledger_key import AmountOutOfRange
    from budgetgate.ledger.redis_ledger import KeyChange, RedisLedger

    client = redis_client.connect(settings.redis_url)
    try:
        ledger = RedisLedger(client, prefix=settings.redis_prefix)
        await client.set(ledger.marker, "g")
        for key in ("a", "b"):
            await ledger.load_key(key, reserved=5, consumed=10**14)  # 1e14 and more: the old script's limit
        big = [KeyChange("a", reserved=-5, consumed=10**15), KeyChange("b", consumed=MAX_AMOUNT)]
        with pytest.raises(AmountOutOfRange):
            await ledger.settle_begin(run_id="r", decision_id="d", seq=1, token="t", changes=big, drop_run=True, now_ms=0)
        assert await ledger.readings(["a", "b"]) == {"a": (5, 10**14), "b": (5, 10**14)}
        await ledger.settle_begin(run_id="r", decision_id="d", seq=1, token="t", changes=big[:1], drop_run=True, now_ms=0)
        assert await ledger.readings(["a"]) == {"a": (5, 10**14 + 10**15)}  # the increase only, before the commit
        assert await ledger.settle_end("r", seq=1, committed=True)
        assert await ledger.readings(["a"]) == {"a": (0, 10**14 + 10**15)}
        assert not await ledger.settle_end("r", seq=1, committed=True)  # ended once
    finally:
        await client.aclose()


async def test_a_late_undo_of_a_rolled_back_settlement_never_ends_the_next_one(settings) -> None:
    """Settlement S1 parks sequence 3 and rolls back; S2 (the run's lock free again) ends it and
    parks its own settlement, again as sequence 3 (the revision S1 never committed). S1's undo,
    arriving late, must leave S2 alone: matched on the number only, it undid S2's increase, and
    S2's commit then found nothing parked."""

    from budgetgate.ledger.redis_ledger import KeyChange, RedisLedger

    client = redis_client.connect(settings.redis_url)
    try:
        ledger = RedisLedger(client, prefix=settings.redis_prefix)
        await client.set(ledger.marker, "g")
        await ledger.load_key("k", reserved=0, consumed=100)
        await ledger.settle_begin(run_id="r", decision_id="d", seq=3, token="s1", changes=[KeyChange("k", consumed=10)], drop_run=False, now_ms=0)
        assert await ledger.settle_end("r", seq=3, committed=False)  # S2, holding the lock, ends S1's
        await ledger.settle_begin(run_id="r", decision_id="d", seq=3, token="s2", changes=[KeyChange("k", consumed=20)], drop_run=False, now_ms=0)
        assert not await ledger.settle_end("r", seq=3, committed=False, token="s1")  # S1's late undo
        assert await ledger.readings(["k"]) == {"k": (0, 120)}
        assert await ledger.settle_end("r", seq=3, committed=True, token="s2")
        assert await ledger.readings(["k"]) == {"k": (0, 120)} and await ledger.pending_settlements() == {}
    finally:
        await client.aclose()


async def test_a_fact_committed_while_its_run_is_being_settled_is_never_left_unsettled(admission_factory, reconciler_factory, pg_dsn) -> None:
    """A fact recorded while a settlement of its run is under way, with the run already marked:
    the settlement either sees the fact or leaves the run marked. Marking with ON CONFLICT DO
    NOTHING took no lock on the existing mark, so the settlement deleted it without seeing the
    uncommitted fact, and the run was never settled again (found by the scale-out fault test)."""
    from budgetgate.ledger.queries import owned_by

    sql = owned_by("budgetgate.services.reconciler")

    await apply_policies(pg_dsn, {"b.yaml": budget_yaml("mark", limit="gpu_hours: 100000")}, sha="e" * 40)
    server = await admission_factory()
    await server.wait_ready()
    assert decision_of(await server.submit(run_id="m", **BODY)) == "ALLOW"
    # No consumer feeds it and its loops wait an hour: only the settlement below runs.
    reconciler = await reconciler_factory(tick_seconds=3600)
    at = datetime.now(UTC) - timedelta(hours=2)
    first = await asyncpg.connect(pg_dsn)
    second = await asyncpg.connect(pg_dsn)
    try:
        await first.execute(sql("record_samples"), ["m"], ["s1"], [at], [1 * H], [0])
        await first.execute(sql("mark_runs_to_settle"), ["m"])  # committed: the run is marked
        recording = second.transaction()
        await recording.start()
        await second.execute(sql("record_samples"), ["m"], ["s2"], [at + timedelta(hours=1)], [3 * H], [0])
        await second.execute(sql("mark_runs_to_settle"), ["m"])
        settling = asyncio.create_task(reconciler.settler.settle("m"))
        await wait_done_or_blocked(settling, second)  # the settlement ran, or waits, while the second fact is uncommitted
        await recording.commit()
        await settling
        unfolded = await first.fetchval("SELECT count(*) FROM run_samples WHERE run_id = 'm' AND gpu_high IS NULL")
        marked = await first.fetchval("SELECT count(*) FROM runs_to_settle WHERE run_id = 'm'")
        assert unfolded == 0 or marked == 1, "a recorded sample is neither folded nor waiting to be"
        if marked:
            await reconciler.settler.settle("m")
        assert sum((await run_charges(pg_dsn, "m")).values()) == 3 * H
    finally:
        await first.close()
        await second.close()
