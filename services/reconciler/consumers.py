"""The reconciler's Kafka side: one FastStream router with a batch subscriber on the lifecycle,
usage-record and decision topics. Each poll is recorded by the inbox in one Postgres transaction
(facts.py; decisions in headroom.py), acknowledged only after that commit
(budgetgate.messaging.subscriber), and then wakes the settle loop for the runs it marked."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from faststream.kafka import KafkaRouter

from budgetgate.services.reconciler.settings import ReconcilerSettings
from budgetgate.messaging.subscriber import subscribe_inbox
from budgetgate.contracts.topics import Topics

if TYPE_CHECKING:
    from budgetgate.services.reconciler.worker import Reconciler


def router(*, settings: ReconcilerSettings, topics: Topics, reconciler: Callable[[], Reconciler]) -> KafkaRouter:
    """The reconciler's subscriber, in consumer group `<topic prefix><consumer_group>`;
    `reconciler()` gives the running reconciler."""
    s = settings
    kafka = KafkaRouter()
    subscribe_inbox(
        kafka,
        topics.lifecycle,
        topics.usage,
        topics.decisions,
        runtime=reconciler,
        then=_wake_settler,
        group_id=f"{s.topic_prefix}{s.consumer_group}",
        max_records=s.consumer_max_records,
        title="reconciler",
        description="Lifecycle events (budgetgate.v1.LifecycleEvent) and usage records (budgetgate.v1.UsageRecord) are recorded "
        "and their runs marked to be settled; decisions (budgetgate.v1.Decision) register the runs waiting for budget or quota "
        "headroom; poison goes to <topic>.dlq with the reason.",
    )
    return kafka


def _wake_settler(rc: Reconciler) -> None:
    if rc.stats.fresh:
        # Set only now: the facts are committed, so the settle loop will see them.
        rc.stats.fresh.clear()
        rc.wakeup.set()
