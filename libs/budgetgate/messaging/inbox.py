"""The one way budgetgate consumes Kafka: what one poll returned is applied in ONE Postgres
transaction with the inbox rows of its messages, and the Kafka offsets are committed only after
that (invariant 5); a message that cannot be used goes to its topic's dead-letter topic with the
reason, and the others of its batch are neither lost nor repeated (invariant 6).

A service gives each topic a route:

- `Route(message_cls, handler)`: `await handler(conn, message, record)` per message, as before
  batches. Each runs under a savepoint of the batch's transaction, so a `Poison` it raises (or
  data Postgres refuses, SQLSTATE class 22) undoes that message alone and sends it to the DLQ.
- `BatchRoute(message_cls, handler)`: `await handler(conn, deliveries)` once per batch with
  every fresh (not yet in the inbox) message of that topic, in offset order per partition.
  The handler does its work through `conn` with multi-row statements, and may
  - return a mapping {delivery: reason} of messages it refuses: those go to the DLQ, the
    transaction commits the rest (the handler must have written nothing for them);
  - raise `Poison(reason, delivery=d)`: the transaction is rolled back and the batch applied
    again without `d`;
  - raise `Poison(reason)` without a delivery, or let Postgres refuse the data (class 22): the
    transaction is rolled back and the batch applied again, each message of that topic under a
    savepoint of its own (`handler(conn, [delivery])`), to find the one to blame.
  A batch may be applied more than once before it commits (after an outage, or as above), so a
  handler keeps its side effects outside Postgres (metrics, callbacks) idempotent or harmless.
- `BatchRoute(message_cls, handler, offsets=True)`: as above, for a handler whose effects are
  idempotent by the messages' own identity (metering-ingest: a sample's id). The inbox keeps no
  row per message: each poll records, in its transaction, the offsets it applied per partition
  (one `consumer_offsets` row each), as Kafka Connect sinks do. A message delivered again (a poll
  applied again after a crash, before its offsets reached Kafka; a producer's resend in a later
  poll) reaches the handler again, which finds it done; within one poll, a repeated event id is
  still a duplicate. Nothing is ever skipped by offset: a broker that lost its log (or a topic made
  anew) starts its offsets again, and those records are new.

Messages are decoded (`wire.decode`) before any handler sees them; one that cannot be is poison.
Duplicates (an event id this consumer's inbox already has, or one repeated within the batch; for
a route tracked by offsets, only the latter) never reach a handler. Any other exception is a
passing outage: the whole batch is retried with capped backoff, in place, so nothing is skipped;
its offsets are committed only once it is done.

`Inbox.apply(records)` is that transactional step, whatever polled the records: the services
consume through a FastStream batch subscriber that applies each poll and acknowledges it (commits
its offsets) only after that (budgetgate.messaging.subscriber: `INBOX_SUBSCRIBER`, `apply_acked`).
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from contextvars import ContextVar
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
from aiokafka import ConsumerRecord
from google.protobuf.message import Message
from opentelemetry import trace
from opentelemetry.trace import Link, SpanKind

from budgetgate.messaging.publisher import Publisher
from budgetgate.contracts import wire
from budgetgate.ledger.queries import owned_by

sql = owned_by("budgetgate.messaging")

log = logging.getLogger(__name__)
tracer = trace.get_tracer("budgetgate.messaging.inbox")

Handler = Callable[[asyncpg.Connection, Any, ConsumerRecord], Awaitable[None]]


@dataclass(eq=False, slots=True)
class Delivery:
    """One decoded message of a batch and the record it came in (compared by identity), and
    what its route's `prepare` made of it, if anything (the handler finds it there)."""

    message: Any
    record: ConsumerRecord
    prepared: Any = None


BatchHandler = Callable[[asyncpg.Connection, Sequence[Delivery]], Awaitable[Mapping[Delivery, str] | None]]


