"""metering-ingest on real Kafka and Postgres: samples in, usage rows and usage.records.v1 out;
duplicates, resends and reordering change nothing; every kind of bad sample is dead-lettered
with its reason while the consumer keeps going; samples of unknown runs wait, then apply or
expire."""

from __future__ import annotations

import json
import random
from datetime import UTC, datetime, timedelta

from aiokafka import AIOKafkaProducer

from budgetgate import wire
from budgetgate.core.metering import Counters, Rejection, Sample, milli, normalize, reason_code, usage_event_id
from budgetgate.topics import Topics, dlq
from budgetgate.v1.metering_pb2 import MeteringSample
from tests.integration.test_consumer import drain
from tests.support.metering import (  # noqa: F401 - pytest fixtures
    T0,
    decide,
    dlq_reasons,
    fetchval,
    json_record,
    metric,
    metering,
    metering_factory,
    sample,
    usage_records,
    usage_rows,
    wait_for,
)

GPU_HOUR = 3_600_000


async def published_outbox(dsn: str) -> bool:
    return await fetchval(dsn, "SELECT count(*) = 0 FROM outbox WHERE published_at IS NULL") is True


async def count(dsn: str, table: str) -> int:
    return int(await fetchval(dsn, f"SELECT count(*) FROM {table}"))  # type: ignore[arg-type]


