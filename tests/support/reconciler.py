"""The reconciler harness: a reconciler on the test's Postgres, Redis and Kafka (built directly,
served as its HTTP service, or as a process of its own, to be killed), a feed of lifecycle events
and usage records on the test's topics, the ledger as each side holds it, and what the reconciler
wrote to Postgres."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import datetime
from pathlib import Path

import asyncpg
import pytest
from google.protobuf.timestamp_pb2 import Timestamp

from budgetgate.contracts import wire
from budgetgate.messaging.publisher import Publisher
from budgetgate.services.reconciler.app import create_app
from budgetgate.services.reconciler.settings import ReconcilerSettings
from budgetgate.services.reconciler.service import Reconciler
from budgetgate.runtime.telemetry import setup_telemetry
from budgetgate.contracts.topics import Topics
from budgetgate.messaging.topic_admin import ensure_topics
from budgetgate.v1 import lifecycle_pb2, usage_pb2
from tests.support.kafka import wait_consumed
from tests.support.waiting import wait_for
from tests.support.servers import InProcessServer, free_port, started_servers

H = 3_600_000  # milli-hours in an hour: one GPU-hour in the ledger's units


def ts(at: datetime) -> Timestamp:
    stamp = Timestamp()
    stamp.FromDatetime(at)
    return stamp


def lifecycle(run_id: str, kind: str, at: datetime, *, gpus: int = 0, event_id: str | None = None) -> lifecycle_pb2.LifecycleEvent:
    return lifecycle_pb2.LifecycleEvent(
        event_id=event_id or str(uuid.uuid4()), event_time=ts(at), run_id=run_id, type=lifecycle_pb2.LifecycleType.Value(kind), gpus=gpus
    )


def usage(run_id: str, sample: str, at: datetime, gpu_hours: float, node_hours: float = 0.0) -> usage_pb2.UsageRecord:
    gpu, node = int(gpu_hours * H), int(node_hours * H)
    return usage_pb2.UsageRecord(
        event_id=str(uuid.uuid4()), event_time=ts(at), run_id=run_id, sample_id=sample, observed_at=ts(at),
        gpu_milli_hours_cumulative=gpu, node_milli_hours_cumulative=node, gpu_milli_hours_observed=gpu, node_milli_hours_observed=node,
    )  # fmt: skip


class Feed:
    """Publishes lifecycle events and usage records to the test's topics."""

    def __init__(self, publisher: Publisher, topics: Topics) -> None:
        self.publisher = publisher
        self.topics = topics

    async def send(self, *messages: object) -> None:
        for message in messages:
            topic = self.topics.lifecycle if isinstance(message, lifecycle_pb2.LifecycleEvent) else self.topics.usage
            await self.publisher.send(topic, message, key=message.run_id)  # type: ignore[attr-defined, arg-type]


@pytest.fixture
async def feed(settings) -> AsyncIterator[Feed]:  # type: ignore[no-untyped-def]
    await ensure_topics(settings.kafka_bootstrap, prefix=settings.topic_prefix)
    async with Publisher(settings.kafka_bootstrap) as publisher:
        yield Feed(publisher, Topics(settings.topic_prefix))


@pytest.fixture
async def reconciler_factory(settings) -> AsyncIterator[Callable[..., Awaitable[Reconciler]]]:  # type: ignore[no-untyped-def]
    started: list[Reconciler] = []

    async def start(**overrides: object) -> Reconciler:
        values = {**settings.model_dump(), "tick_seconds": 0.2, "drift_check_seconds": 0, **overrides}
        reconciler = Reconciler.create(ReconcilerSettings(**values), telemetry=setup_telemetry(service_name="reconciler-test", otlp_endpoint=None))
        await reconciler.start()
        started.append(reconciler)
        return reconciler

    yield start
    for reconciler in started:
        await reconciler.stop()


class ReconcilerServer(InProcessServer):
    """The reconciler service running (its app: /healthz, /readyz, /metrics and the operator's
    routes), an HTTP client for it with a token of every role, and the Reconciler as `rt`."""

    name = "reconciler"

    def __init__(self, settings: ReconcilerSettings) -> None:
        self.settings = settings
        super().__init__(create_app(settings), port=settings.port, dsn=settings.postgres_dsn)

    async def metrics(self) -> str:
        response = await self.client.get("/metrics")
        assert response.status_code == 200, response.text
        return response.text


@pytest.fixture
async def reconciler_server_factory(settings) -> AsyncIterator[Callable[..., Awaitable[ReconcilerServer]]]:  # type: ignore[no-untyped-def]
    """Start reconciler services on the test's backends, as reconciler_factory starts reconcilers."""
    build = lambda values: ReconcilerServer(ReconcilerSettings(**values))
    async with started_servers(settings, build, tick_seconds=0.2, drift_check_seconds=0) as start:
        yield start