class Poison(ValueError):
    """A message that can never be processed; `reason` goes with it to the dead-letter topic.

    A batch handler names the message with `delivery`; without it, the batch is split to find it.
    """

    def __init__(self, reason: str, *, delivery: Delivery | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.delivery = delivery


@dataclass(frozen=True)
class Route:
    """How one topic is read, message by message: its message class and the handler of each."""

    message: type[Message]
    handler: Handler


@dataclass(frozen=True)
class BatchRoute:
    """How one topic is read, batch by batch: its message class and the handler of a batch.

    `prepare(deliveries)`, if given, is work on a batch without I/O that the inbox does while
    Postgres claims the batch's inbox rows, for the handler to find done (it is given every
    delivery of the topic, duplicates too, and may be given a batch again)."""

    message: type[Message]
    handler: BatchHandler
    prepare: Callable[[Sequence[Delivery]], None] | None = None
    # The handler's effects are idempotent by the messages' own identity: the poll's offsets are
    # recorded per partition instead of an inbox row per message (see the module docstring).
    offsets: bool = False


@dataclass(eq=False)
class Turn:
    """A batch's place among batches applied one after another with their transactions
    overlapping (budgetgate.messaging.subscriber's pipeline): it claims its inbox rows only after the
    batch before it (`after`) has claimed its own, and runs its handlers only after that batch's
    handlers have returned (or said `locks_taken`), so every lock the earlier batch takes is
    taken first and the later batch waits on it in Postgres until the earlier one commits (or
    rolls back).

    `claimed` and `handled` are this batch's own steps, set for the batch after it (also when
    this one fails or is cancelled). A batch rolled back by an outage and applied again after its
    successor committed is applied after it: every handler that runs pipelined must give the
    same result in either order. metering-ingest's does for counters that only go up: a sample
    applied after a later one of its run is late, and the run's high-water mark and totals are
    the same; of two samples that contradict each other, the one applied second is refused."""

    after: Turn | None = None
    claimed: asyncio.Event = field(default_factory=asyncio.Event)
    handled: asyncio.Event = field(default_factory=asyncio.Event)
    # The event ids of this batch's messages. The batch after it leaves them out of its claim
    # and counts them as duplicates: this batch applies them, or fails and takes that one down
    # with it. Claiming them too would wait in Postgres on this batch's uncommitted inbox rows,
    # and, should this batch roll back and claim again, hold them against it while waiting here
    # for its handlers: a deadlock Postgres cannot see.
    event_ids: frozenset[str] = frozenset()

    def finish(self) -> None:
        self.claimed.set()
        self.handled.set()
        # Done: it waits on the batch before it no more. Kept, each turn would hold every turn
        # since the start (and their event ids) through this link.
        self.after = None


_HANDLING: ContextVar[Turn | None] = ContextVar("budgetgate_consumer_turn", default=None)


def locks_taken() -> None:
    """Said by a batch handler once its transaction holds every lock it will take: the handlers
    of the batch after it may start now, while this one finishes work that takes none (building
    and writing its outbox rows), so Postgres works on the next batch meanwhile. Nothing outside
    a pipelined batch's handler, or in a batch applied message by message."""
    turn = _HANDLING.get()
    if turn is not None:
        turn.handled.set()


@dataclass
class Applied:
    """What one `Inbox.apply` did."""

    records: int = 0
    processed: int = 0
    duplicates: int = 0
    dead_lettered: int = 0
    # The fresh messages whose effects committed, for lag measurements.
    committed: list[Delivery] = field(default_factory=list)


class Inbox:
    """Applies batches of consumed records for `routes` (topic → route); `name` keys the inbox."""

    def __init__(
        self,
        *,
        name: str,
        pool: asyncpg.Pool,
        publisher: Publisher,
        routes: Mapping[str, Route | BatchRoute],
        max_backoff: float = 10.0,
        on_dead_letter: Callable[[str, str], None] | None = None,
    ) -> None:
        self.name = name
        self.pool = pool
        self.publisher = publisher
        self.routes = dict(routes)
        # Topics whose polls are recorded by offsets, with no inbox row per message.
        self.by_offsets = frozenset(topic for topic, route in self.routes.items() if isinstance(route, BatchRoute) and route.offsets)
        self.max_backoff = max_backoff
        self.on_dead_letter = on_dead_letter
        self.processed = 0
        self.duplicates = 0
        self.dead_lettered = 0

    async def apply(self, records: Sequence[ConsumerRecord], *, turn: Turn | None = None) -> Applied:
        """Apply `records` (any topics and partitions, offset order within each partition) in one
        transaction; returns once their effects and their dead letters are durable. Retries
        outages until it succeeds (or is cancelled). With `turn`, its transaction overlaps the
        one of the batch before it, in that batch's wake (see Turn)."""
        try:
            return await self._apply(records, turn)
        finally:
            if turn is not None:
                turn.finish()

    async def _apply(self, records: Sequence[ConsumerRecord], turn: Turn | None) -> Applied:
        poisoned: dict[int, str] = {}  # index in `records` → reason
        deliveries: list[tuple[int, Delivery]] = []
        for index, record in enumerate(records):
            try:
                message = wire.decode(self.routes[record.topic].message, record.value, record.headers)
            except wire.WireError as exc:
                poisoned[index] = exc.reason
                continue
            deliveries.append((index, Delivery(message, record)))
        if turn is not None:
            turn.event_ids = frozenset(d.message.event_id for _, d in deliveries)
        applied = _offset_ranges(records, self.by_offsets)
        split: set[str] = set()  # topics whose batch handler runs message by message
        delay = 0.2
        while True:
            try:
                outcome = await self._transaction([d for i, d in deliveries if i not in poisoned], split, turn, applied)
            except asyncio.CancelledError:
                raise
            except _Blame as blame:
                if blame.delivery is None:
                    split.add(blame.topic)
                else:
                    index = next((i for i, d in deliveries if d is blame.delivery), None)
                    if index is None:
                        raise RuntimeError(f"{self.name}: a handler of {blame.topic} named poison that is not in its batch") from blame
                    poisoned[index] = blame.reason
                continue
            except Exception as exc:  # noqa: BLE001 - an outage: apply the batch again
                first = records[0]
                log.warning(
                    "%s: batch of %d from %s[%d]@%d failed, retrying in %.1fs: %s: %s",
                    self.name,
                    len(records),
                    first.topic,
                    first.partition,
                    first.offset,
                    delay,
                    type(exc).__name__,
                    exc,
                )
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.max_backoff)
                continue
            break
        fresh, duplicates, refused = outcome
        index_of = {id(d): i for i, d in deliveries}
        poisoned.update((index_of[id(d)], reason) for d, reason in refused.items())
        # Parked only now that the others are committed: a crash before this point redelivers the
        # whole batch, and the poison (which has no inbox row) is found poison again.
        for index in sorted(poisoned):
            await self._dead_letter(records[index], poisoned[index])
        committed = [d for d in fresh if d not in refused]
        self.processed += len(committed)
        self.duplicates += duplicates
        return Applied(records=len(records), processed=len(committed), duplicates=duplicates, dead_lettered=len(poisoned), committed=committed)

    async def _transaction(
        self, deliveries: list[Delivery], split: set[str], turn: Turn | None, applied: _Ranges | None
    ) -> tuple[list[Delivery], int, dict[Delivery, str]]:
        """One try: inbox rows, then every route's handler, then the offsets of the topics tracked
        by offsets (`applied`); the fresh deliveries, the number of duplicates and the deliveries a
        handler refused (their inbox rows removed again)."""
        before = turn.after if turn is not None else None
        links = [Link(ctx) for d in deliveries[:64] if (ctx := trace.get_current_span(wire.context_from_headers(d.record.headers)).get_span_context()).is_valid]
        with tracer.start_as_current_span("consume batch", kind=SpanKind.CONSUMER, links=links) as span:
            span.set_attribute("messaging.batch.message_count", len(deliveries))
            async with self.pool.acquire() as conn, conn.transaction():
                claimable = deliveries
                if before is not None:
                    await before.claimed.wait()
                    claimable = [d for d in deliveries if d.message.event_id not in before.event_ids]
                claim = asyncio.ensure_future(self._claim(conn, claimable))
                try:
                    await asyncio.sleep(0)  # the claim goes out; the routes prepare meanwhile
                    self._prepare(deliveries, split)
                finally:
                    fresh = await claim  # awaited whatever happened: the connection is not left in use
                if turn is not None:
                    turn.claimed.set()
                if before is not None:
                    await before.handled.wait()
                refused: dict[Delivery, str] = {}
                by_topic: dict[str, list[Delivery]] = defaultdict(list)
                for delivery in fresh:
                    by_topic[delivery.record.topic].append(delivery)
                for topic, batch in by_topic.items():
                    route = self.routes[topic]
                    if isinstance(route, BatchRoute) and topic not in split:
                        refused.update(await self._whole(conn, topic, route, batch, turn))
                    else:
                        for delivery in batch:
                            reason = await self._alone(conn, route, delivery)
                            if reason is not None:
                                refused[delivery] = reason
                if turn is not None:
                    turn.handled.set()
                if forget := [d.message.event_id for d in refused if d.record.topic not in self.by_offsets]:
                    await conn.execute(sql("inbox_forget"), self.name, forget)
                if applied is not None:
                    await conn.execute(sql("offsets_record"), self.name, *applied)
        return fresh, len(deliveries) - len(fresh), refused

    def _prepare(self, deliveries: list[Delivery], split: set[str]) -> None:
        by_topic: dict[str, list[Delivery]] = defaultdict(list)
        for delivery in deliveries:
            by_topic[delivery.record.topic].append(delivery)
        for topic, batch in by_topic.items():
            route = self.routes[topic]
            if isinstance(route, BatchRoute) and route.prepare is not None and topic not in split:
                route.prepare(batch)

    async def _claim(self, conn: asyncpg.Connection, deliveries: list[Delivery]) -> list[Delivery]:
        """Insert the inbox rows (none for a topic tracked by offsets); the deliveries whose event
        id was new (the first of each)."""
        if not deliveries:
            return []
        # Sorted, so two consumers that claim overlapping ids (during a rebalance) lock them in
        # the same order and cannot deadlock.
        ids = sorted({d.message.event_id: d.record.topic for d in deliveries if d.record.topic not in self.by_offsets}.items())
        seen = {row[0] for row in await conn.fetch(sql("inbox_claim"), self.name, [i for i, _ in ids], [t for _, t in ids])} if ids else set()
        fresh = []
        for delivery in deliveries:
            event_id = delivery.message.event_id
            if event_id not in seen:
                seen.add(event_id)  # the first of the batch's copies is the one applied
                fresh.append(delivery)
        return fresh

    async def _whole(self, conn: asyncpg.Connection, topic: str, route: BatchRoute, batch: list[Delivery], turn: Turn | None) -> Mapping[Delivery, str]:
        handling = _HANDLING.set(turn)
        try:
            return await route.handler(conn, batch) or {}
        except Poison as exc:
            if exc.delivery is None and len(batch) == 1:
                raise _Blame(topic, exc.reason, batch[0]) from exc
            raise _Blame(topic, exc.reason, exc.delivery) from exc
        except asyncpg.DataError as exc:
            raise _Blame(topic, _refused(exc), batch[0] if len(batch) == 1 else None) from exc
        finally:
            _HANDLING.reset(handling)

    async def _alone(self, conn: asyncpg.Connection, route: Route | BatchRoute, delivery: Delivery) -> str | None:
        """Run one message's handler under a savepoint; the reason if it is poison."""
        parent = wire.context_from_headers(delivery.record.headers)
        with tracer.start_as_current_span(f"consume {delivery.record.topic}", context=parent, kind=SpanKind.CONSUMER):
            try:
                async with conn.transaction():
                    if isinstance(route, BatchRoute):
                        refused = await route.handler(conn, [delivery]) or {}
                        if delivery in refused:
                            return refused[delivery]
                    else:
                        await route.handler(conn, delivery.message, delivery.record)
            except Poison as exc:
                return exc.reason
            except asyncpg.DataError as exc:
                return _refused(exc)
        return None

    async def _dead_letter(self, record: ConsumerRecord, reason: str) -> None:
        log.warning("%s: %s[%d]@%d to the dead-letter topic: %s", self.name, record.topic, record.partition, record.offset, reason)
        delay = 0.2
        while True:
            try:
                await self.publisher.send_dead_letter(record, reason=reason)
                break
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - Kafka away: the offset waits for the DLQ copy
                log.warning("%s: dead letter not sent, retrying in %.1fs: %s", self.name, delay, exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.max_backoff)
        self.dead_lettered += 1
        if self.on_dead_letter is not None:
            self.on_dead_letter(record.topic, reason)

    async def prune(self, before: datetime, *, slice_rows: int = 10_000) -> tuple[int, int]:
        """Forget what this consumer applied before `before`: its inbox rows, and its polls'
        `consumer_offsets` rows but for the latest of each partition; how many of each went.
        Deleted a slice at a time, each its own transaction."""
        return await self._prune(sql("inbox_prune"), before, slice_rows), await self._prune(sql("offsets_prune"), before, slice_rows)

    async def _prune(self, query: str, before: datetime, slice_rows: int) -> int:
        gone = 0
        while True:
            deleted = int(await self.pool.fetchval(query, self.name, before, slice_rows))
            gone += deleted
            if deleted < slice_rows:
                return gone


