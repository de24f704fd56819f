"""A FastStream batch subscriber feeding the inbox (budgetgate.consumer.Inbox): each poll is applied
in one Postgres transaction and acknowledged (its offsets committed) only after that commit.
metering-ingest and the reconciler both consume this way; each declares its own subscriber on its
own router with `subscribe_inbox` (`**INBOX_SUBSCRIBER`, and `apply_acked` per poll). `inbox_broker`
makes the broker a service includes its router into (its Kafka access: TLS, SASL), and
`start_consuming` starts it once Kafka answers.

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

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from aiokafka import ConsumerRecord
from faststream.kafka import KafkaBroker, KafkaRouter
from faststream.kafka.annotations import KafkaMessage
from faststream.middlewares import AckPolicy

from budgetgate.consumer import Applied, Inbox

if TYPE_CHECKING:
    from budgetgate import wire
    from budgetgate.lag import ConsumerProgress
    from budgetgate.settings import CommonSettings

log = logging.getLogger(__name__)


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


class Consuming(Protocol):
    """What a subscriber's handler needs of the running service."""

    @property
    def inbox(self) -> Inbox: ...

    @property
    def progress(self) -> ConsumerProgress | None: ...


R = TypeVar("R", bound=Consuming)


def subscribe_inbox(router: KafkaRouter, *topics: str, runtime: Callable[[], R], then: Callable[[R], None] | None = None, **options: Any) -> None:
    """Subscribe `router` to `topics` as an inbox consumer (`INBOX_SUBSCRIBER` and `options`:
    group_id, max_records, title, description...): each poll is applied by `runtime().inbox` and
    acknowledged (`apply_acked`), then `then(runtime())` runs, the poll's effects committed."""

    async def apply(message: KafkaMessage) -> None:
        rt = runtime()
        await apply_acked(rt.inbox, message, progress=rt.progress)
        if then is not None:
            then(rt)

    router.subscriber(*topics, **INBOX_SUBSCRIBER, **options)(apply)


def inbox_broker(settings: CommonSettings, router: KafkaRouter) -> KafkaBroker:
    """The FastStream broker of a service (`settings.service_name`) consuming through `router`,
    with the deployment's Kafka access (TLS, SASL); connected on `start_consuming`."""
    broker = KafkaBroker(settings.kafka_bootstrap, client_id=settings.service_name, log_level=logging.DEBUG, security=settings.kafka_access.faststream())
    broker.include_router(router)
    return broker


async def start_consuming(
    broker: KafkaBroker, publisher: wire.Publisher, *, what: str, prepare: Callable[[], Awaitable[Any]] | None = None, retry_seconds: float = 2.0
) -> None:
    """Start the dead-letter producer and then the broker's subscribers (after `prepare()`, if
    given), waiting for Kafka as long as it takes; once started, FastStream reconnects by itself.
    The records wait in their topics meanwhile."""
    while True:
        try:
            if prepare is not None:
                await prepare()
            await publisher.start()
            await broker.start()
            return
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - Kafka may come later
            log.warning("%s not started (%s); retrying in %.0fs", what, exc, retry_seconds)
            with contextlib.suppress(Exception):
                await broker.stop()
            with contextlib.suppress(Exception):
                await publisher.stop()
            await asyncio.sleep(retry_seconds)
