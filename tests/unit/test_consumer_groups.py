"""Every consumer's Kafka group is named under BUDGETGATE_TOPIC_PREFIX, so stacks side by side on
one broker (the prefix's purpose) never share a group and split each other's partitions."""

from __future__ import annotations

import pytest

from budgetgate.services.evidence_emitter import consumers as evidence_consumers
from budgetgate.services.evidence_emitter.settings import EvidenceSettings
from budgetgate.services.metering_ingest import consumers as metering_consumers
from budgetgate.services.metering_ingest.settings import MeteringSettings
from budgetgate.services.reconciler import consumers as reconciler_consumers
from budgetgate.services.reconciler.settings import ReconcilerSettings
from budgetgate.contracts.topics import Topics


@pytest.mark.parametrize("prefix", ["", "stack-b-"])
def test_every_consumer_group_is_named_under_the_topic_prefix(prefix: str) -> None:
    topics = Topics(prefix)
    routers = {
        "metering-ingest": metering_consumers.subscription(MeteringSettings(topic_prefix=prefix), topics).router(lambda: None),  # type: ignore[arg-type,return-value]
        "reconciler": reconciler_consumers.subscription(ReconcilerSettings(topic_prefix=prefix), topics).router(lambda: None),  # type: ignore[arg-type,return-value]
        "evidence-emitter": evidence_consumers.subscription(EvidenceSettings(topic_prefix=prefix), topics).router(lambda: None),  # type: ignore[arg-type,return-value]
    }
    groups = {name: {subscriber.group_id for subscriber in router.subscribers} for name, router in routers.items()}  # type: ignore[attr-defined]
    assert groups == {name: {f"{prefix}budgetgate-{name}"} for name in routers}