async def prune_forever(inbox: Inbox, *, keep: timedelta, every: float = 3600.0) -> None:
    """Every `every` seconds, `inbox.prune` what is older than `keep`, outliving any outage (a
    loop of each consuming service)."""
    while True:
        try:
            inbox_rows, offset_rows = await inbox.prune(datetime.now(UTC) - keep)
            if inbox_rows or offset_rows:
                log.info("%s: forgot %d inbox rows and %d consumer_offsets rows older than %s", inbox.name, inbox_rows, offset_rows, keep)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - retried on the next tick
            log.warning("%s: pruning the inbox failed: %s", inbox.name, exc)
        await asyncio.sleep(every)


# Per topic partition of a poll tracked by offsets: topics, partitions, first and last offsets,
# records (the arguments of offsets_record after the consumer's name).
_Ranges = tuple[list[str], list[int], list[int], list[int], list[int]]


def _offset_ranges(records: Sequence[ConsumerRecord], topics: frozenset[str]) -> _Ranges | None:
    """What `records` cover of the topics in `topics`, per partition; None when none."""
    if not topics:
        return None
    spans: dict[tuple[str, int], list[int]] = {}
    for record in records:
        if record.topic in topics:
            offset = record.offset
            span = spans.get((record.topic, record.partition))
            if span is None:
                spans[record.topic, record.partition] = [offset, offset, 1]
            else:
                if offset < span[0]:
                    span[0] = offset
                elif offset > span[1]:
                    span[1] = offset
                span[2] += 1
    if not spans:
        return None
    keys = sorted(spans)
    return [t for t, _ in keys], [p for _, p in keys], [spans[k][0] for k in keys], [spans[k][1] for k in keys], [spans[k][2] for k in keys]


class _Blame(Exception):
    """A batch handler found poison: roll back, then drop `delivery` (or split `topic`'s batch)."""

    def __init__(self, topic: str, reason: str, delivery: Delivery | None) -> None:
        super().__init__(reason)
        self.topic = topic
        self.reason = reason
        self.delivery = delivery


def _refused(exc: asyncpg.DataError) -> str:
    # Postgres refuses the message's own data (class 22: a value out of range, an invalid
    # byte): retrying cannot help, so it is poison, not an outage.
    return f"data Postgres cannot store: {type(exc).__name__}: {exc}"
