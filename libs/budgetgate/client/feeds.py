"""Lifecycle events and metering samples, as platforms and exporters send them: built here,
then published to Kafka (KafkaFeed) or posted to metering-ingest (the clients' publish_*).

Ids are stable where a resend must deduplicate: a sample's event id derives from its run and
sample id, a lifecycle event's from its run, type and time, unless the caller names one.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import UTC, datetime
from typing import Any

from google.protobuf import json_format

from budgetgate.messaging.publisher import Publisher
from budgetgate.client.calls import Call
from budgetgate.client.errors import InvalidRequest
from budgetgate.core.metering import sample_event_id
from budgetgate.core.reconciliation import LIFECYCLE_KINDS
from budgetgate.contracts.lifecycle_rules import derived_event_id
from budgetgate.contracts.timestamps import timestamp
from budgetgate.v1.lifecycle_pb2 import LifecycleEvent, LifecycleType
from budgetgate.v1.metering_pb2 import MeteringSample


def lifecycle_event(
    run_id: str,
    kind: str,
    *,
    at: datetime | None = None,
    gpus: int = 0,
    nodes: int = 0,
    flavor: str = "",
    region: str = "",
    reason: str = "",
    event_id: str | None = None,
) -> LifecycleEvent:
    """A LifecycleEvent: `kind` is STARTED, COMPLETED, FAILED, CANCELLED, EVICTED, READMITTED or
    STORED (the run's object exists: confirms a provisional hold)."""
    when = at or datetime.now(UTC)
    kind = kind.upper()
    if kind not in LIFECYCLE_KINDS:
        raise InvalidRequest.unsent([{"field": "type", "msg": f"lifecycle kind {kind!r} is not one of {', '.join(LIFECYCLE_KINDS)}"}])
    event = LifecycleEvent(
        event_time=timestamp(when), run_id=run_id, type=LifecycleType.Value(kind), gpus=gpus, nodes=nodes, flavor=flavor, region=region, reason=reason
    )
    event.event_id = event_id or derived_event_id(event)
    return event


def metering_sample(
    run_id: str,
    *,
    sample_id: str,
    gpu_seconds: float,
    node_seconds: float = 0.0,
    observed_at: datetime | None = None,
    exporter: str = "budgetgate-client",
    event_id: str | None = None,
) -> MeteringSample:
    """A MeteringSample: GPU- and node-seconds used since the run started (cumulative)."""
    observed = timestamp(observed_at or datetime.now(UTC))
    return MeteringSample(
        event_id=event_id or sample_event_id(run_id, sample_id),
        event_time=timestamp(datetime.now(UTC)),
        sample_id=sample_id,
        run_id=run_id,
        observed_at=observed,
        gpu_seconds=gpu_seconds,
        node_seconds=node_seconds,
        exporter=exporter,
    )


def _json(messages: Iterable[LifecycleEvent | MeteringSample]) -> list[dict[str, Any]]:
    return [json_format.MessageToDict(m) for m in messages]


def _results(body: Any) -> list[dict[str, Any]]:
    return list(body.get("results", [])) if isinstance(body, dict) else []


def post_lifecycle(events: Sequence[LifecycleEvent]) -> Call[list[dict[str, Any]]]:
    """POST /v1/lifecycle/events to metering-ingest."""
    return Call("POST", "/v1/lifecycle/events", _results, json={"events": _json(events)})


def post_metering(samples: Sequence[MeteringSample]) -> Call[list[dict[str, Any]]]:
    """POST /v1/metering/samples to metering-ingest."""
    return Call("POST", "/v1/metering/samples", _results, json={"samples": _json(samples)})


class KafkaFeed:
    """Publishes lifecycle events and metering samples to their topics, each acknowledged by
    the broker before `send_*` returns (async with: connect and disconnect)."""

    def __init__(self, bootstrap: str, *, topic_prefix: str = "", client_id: str = "budgetgate-client") -> None:
        from budgetgate.contracts.topics import Topics

        self.topics = Topics(topic_prefix)
        self.publisher = Publisher(bootstrap, client_id=client_id)

    async def __aenter__(self) -> KafkaFeed:
        await self.publisher.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.publisher.stop()

    async def send_lifecycle(self, *events: LifecycleEvent) -> None:
        """Publish `events` on workload.lifecycle.v1, keyed by run id (in order per run)."""
        for event in events:
            await self.publisher.send(self.topics.lifecycle, event, key=event.run_id)

    async def send_metering(self, *samples: MeteringSample) -> None:
        """Publish `samples` on metering.samples.v1, keyed by run id."""
        for sample in samples:
            await self.publisher.send(self.topics.metering, sample, key=sample.run_id)
