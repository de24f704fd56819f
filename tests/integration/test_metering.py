"""metering-ingest on real Kafka and Postgres: samples in, usage rows and usage.records.v1 out;
duplicates, resends and reordering change nothing; every kind of bad sample is dead-lettered
with its reason while the consumer keeps going; samples of unknown runs wait, then apply or
expire."""

from __future__ import annotations

import json
import random
from datetime import UTC, datetime, timedelta

import asyncpg
from aiokafka import AIOKafkaProducer

from budgetgate.messaging.publisher import Publisher
from budgetgate.contracts import wire
from budgetgate.core.metering import Counters, Duplicate, Rejected, Rejection, Sample, milli, normalize, reason_code, usage_event_id
from budgetgate.services.metering_ingest.ingest import Ingestor, Origin
from budgetgate.contracts.topics import Topics, dlq
from budgetgate.v1.metering_pb2 import MeteringSample
from tests.support.kafka import drain
from tests.support.metering import T0, decide, dlq_reasons, fetchval, json_record, metric, sample, usage_records, usage_rows
from tests.support.metering import metering, metering_factory  # noqa: F401 - pytest fixtures
from tests.support.waiting import wait_for

GPU_HOUR = 3_600_000


async def published_outbox(dsn: str) -> bool:
    return await fetchval(dsn, "SELECT count(*) = 0 FROM outbox WHERE published_at IS NULL") is True


async def count(dsn: str, table: str) -> int:
    return int(await fetchval(dsn, f"SELECT count(*) FROM {table}"))  # type: ignore[arg-type]


async def test_samples_become_usage_rows_and_usage_records(metering, settings, pg_dsn) -> None:
    topics = Topics(settings.topic_prefix)
    await decide(pg_dsn, "run-a")
    async with Publisher(settings.kafka_bootstrap) as publisher:
        for message in [
            sample("run-a", "s1", 1800.0, minute=0, node_seconds=225.0),
            sample("run-a", "s2", 3600.0, minute=10, node_seconds=450.0),
            sample("run-a", "s3", 3600.0, minute=20, node_seconds=450.0),
        ]:
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
    arriving += [
        sample(m.run_id, f"{m.sample_id}/again", m.gpu_seconds, at=m.observed_at.ToDatetime(tzinfo=UTC), node_seconds=m.node_seconds) for m in clean[::3]
    ]
    rng.shuffle(arriving)
    async with Publisher(settings.kafka_bootstrap) as publisher:
        for message in arriving:
            await publisher.send(topics.metering, message, key=message.run_id)

    await wait_for(lambda: _processed(metering, len(arriving)), what="every sample consumed")
    expected, _ = normalize(
        Sample(m.run_id, m.sample_id, m.observed_at.ToDatetime(tzinfo=UTC), Counters(milli(m.gpu_seconds), milli(m.node_seconds))) for m in clean
    )
    for run_id in runs:
        rows = await usage_rows(pg_dsn, run_id)
        assert [(r["observed_at"], Counters(r["gpu_milli_hours"], r["node_milli_hours"])) for r in rows] == [
            (k.observed_at, k.counters) for k in expected.recorded(run_id)
        ]
        cumulative = await fetchval(
            pg_dsn, "SELECT row(gpu_milli_hours_cumulative, node_milli_hours_cumulative)::text FROM usage_runs WHERE run_id = $1", run_id
        )
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


