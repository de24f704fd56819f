"""A FastStream batch subscriber feeding the inbox (budgetgate.messaging.inbox.Inbox): each poll is applied
in one Postgres transaction and acknowledged (its offsets committed) only after that commit.
metering-ingest, the reconciler and the evidence-emitter consume this way; each declares once what
it consumes (`Subscription`: each topic with its inbox route, and the subscriber's options), from
which both its subscriber on its own router (`subscribe_inbox`: `**INBOX_SUBSCRIBER`, and
`apply_acked` per poll) and its inbox's routes are derived. `inbox_broker`
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
  when one is not (or has no value, a null, which Kafka allows too), fails the whole batch before
  the handler runs, so with manual acks the poison record and every good one polled with it
  would be skipped silently (seen on Tansu and Kafka alike: a header is bytes to Kafka). The
  parser hands FastStream header values it can decode and keeps the records as they came in
  `raw_message`, which is what the inbox reads.
- The poison handling itself (decode, dead-letter topic, the others committed once) is the
  inbox's: FastStream's own exception handling would ack or nack the batch as a whole.
- `subscribe_inbox(..., pipelined=True)` (metering-ingest) overlaps each poll's transaction with
  the next poll (`Pipeline`). Its handler returns before its poll is committed, so FastStream's
  ack, which commits the consumer's position, cannot be used: the pipeline commits each poll's
  own offsets with aiokafka's `commit` once it and every poll before it have committed, and
  seeks a failed poll back itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import weakref
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from aiokafka import ConsumerRecord, TopicPartition
from aiokafka.structs import OffsetAndMetadata
from faststream.kafka import KafkaBroker, KafkaRouter
from faststream.kafka.annotations import KafkaMessage
from faststream.middlewares import AckPolicy

from budgetgate.messaging.publisher import Publisher
from budgetgate.messaging.inbox import Applied, BatchRoute, Inbox, Route, Turn
from budgetgate.runtime.kafka_access import start_whole

if TYPE_CHECKING:
    from budgetgate.messaging.lag import ConsumerProgress
    from budgetgate.runtime.settings import CommonSettings

log = logging.getLogger(__name__)


async def keep_header_bytes(records: tuple[ConsumerRecord, ...], parse: Callable[[tuple[ConsumerRecord, ...]], Awaitable[Any]]) -> Any:
    """FastStream's batch message of `records`, with the records as they came in `raw_message`.

    FastStream's batch parser is given only the first record (with header values it can
    decode), for the message's own headers and context: it turns every header of every record
    into a dict of text, which nothing here reads (the inbox reads the records themselves),
    and which cost more per record than the rest of the poll's handling outside the inbox.
    `batch_headers` therefore holds the first record's headers only."""
    first = records[0]
    if not _utf8(first.headers):
        first = dataclasses.replace(first, headers=[(k, _readable(v)) for k, v in first.headers])
    message = await parse((first,))
    message.raw_message = records
    message.body = [r.value or b"" for r in records]
    message.message_id = f"{records[0].offset}-{records[-1].offset}-{records[0].timestamp}"
    return message


def _utf8(headers: Sequence[tuple[str, bytes | None]] | None) -> bool:
    """Whether every header value is UTF-8 text: Kafka allows any bytes, and no value at all
    (null), on which FastStream's parser fails (and then skips the whole poll)."""
    try:
        for _, value in headers or ():
            if value is None:
                return False
            value.decode()
    except UnicodeDecodeError:
        return False
    return True


def _readable(value: bytes | None) -> bytes:
    """A header value FastStream's parser can decode: none (null) is empty."""
    return b"" if value is None else value.decode("utf-8", errors="replace").encode()


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


# What this process last committed, per consumer and partition. A broker that answers with a
# lower committed offset for the group, or none, lost the group's offsets, and with them, it may
# be, the log the consumer's position points into (a broker restarted empty, a topic made anew):
# records written there since sit below a position carried over from the old log, and would be
# skipped. Checked before every commit (`offsets_lost`).
_COMMITTED: weakref.WeakKeyDictionary[Any, dict[TopicPartition, int]] = weakref.WeakKeyDictionary()