async def test_samples_become_usage_rows_and_usage_records(metering, settings, pg_dsn) -> None:
    topics = Topics(settings.topic_prefix)
    await decide(pg_dsn, "run-a")
    async with wire.Publisher(settings.kafka_bootstrap) as publisher:
        for message in [sample("run-a", "s1", 1800.0, minute=0, node_seconds=225.0), sample("run-a", "s2", 3600.0, minute=10, node_seconds=450.0), sample("run-a", "s3", 3600.0, minute=20, node_seconds=450.0)]:
            await publisher.send(topics.metering, message, key=message.run_id)

    await wait_for(lambda: _rows(pg_dsn, 3), what="3 usage rows")
    rows = await usage_rows(pg_dsn, "run-a")
    assert [(r["sample_id"], r["gpu_milli_hours"], r["gpu_milli_hours_delta"], r["node_milli_hours_cumulative"]) for r in rows] == [
        ("s1", GPU_HOUR // 2, GPU_HOUR // 2, 225_000),
        ("s2", GPU_HOUR, GPU_HOUR // 2, 450_000),
        ("s3", GPU_HOUR, 0, 450_000),
    ]
    assert {r["source"] for r in rows} == {"kafka"} and not any(r["late"] for r in rows)
    run = await fetchval(pg_dsn, "SELECT row(gpu_milli_hours_cumulative, node_milli_hours_cumulative, samples)::text FROM usage_runs WHERE run_id = 'run-a'")
    assert run == f"({GPU_HOUR},450000,3)"

    records = await usage_records(settings.kafka_bootstrap, topics.usage, 3)
    assert [(r.sample_id, r.gpu_milli_hours_cumulative, r.gpu_milli_hours_delta, r.node_milli_hours_delta) for r in records] == [
        ("s1", GPU_HOUR // 2, GPU_HOUR // 2, 225_000),
        ("s2", GPU_HOUR, GPU_HOUR // 2, 225_000),
        ("s3", GPU_HOUR, 0, 0),
    ]
    assert [r.event_id for r in records] == [usage_event_id("run-a", s) for s in ("s1", "s2", "s3")]
    assert [r.gpu_milli_hours_observed for r in records] == [r.gpu_milli_hours_cumulative for r in records]
    assert records[0].observed_at.ToDatetime(tzinfo=UTC) == T0


async def _rows(dsn: str, expected: int) -> bool:
    return len(await usage_rows(dsn)) >= expected


async def test_duplicated_resent_and_shuffled_stream_gives_the_clean_usage(metering, settings, pg_dsn) -> None:
    topics = Topics(settings.topic_prefix)
    runs = ["run-x", "run-y"]
    await decide(pg_dsn, *runs)
    rng = random.Random(7)
    clean = []
    for run_id in runs:
        gpu = 0.0
        for i in range(12):
            gpu += rng.choice([0.0, 12.5, 60.0, 3600.0])
            clean.append(sample(run_id, f"{run_id}/s{i}", gpu, minute=i * 5, node_seconds=gpu / 8))
    # Every sample again (the same message re-sent), a third resent under a new sample id, all shuffled.
    arriving = clean + [sample(m.run_id, m.sample_id, m.gpu_seconds, at=m.observed_at.ToDatetime(tzinfo=UTC), node_seconds=m.node_seconds) for m in clean]
    arriving += [sample(m.run_id, f"{m.sample_id}/again", m.gpu_seconds, at=m.observed_at.ToDatetime(tzinfo=UTC), node_seconds=m.node_seconds) for m in clean[::3]]
    rng.shuffle(arriving)
    async with wire.Publisher(settings.kafka_bootstrap) as publisher:
        for message in arriving:
            await publisher.send(topics.metering, message, key=message.run_id)

    await wait_for(lambda: _processed(metering, len(arriving)), what="every sample consumed")
    expected, _ = normalize(Sample(m.run_id, m.sample_id, m.observed_at.ToDatetime(tzinfo=UTC), Counters(milli(m.gpu_seconds), milli(m.node_seconds))) for m in clean)
    for run_id in runs:
        rows = await usage_rows(pg_dsn, run_id)
        assert [(r["observed_at"], Counters(r["gpu_milli_hours"], r["node_milli_hours"])) for r in rows] == [(k.observed_at, k.counters) for k in expected.recorded(run_id)]
        cumulative = await fetchval(pg_dsn, "SELECT row(gpu_milli_hours_cumulative, node_milli_hours_cumulative)::text FROM usage_runs WHERE run_id = $1", run_id)
        assert cumulative == f"({expected.cumulative(run_id).gpu},{expected.cumulative(run_id).node})"

    await wait_for(lambda: published_outbox(pg_dsn), what="outbox relayed")
    recorded = await usage_rows(pg_dsn)
    records = await usage_records(settings.kafka_bootstrap, topics.usage, len(recorded))
    # One usage record per usage row, late ones included.
    assert sorted(r.event_id for r in records) == sorted(r["event_id"] for r in recorded)
    for run_id in runs:
        mine = [r for r in records if r.run_id == run_id]
        assert sum(r.gpu_milli_hours_delta for r in mine) == max(r.gpu_milli_hours_cumulative for r in mine) == expected.cumulative(run_id).gpu
        assert sum(r.node_milli_hours_delta for r in mine) == expected.cumulative(run_id).node
        # One partition per run key: the records of a run arrive in the order they were made,
        # and in that order the cumulative never goes down.
        assert [r.gpu_milli_hours_cumulative for r in mine] == sorted(r.gpu_milli_hours_cumulative for r in mine)
        # The own counters of all records are the clean stream's points, whatever came late.
        points = sorted((r.observed_at.ToDatetime(tzinfo=UTC), Counters(r.gpu_milli_hours_observed, r.node_milli_hours_observed)) for r in mine)
        assert points == [(k.observed_at, k.counters) for k in expected.recorded(run_id)]


async def _processed(server, expected: int) -> bool:  # type: ignore[no-untyped-def]
    consumer = server.rt.consumer
    return consumer is not None and consumer.processed + consumer.duplicates + consumer.dead_lettered >= expected


async def test_every_rejection_reason_goes_to_the_dlq_and_the_consumer_keeps_going(metering, settings, pg_dsn) -> None:
    topics = Topics(settings.topic_prefix)
    await decide(pg_dsn, "run-ok")
    future = datetime.now(UTC) + timedelta(hours=1)
    long_ago = datetime.now(UTC) - timedelta(days=2)
    bad = {
        "negative": sample("run-ok", "neg", -5.0, minute=1),
        "not_finite": sample("run-ok", "nan", float("nan"), minute=2),
        "out_of_range": sample("run-ok", "huge", 2e15, minute=2.5),
        "missing_field": sample("", "no-run", 5.0, minute=3),
        "invalid_field": sample("run ok", "space", 5.0, minute=4),
        "future_timestamp": sample("run-ok", "future", 5.0, at=future),
        "counter_regression": sample("run-ok", "down", 10.0, minute=30),
        "conflict": sample("run-ok", "first", 999.0, minute=20),
        "unknown_run": sample("never-decided", "old", 5.0, at=long_ago),
    }
    async with wire.Publisher(settings.kafka_bootstrap) as publisher:
        await publisher.send(topics.metering, sample("run-ok", "first", 100.0, minute=20), key="run-ok")
        for message in bad.values():
            await publisher.send(topics.metering, message, key=message.run_id or "none")
        await publisher.send_record(topics.metering, wire.Record(value=b"\x00not protobuf", key=b"run-ok", headers=[(wire.CONTENT_TYPE, wire.PROTOBUF.encode())]))
        await publisher.send_record(topics.metering, wire.Record(value=json.dumps({"eventId": "e-1", "runId": "run-ok", "gpuSeconds": "lots"}).encode(), key=b"run-ok", headers=[(wire.CONTENT_TYPE, b"application/json")]))
        await publisher.send(topics.metering, sample("run-ok", "last", 200.0, minute=40), key="run-ok")

    expected_reasons = sorted([*bad, "unparseable", "unparseable"])
    assert set(expected_reasons) == {str(r) for r in Rejection}, "every reason is tried"
    dead = await drain(settings.kafka_bootstrap, dlq(topics.metering), len(expected_reasons))
    reasons = dlq_reasons(dead)
    # Samples that do not even parse carry the consumer's reason, which names no code of ours.
    assert sorted(str(reason_code(r)) for r in reasons) == expected_reasons, reasons
    assert any("gpu_seconds" in r and "-5.0" in r for r in reasons)
    assert all(wire.header(r.headers, wire.DLQ_SOURCE_TOPIC) == topics.metering.encode() for r in dead)
    # The consumer went on: the sample after all of them is recorded, none of the bad ones is.
    await wait_for(lambda: _rows(pg_dsn, 2), what="the good samples recorded")
    assert [r["sample_id"] for r in await usage_rows(pg_dsn)] == ["first", "last"]
    assert await count(pg_dsn, "metering_pending") == 0

    text = (await metering.client.get("/metrics")).text
    for reason in set(expected_reasons):
        assert metric(text, "budgetgate_metering_rejections_total", reason=reason, source="kafka") == expected_reasons.count(reason), reason
    assert metric(text, "budgetgate_metering_samples_total", outcome="accepted", source="kafka") == 2


async def test_json_mapped_samples_are_accepted(metering, settings, pg_dsn) -> None:
    topics = Topics(settings.topic_prefix)
    await decide(pg_dsn, "run-json")
    producer = AIOKafkaProducer(bootstrap_servers=settings.kafka_bootstrap)
    await producer.start()
    try:
        for message in [sample("run-json", "j1", 7.25, minute=0), sample("run-json", "j2", 9.5, minute=1, node_seconds=1.0)]:
            record = json_record(message)
            await producer.send_and_wait(topics.metering, value=record.value, key=record.key, headers=record.headers)
    finally:
        await producer.stop()
    await wait_for(lambda: _rows(pg_dsn, 2), what="JSON samples recorded")
    rows = await usage_rows(pg_dsn, "run-json")
    assert [(r["gpu_milli_hours"], r["node_milli_hours"]) for r in rows] == [(7250, 0), (9500, 1000)]


async def test_unknown_run_waits_for_its_decision(metering, settings, pg_dsn) -> None:
    topics = Topics(settings.topic_prefix)
    now = datetime.now(UTC)
    waiting = [
        sample("late-run", "p2", 20.0, at=now - timedelta(seconds=30)),
        sample("late-run", "p1", 10.0, at=now - timedelta(seconds=60)),
        sample("late-run", "p3", 15.0, at=now - timedelta(seconds=10)),  # lower than p2, later
    ]
    async with wire.Publisher(settings.kafka_bootstrap) as publisher:
        for message in waiting:
            await publisher.send(topics.metering, message, key=message.run_id)
    await wait_for(lambda: _pending(pg_dsn, 3), what="three samples pending")
    assert await usage_rows(pg_dsn) == []

    await decide(pg_dsn, "late-run")
    await wait_for(lambda: _pending(pg_dsn, 0), what="pending samples taken")
    rows = await usage_rows(pg_dsn, "late-run")
    # Applied earliest observation first, so neither is late and p2 carries the increase.
    assert [(r["sample_id"], r["gpu_milli_hours_delta"], r["late"]) for r in rows] == [("p1", 10_000, False), ("p2", 10_000, False)]
    records = await usage_records(settings.kafka_bootstrap, topics.usage, 2)
    assert [r.sample_id for r in records] == ["p1", "p2"]
    # p3 went down after p2: dead-lettered through the outbox, with what came with it.
    [dead] = await drain(settings.kafka_bootstrap, dlq(topics.metering), 1)
    assert dlq_reasons([dead])[0].startswith("counter_regression:")
    assert wire.decode(MeteringSample, dead.value, dead.headers).sample_id == "p3"


async def _pending(dsn: str, expected: int) -> bool:
    return await count(dsn, "metering_pending") == expected


async def test_unknown_run_past_its_grace_is_dead_lettered(metering_factory, settings, pg_dsn) -> None:
    server = await metering_factory(unknown_run_grace_seconds=1.0)
    await server.wait_ready()
    topics = Topics(settings.topic_prefix)
    async with wire.Publisher(settings.kafka_bootstrap) as publisher:
        await publisher.send(topics.metering, sample("ghost", "g1", 5.0, at=datetime.now(UTC)), key="ghost")
    dead = await drain(settings.kafka_bootstrap, dlq(topics.metering), 1)
    [reason] = dlq_reasons(dead)
    assert reason.startswith("unknown_run: run 'ghost' has no decision")
    assert wire.header(dead[0].headers, wire.DLQ_SOURCE_TOPIC) == topics.metering.encode()
    assert wire.header(dead[0].headers, wire.DLQ_OFFSET) == b"0"
    assert await count(pg_dsn, "metering_pending") == 0 and await usage_rows(pg_dsn) == []