async def test_a_topic_read_again_from_its_start_changes_nothing(metering_factory, settings, pg_dsn) -> None:
    """No inbox row per sample (its polls' offsets are recorded instead): a second consumer group
    reading the whole topic again, as after a crash before offsets were committed or a group
    whose offsets expired, finds every sample a duplicate of itself or pending already, and
    writes no usage row, usage record or dead letter."""
    topics = Topics(settings.topic_prefix)
    await decide(pg_dsn, "run-a", "run-b")
    stream = [sample(run, f"{run}/s{i}", 600.0 * i, minute=i, node_seconds=75.0 * i) for i in range(1, 8) for run in ("run-a", "run-b")]
    recent = datetime.now(UTC) - timedelta(seconds=30)  # within the grace a run without a decision is given
    stream.append(sample("run-late", "run-late/s1", 60.0, at=recent))  # its decision comes later: kept pending, then applied
    stream.append(sample("run-never", "run-never/s1", 60.0, at=recent))  # never decided: kept pending
    first = await metering_factory()
    await first.wait_ready()
    async with Publisher(settings.kafka_bootstrap) as publisher:
        for message in stream:
            await publisher.send(topics.metering, message, key=message.run_id)
    await wait_for(lambda: _processed(first, len(stream)), what="every sample consumed")
    await decide(pg_dsn, "run-late")
    await wait_for(lambda: _rows(pg_dsn, 15), what="the pending sample applied once its run was decided")
    await wait_for(lambda: published_outbox(pg_dsn), what="outbox relayed")
    before = {
        "rows": [dict(r) for r in await usage_rows(pg_dsn)],
        "runs": await fetchval(pg_dsn, "SELECT array_agg(row(run_id, gpu_milli_hours_cumulative, samples)::text ORDER BY run_id) FROM usage_runs"),
        "outbox": await count(pg_dsn, "outbox"),
        "pending": await fetchval(pg_dsn, "SELECT array_agg(sample_id) FROM metering_pending"),
    }
    assert len(before["rows"]) == 15 and before["pending"] == ["run-never/s1"]

    again = await metering_factory(consumer_group="metering-again")
    await again.wait_ready()
    await wait_for(lambda: _processed(again, len(stream)), what="the topic read again")
    inbox = again.rt.inbox
    assert (inbox.processed, inbox.duplicates, inbox.dead_lettered) == (len(stream), 0, 0)
    exported = (await again.client.get("/metrics")).text
    assert metric(exported, "budgetgate_metering_samples_total", outcome="duplicate", source="kafka") == 15
    assert metric(exported, "budgetgate_metering_samples_total", outcome="pending", source="kafka") == 1
    after = {
        "rows": [dict(r) for r in await usage_rows(pg_dsn)],
        "runs": await fetchval(pg_dsn, "SELECT array_agg(row(run_id, gpu_milli_hours_cumulative, samples)::text ORDER BY run_id) FROM usage_runs"),
        "outbox": await count(pg_dsn, "outbox"),
        "pending": await fetchval(pg_dsn, "SELECT array_agg(sample_id) FROM metering_pending"),
    }
    assert after == before
    assert await count(pg_dsn, "inbox") == 0


async def _processed(server, expected: int) -> bool:  # type: ignore[no-untyped-def]
    inbox = server.rt.inbox
    return inbox.processed + inbox.duplicates + inbox.dead_lettered >= expected


async def test_every_rejection_reason_goes_to_the_dlq_and_the_consumer_keeps_going(metering, settings, pg_dsn) -> None:
    topics = Topics(settings.topic_prefix)
    await decide(pg_dsn, "run-ok")
    await decide(pg_dsn, "run-one-gpu", gpus=1, nodes=1)  # decided now: at most 1 GPU x (300 s slack) x 1.05 so far
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
        "impossible_usage": sample("run-one-gpu", "fast", 3600.0, at=datetime.now(UTC)),
    }
    async with Publisher(settings.kafka_bootstrap) as publisher:
        await publisher.send(topics.metering, sample("run-ok", "first", 100.0, minute=20), key="run-ok")
        for message in bad.values():
            await publisher.send(topics.metering, message, key=message.run_id or "none")
        await publisher.send_record(
            topics.metering, wire.Record(value=b"\x00not protobuf", key=b"run-ok", headers=[(wire.CONTENT_TYPE, wire.PROTOBUF.encode())])
        )
        await publisher.send_record(
            topics.metering,
            wire.Record(
                value=json.dumps({"eventId": "e-1", "runId": "run-ok", "gpuSeconds": "lots"}).encode(),
                key=b"run-ok",
                headers=[(wire.CONTENT_TYPE, b"application/json")],
            ),
        )
        await publisher.send(topics.metering, sample("run-ok", "last", 200.0, minute=40), key="run-ok")

    expected_reasons = sorted([*bad, "unparseable", "unparseable"])
    # out_of_scope only meets HTTP samples of a sender limited to namespaces or tenants (test_exporter_scope.py).
    assert set(expected_reasons) == {str(r) for r in Rejection} - {str(Rejection.OUT_OF_SCOPE)}, "every reason a Kafka sample can meet is tried"
    dead = await drain(settings.kafka_bootstrap, dlq(topics.metering), len(expected_reasons))
    reasons = dlq_reasons(dead)
    # Samples that do not even parse carry the consumer's reason, which names no code of ours.
    assert sorted(str(reason_code(r)) for r in reasons) == expected_reasons, reasons
    assert any("gpu_seconds" in r and "-5.0" in r for r in reasons)
    assert any(r.startswith("impossible_usage: run 'run-one-gpu' reported 3600 GPU-seconds") for r in reasons), reasons
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
    async with Publisher(settings.kafka_bootstrap) as publisher:
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
    async with Publisher(settings.kafka_bootstrap) as publisher:
        await publisher.send(topics.metering, sample("ghost", "g1", 5.0, at=datetime.now(UTC)), key="ghost")
    dead = await drain(settings.kafka_bootstrap, dlq(topics.metering), 1)
    [reason] = dlq_reasons(dead)
    assert reason.startswith("unknown_run: run 'ghost' has no decision")
    assert wire.header(dead[0].headers, wire.DLQ_SOURCE_TOPIC) == topics.metering.encode()
    assert wire.header(dead[0].headers, wire.DLQ_OFFSET) == b"0"
    assert await count(pg_dsn, "metering_pending") == 0 and await usage_rows(pg_dsn) == []