async def offsets_lost(consumer: Any, partitions: Iterable[TopicPartition], *, name: str) -> bool:
    """Whether the broker lost offsets this consumer committed on any of `partitions`; if so,
    every partition assigned to it is sought to its beginning, to be read again (the inbox skips
    what is done), and nothing is to be committed for the poll. When the broker cannot be asked,
    False: the commit goes ahead as before."""
    mine = _COMMITTED.get(consumer)
    known = [tp for tp in partitions if mine and tp in mine]
    if mine is None or not known:
        return False
    try:  # (the partitions' questions at once: one round trip's wait on the poll's path, not one each)
        answers = await asyncio.gather(*(consumer.committed(tp) for tp in known))
    except Exception:  # noqa: BLE001 - cannot tell: commit as usual
        return False
    lost = {tp: (theirs, mine[tp]) for tp, theirs in zip(known, answers, strict=True) if theirs is None or theirs < mine[tp]}
    if not lost:
        return False
    log.warning(
        "%s: the broker holds %s for the group where this consumer committed %s: it lost the group's offsets (restarted empty, or the topic "
        "was made anew); every assigned partition is read again from its start, and the inbox skips what is done",
        name, {str(tp): theirs for tp, (theirs, _) in lost.items()}, {str(tp): ours for tp, (_, ours) in lost.items()},
    )  # fmt: skip
    _COMMITTED.pop(consumer, None)
    if assigned := consumer.assignment():
        await consumer.seek_to_beginning(*assigned)
    return True


def committed(consumer: Any, offsets: Mapping[TopicPartition, int]) -> None:
    """Remember what `consumer` committed (the next offset to read, per partition); not for a
    consumer that cannot be asked what its group committed (FastStream's stand-in without a group)."""
    if hasattr(consumer, "committed"):
        _COMMITTED.setdefault(consumer, {}).update(offsets)


async def apply_acked(inbox: Inbox, message: KafkaMessage, *, progress: ConsumerProgress | None = None) -> Applied:
    """Apply one poll's records in one transaction, then acknowledge them (nack on failure, so
    FastStream seeks back and nothing is skipped). Not acknowledged when the broker lost the
    group's offsets: the consumer then reads its partitions again from their start."""
    records: Sequence[ConsumerRecord] = message.raw_message
    started = time.perf_counter()
    try:
        applied = await inbox.apply(records)
    except BaseException:
        await message.nack()
        raise
    read = {tp: last + 1 for tp, (_, last) in _offsets(records).items()}
    if await offsets_lost(message.consumer, read, name=inbox.name):
        return applied
    await message.ack()
    committed(message.consumer, read)
    if progress is not None:
        await progress.polled(applied, seconds=time.perf_counter() - started, records=records, consumer=message.consumer)
    return applied


@dataclass(eq=False)
class _Flight:
    """One poll applied by a pipeline: its records, its transaction and its offsets' commit."""

    records: Sequence[ConsumerRecord]
    turn: Turn
    applying: asyncio.Future[Applied]
    committing: asyncio.Future[None] = field(init=False)  # set as soon as the flight exists
    started: float = field(default_factory=time.perf_counter)