async def ledger_in_postgres(dsn: str) -> dict[str, tuple[int, int]]:
    """(reserved, consumed) of every ledger key, from Postgres."""
    conn = await asyncpg.connect(dsn)
    try:
        rows = await conn.fetch(
            "SELECT e.ledger_key, e.consumed, COALESCE((SELECT sum(amount) FROM reservations r WHERE r.ledger_key = "
            "e.ledger_key AND r.state = 'held'), 0)::bigint AS reserved FROM ledger_entries e"
        )
        return {r["ledger_key"]: (r["reserved"], r["consumed"]) for r in rows}
    finally:
        await conn.close()


async def ledger_in_redis(reconciler: Reconciler) -> dict[str, tuple[int, int]]:
    return await reconciler.ledger.all_readings()


async def wait_caught_up(reconciler: Reconciler, *, timeout: float = 60) -> None:
    """Wait until `reconciler` has applied every fact now on its topics and settled every run they
    marked, in Postgres and in Redis: whatever it was sent has had its effect, so a test may check
    that something did *not* happen without sleeping "long enough" first."""
    s = reconciler.settings
    topics = Topics(s.topic_prefix)
    # The group its subscriber joins (services/reconciler/consumers.py).
    await wait_consumed(s.kafka_bootstrap, f"{s.topic_prefix}{s.consumer_group}", [topics.lifecycle, topics.usage], timeout=timeout)

    async def settled_everywhere() -> bool:
        if await reconciler.pool.fetchval("SELECT count(*) FROM runs_to_settle"):
            return False
        return not any([await ledger.pending_settlements() for ledger in reconciler.ledgers])

    await wait_for(settled_everywhere, timeout=timeout, what="every marked run settled, in Postgres and Redis")


async def outbox(dsn: str, topic: str, message_class):  # type: ignore[no-untyped-def]
    """The messages of `topic` in the outbox, in the order they were written."""
    conn = await asyncpg.connect(dsn)
    try:
        rows = await conn.fetch("SELECT payload, headers FROM outbox WHERE topic = $1 ORDER BY id", topic)
    finally:
        await conn.close()
    return [wire.decode(message_class, r["payload"], None) for r in rows]


async def settled(dsn: str, run_id: str) -> asyncpg.Record | None:
    conn = await asyncpg.connect(dsn)
    try:
        return await conn.fetchrow("SELECT * FROM run_settlements WHERE run_id = $1", run_id)
    finally:
        await conn.close()


async def run_charges(dsn: str, run_id: str) -> dict[tuple[str, datetime], int]:
    conn = await asyncpg.connect(dsn)
    try:
        return {(r["ledger_key"], r["bucket"]): r["amount"] for r in await conn.fetch("SELECT * FROM run_charges WHERE run_id = $1", run_id)}
    finally:
        await conn.close()


async def counts(dsn: str) -> tuple[int, int, int]:
    """(runs settled for good, the facts' inbox rows, facts recorded)."""
    conn = await asyncpg.connect(dsn)
    try:
        final = await conn.fetchval("SELECT count(*) FROM run_settlements WHERE final")
        # The facts' inbox rows (the reconciler also consumes decisions, for waiting runs).
        inbox = await conn.fetchval("SELECT count(*) FROM inbox WHERE consumer = 'reconciler' AND topic NOT LIKE '%budget.decisions.v1'")
        facts = await conn.fetchval("SELECT (SELECT count(*) FROM lifecycle_events) + (SELECT count(*) FROM run_samples)")
        return final, inbox, facts
    finally:
        await conn.close()


def start_reconciler(settings, log: Path, **env: str) -> subprocess.Popen[bytes]:  # type: ignore[no-untyped-def]
    """The reconciler as a process of its own (to be SIGKILLed) on the test's backends, ticking
    every 0.2 s with no drift check, its output appended to `log`; `env` sets more variables
    (BUDGETGATE_ added, upper-cased: drift_check_seconds="1", consumer_group=...)."""
    variables = {**os.environ, **{f"BUDGETGATE_{k.upper()}": str(v) for k, v in settings.model_dump().items() if v is not None and k != "service_name"}}
    # A port of its own: it serves /healthz, /readyz and /metrics, and tests run side by side.
    variables |= {"BUDGETGATE_TICK_SECONDS": "0.2", "BUDGETGATE_DRIFT_CHECK_SECONDS": "0", "BUDGETGATE_PORT": str(free_port())}
    variables |= {f"BUDGETGATE_{k.upper()}": v for k, v in env.items()}
    with log.open("ab") as out:
        return subprocess.Popen([sys.executable, "-m", "budgetgate.services.reconciler"], env=variables, stdout=out, stderr=subprocess.STDOUT)
