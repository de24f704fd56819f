"""Every service's consumer group members run with the session timeout and heartbeat of its
settings (BUDGETGATE_KAFKA_SESSION_TIMEOUT_MS), in every worker's FastStream subscriber."""

from __future__ import annotations

from typing import Any

import pytest

from budgetgate.contracts.topics import Topics
from budgetgate.services.evidence_emitter import consumers as evidence_consumers
from budgetgate.services.evidence_emitter.settings import EvidenceSettings
from budgetgate.services.metering_ingest import consumers as metering_consumers
from budgetgate.services.metering_ingest.settings import MeteringSettings
from budgetgate.services.reconciler import consumers as reconciler_consumers
from budgetgate.services.reconciler.settings import ReconcilerSettings


@pytest.mark.parametrize(
    ("settings_class", "consumers"),
    [(MeteringSettings, metering_consumers), (ReconcilerSettings, reconciler_consumers), (EvidenceSettings, evidence_consumers)],
    ids=["metering-ingest", "reconciler", "evidence-emitter"],
)
def test_each_subscriber_joins_with_the_settings_session_timeout(monkeypatch: pytest.MonkeyPatch, settings_class: Any, consumers: Any) -> None:
    monkeypatch.setenv("BUDGETGATE_KAFKA_SESSION_TIMEOUT_MS", "4500")
    settings = settings_class()
    subscription = consumers.subscription(settings, Topics(settings.topic_prefix))
    router = subscription.router(lambda: None)
    assert router.subscribers, "no subscriber"
    for subscriber in router.subscribers:
        config = subscriber._connection_args  # (what FastStream gives aiokafka's consumer)
        assert (config["session_timeout_ms"], config["heartbeat_interval_ms"]) == (4_500, 1_500)


def test_every_inbox_consumer_renews_its_view_of_the_partitions_as_set(monkeypatch: pytest.MonkeyPatch) -> None:
    # A partition a consumer does not know of is read by no member of its group (see
    # tests/faults/test_broker_restart.py): aiokafka's 5-minute default is not kept.
    from faststream.kafka import KafkaRouter

    from budgetgate.messaging.subscriber import inbox_broker

    monkeypatch.delenv("BUDGETGATE_KAFKA_METADATA_MAX_AGE_MS", raising=False)
    assert EvidenceSettings().kafka_metadata_max_age_ms == 10_000
    monkeypatch.setenv("BUDGETGATE_KAFKA_METADATA_MAX_AGE_MS", "4000")
    broker = inbox_broker(EvidenceSettings(), KafkaRouter())
    builder = broker.config.broker_config.builder  # (what FastStream makes every subscriber's aiokafka consumer with)
    assert builder.keywords["metadata_max_age_ms"] == 4_000
    monkeypatch.setenv("BUDGETGATE_KAFKA_METADATA_MAX_AGE_MS", "999")
    with pytest.raises(ValueError, match="kafka_metadata_max_age_ms"):
        EvidenceSettings()
