"""Kill metering-ingest, or Postgres under it, mid-stream: once things are back, every sample is
applied exactly once (no usage row lost, none applied twice) and every usage record is out."""

from __future__ import annotations

import asyncio
from datetime import timedelta


from budgetgate.messaging.publisher import Publisher
from budgetgate.contracts.topics import Topics
from budgetgate.messaging.topic_admin import ensure_topics
from budgetgate.v1.metering_pb2 import MeteringSample
from tests.support.databases import private_database
from tests.support.metering import T0, IngestProcess, as_json, assert_applied_exactly_once, decide, rows, sample
from tests.support.metering import metering_factory  # noqa: F401 - pytest fixtures
from tests.support.waiting import wait_for

RUNS = [f"run-{i}" for i in range(4)]


def stream(count: int, *, start: int = 0) -> list[MeteringSample]:
    """`count` samples spread over RUNS, counters rising, every tenth one sent twice."""
    messages = []
    for i in range(start, start + count):
        run_id = RUNS[i % len(RUNS)]
        step = i // len(RUNS)
        message = sample(run_id, f"{run_id}/{step}", 10.0 * step + 0.25, at=T0 + timedelta(seconds=step), node_seconds=float(step))
        messages.append(message)
        if i % 10 == 0:
            messages.append(message)  # the very same record again: a duplicate (by event id in one poll, by sample id across polls)
    return messages


async def test_ingest_killed_mid_stream_loses_nothing_and_applies_nothing_twice(settings, pg_dsn, tmp_path) -> None:
    await ensure_topics(settings.kafka_bootstrap, prefix=settings.topic_prefix, partitions=2)
    await decide(pg_dsn, *RUNS)
    topics = Topics(settings.topic_prefix)
    ingest = IngestProcess(settings, tmp_path / "ingest.log")
    await ingest.start()
    messages = stream(1500)
    sent = 0
    head = 200  # sent before the kill; the rest while ingest is down
    killed = asyncio.Event()

    async def publish() -> None:
        # One by one, acknowledged each: ingest is killed while it works through the head of the
        # stream, however fast it keeps up, and the rest arrives while it is down.
        nonlocal sent
        async with Publisher(settings.kafka_bootstrap) as publisher:
            for index, message in enumerate(messages):
                if index == head:
                    await killed.wait()
                await publisher.send(topics.metering, message, key=message.run_id)
                sent += 1

    publishing = asyncio.create_task(publish())
    try:
        await wait_for(lambda: _at_least(pg_dsn, 30), what="ingest under way")
        ingest.kill()
        killed.set()
        sent_at_kill, at_kill = sent, await rows(pg_dsn)
        assert 0 < at_kill and sent_at_kill <= head < len(messages), f"the kill should land mid-stream ({at_kill} applied, {sent_at_kill} sent)"
        await publishing
        await ingest.start()
        distinct = len({(m.run_id, m.sample_id) for m in messages})
        await wait_for(lambda: _at_least(pg_dsn, distinct), timeout=120, what="every sample applied after the restart")
        await assert_applied_exactly_once(settings, pg_dsn, messages)
    finally:
        publishing.cancel()
        ingest.stop()


async def _at_least(dsn: str, count: int) -> bool:
    return await rows(dsn) >= count


async def test_postgres_killed_mid_stream_is_waited_out(metering_factory, killable_postgres, settings) -> None:
    dsn = await private_database(killable_postgres.dsn)
    await decide(dsn, *RUNS)
    server = await metering_factory(postgres_dsn=dsn)
    await server.wait_ready()
    topics = Topics(settings.topic_prefix)
    messages = stream(400)
    async with Publisher(settings.kafka_bootstrap) as publisher:
        for message in messages:
            await publisher.send(topics.metering, message, key=message.run_id)
        await wait_for(lambda: _at_least(dsn, 20), what="ingest under way")
        killable_postgres.stop()
        refused = await server.post(as_json(sample(RUNS[0], "during-outage", 1.0)))
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert (await server.client.get("/readyz")).status_code == 503
        killable_postgres.start()

    await wait_for(lambda: _at_least(dsn, 400), timeout=120, what="every sample applied after Postgres returned")
    # Nothing was taken for poison while Postgres was away.
    assert server.rt.inbox.dead_lettered == 0
    await assert_applied_exactly_once(settings, dsn, messages)
