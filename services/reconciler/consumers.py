"""The reconciler's Kafka side, declared once (`subscription`): a batch subscriber on the
lifecycle, usage-record and decision topics. Each poll is recorded by the inbox in one Postgres
transaction (facts.py; decisions in headroom.py), acknowledged only after that commit
(budgetgate.messaging.subscriber), and then wakes the settle loop for the runs it marked."""

from __future__ import annotations

from typing import TYPE_CHECKING

from budgetgate.contracts.topics import Topics
from budgetgate.messaging.subscriber import Subscription
from budgetgate.services.reconciler import facts, headroom
from budgetgate.services.reconciler.settings import ReconcilerSettings

if TYPE_CHECKING:
    from budgetgate.services.reconciler.service import Reconciler


def subscription(settings: ReconcilerSettings, topics: Topics) -> Subscription[Reconciler]:
    """What the reconciler consumes, in consumer group `<topic prefix><consumer_group>`."""
    s = settings
    return Subscription(
        routes={
            topics.lifecycle: lambda rc: facts.lifecycle_route(on_fact=rc.stats.fresh.add),
            topics.usage: lambda rc: facts.usage_route(on_fact=rc.stats.fresh.add),
            topics.decisions: lambda rc: headroom.decisions_route(bundles=rc.bundles),
        },
        then=_wake_settler,
        group_id=f"{s.topic_prefix}{s.consumer_group}",
        group_timing=s.kafka_group_timing,
        max_records=s.consumer_max_records,
        title="reconciler",
        description="Lifecycle events (budgetgate.v1.LifecycleEvent) and usage records (budgetgate.v1.UsageRecord) are recorded "
        "and their runs marked to be settled; decisions (budgetgate.v1.Decision) register the runs waiting for budget or quota "
        "headroom; poison goes to <topic>.dlq with the reason.",
    )


def _wake_settler(rc: Reconciler) -> None:
    if rc.stats.fresh:
        # Set only now: the facts are committed, so the settle loop will see them.
        rc.stats.fresh.clear()
        rc.wakeup.set()