async def test_a_header_that_is_not_utf8_loses_nothing(metering, settings, pg_dsn) -> None:
    """Kafka headers are bytes: a record with one that is no UTF-8 is used like any other (and its
    neighbours in the batch too), and a poison one among them goes to the DLQ."""
    topics = Topics(settings.topic_prefix)
    await decide(pg_dsn, "run-h")
    odd = ("x-exporter-blob", b"\xff\xfe\x00")
    async with Publisher(settings.kafka_bootstrap) as publisher:
        await publisher.send(topics.metering, sample("run-h", "s1", 60.0, minute=1), key="run-h")
        record = wire.encode(sample("run-h", "s2", 120.0, minute=2), key="run-h")
        await publisher.send_record(topics.metering, wire.Record(value=record.value, key=record.key, headers=[*record.headers, odd]))
        await publisher.send_record(topics.metering, wire.Record(value=b"\x00not protobuf", key=b"run-h", headers=[odd]))
        await publisher.send(topics.metering, sample("run-h", "s3", 180.0, minute=3), key="run-h")
    await wait_for(lambda: _rows(pg_dsn, 3), what="the three samples recorded")
    assert [r["sample_id"] for r in await usage_rows(pg_dsn, "run-h")] == ["s1", "s2", "s3"]
    [dead] = await drain(settings.kafka_bootstrap, dlq(topics.metering), 1)
    assert wire.header(dead.headers, "x-exporter-blob") == odd[1] and dead.value == b"\x00not protobuf"


async def test_a_header_without_a_value_loses_nothing(metering, settings, pg_dsn) -> None:
    """Kafka allows a header with a null value: on the first record of a poll it once made the
    parser fail, which FastStream logs and skips, so the whole poll was lost (its offsets
    committed past it by the next). Now it is read like any other, and a poison one among
    them goes to the DLQ with it."""
    topics = Topics(settings.topic_prefix)
    await decide(pg_dsn, "run-n")
    empty = ("x-exporter-note", None)
    async with Publisher(settings.kafka_bootstrap) as publisher:
        record = wire.encode(sample("run-n", "s1", 60.0, minute=1), key="run-n")
        await publisher.send_record(topics.metering, wire.Record(value=record.value, key=record.key, headers=[empty, *record.headers]))
        await publisher.send_record(topics.metering, wire.Record(value=b"\x00not protobuf", key=b"run-n", headers=[empty]))
        await publisher.send(topics.metering, sample("run-n", "s2", 120.0, minute=2), key="run-n")
    await wait_for(lambda: _rows(pg_dsn, 2), what="the two samples recorded")
    assert [r["sample_id"] for r in await usage_rows(pg_dsn, "run-n")] == ["s1", "s2"]
    [dead] = await drain(settings.kafka_bootstrap, dlq(topics.metering), 1)
    assert dead.value == b"\x00not protobuf" and ("x-exporter-note", None) in [tuple(h) for h in dead.headers]


