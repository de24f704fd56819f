"""Sending records to Kafka: a producer that waits for every in-sync replica, batching what an
outbox relay sends together, and parking what a consumer cannot use on its dead-letter topic."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Sequence

from aiokafka import AIOKafkaProducer
from aiokafka.errors import MessageSizeTooLargeError
from aiokafka.partitioner import DefaultPartitioner, murmur2
from aiokafka.producer.message_accumulator import BatchBuilder
from aiokafka.structs import RecordMetadata
from google.protobuf.message import Message

from budgetgate.runtime.kafka_access import PLAINTEXT, KafkaAccess, start_whole
from budgetgate.contracts.topics import dlq
from budgetgate.contracts.wire import Acked, ConsumedRecord, Record, dead_letter, encode


@functools.lru_cache(maxsize=65_536)
def key_hash(key: bytes) -> int:
    """The default partitioner's hash of a record key (Kafka's murmur2, positive), kept for the
    keys sent lately: aiokafka's murmur2 is pure Python, 3.5 µs for a run id against 0.07 from
    the cache (timeit), and an outbox relay sends the usage records of the same runs poll after
    poll."""
    return murmur2(key) & 0x7FFFFFFF


def partition_of(key: bytes, partitions: Sequence[int]) -> int:
    """The partition of `partitions` (all of a topic's, sorted) the default partitioner gives a
    keyed record: the Java client's choice, so every producer puts a key on the same one."""
    return partitions[key_hash(key) % len(partitions)]


class Publisher:
    """Sends messages and waits for the broker's acknowledgement from all in-sync replicas.

    Idempotent and transactional producing stay off: the brokers budgetgate runs on (Tansu in
    the local stack) do not all support them, and consumers deduplicate on event_id instead.
    """

    def __init__(self, bootstrap: str, *, client_id: str = "budgetgate", access: KafkaAccess = PLAINTEXT) -> None:
        self._bootstrap = bootstrap
        self._client_id = client_id
        self.access = access
        self._producer: AIOKafkaProducer | None = None

    @property
    def bootstrap(self) -> str:
        """The bootstrap servers it connects to."""
        return self._bootstrap

    async def start(self) -> None:
        """Connect to the cluster."""
        # Built here, not in __init__: aiokafka binds a producer to the running event loop, and
        # a publisher is usually constructed in a factory before any loop runs.
        producer = AIOKafkaProducer(
            bootstrap_servers=self._bootstrap,
            client_id=self._client_id,
            acks="all",
            enable_idempotence=False,
            # Outbox batches go out together: room for many records per partition request.
            max_batch_size=256 * 1024,
            **self.access.aiokafka(),
        )
        try:
            await start_whole(producer.start())
        except BaseException:
            # A producer that failed to connect still holds a client; close it, or it leaks.
            await producer.stop()
            raise
        self._producer = producer

    async def stop(self) -> None:
        """Flush pending sends and disconnect."""
        producer, self._producer = self._producer, None
        if producer is not None:
            await producer.stop()

    async def __aenter__(self) -> Publisher:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    async def send(self, topic: str, message: Message, *, key: str | None) -> RecordMetadata:
        """Encode `message` and return once the broker has acknowledged it."""
        return await self.send_record(topic, encode(message, key=key))

    async def send_record(self, topic: str, record: Record) -> RecordMetadata:
        """Send an already encoded record and return once the broker has acknowledged it."""
        if self._producer is None:
            raise RuntimeError("Publisher.send before start()")
        return await self._producer.send_and_wait(topic, value=record.value, key=record.key, headers=record.headers)

    async def send_records(self, sends: Sequence[tuple[str, Record]]) -> list[Acked]:
        """Send records ((topic, record) each, in order) and return once the broker has
        acknowledged all of them: where each went, in the same order.

        The records are packed into one batch per partition (the producer's batch API) rather
        than sent one by one: the producer's per-record path costs more than the rest of a relay
        together. Partitions are chosen as `send` chooses them (the default partitioner: a key's
        records go to one partition, in order), a key's hash kept across calls (`key_hash`).
        """
        producer = self._producer
        if producer is None:
            raise RuntimeError("Publisher.send_records before start()")
        partitioner = DefaultPartitioner()
        partitions: dict[str, list[int]] = {}
        filling: dict[tuple[str, int], tuple[BatchBuilder, list[int]]] = {}
        submitted: list[tuple[asyncio.Future[RecordMetadata], list[int]]] = []
        singles: list[tuple[asyncio.Future[RecordMetadata], int]] = []
        placed: list[tuple[str, int]] = []
        for index, (topic, record) in enumerate(sends):
            if topic not in partitions:
                partitions[topic] = sorted(await producer.partitions_for(topic))
            key = record.key
            if key is None:
                partition = partitioner(None, partitions[topic], partitions[topic])
            else:
                partition = partition_of(key, partitions[topic])
            placed.append((topic, partition))
            batch, members = filling.get((topic, partition)) or filling.setdefault((topic, partition), (producer.create_batch(), []))
            if batch.append(key=key, value=record.value, timestamp=None, headers=record.headers) is not None:
                members.append(index)
                continue
            # The batch is full: it goes, and the record starts the next one (or, too big for
            # any batch, goes on its own, after it).
            del filling[topic, partition]
            if members:
                submitted.append((await producer.send_batch(batch, topic, partition=partition), members))
            batch = producer.create_batch()
            if batch.append(key=key, value=record.value, timestamp=None, headers=record.headers) is not None:
                filling[topic, partition] = (batch, [index])
            else:
                singles.append((await producer.send(topic, value=record.value, key=key, partition=partition, headers=record.headers), index))
        for (topic, partition), (batch, members) in filling.items():
            if members:
                submitted.append((await producer.send_batch(batch, topic, partition=partition), members))
        offsets = [-1] * len(sends)
        for future, members in submitted:
            base = (await future).offset
            for relative, index in enumerate(members):
                offsets[index] = base + relative
        for future, index in singles:
            offsets[index] = (await future).offset
        return [Acked(topic, partition, offset) for (topic, partition), offset in zip(placed, offsets, strict=True)]

    async def send_dead_letter(self, record: ConsumedRecord, *, reason: str) -> RecordMetadata:
        """Park a consumed record on its topic's DLQ with `reason`: whole, or when the copy is too
        large for the broker (a record near its size limit, with the reason and whence added,
        which no retry can send), without its key, value and headers (`dead_letter`)."""
        try:
            return await self.send_record(dlq(record.topic), dead_letter(record, reason=reason))
        except MessageSizeTooLargeError:
            return await self.send_record(dlq(record.topic), dead_letter(record, reason=reason, whole=False))
