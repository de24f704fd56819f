"""A consumer group as the broker describes it (its members and their partitions), and what each
member took care of (its /metrics): for benchmarks and tests that run several processes of one
consumer in a group, must know when all of them have joined, and say what each one did."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence

import httpx
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.coordinator.protocol import ConsumerProtocolMemberAssignment
from prometheus_client.parser import text_string_to_metric_families

log = logging.getLogger(__name__)

# Records a consumer took care of (applied, duplicate or dead-lettered), by topic: budgetgate.messaging.lag.
RECORDS = "budgetgate_consumer_records_total"


async def group_members(bootstrap: str, *names: str) -> list[frozenset[int]] | None:
    """The partitions of each member of the first of `names` that is a consumer group with
    members, or None while there is none or it is rebalancing.

    Tansu names the members but leaves their assignments empty; then each member is given as
    the empty set and only their number can be checked.
    """
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        # One group per request: Tansu answers a request for several with a malformed response.
        responses = [response for name in names for response in await admin.describe_consumer_groups([name])]
    finally:
        await admin.close()
    for response in responses:
        for error, _group, state, _ptype, _protocol, members in response.groups:
            if error or not members:
                continue
            if state != "Stable":
                return None
            found = []
            for _member_id, _client_id, _host, _metadata, assignment in members:
                partitions: set[int] = set()
                if assignment:
                    for _topic, numbers in ConsumerProtocolMemberAssignment.decode(assignment).assignment:
                        partitions.update(numbers)
                found.append(frozenset(partitions))
            return found
    return None


async def until_members(bootstrap: str, name: str, count: int, *, timeout: float, alive: Callable[[], None] = lambda: None, every: float = 0.05) -> None:
    """Return once group `name` is stable with at least `count` members; TimeoutError after
    `timeout` seconds. `alive` is called between looks (it raises when a member's process died)."""
    deadline = time.monotonic() + timeout
    while True:
        found = await group_members(bootstrap, name)
        if found is not None and len(found) >= count:
            return
        alive()
        if time.monotonic() > deadline:
            raise TimeoutError(f"consumer group {name} not stable with {count} members after {timeout:.0f}s (now: {found})")
        await asyncio.sleep(every)


def records_taken(metrics_text: str) -> int:
    """The records a consumer process took care of, over every topic, from its /metrics text."""
    return round(sum(found.value for family in text_string_to_metric_families(metrics_text) for found in family.samples if found.name == RECORDS))


async def taken_by(base_urls: Sequence[str]) -> list[int] | None:
    """`records_taken` of each process at `base_urls`; None when one cannot be read (an addition
    to a benchmark run, never its failure)."""
    counts = []
    try:
        async with httpx.AsyncClient(timeout=5) as client:
            for url in base_urls:
                response = await client.get(f"{url}/metrics")
                response.raise_for_status()
                counts.append(records_taken(response.text))
    except httpx.HTTPError as exc:
        log.warning("records per replica left out: %s", exc)
        return None
    return counts
