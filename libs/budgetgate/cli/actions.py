"""`budgetgate actions` and `budgetgate dlq`: read what the stack published on budget.actions.v1
(holds, drains, threshold alerts, headroom) and what its consumers dead-lettered, with the reasons."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime
from typing import Any

import click
from google.protobuf.json_format import MessageToDict

from budgetgate.runtime.kafka_access import PLAINTEXT, KafkaAccess
from budgetgate.cli import backend


async def read_topics(bootstrap: str, topics: list[str], *, follow: bool, skip_missing: bool = False, access: KafkaAccess = PLAINTEXT) -> AsyncIterator[Any]:
    """Every record of `topics` from the beginning, in order per partition; then, with `follow`,
    new ones as they come. A topic the broker does not know is a ClickException (or, with
    `skip_missing`, left out)."""
    from aiokafka import AIOKafkaConsumer, TopicPartition
    from aiokafka.errors import KafkaError

    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap, group_id=None, enable_auto_commit=False, auto_offset_reset="earliest", request_timeout_ms=10000, **access.aiokafka()
    )
    try:
        await consumer.start()
    except (KafkaError, OSError) as exc:
        await consumer.stop()
        raise click.ClickException(
            f"cannot reach Kafka at {bootstrap}: {exc}; start the local stack with `budgetgate dev up`, or set BUDGETGATE_KAFKA_BOOTSTRAP"
        ) from None
    try:
        known = await consumer.topics()
        missing = [t for t in topics if t not in known]
        topics = [t for t in topics if t in known]
        if missing and not (skip_missing and topics):
            raise click.ClickException(f"Kafka at {bootstrap} has no topic {', '.join(missing)}; is this the right stack (`budgetgate dev status`)?")
        partitions = [TopicPartition(t, p) for t in topics for p in sorted(consumer.partitions_for_topic(t) or ())]
        consumer.assign(partitions)
        await consumer.seek_to_beginning(*partitions)
        ends = await consumer.end_offsets(partitions)
        while True:
            batch = await consumer.getmany(*partitions, timeout_ms=500)
            for records in batch.values():
                for record in records:
                    yield record
            if not follow:
                positions = {p: await consumer.position(p) for p in partitions}
                if all(positions[p] >= ends[p] for p in partitions):
                    return
    finally:
        await consumer.stop()


def _when(record: Any) -> str:
    return datetime.fromtimestamp(record.timestamp / 1000, UTC).isoformat().replace("+00:00", "Z")


def _run(bootstrap: str, topics: list[str], follow: bool, show: Callable[[Any], None], *, skip_missing: bool = False, access: KafkaAccess = PLAINTEXT) -> None:
    async def main() -> None:
        async for record in read_topics(bootstrap, topics, follow=follow, skip_missing=skip_missing, access=access):
            show(record)

    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        pass


@click.command()
@click.option("--follow", "-f", is_flag=True, help="Keep printing new actions as they are published.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
def actions(follow: bool, as_json: bool) -> None:
    """Holds, drains, threshold alerts and HEADROOM the reconciler published on budget.actions.v1."""
    from budgetgate.contracts import wire
    from budgetgate.contracts.topics import Topics
    from budgetgate.v1.actions_pb2 import ActionType, BudgetAction

    settings = backend.stack_settings(needs="kafka")
    topic = Topics(settings.topic_prefix).actions

    def show(record: Any) -> None:
        try:
            action = wire.decode(BudgetAction, record.value, record.headers)
        except wire.WireError as exc:
            click.echo(f"{topic}[{record.partition}]@{record.offset}: unreadable ({exc.reason})", err=True)
            return
        data = MessageToDict(action, preserving_proto_field_name=True)
        if as_json:
            click.echo(json.dumps(data, sort_keys=True))
            return
        what = data.get("type", "?") + (f" {action.measure} {action.threshold_percent}%".replace("  ", " ") if action.threshold_percent else "")
        subject = f"policy {action.policy_id} on {action.scope_id}" + (f", run {action.run_id}" if action.run_id else "")
        if action.type == ActionType.HEADROOM:
            subject = f"run {action.run_id} attempt {action.attempt}"
        click.echo(f"{data.get('event_time', _when(record))}  {what:<18} {subject}" + (f": {action.message}" if action.message else ""))

    _run(backend.kafka(settings.kafka_bootstrap), [topic], follow, show, access=settings.kafka_access)


@click.command()
@click.option("--topic", "source", default=None, help="Only the dead letters of this topic (e.g. metering.samples.v1); default: every topic.")
@click.option("--follow", "-f", is_flag=True, help="Keep printing new dead letters as they come.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
def dlq(source: str | None, follow: bool, as_json: bool) -> None:
    """Messages the stack's consumers could not use, with the reason and where they came from."""
    from budgetgate.contracts import topics as topic_names
    from budgetgate.contracts import wire

    settings = backend.stack_settings(needs="kafka")
    names = topic_names.Topics(settings.topic_prefix)
    if source is not None and source.removesuffix(topic_names.DLQ_SUFFIX) not in topic_names.EVENT_TOPICS:
        raise click.BadParameter(f"{source!r} is not a budgetgate topic; one of {', '.join(topic_names.EVENT_TOPICS)}", param_hint="--topic")
    sources = [source.removesuffix(topic_names.DLQ_SUFFIX)] if source else list(topic_names.EVENT_TOPICS)
    dlqs = [names.name(topic_names.dlq(t)) for t in sources]

    def show(record: Any) -> None:
        headers = {k: v.decode("utf-8", "replace") for k, v in (record.headers or ())}
        data = {
            "dlq_topic": record.topic,
            "source_topic": headers.get(wire.DLQ_SOURCE_TOPIC),
            "source_partition": headers.get(wire.DLQ_PARTITION),
            "source_offset": headers.get(wire.DLQ_OFFSET),
            "reason": headers.get(wire.DLQ_REASON),
            "event_id": headers.get(wire.EVENT_ID),
            "key": record.key.decode("utf-8", "replace") if record.key else None,
            "dead_lettered_at": _when(record),
            "size": len(record.value or b""),
        }
        if as_json:
            click.echo(json.dumps(data, sort_keys=True))
        else:
            where = f"{data['source_topic']}[{data['source_partition']}]@{data['source_offset']}"
            click.echo(f"{data['dead_lettered_at']}  {where}  key {data['key'] or '-'}  event {data['event_id'] or '-'}: {data['reason']}")

    _run(backend.kafka(settings.kafka_bootstrap), dlqs, follow, show, skip_missing=source is None, access=settings.kafka_access)