class Pipeline:
    """Applies the polls of one subscriber with each poll's transaction overlapping the next
    poll's work: the next poll is fetched, decoded and validated, and its inbox rows claimed,
    while Postgres still works on this one (`Inbox.apply` with a `Turn` keeps every lock in poll
    order). At most two polls are in flight: a poll's handler returns once the poll before it
    is committed and its offsets with it.

    Offsets are committed by the pipeline, poll by poll in order, each once its own
    transaction has committed, and with the offsets of that poll only: FastStream's ack commits
    the consumer's position, which is past a poll still in flight here, so this is the part
    that uses aiokafka's commit directly. A poll that fails (not an outage: `Inbox.apply`
    retries those in place) rewinds every partition of it and of the polls after it to its
    first record, as a nack does, and nothing after it is committed."""

    def __init__(self, inbox: Inbox, *, progress: ConsumerProgress | None = None) -> None:
        self.inbox = inbox
        self.progress = progress
        self._last: _Flight | None = None
        # Where failed polls sent their partitions back to, until a poll starts there again.
        self._rewound: dict[TopicPartition, int] = {}
        _PIPELINES.add(self)

    async def apply(self, message: KafkaMessage) -> None:
        """Start applying one poll; returns once the poll before it is committed. When that one
        failed, this one is cancelled, both are rewound and its failure is raised."""
        records: Sequence[ConsumerRecord] = message.raw_message
        consumer = message.consumer
        if self._rewound and self._stale(consumer, records):
            return
        before = self._last
        if before is not None and before.committing.done() and _failed(before.committing):
            before = None  # failed and rewound before this poll was fetched: this one starts afresh
        turn = Turn(after=before.turn if before is not None else None)
        flight = _Flight(records, turn, asyncio.ensure_future(self.inbox.apply(records, turn=turn)))
        flight.committing = asyncio.ensure_future(self._commit(before, flight, consumer))
        self._last = flight
        if before is None:
            return
        # Waited for without taking its outcome: cancelling this handler (the service stopping)
        # leaves both polls to finish and commit in the background.
        await asyncio.wait([before.committing])
        if _failed(before.committing):
            self._last = None
            await asyncio.wait([flight.committing])  # cancels this poll's transaction (its predecessor failed)
            _failed(flight.committing)  # its failure is the one raised below
            self._rewind(consumer, [*before.records, *records])
            # Raised as an error of this handler (not the poll's own exception, which may be a
            # cancellation): FastStream's consume loop goes on with the rewound partitions.
            cause = None if before.committing.cancelled() else before.committing.exception()
            raise RuntimeError(f"{self.inbox.name}: a poll of {len(before.records)} records failed; it and the next are read again") from cause

    def _rewind(self, consumer: Any, records: Sequence[ConsumerRecord]) -> None:
        """Seek each partition of `records` back to its first record there (or to where an
        earlier failure sent it, if that is earlier): they are read again."""
        for tp, (offset, _) in _offsets(records).items():
            self._rewound[tp] = min(offset, self._rewound.get(tp, offset))
        for tp, offset in self._rewound.items():
            with contextlib.suppress(Exception):  # no longer assigned: its new owner starts from the committed offset
                consumer.seek(tp, offset)

    def _stale(self, consumer: Any, records: Sequence[ConsumerRecord]) -> bool:
        """Whether `records` were fetched before a rewind (a rewound partition's records not
        starting where it was sent back to): then they are dropped, and every partition of
        them is sought back, to be read again in order."""
        assigned = consumer.assignment()
        self._rewound = {tp: offset for tp, offset in self._rewound.items() if tp in assigned}  # a rebalance took the others
        first = _offsets(records)
        if any(tp in self._rewound and offset != self._rewound[tp] for tp, (offset, _) in first.items()):
            log.warning("%s: a poll fetched before a rewind is dropped and read again", self.inbox.name)
            self._rewind(consumer, records)
            return True
        for tp in first:
            self._rewound.pop(tp, None)  # read again from where it was sent back to
        return False

    async def drain(self) -> None:
        """Wait for the polls in flight to be committed or to have failed."""
        last = self._last
        if last is not None:
            with contextlib.suppress(BaseException):
                await asyncio.shield(last.committing)

    async def _commit(self, before: _Flight | None, flight: _Flight, consumer: Any) -> None:
        """Commit the offsets of `flight` once it and every poll before it are committed."""
        if before is not None:
            await asyncio.wait([before.committing])
            if _failed(before.committing):
                flight.applying.cancel()  # the handler waiting on `before` rewinds both
                await asyncio.wait([flight.applying])
                _failed(flight.applying)
                raise RuntimeError(f"{self.inbox.name}: the poll before this one failed")
        try:
            applied = await flight.applying
        except BaseException as exc:
            log.error("%s: a poll of %d records failed, read again from its first: %r", self.inbox.name, len(flight.records), exc)
            self._rewind(consumer, flight.records)
            raise
        # Only partitions still assigned: aiokafka refuses the whole commit for one that a
        # rebalance took (its new owner reads it again, and its inbox skips what is done).
        assigned = consumer.assignment()
        offsets = {tp: OffsetAndMetadata(last + 1, "") for tp, (_, last) in _offsets(flight.records).items() if tp in assigned}
        try:
            if offsets and not await offsets_lost(consumer, offsets, name=self.inbox.name):
                await consumer.commit(offsets)
                committed(consumer, {tp: meta.offset for tp, meta in offsets.items()})
        except Exception as exc:  # noqa: BLE001 - not committed: read again, and skipped by the inbox
            log.warning("%s: offsets %s not committed: %s", self.inbox.name, offsets, exc)
        if self.progress is not None:
            await self.progress.polled(applied, seconds=time.perf_counter() - flight.started, records=flight.records, consumer=consumer)


