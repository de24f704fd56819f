"""The transactional outbox: a record written with the effect it announces, in the same
Postgres transaction (`enqueue`), and a relay that publishes committed rows to Kafka, in order,
at least once (`OutboxRelay`).

A row holds one record, or a bundle of records of one topic that one transaction announces
(`enqueue_bundle`: metering-ingest's usage records of a poll, one row to write, claim and mark
instead of one per sample). Rows are claimed with FOR UPDATE SKIP LOCKED, so several instances
(of any service) can relay side by side; a row is marked published only after the broker
acknowledged every record it carries. Consumers deduplicate on the event id, so a crash between
the ack and the mark only causes a redelivery. Rows name the topic without the deployment's
prefix; the relay adds its own.

A broker may forget records it acknowledged: Tansu with in-memory storage loses everything when
it restarts, and a Kafka cluster can be restored from an older state. Published rows therefore
stay for a replay window (pruned after it), each with the partitions its records went to, and
the relays keep, per partition, an offset it acknowledged: the first of the latest batch
(`outbox_watermarks`; not the last, since Tansu reports a partition's end as its last record
batch's base offset plus one). A partition whose log ends at or below that offset, or that acknowledges a new record at
or below it, has lost records: its rows published within the window become pending again and
are sent anew, in id order. Nothing older than the window can be recovered. This needs neither
idempotent nor transactional producers, which Tansu lacks; consumers deduplicate the resends.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

import asyncpg
import orjson
from aiokafka import AIOKafkaConsumer, TopicPartition
from google.protobuf.message import Message

from budgetgate.messaging.publisher import Publisher
from budgetgate.contracts import wire
from budgetgate.runtime.kafka_access import start_whole
from budgetgate.ledger.queries import owned_by
from budgetgate.contracts.topics import Topics
from budgetgate.messaging.topic_admin import ensure_topics

sql = owned_by("budgetgate.messaging")

log = logging.getLogger(__name__)


async def enqueue(conn: asyncpg.Connection, *, topic: str, record: wire.Record) -> None:
    """Write `record` to the outbox in `conn`'s transaction, for `topic` (unprefixed name)."""
    await conn.execute(sql("insert_outbox"), *row(topic=topic, record=record))


def row(*, topic: str, record: wire.Record) -> tuple[str, str | None, bytes, str]:
    """The outbox columns (topic, key, payload, headers) of `record`, for a statement that
    writes the outbox row together with other changes."""
    return topic, _key(record.key), record.value, _pack_headers(record.headers)


@dataclass(frozen=True)
class Bundle:
    """Records of one topic that one transaction announces, for one outbox row (`enqueue_bundle`):
    their keys, values and event ids, and the headers they share but for the event id."""

    topic: str
    keys: list[str | None]
    payloads: list[bytes]
    event_ids: list[str]
    headers: str  # jsonb text, as `row` packs them


def bundle_messages(*, topic: str, messages: Sequence[Message], keys: Sequence[str | None], trace_headers: wire.Headers) -> Bundle:
    """`messages` (of one type, with their `keys`) as one bundle: the records `wire.encode` would
    give them with `trace_headers`, without making them (see `wire.encode_many`)."""
    if len(keys) != len(messages):
        raise ValueError(f"{len(messages)} messages with {len(keys)} keys")
    values, event_ids, shared = wire.encode_many(messages, trace_headers=trace_headers)
    return Bundle(topic, list(keys), values, event_ids, _pack_headers(shared))


async def claim(conn: asyncpg.Connection, batch: int) -> list[asyncpg.Record]:
    """Lock the next pending rows, up to `batch` records (claim_outbox), in `conn`'s transaction;
    when there are any, the transaction's other outbox statements (the mark, a replay) are then
    planned for their parameters each time, never from a cached generic plan.

    The statements are prepared once per connection, usually while the outbox is all but empty,
    and the mark's plan made then joined by scanning the whole table. The table keeps every row
    published within the replay window, so each relay pass read all of them (admission's open
    loop got slower for as long as the window filled). A custom plan did the same while the
    table held a few thousand rows (hashing ten ids and reading the table was costed below ten
    probes per partition); the mark now names its rows to the scan as well (mark_published), so
    every plan of it probes the key. The claim's own plan probes the pending index whenever it is
    made; an idle pass, which finds nothing, costs one round trip.

    The transaction's commit does not wait for its WAL flush (synchronous_commit off): what it
    records is that rows were published, and a crash that loses it only makes them pending
    again, to be sent once more to consumers that drop what they have seen. Every relay pass
    committed with its own flush, one more flush per admission batch for the batches' own
    commits to queue behind. A pass that makes rows pending again because the broker lost them
    (`_replay`) commits with the flush, as that is not safe to lose."""
    rows = await conn.fetch(sql("claim_outbox"), batch)
    if rows:
        await conn.execute("SET LOCAL plan_cache_mode = force_custom_plan; SET LOCAL synchronous_commit = off")
    return rows


