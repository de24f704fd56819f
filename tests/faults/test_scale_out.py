"""Scale-out: two metering-ingest processes, and two reconciler processes, in one consumer group
share the partitions of their topics; one of them is SIGKILLed mid-stream and the other takes
its partitions over. Nothing is lost or applied twice and the ledger is exact.

Written against the processes' outside: records in on Kafka, rows and Redis keys out, and the
consumer group as the broker describes it, so it holds however the consumers are built.
"""

from __future__ import annotations

import signal
import subprocess
from datetime import timedelta
from pathlib import Path

import asyncpg
import httpx

from budgetgate.benchmark.consumer_group import group_members, records_taken
from budgetgate.messaging.publisher import Publisher
from budgetgate.contracts.topics import Topics
from budgetgate.messaging.topic_admin import ensure_topics
from budgetgate.v1.metering_pb2 import MeteringSample
from tests.support.admission import apply_policies, budget_yaml
from tests.support.clock import this_month
from tests.support.metering import IngestProcess, T0, assert_applied_exactly_once, decide, rows, sample
from tests.support.reconciler import H, counts, ledger_in_postgres, lifecycle, start_reconciler, usage
from tests.support.reconciler import feed  # noqa: F401 - pytest fixtures
from tests.support.waiting import wait_for
from budgetgate.runtime.redis_client import connect

PARTITIONS = 3
INGEST_RUNS = [f"scale-{i}" for i in range(12)]  # keys enough to land on every partition
RECONCILER_RUNS = 36


async def wait_for_members(bootstrap: str, names: tuple[str, ...], count: int) -> list[frozenset[int]]:
    """Wait until the group (called one of `names`) is stable with `count` members; each must
    hold partitions when the broker says which."""
    seen: list[list[frozenset[int]] | None] = [None]

    async def stable() -> bool:
        seen[0] = await group_members(bootstrap, *names)
        return seen[0] is not None and len(seen[0]) == count

    await wait_for(stable, timeout=90, what=f"consumer group {names} stable with {count} members")
    members = seen[0]
    assert members is not None
    if any(members):  # the broker reports assignments (Apache Kafka does; Tansu does not)
        assert all(members), f"a member of {names} holds no partition: {members}"
    return members


async def kafka_samples(port: int) -> int:
    """How many Kafka samples one metering-ingest process took care of (its /metrics)."""
    async with httpx.AsyncClient(timeout=5) as client:
        return records_taken((await client.get(f"http://127.0.0.1:{port}/metrics")).text)


def samples(count: int, *, start: int = 0) -> list[MeteringSample]:
    """`count` samples over INGEST_RUNS, counters rising, every seventh one sent twice."""
    messages = []
    for i in range(start, start + count):
        run_id = INGEST_RUNS[i % len(INGEST_RUNS)]
        step = i // len(INGEST_RUNS)
        message = sample(run_id, f"{run_id}/{step}", 10.0 * step + 0.5, at=T0 + timedelta(seconds=step))
        messages.append(message)
        if i % 7 == 0:
            messages.append(message)
    return messages


async def test_two_ingest_processes_share_partitions_and_one_takes_over_from_the_other(settings, pg_dsn, tmp_path: Path) -> None:
    await ensure_topics(settings.kafka_bootstrap, prefix=settings.topic_prefix, partitions=PARTITIONS)
    await decide(pg_dsn, *INGEST_RUNS)
    topics = Topics(settings.topic_prefix)
    group = (f"{settings.topic_prefix}metering",)
    first, second = IngestProcess(settings, tmp_path / "ingest-1.log"), IngestProcess(settings, tmp_path / "ingest-2.log")
    await first.start()
    await second.start()
    try:
        await wait_for_members(settings.kafka_bootstrap, group, 2)
        before, after = samples(480), samples(240, start=480)
        async with Publisher(settings.kafka_bootstrap) as publisher:
            for message in before:
                await publisher.send(topics.metering, message, key=message.run_id)

            async def both_working() -> bool:
                return await kafka_samples(first.port) > 0 and await kafka_samples(second.port) > 0

            await wait_for(both_working, timeout=60, what="both processes consuming their partitions")
            first.kill()
            at_kill = await rows(pg_dsn)
            # Sent after the kill: the partitions of the killed process have work the survivor
            # must take over, however fast the first part went.
            for message in after:
                await publisher.send(topics.metering, message, key=message.run_id)
        distinct = len({(m.run_id, m.sample_id) for m in before + after})
        assert at_kill < distinct
        await wait_for_members(settings.kafka_bootstrap, group, 1)

        async def all_applied() -> bool:
            return await rows(pg_dsn) >= distinct

        await wait_for(all_applied, timeout=120, what="every sample applied by the survivor")
        await assert_applied_exactly_once(settings, pg_dsn, before + after)
    finally:
        first.stop()
        second.stop()