_PIPELINES: weakref.WeakSet[Pipeline] = weakref.WeakSet()


async def drain_pipelines(inbox: Inbox) -> None:
    """Wait for the polls `inbox`'s pipelines still have in flight (a service stopping, its
    consumers stopped): they commit in Postgres, and their dead letters go out, before the
    pool and the producers close. Their offsets are not committed then: they are read again
    on the next start, and skipped by the inbox."""
    for pipeline in list(_PIPELINES):
        if pipeline.inbox is inbox:
            await pipeline.drain()


def _failed(done: asyncio.Future[None]) -> bool:
    return done.cancelled() or done.exception() is not None


def _offsets(records: Sequence[ConsumerRecord]) -> dict[TopicPartition, tuple[int, int]]:
    """The first and the last offset of `records` in each of their partitions."""
    spans: dict[tuple[str, int], list[int]] = {}
    for record in records:  # in offset order within each partition, as a poll gives them
        span = spans.get((record.topic, record.partition))
        if span is None:
            spans[record.topic, record.partition] = [record.offset, record.offset]
        else:
            span[1] = record.offset
    # Keyed by plain tuples while counting: a TopicPartition per record (0.24 µs, timeit) was 2 %
    # of metering-ingest's samples in py-spy.
    return {TopicPartition(topic, partition): (first, last) for (topic, partition), (first, last) in spans.items()}


class Consuming(Protocol):
    """What a subscriber's handler needs of the running service."""

    @property
    def inbox(self) -> Inbox: ...

    @property
    def progress(self) -> ConsumerProgress | None: ...


R = TypeVar("R", bound=Consuming)


def subscribe_inbox(
    router: KafkaRouter, *topics: str, runtime: Callable[[], R], then: Callable[[R], None] | None = None, pipelined: bool = False, **options: Any
) -> None:
    """Subscribe `router` to `topics` as an inbox consumer (`INBOX_SUBSCRIBER` and `options`:
    group_id, max_records, title, description...): each poll is applied by `runtime().inbox` and
    acknowledged (`apply_acked`), then `then(runtime())` runs, the poll's effects committed.
    `pipelined` (without `then`): each poll's transaction overlaps the next poll (`Pipeline`),
    for handlers whose result does not depend on the order of two polls applied after an
    outage (see consumer.Turn)."""
    if pipelined and then is not None:
        raise ValueError("a pipelined subscriber has no `then`: its polls commit in the background")

    async def apply(message: KafkaMessage) -> None:
        rt = runtime()
        await apply_acked(rt.inbox, message, progress=rt.progress)
        if then is not None:
            then(rt)

    pipeline: Pipeline | None = None  # of the running service's inbox (a restart makes a new one)

    async def apply_pipelined(message: KafkaMessage) -> None:
        nonlocal pipeline
        rt = runtime()
        if pipeline is None or pipeline.inbox is not rt.inbox:
            pipeline = Pipeline(rt.inbox, progress=rt.progress)
        await pipeline.apply(message)

    router.subscriber(*topics, **INBOX_SUBSCRIBER, **options)(apply_pipelined if pipelined else apply)