async def enqueue_bundle(conn: asyncpg.Connection, bundle: Bundle) -> None:
    """Write `bundle` to the outbox as one row in `conn`'s transaction (nothing when empty)."""
    if bundle.payloads:
        await conn.execute(sql("insert_outbox_bundle"), bundle.topic, bundle.keys, bundle.payloads, bundle.event_ids, bundle.headers)


def _key(key: bytes | None) -> str | None:
    return key.decode("utf-8", errors="replace") if key is not None else None


def _pack_headers(headers: wire.Headers) -> str:
    # Header values are bytes; latin-1 maps each byte to one character and back unchanged.
    return orjson.dumps([[name, value.decode("latin-1")] for name, value in headers]).decode()


class OutboxRelay:
    """Publishes the outbox, batch by batch, through `publisher` under `topics`' prefix, and
    sends again what the broker forgot within `replay_window`."""

    def __init__(
        self,
        *,
        pool: asyncpg.Pool,
        publisher: Publisher,
        topics: Topics,
        batch: int = 200,
        idle_seconds: float = 0.2,
        replay_window: timedelta = timedelta(minutes=15),
        check_seconds: float = 1.0,
    ) -> None:
        self.pool = pool
        self.publisher = publisher
        self.topics = topics
        self.batch = batch
        self.idle_seconds = idle_seconds
        self.replay_window = replay_window
        self.check_seconds = check_seconds
        self.wakeup = asyncio.Event()
        self.published = 0
        self.replayed = 0  # rows made pending again because the broker lost them
        self.forgotten_partitions = 0
        # Per partition, the first offset of the latest batch it acknowledged (committed to
        # outbox_watermarks): a partition that acknowledges a new record at or below it went
        # backwards.
        self._acked: dict[TopicPartition, int] = {}
        self._next_check = 0.0
        self._next_prune = 0.0
        self._ensure_topics = False
        self._offsets: AIOKafkaConsumer | None = None
        # The last claim left pending rows behind (its batch was full before they fit): the next
        # claim comes without waiting, however few records this one sent.
        self.backlog = False

    async def relay_once(self) -> int:
        """Publish one batch of up to `batch` records (after the broker check and pruning, when
        they are due); returns how many records were published."""
        await self._upkeep()
        async with self.pool.acquire() as conn, conn.transaction():
            rows = await claim(conn, self.batch)
            self.backlog = bool(rows) and bool(rows[0]["more"])
            if not rows:
                return 0
            owners, sends = self._sends(rows)
            # Sent together, acknowledged together: per-key order holds because one producer
            # sends them in id order to the partition of each key.
            acks = await self.publisher.send_records(sends)
            lowest = _lowest(acks)
            backwards = {tp: offset for tp, offset in lowest.items() if offset <= self._acked.get(tp, -1)}
            if backwards:
                # Before the mark: these rows are still pending, so the replay leaves them be.
                await self._replay(conn, backwards, why="acknowledged a new record at offset")
            # Each row with each partition its records went to: a bundle's thousands of records
            # come down to a few pairs.
            went = sorted(set(zip(owners, [ack.partition for ack in acks], strict=True)))
            await conn.execute(
                sql("mark_published"),
                [row_id for row_id, _ in went], [partition for _, partition in went],
                [tp.topic for tp in lowest], [tp.partition for tp in lowest], list(lowest.values()),
            )  # fmt: skip
        for tp, offset in lowest.items():
            self._acked[tp] = max(offset, self._acked.get(tp, -1))
        if backwards:
            self._next_check = 0.0  # the other partitions of a broker that forgot are checked now
        self.published += len(sends)
        return len(sends)

    def _sends(self, rows: list[asyncpg.Record]) -> tuple[list[int], list[tuple[str, wire.Record]]]:
        """The records of claimed rows, in order, each with its row's id."""
        owners: list[int] = []
        sends: list[tuple[str, wire.Record]] = []
        for row in rows:
            topic = self.topics.name(row["topic"])
            if row["payloads"] is None:
                owners.append(row["id"])
                sends.append((topic, _record(row)))
                continue
            shared = _unpack_headers(row["headers"])
            for key, value, event_id in zip(row["keys"], row["payloads"], row["event_ids"], strict=True):
                owners.append(row["id"])
                sends.append((topic, wire.Record(value=value, key=key.encode() if key else None, headers=[(wire.EVENT_ID, event_id.encode()), *shared])))
        return owners, sends

    async def check_broker(self) -> int:
        """Compare each partition's end with an offset it acknowledged, and make the rows of
        every partition that lost records pending again; returns how many."""
        async with self.pool.acquire() as conn:
            rows = await conn.fetch(sql("outbox_watermarks"), self.topics.prefix)
        acked = {TopicPartition(r["topic"], r["kafka_partition"]): r["acked_offset"] for r in rows}
        self._acked = dict(acked)
        if not acked:
            return 0
        if self._offsets is None:
            consumer = AIOKafkaConsumer(
                bootstrap_servers=self.publisher.bootstrap, group_id=None, client_id="budgetgate-outbox-check", **self.publisher.access.aiokafka()
            )
            try:
                await start_whole(consumer.start())
            except BaseException:
                await consumer.stop()  # a consumer that failed to connect still holds a client
                raise
            self._offsets = consumer
        try:
            ends = await asyncio.wait_for(self._offsets.end_offsets(list(acked)), timeout=10)
        except BaseException:
            await self.close()
            raise
        # The end offset is past every record the partition holds, so past what it acknowledged.
        lost = {tp: ends.get(tp, 0) for tp, offset in acked.items() if ends.get(tp, 0) <= offset}
        if not lost:
            return 0
        await ensure_topics(self.publisher.bootstrap, prefix=self.topics.prefix, access=self.publisher.access)
        async with self.pool.acquire() as conn, conn.transaction():
            replayed = await self._replay(conn, lost, why="ends at offset")
        self.wakeup.set()
        return replayed

    async def _replay(self, conn: asyncpg.Connection, lost: dict[TopicPartition, int], *, why: str) -> int:
        """Make pending again the rows of each partition that now shows an offset (`lost`) at or
        below the watermark stored for it (replay_partition); returns how many."""
        replayed = 0
        await conn.execute("SET LOCAL synchronous_commit TO DEFAULT")  # see `claim`: this must not be lost
        for tp, seen in sorted(lost.items()):
            status = await conn.execute(sql("replay_partition"), tp.topic, tp.partition, seen, tp.topic.removeprefix(self.topics.prefix), self.replay_window)
            count = int(status.rsplit(" ", 1)[-1])
            log.warning(
                "Kafka partition %s[%d] %s %d, at or below what it had acknowledged: sending %d outbox rows again", tp.topic, tp.partition, why, seen, count
            )
            self._acked.pop(tp, None)
            replayed += count
            self.forgotten_partitions += 1
        self.replayed += replayed
        return replayed

    async def prune(self, *, limit: int = 5000) -> int:
        """Delete rows published before the replay window; returns how many."""
        pruned = 0
        while True:
            status = await self.pool.execute(sql("prune_outbox"), self.replay_window, limit)
            count = int(status.rsplit(" ", 1)[-1])
            pruned += count
            if count < limit:
                return pruned

    async def _upkeep(self) -> None:
        if self._ensure_topics:
            # After a failure: a broker that came back empty gets its topics (with their
            # partition counts) before a send would have it create them on its own terms.
            await ensure_topics(self.publisher.bootstrap, prefix=self.topics.prefix, access=self.publisher.access)
            self._ensure_topics = False
        now = time.monotonic()
        if now >= self._next_check:
            self._next_check = now + self.check_seconds
            try:
                await self.check_broker()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - a failed check must not stop the relay
                log.warning("outbox broker check failed (%s); next try in %.1fs", exc, self.check_seconds)
                self._ensure_topics = True
        if now >= self._next_prune:
            self._next_prune = now + max(self.replay_window.total_seconds() / 10, 1.0)
            await self.prune()

    async def close(self) -> None:
        """Disconnect the broker check's client (the publisher is its owner's to stop)."""
        consumer, self._offsets = self._offsets, None
        if consumer is not None:
            await consumer.stop()

    async def serve(self) -> None:
        """Connect the publisher (waiting for Kafka as long as it takes), then `run`."""
        while True:
            try:
                await self.publisher.start()
                break
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - Kafka may come later; the rows wait
                log.warning("Kafka not reachable yet (%s); outbox rows wait", exc)
                await asyncio.sleep(2)
        await self.run()

    async def run(self) -> None:
        """Relay until cancelled; backs off while Kafka or Postgres is unavailable."""
        delay = self.idle_seconds
        try:
            while True:
                try:
                    sent = await self.relay_once()
                    delay = self.idle_seconds
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # noqa: BLE001 - the relay must outlive any outage
                    log.warning("outbox relay failed, retrying in %.1fs: %s", delay, exc)
                    # The broker may come back empty: check it, and give it its topics, first.
                    self._ensure_topics = True
                    self._next_check = 0.0
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 10.0)
                    continue
                if sent < self.batch and not self.backlog:
                    self.wakeup.clear()
                    try:
                        await asyncio.wait_for(self.wakeup.wait(), timeout=self.idle_seconds)
                    except TimeoutError:
                        pass
        finally:
            await self.close()


def _record(row: asyncpg.Record) -> wire.Record:
    return wire.Record(value=row["payload"], key=row["key"].encode() if row["key"] else None, headers=_unpack_headers(row["headers"]))


def _unpack_headers(packed: str) -> list[tuple[str, bytes]]:
    return [(k, v.encode("latin-1")) for k, v in orjson.loads(packed)]


def _lowest(acks: list[wire.Acked]) -> dict[TopicPartition, int]:
    # The lowest, not the highest: Tansu reports a partition's end as the base offset of its
    # last record batch plus one, so only the first record of our batch is sure to be below it.
    lowest: dict[tuple[str, int], int] = {}
    for topic, partition, offset in acks:
        if offset < lowest.get((topic, partition), offset + 1):
            lowest[topic, partition] = offset
    return {TopicPartition(topic, partition): offset for (topic, partition), offset in lowest.items()}
