"""`budgetgate publish …`: send one well-formed test event to the running stack's Kafka.

Each subcommand builds one message and hands it to `_send`, which reads the connection settings
(BUDGETGATE_* variables, else the `.budgetgate/dev.json` of a running `budgetgate dev up`) and
waits for the broker's acknowledgement. Another event type is one more subcommand.
"""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, datetime

import click
from budgetgate.messaging.publisher import Publisher
from budgetgate.core.metering import EARLIEST
from google.protobuf.message import Message
from google.protobuf.timestamp_pb2 import Timestamp

from budgetgate.cli import backend
from budgetgate.runtime.settings import CommonSettings


@click.group()
def publish() -> None:
    """Publish test events to the local stack's topics."""


class _Time(click.ParamType):
    """An ISO 8601 time; one without a zone is taken as UTC."""

    name = "time"

    def convert(self, value: object, param: click.Parameter | None, ctx: click.Context | None) -> datetime:
        if isinstance(value, datetime):
            return value
        try:
            parsed = datetime.fromisoformat(str(value))
            at = parsed.astimezone(UTC) if parsed.tzinfo is not None else parsed.replace(tzinfo=UTC)
        except ValueError:
            self.fail(f"{value!r} is not an ISO 8601 time such as 2025-01-31T12:00:00Z", param, ctx)
        except OverflowError:  # an instant whose UTC falls outside years 1 to 9999
            self.fail(f"{value!r} is out of range in UTC", param, ctx)
        if at < EARLIEST:  # what metering-ingest and the reconciler refuse (dead-lettered, not counted)
            self.fail(f"{value!r} is before {EARLIEST.date().isoformat()}, the earliest time budgetgate takes", param, ctx)
        return at


TIME = _Time()


def timestamp(at: datetime) -> Timestamp:
    """A protobuf Timestamp of an aware datetime."""
    stamp = Timestamp()
    stamp.FromDatetime(at.astimezone(UTC))
    return stamp


@publish.command()
@click.option("--run-id", required=True, help="The run the usage belongs to (as admitted).")
@click.option("--gpu-seconds", required=True, type=float, help="GPU-seconds used since the run started (cumulative).")
@click.option("--node-seconds", default=0.0, show_default=True, type=float, help="Node-seconds used since the run started (cumulative).")
@click.option("--at", "at", type=TIME, default=None, help="When the counters were read (ISO 8601). Default: now.")
@click.option("--sample-id", default=None, help="The exporter's id of this sample. Default: a new uuid.")
@click.option("--exporter", default="budgetgate-cli", show_default=True, help="Name of the sending exporter.")
def metering(run_id: str, gpu_seconds: float, node_seconds: float, at: datetime | None, sample_id: str | None, exporter: str) -> None:
    """Send one metering sample to metering.samples.v1.

    Values are sent as given, so a negative or NaN figure shows how metering-ingest rejects it
    (on metering.samples.v1.dlq).
    """
    from budgetgate.client import metering_sample
    from budgetgate.contracts.topics import Topics

    sample = metering_sample(
        run_id, sample_id=sample_id or str(uuid.uuid4()), gpu_seconds=gpu_seconds, node_seconds=node_seconds,
        observed_at=at, exporter=exporter, event_id=str(uuid.uuid4()),
    )  # fmt: skip
    settings = backend.stack_settings(needs="kafka")
    topic = Topics(settings.topic_prefix).metering
    partition, offset = _send(settings, topic, sample, key=run_id)
    click.echo(f"sent sample {sample.sample_id} of run {run_id!r} to {topic} (partition {partition}, offset {offset})")


def _send(settings: CommonSettings, topic: str, message: Message, *, key: str) -> tuple[int, int]:
    """Publish `message` on `topic` and wait for the broker; (partition, offset) it landed at."""
    from aiokafka.errors import KafkaError

    backend.kafka(settings.kafka_bootstrap)

    async def send() -> tuple[int, int]:
        async with Publisher(settings.kafka_bootstrap, client_id="budgetgate-cli", access=settings.kafka_access) as publisher:
            meta = await publisher.send(topic, message, key=key)
            return meta.partition, meta.offset

    try:
        return asyncio.run(send())
    except (KafkaError, OSError) as exc:
        raise click.ClickException(f"cannot publish to Kafka at {settings.kafka_bootstrap}: {type(exc).__name__}: {exc}") from exc


# The event's gpus and nodes are int32 fields.
COUNT = click.IntRange(0, 2**31 - 1)
LIFECYCLE_EVENTS = ("started", "completed", "failed", "cancelled", "evicted", "readmitted", "stored")


@publish.command()
@click.option("--run-id", required=True, help="The run the event is about (as admitted).")
@click.option("--event", "kind", required=True, type=click.Choice(LIFECYCLE_EVENTS, case_sensitive=False), help="What happened to the run.")
@click.option("--at", "at", type=TIME, default=None, help="When it happened on the platform (ISO 8601). Default: now.")
@click.option("--gpus", type=COUNT, default=0, show_default=True, help="GPUs bound (for started/readmitted; 0 = as requested).")
@click.option("--nodes", type=COUNT, default=0, show_default=True, help="Nodes bound (for started/readmitted; 0 = as requested).")
@click.option("--flavor", default="", help="Resource flavor bound, e.g. h100.")
@click.option("--reason", default="", help="Why (for failed, cancelled, evicted).")
@click.option("--event-id", default=None, help="The event's id; send the same id twice to see deduplication. Default: a new uuid.")
def lifecycle(run_id: str, kind: str, at: datetime | None, gpus: int, nodes: int, flavor: str, reason: str, event_id: str | None) -> None:
    """Send one lifecycle event to workload.lifecycle.v1 (what the reconciler settles runs from)."""
    from budgetgate.client import lifecycle_event
    from budgetgate.contracts.topics import Topics

    event = lifecycle_event(run_id, kind, at=at, gpus=gpus, nodes=nodes, flavor=flavor, reason=reason, event_id=event_id or str(uuid.uuid4()))
    settings = backend.stack_settings(needs="kafka")
    topic = Topics(settings.topic_prefix).lifecycle
    partition, offset = _send(settings, topic, event, key=run_id)
    click.echo(f"sent {kind.upper()} of run {run_id!r} (event {event.event_id}) to {topic} (partition {partition}, offset {offset})")