@dataclass(frozen=True)
class Subscription(Generic[R]):
    """What a service consumes through its inbox, declared once (in its consumers.py): each topic
    with the route that reads it, made from the running service (`routes`), and the options of
    its FastStream subscriber. Both the subscriber (`router`) and the inbox's routes
    (`inbox_routes`) are derived from it, so a topic is never subscribed without a route or the
    other way round.

    `workers` subscribers of one group in one process each own some of the partitions (as
    processes side by side would); only the first is in the AsyncAPI document, the others are
    titled `<title>#<n>`. `then` and `pipelined` are `subscribe_inbox`'s."""

    routes: Mapping[str, Callable[[R], Route | BatchRoute]]
    group_id: str
    max_records: int
    title: str
    description: str
    then: Callable[[R], None] | None = None
    pipelined: bool = False
    workers: int = 1
    # The group member's session timeout and heartbeat (CommonSettings.kafka_group_timing);
    # empty: aiokafka's defaults.
    group_timing: Mapping[str, int] = field(default_factory=dict)

    @property
    def topics(self) -> list[str]:
        return list(self.routes)

    def inbox_routes(self, service: R) -> dict[str, Route | BatchRoute]:
        """The inbox's route of each topic, for the running `service`."""
        return {topic: make(service) for topic, make in self.routes.items()}

    def router(self, runtime: Callable[[], R]) -> KafkaRouter:
        """The FastStream router of the subscribers; `runtime()` gives the running service."""
        kafka = KafkaRouter()
        for worker in range(self.workers):
            subscribe_inbox(
                kafka,
                *self.routes,
                runtime=runtime,
                then=self.then,
                pipelined=self.pipelined,
                group_id=self.group_id,
                max_records=self.max_records,
                title=f"{self.title}#{worker}" if worker else self.title,
                description=self.description,
                include_in_schema=worker == 0,
                **self.group_timing,
            )
        return kafka


def inbox_broker(settings: CommonSettings, router: KafkaRouter) -> KafkaBroker:
    """The FastStream broker of a service (`settings.service_name`) consuming through `router`,
    with the deployment's Kafka access (TLS, SASL); connected on `start_consuming`."""
    # FastStream logs through the process's own logging (the service's format, on stderr), not a
    # handler of its own on stdout with colours; each message it handles at DEBUG. Its consumers
    # look at the topics' partitions every kafka_metadata_max_age_ms: a partition they do not
    # know of (a topic a broker that lost its state made anew with more) is read by nobody.
    broker = KafkaBroker(
        settings.kafka_bootstrap,
        client_id=settings.service_name,
        metadata_max_age_ms=settings.kafka_metadata_max_age_ms,
        logger=logging.getLogger("budgetgate.messaging.kafka"),
        log_level=logging.DEBUG,
        security=settings.kafka_access.faststream(),
    )
    broker.include_router(router)
    return broker


async def start_consuming(
    broker: KafkaBroker, publisher: Publisher, *, what: str, prepare: Callable[[], Awaitable[Any]] | None = None, retry_seconds: float = 2.0
) -> None:
    """Start the dead-letter producer and then the broker's subscribers (after `prepare()`, if
    given), waiting for Kafka as long as it takes; once started, FastStream reconnects by itself.
    The records wait in their topics meanwhile."""
    while True:
        try:
            if prepare is not None:
                await prepare()
            await publisher.start()
            await start_whole(broker.start())
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