async def test_two_reconcilers_share_partitions_and_one_takes_over_from_the_other(admission_factory, feed, settings, pg_dsn, tmp_path: Path) -> None:  # noqa: F811
    await apply_policies(pg_dsn, {"b.yaml": budget_yaml("s", limit="gpu_hours: 1000000")}, sha="5" * 40)
    server = await admission_factory()
    await server.wait_ready()
    for i in range(RECONCILER_RUNS):
        answer = await server.submit(run_id=f"s{i}", labels={"team": "vision"}, resources={"gpus": 8}, projected_runtime_hours=10.0)
        assert answer.json()["decision"] == "ALLOW"
    start = this_month(timedelta(hours=5))
    messages = []
    for i in range(RECONCILER_RUNS):
        messages += [lifecycle(f"s{i}", "STARTED", start), usage(f"s{i}", "1", start + timedelta(hours=1), 2 + i % 3)]
        messages += [usage(f"s{i}", "2", start + timedelta(hours=2), 6 + i % 4), lifecycle(f"s{i}", "COMPLETED", start + timedelta(hours=2))]
    name = f"{settings.topic_prefix}reconciler"
    # The drift check stays on (as deployed), often: it is how Redis catches up with a settlement
    # the killed process committed to Postgres but never applied to Redis.
    processes = [start_reconciler(settings, tmp_path / f"reconciler-{n}.log", drift_check_seconds="1", consumer_group=name) for n in (1, 2)]
    # Today the reconciler puts the topic prefix before the group name it is given.
    group = (name, f"{settings.topic_prefix}{name}")
    try:
        await wait_for_members(settings.kafka_bootstrap, group, 2)
        half = len(messages) // 2
        await feed.send(*messages[:half])

        async def some_settled() -> bool:
            final, _, _ = await counts(pg_dsn)
            return final >= 3

        await wait_for(some_settled, timeout=60, what="a few runs settled")
        processes[0].send_signal(signal.SIGKILL)
        processes[0].wait(10)
        final_at_kill, _, _ = await counts(pg_dsn)
        assert final_at_kill < RECONCILER_RUNS, "the kill came too late to interrupt anything"
        await feed.send(*messages[half:])
        await wait_for_members(settings.kafka_bootstrap, group, 1)
        [key] = await ledger_in_postgres(pg_dsn)
        expected = {key: (0, sum((6 + i % 4) * H for i in range(RECONCILER_RUNS)))}

        async def all_settled() -> bool:
            final, inbox, _ = await counts(pg_dsn)
            return final == RECONCILER_RUNS and inbox == len(messages) and await ledger_in_postgres(pg_dsn) == expected

        try:
            await wait_for(all_settled, timeout=120, what="every run settled by the survivor")
        except AssertionError as exc:
            wrong = await _runs_charged_wrongly(pg_dsn, {f"s{i}": (6 + i % 4) * H for i in range(RECONCILER_RUNS)})
            found = (await counts(pg_dsn), await ledger_in_postgres(pg_dsn))
            raise AssertionError(f"{exc}; (final, inbox, facts), ledger: {found}, expected {expected}; runs charged other than their usage: {wrong}") from exc
        final, inbox, facts = await counts(pg_dsn)
        assert final == RECONCILER_RUNS and inbox == facts == len(messages), "every fact applied once"
        assert await ledger_in_postgres(pg_dsn) == expected
        # The survivor, with no restart, brings Redis in line with what the killed one committed.
        await wait_for(lambda: _redis_reads(settings, key, expected[key]), timeout=60, what="Redis in line with the ledger")
    finally:
        for proc in processes:
            _stop(proc)


async def _runs_charged_wrongly(dsn: str, usage: dict[str, int]) -> dict[str, object]:
    """The runs whose charges do not add up to their usage, with what the reconciler holds of them."""
    conn = await asyncpg.connect(dsn)
    try:
        charged = dict(await conn.fetch("SELECT run_id, sum(amount)::bigint FROM run_charges GROUP BY run_id"))
        wrong: dict[str, object] = {}
        for run_id, amount in usage.items():
            if charged.get(run_id, 0) != amount:
                wrong[run_id] = {
                    "charged": charged.get(run_id, 0),
                    "usage": amount,
                    "charges": [tuple(r) for r in await conn.fetch("SELECT ledger_key, bucket, amount FROM run_charges WHERE run_id = $1", run_id)],
                    "meter": [dict(r) for r in await conn.fetch("SELECT * FROM run_meters WHERE run_id = $1", run_id)],
                    "samples": [dict(r) for r in await conn.fetch("SELECT * FROM run_samples WHERE run_id = $1", run_id)],
                    "settlement": [dict(r) for r in await conn.fetch("SELECT * FROM run_settlements WHERE run_id = $1", run_id)],
                }
        return wrong
    finally:
        await conn.close()


async def _redis_reads(settings, key: str, wanted: tuple[int, int]) -> bool:  # type: ignore[no-untyped-def]
    client = connect(settings.redis_url)
    try:
        reserved, consumed = await client.hmget(f"{{{settings.redis_prefix}}}:l:{key}", "reserved", "consumed")
    finally:
        await client.aclose()
    return reserved is not None and (int(reserved), int(consumed)) == wanted


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
