"""Kill metering-ingest, or Postgres under it, mid-stream: once things are back, every sample is
applied exactly once (no usage row lost, none applied twice) and every usage record is out."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections import defaultdict
from datetime import timedelta
from pathlib import Path

import httpx

from budgetgate.messaging.publisher import Publisher
from budgetgate.core.metering import Counters, milli
from budgetgate.contracts.topics import Topics
from budgetgate.messaging.topic_admin import ensure_topics
from budgetgate.v1.metering_pb2 import MeteringSample
from tests.faults.test_admission_faults import private_database
from tests.support.servers import free_port
from tests.support.metering import T0, as_json, decide, fetchval, metering_factory, sample, usage_records, usage_rows, wait_for  # noqa: F401 - fixture

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
            messages.append(message)  # the very same record again: the inbox must catch it
    return messages


def expected_usage(messages: list[MeteringSample]) -> dict[str, Counters]:
    final: dict[str, Counters] = defaultdict(Counters)
    for m in messages:
        final[m.run_id] = final[m.run_id].high_water(Counters(milli(m.gpu_seconds), milli(m.node_seconds)))
    return dict(final)


class IngestProcess:
    """metering-ingest as its own process, to be killed with SIGKILL."""

    def __init__(self, settings, log: Path) -> None:  # type: ignore[no-untyped-def]
        self.port = free_port()
        self.env = {
            **os.environ,
            "BUDGETGATE_POSTGRES_DSN": settings.postgres_dsn,
            "BUDGETGATE_KAFKA_BOOTSTRAP": settings.kafka_bootstrap,
            "BUDGETGATE_TOPIC_PREFIX": settings.topic_prefix,
            "BUDGETGATE_CONSUMER_GROUP": "metering",  # joined under the test's topic prefix
            "BUDGETGATE_PENDING_RECHECK_SECONDS": "0.2",
        }
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None

    async def start(self) -> None:
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "budgetgate.services.metering_ingest", "--port", str(self.port)], env=self.env, stdout=out, stderr=subprocess.STDOUT
            )
        await wait_for(self._ready, timeout=60, what=f"metering-ingest ready (log: {self.log})")

    async def _ready(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError(f"metering-ingest exited with {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
        try:
            async with httpx.AsyncClient(timeout=2) as client:
                return (await client.get(f"http://127.0.0.1:{self.port}/readyz")).status_code == 200
        except httpx.HTTPError:
            return False

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()


async def rows(dsn: str) -> int:
    return int(await fetchval(dsn, "SELECT count(*) FROM usage_records"))  # type: ignore[arg-type]


async def assert_applied_exactly_once(settings, dsn: str, messages: list[MeteringSample]) -> None:  # type: ignore[no-untyped-def]
    distinct = {(m.run_id, m.sample_id) for m in messages}
    recorded = await usage_rows(dsn)
    assert sorted((r["run_id"], r["sample_id"]) for r in recorded) == sorted(distinct)
    assert await fetchval(dsn, "SELECT count(*) FROM inbox WHERE consumer = 'metering-ingest'") == len({m.event_id for m in messages})
    final = expected_usage(messages)
    for run_id, counters in final.items():
        state = await fetchval(
            dsn, "SELECT row(gpu_milli_hours_cumulative, node_milli_hours_cumulative, samples)::text FROM usage_runs WHERE run_id = $1", run_id
        )
        # `samples` counts applications: a sample applied twice would show here.
        assert state == f"({counters.gpu},{counters.node},{sum(1 for r in recorded if r['run_id'] == run_id)})"
    await wait_for(lambda: _relayed(dsn), what="outbox relayed")
    published = await usage_records(settings.kafka_bootstrap, Topics(settings.topic_prefix).usage, len(distinct))
    by_event: dict[str, set[bytes]] = defaultdict(set)
    for record in published:
        by_event[record.event_id].add(record.SerializeToString(deterministic=True))
    # At least once on Kafka, and a redelivered record is the same record.
    assert len(by_event) == len(distinct) and all(len(copies) == 1 for copies in by_event.values())
    for run_id, counters in final.items():
        mine = {e: r for r in published if r.run_id == run_id for e in [r.event_id]}.values()
        assert sum(r.gpu_milli_hours_delta for r in mine) == counters.gpu


async def _relayed(dsn: str) -> bool:
    return await fetchval(dsn, "SELECT count(*) = 0 FROM outbox WHERE published_at IS NULL") is True


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