async def test_poison_too_large_to_park_whole_is_parked_without_its_value(metering, settings, pg_dsn) -> None:
    """A poison record near the producer's size limit cannot be copied whole to the DLQ (the
    reason and whence headers push it over): no retry could send it, and the consumer once
    retried for ever, every later record waiting. It is parked without its key, value and
    headers, which stay at the source offset the DLQ copy names, and the records after it go on."""
    topics = Topics(settings.topic_prefix)
    await decide(pg_dsn, "run-big")
    big = b"\x00" * 1_048_450  # not protobuf; within 1 MiB, which the copy with its reason and whence is not
    async with Publisher(settings.kafka_bootstrap) as publisher:
        await publisher.send_record(topics.metering, wire.Record(value=big, key=b"run-big", headers=[("x-big", b"1")]))
        await publisher.send(topics.metering, sample("run-big", "s1", 60.0, minute=1), key="run-big")
    await wait_for(lambda: _rows(pg_dsn, 1), what="the sample after the poison recorded")
    [dead] = await drain(settings.kafka_bootstrap, dlq(topics.metering), 1)
    assert dead.value in (b"", None) and dead.key is None
    assert wire.header(dead.headers, wire.DLQ_VALUE_DROPPED) == b"1048450"
    assert wire.header(dead.headers, wire.DLQ_SOURCE_TOPIC) == topics.metering.encode() and wire.header(dead.headers, wire.DLQ_OFFSET) == b"0"
    assert wire.header(dead.headers, wire.DLQ_REASON).startswith(b"not a valid")
    assert wire.header(dead.headers, "x-big") is None
    async with Publisher(settings.kafka_bootstrap) as publisher:  # a later poll is consumed too
        await publisher.send(topics.metering, sample("run-big", "s2", 120.0, minute=2), key="run-big")
    await wait_for(lambda: _rows(pg_dsn, 2), what="a later sample recorded")


async def test_batches_judged_against_recorded_history_give_what_one_by_one_gives(pg_dsn) -> None:
    """Ingestor.place_batch on Postgres, batch after batch, against the pure core applying the
    same samples one by one: late samples, resends under new ids, repeats, conflicts and
    regressions, within a batch and against what earlier batches recorded."""
    runs = ["run-x", "run-y", "run-z"]
    await decide(pg_dsn, *runs)
    ingestor = Ingestor(max_skew=timedelta(minutes=5), grace=timedelta(minutes=10), counts=_NoCounts())
    conn = await asyncpg.connect(pg_dsn)
    reference, _ = normalize([])
    try:
        for seed in range(3):
            rng = random.Random(seed)
            minutes = [seed * 100 + k for k in range(1, 16)]
            clean = [Sample(r, f"{r}/{m}", T0 + timedelta(minutes=m), Counters(1000 * m, 100 * m)) for r in runs for m in minutes]
            stream = clean + rng.sample(clean, 8)  # repeats
            stream += [Sample(s.run_id, f"{s.sample_id}/again", s.observed_at, s.counters) for s in rng.sample(clean, 5)]  # resends
            rng.shuffle(stream)
            # Last, so that most are judged against neighbours recorded by earlier batches.
            stream += [
                Sample(s.run_id, f"{s.sample_id}/odd", s.observed_at + timedelta(seconds=30), Counters(rng.randrange(0, 400_000), s.counters.node + 50))
                for s in rng.sample(clean, 12)
            ]
            stream += [Sample(r, f"{r}/{seed}/down", T0 + timedelta(minutes=seed * 100 + 20), Counters(500, 50)) for r in runs]
            at = 0
            while at < len(stream):
                batch = stream[at : at + rng.randrange(1, 25)]
                at += len(batch)
                origin = Origin(source="kafka", topic="t", payload=b"", headers=())
                async with conn.transaction():
                    got = await ingestor.place_batch(conn, [(s, origin) for s in batch])
                assert [_shape(o) for o in got] == [_shape(_one(reference, s)) for s in batch]
        for run_id in runs:
            recorded = await fetchval(pg_dsn, "SELECT gpu_milli_hours_cumulative FROM usage_runs WHERE run_id = $1", run_id)
            assert recorded == reference.cumulative(run_id).gpu
    finally:
        await conn.close()


class _NoCounts:
    def outcome(self, *_args: object, **_kwargs: object) -> None: ...

    def rejected(self, *_args: object, **_kwargs: object) -> None: ...


def _one(store, sample: Sample):  # type: ignore[no-untyped-def]
    try:
        return store.apply(sample)
    except Rejected as exc:
        return exc


def _shape(outcome) -> tuple[object, ...]:  # type: ignore[no-untyped-def]
    if isinstance(outcome, Rejected):
        return ("rejected", outcome.reason)
    if isinstance(outcome, Duplicate):
        return ("duplicate", outcome.sample.sample_id, outcome.of)
    return ("accepted", outcome.sample.sample_id, outcome.cumulative, outcome.delta, outcome.late)
