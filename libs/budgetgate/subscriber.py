"""A FastStream batch subscriber feeding the inbox (budgetgate.consumer.Inbox): each poll is applied
in one Postgres transaction and acknowledged (its offsets committed) only after that commit.
metering-ingest and the reconciler both consume this way; each declares its own subscriber on its
own router with `**INBOX_SUBSCRIBER` and calls `apply_acked` from its handler.

How FastStream is used, and where it is not enough for the inbox pattern:
- `batch=True, max_records`: one poll, one list of records, one transaction.
- `ack_policy=AckPolicy.MANUAL` and `message.ack()` after `Inbox.apply` returned: the ack commits
  the position of every partition the consumer has returned records of, and all of those are
  durable by then (effects, inbox rows, dead letters). An outage never leaves the handler:
  `Inbox.apply` retries the batch in place. Should the handler fail anyway, it nacks, and
  FastStream seeks every partition of the batch back to its first record: nothing is skipped.
  (A handler that raised without a nack would be skipped: the next batch's ack commits past it.)
- `parser=keep_header_bytes`: FastStream's batch parser decodes every header value as UTF-8 and,
  when one is not, fails the whole batch before the handler runs, so with manual acks the poison
  record and every good one polled with it would be skipped silently (seen on Tansu and Kafka
  alike: a header is bytes to Kafka). The parser hands FastStream header values it can decode
  and keeps the records as they came in `raw_message`, which is what the inbox reads.
- The poison handling itself (decode, dead-letter topic, the others committed once) is the
  inbox's: FastStream's own exception handling would ack or nack the batch as a whole.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

from aiokafka import ConsumerRecord
from faststream.kafka.annotations import KafkaMessage
from faststream.middlewares import AckPolicy

from budgetgate.consumer import Applied, Inbox

if TYPE_CHECKING:
    from budgetgate.lag import ConsumerProgress


async def keep_header_bytes(records: tuple[ConsumerRecord, ...], parse: Callable[[tuple[ConsumerRecord, ...]], Awaitable[Any]]) -> Any:
    """FastStream's batch parser, given header values it can decode; the records as they came."""
    readable = tuple(
        r if _utf8(r.headers) else dataclasses.replace(r, headers=[(k, v.decode("utf-8", errors="replace").encode()) for k, v in r.headers]) for r in records
    )
    message = await parse(readable)
    message.raw_message = records
    return message


def _utf8(headers: Sequence[tuple[str, bytes]] | None) -> bool:
    try:
        for _, value in headers or ():
            value.decode()
    except UnicodeDecodeError:
        return False
    return True


async def raw_bodies(message: Any, _decode: Callable[[Any], Awaitable[Any]]) -> Any:
    """The record values as they are: the inbox decodes them (protobuf or its JSON mapping)."""
    return message.body


# What every inbox subscriber is, whatever it consumes (see the module docstring).
INBOX_SUBSCRIBER: dict[str, Any] = {
    "batch": True,
    "auto_offset_reset": "earliest",
    "ack_policy": AckPolicy.MANUAL,
    "parser": keep_header_bytes,
    "decoder": raw_bodies,
}


async def apply_acked(inbox: Inbox, message: KafkaMessage, *, progress: ConsumerProgress | None = None) -> Applied:
    """Apply one poll's records in one transaction, then acknowledge them (nack on failure, so
    FastStream seeks back and nothing is skipped)."""
    records: Sequence[ConsumerRecord] = message.raw_message
    started = time.perf_counter()
    try:
        applied = await inbox.apply(records)
    except BaseException:
        await message.nack()
        raise
    await message.ack()
    if progress is not None:
        progress.batch(applied, seconds=time.perf_counter() - started, topics=(r.topic for r in records))
        await progress.refresh(message.consumer)
    return applied
