"""metering-ingest harness: a real uvicorn server on a free port (its Kafka consumer, relay and
pending re-check inside), wired to the test's own database and topic prefix, or the service as a
process of its own, to be killed; plus samples, decisions, readers for what the service wrote
and the check that a stream of samples was applied exactly once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

import asyncpg
import httpx
import pytest
from google.protobuf import json_format
from prometheus_client.parser import text_string_to_metric_families

from budgetgate.contracts import wire
from budgetgate.core.metering import Counters, milli
from budgetgate.messaging.publisher import Publisher
from budgetgate.services.metering_ingest.app import create_app
from budgetgate.services.metering_ingest.settings import MeteringSettings
from budgetgate.contracts.topics import Topics
from budgetgate.messaging.topic_admin import ensure_topics
from budgetgate.v1.metering_pb2 import MeteringSample
from budgetgate.v1.usage_pb2 import UsageRecord
from tests.support.kafka import drain
from tests.support.servers import InProcessServer, free_port, started_servers
from tests.support.waiting import wait_for

T0 = datetime.now(UTC).replace(microsecond=0) - timedelta(hours=1)


class MeteringServer(InProcessServer):
    """A running metering-ingest service and an HTTP client for it."""

    name = "metering-ingest"

    def __init__(self, settings: MeteringSettings) -> None:
        self.settings = settings
        super().__init__(create_app(settings), port=settings.port, dsn=settings.postgres_dsn)

    async def post(self, *samples: dict[str, object]) -> httpx.Response:
        return await self.client.post("/v1/metering/samples", json={"samples": list(samples)})


@pytest.fixture
async def metering_factory(settings) -> AsyncIterator[Callable[..., Awaitable[MeteringServer]]]:  # type: ignore[no-untyped-def]
    """Start metering-ingest servers on the test's backends (topics created first).

    A row and a usage record per sample (metering_fold off) unless a test asks for the fold:
    these tests pin down how each sample is judged and recorded; tests/integration/
    test_metering_fold.py shows what the fold keeps of them."""
    await ensure_topics(settings.kafka_bootstrap, prefix=settings.topic_prefix, partitions=1)
    # consumer_group: joined under the test's topic prefix.
    build = lambda values: MeteringServer(MeteringSettings(**values))
    async with started_servers(settings, build, pending_recheck_seconds=0.2, consumer_group="metering", metering_fold=False) as start:
        yield start


@pytest.fixture
async def metering(metering_factory) -> MeteringServer:  # type: ignore[no-untyped-def]
    """One ready metering-ingest service."""
    server = await metering_factory()
    await server.wait_ready()
    return server


def sample(run_id: str, sample_id: str, gpu_seconds: float, *, minute: float = 0, node_seconds: float = 0.0, at: datetime | None = None) -> MeteringSample:
    """A sample as an exporter publishes it, observed `minute` minutes after T0."""
    stamp_at = at or T0 + timedelta(minutes=minute)
    message = MeteringSample(
        event_id=str(uuid.uuid4()), sample_id=sample_id, run_id=run_id, gpu_seconds=gpu_seconds, node_seconds=node_seconds, exporter="test"
    )
    message.event_time.FromDatetime(datetime.now(UTC))
    message.observed_at.FromDatetime(stamp_at)
    return message


def as_json(message: MeteringSample) -> dict[str, object]:
    """The canonical protobuf JSON mapping of a sample."""
    return json_format.MessageToDict(message)


def json_record(message: MeteringSample) -> wire.Record:
    """A Kafka record carrying `message` in the protobuf JSON mapping."""
    return wire.Record(
        value=json.dumps(as_json(message)).encode(),
        key=message.run_id.encode(),
        headers=[(wire.CONTENT_TYPE, b"application/json; charset=utf-8"), (wire.EVENT_ID, message.event_id.encode())],
    )


async def decide(
    dsn: str,
    *run_ids: str,
    namespace: str = "test",
    labels: dict[str, str] | None = None,
    gpus: int | None = None,
    nodes: int | None = None,
    decided_at: datetime | None = None,
    attempt: int = 1,
) -> None:
    """Record an ALLOW decision for each run, as admission would have (in `namespace`, with
    `labels`): the runs become known. `gpus` and `nodes`: what it asked for (None: no count, as
    no decision of admission's has; the run's usage then has no bound); `decided_at`: when
    (default: the database's now)."""
    conn = await asyncpg.connect(dsn)
    try:
        await conn.executemany(
            """INSERT INTO decisions (decision_id, run_id, attempt, outcome, reason, namespace, labels, projected_gpu, request, response, decided_at,
                                      gpus, nodes)
               VALUES ($1, $2, $5, 'ALLOW', 'test', $3, $4::jsonb, 0, '{}', '{}', COALESCE($6, now()), $7, $8)""",
            [(uuid.uuid4(), run_id, namespace, json.dumps(labels or {}), attempt, decided_at, gpus, nodes) for run_id in run_ids],
        )
    finally:
        await conn.close()


async def usage_rows(dsn: str, run_id: str | None = None) -> list[asyncpg.Record]:
    conn = await asyncpg.connect(dsn)
    try:
        return await conn.fetch("SELECT * FROM usage_records WHERE $1::text IS NULL OR run_id = $1 ORDER BY run_id, observed_at", run_id)
    finally:
        await conn.close()


async def fetchval(dsn: str, query: str, *args: object) -> object:
    conn = await asyncpg.connect(dsn)
    try:
        return await conn.fetchval(query, *args)
    finally:
        await conn.close()


async def usage_records(bootstrap: str, topic: str, expected: int, timeout: float = 20) -> list[UsageRecord]:
    """The usage records on `topic`, once `expected` distinct ones are there (or whatever came by
    `timeout`): the relay may send a record again after a crash, and a copy is no new record."""
    found = await drain(bootstrap, topic, expected, timeout=timeout, distinct=lambda r: wire.header(r.headers, wire.EVENT_ID))
    return [wire.decode(UsageRecord, r.value, r.headers) for r in found]


def metric(text: str, name: str, **labels: str) -> float:
    """The value of the Prometheus sample `name` whose labels include `labels` (0 if none)."""
    for family in text_string_to_metric_families(text):
        for found in family.samples:
            if found.name == name and all(found.labels.get(k) == v for k, v in labels.items()):
                return found.value
    return 0.0


def dlq_reasons(records: list) -> list[str]:  # type: ignore[type-arg]
    return [(wire.header(r.headers, wire.DLQ_REASON) or b"").decode() for r in records]


async def metrics_after_one_sample(server: MeteringServer, dsn: str) -> str:
    """The service's /metrics once it has consumed one sample from Kafka (so that every metric
    of the consumer has a value to export)."""
    run_id = f"metrics-{uuid.uuid4().hex[:8]}"
    await decide(dsn, run_id)
    async with Publisher(server.settings.kafka_bootstrap) as publisher:
        await publisher.send(Topics(server.settings.topic_prefix).metering, sample(run_id, "s1", 60.0), key=run_id)
    await wait_for(lambda: _has_usage(dsn, run_id), what="the sample consumed")

    async def lag_exported() -> bool:
        return "budgetgate_consumer_lag_records{" in (await server.client.get("/metrics")).text

    await wait_for(lag_exported, what="consumer lag exported")
    return (await server.client.get("/metrics")).text


async def _has_usage(dsn: str, run_id: str) -> bool:
    return bool(await usage_rows(dsn, run_id))


def expected_usage(messages: list[MeteringSample]) -> dict[str, Counters]:
    final: dict[str, Counters] = defaultdict(Counters)
    for m in messages:
        final[m.run_id] = final[m.run_id].high_water(Counters(milli(m.gpu_seconds), milli(m.node_seconds)))
    return dict(final)


class IngestProcess:
    """metering-ingest as its own process, to be killed with SIGKILL."""

    def __init__(self, settings, log: Path, *, fold: bool = False) -> None:  # type: ignore[no-untyped-def]
        self.port = free_port()
        self.env = {
            **os.environ,
            "BUDGETGATE_POSTGRES_DSN": settings.postgres_dsn,
            "BUDGETGATE_KAFKA_BOOTSTRAP": settings.kafka_bootstrap,
            "BUDGETGATE_TOPIC_PREFIX": settings.topic_prefix,
            "BUDGETGATE_CONSUMER_GROUP": "metering",  # joined under the test's topic prefix
            "BUDGETGATE_PENDING_RECHECK_SECONDS": "0.2",
            "BUDGETGATE_METERING_FOLD": "true" if fold else "false",  # as metering_factory
        }
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None

    async def start(self) -> None:
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "budgetgate.services.metering_ingest", "--port", str(self.port)], env=self.env, stdout=out, stderr=subprocess.STDOUT
            )
        # One client for every look: a new one builds an SSL context each time (this helper was
        # the largest caller of ssl.create_default_context in a py-spy profile of the suite's workers).
        async with httpx.AsyncClient(timeout=2) as client:
            await wait_for(lambda: self._ready(client), timeout=60, what=f"metering-ingest ready (log: {self.log})")

    async def _ready(self, client: httpx.AsyncClient) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError(f"metering-ingest exited with {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
        try:
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
    # Samples are tracked by offsets, with no inbox row each: every record of the (fresh) topic was
    # in a poll that committed, and none was kept in an inbox.
    applied = await fetchval(
        dsn,
        "SELECT coalesce(sum(last + 1), 0) FROM (SELECT max(last_offset) AS last FROM consumer_offsets"
        " WHERE consumer = 'metering-ingest' AND topic = $1 GROUP BY kafka_partition) p",
        Topics(settings.topic_prefix).metering,
    )
    assert applied == len(messages), f"the polls' offsets cover {applied} of {len(messages)} records"
    assert await fetchval(dsn, "SELECT count(*) FROM inbox WHERE consumer = 'metering-ingest'") == 0
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
