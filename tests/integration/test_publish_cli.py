"""`budgetgate publish lifecycle|metering` build their events with the client's builders and send
them to the stack's topics as given."""

from __future__ import annotations

import asyncio
import math

from click.testing import CliRunner

from budgetgate.contracts import wire
from budgetgate.cli.main import cli
from budgetgate.contracts.topics import Topics
from budgetgate.messaging.topic_admin import ensure_topics
from budgetgate.v1.lifecycle_pb2 import LifecycleEvent, LifecycleType
from budgetgate.v1.metering_pb2 import MeteringSample
from tests.support.kafka import drain


async def test_publish_sends_what_it_is_told(settings) -> None:
    await ensure_topics(settings.kafka_bootstrap, prefix=settings.topic_prefix, partitions=1)
    env = {"BUDGETGATE_HOME": "", "BUDGETGATE_KAFKA_BOOTSTRAP": settings.kafka_bootstrap, "BUDGETGATE_TOPIC_PREFIX": settings.topic_prefix}

    def run(*args: str) -> str:
        result = CliRunner().invoke(cli, ["publish", *args], env=env)
        assert result.exit_code == 0, result.output
        return result.output

    await asyncio.to_thread(
        run, "lifecycle", "--run-id", "r1", "--event", "evicted", "--at", "2026-07-14T09:00:00", "--reason", "node drained", "--event-id", "e-1"
    )
    await asyncio.to_thread(run, "lifecycle", "--run-id", "r1", "--event", "evicted", "--at", "2026-07-14T09:00:00", "--event-id", "e-1")
    await asyncio.to_thread(run, "metering", "--run-id", "r1", "--gpu-seconds", "nan", "--sample-id", "s-1")
    topics = Topics(settings.topic_prefix)
    events = [wire.decode(LifecycleEvent, r.value, r.headers) for r in await drain(settings.kafka_bootstrap, topics.lifecycle, 2)]
    assert [(e.event_id, LifecycleType.Name(e.type), e.reason) for e in events] == [("e-1", "EVICTED", "node drained"), ("e-1", "EVICTED", "")]
    assert events[0].event_time.ToJsonString() == "2026-07-14T09:00:00Z"
    (sample,) = [wire.decode(MeteringSample, r.value, r.headers) for r in await drain(settings.kafka_bootstrap, topics.metering, 1)]
    assert sample.sample_id == "s-1" and math.isnan(sample.gpu_seconds)  # sent as given, for ingest to reject
