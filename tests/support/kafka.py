"""Reading what reached a Kafka topic, from its start, as a test checks what a service sent."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition


async def drain(bootstrap: str, topic: str, expected: int, timeout: float = 20, *, distinct: Callable[[Any], object] | None = None) -> list:  # type: ignore[type-arg]
    """The records of `topic` from its start, once `expected` are there (or whatever came by
    `timeout`); with `distinct`, once that many distinct keys of it are (at-least-once topics:
    a record sent again must not stand in for one not read yet)."""
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, auto_offset_reset="earliest")
    await consumer.start()
    try:
        deadline = asyncio.get_running_loop().time() + timeout
        partitions = consumer.partitions_for_topic(topic) or set()
        while not partitions and asyncio.get_running_loop().time() < deadline:
            await consumer._client.force_metadata_update()  # noqa: SLF001 - the topic may be brand new
            partitions = consumer.partitions_for_topic(topic) or set()
        consumer.assign([TopicPartition(topic, p) for p in partitions])
        await consumer.seek_to_beginning()
        found: list = []  # type: ignore[type-arg]
        keys: set[object] = set()
        while (len(keys) if distinct else len(found)) < expected and asyncio.get_running_loop().time() < deadline:
            for records in (await consumer.getmany(timeout_ms=300)).values():
                found.extend(records)
                if distinct:
                    keys.update(distinct(r) for r in records)
        return found
    finally:
        await consumer.stop()
