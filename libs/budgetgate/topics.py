"""The Kafka topics budgetgate uses, the message each one carries, and creating them.

Names are versioned: a breaking change to a message is a new topic, never a new meaning for an
old one. Every topic has a dead-letter topic, `<topic>.dlq`, for messages its consumers could
not use. A prefix (settings.topic_prefix) lets tests and side-by-side stacks share one broker.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import TopicAlreadyExistsError, for_code
from google.protobuf.message import Message

from budgetgate.kafka_access import PLAINTEXT, KafkaAccess, start_whole
from budgetgate.settings import CommonSettings
from budgetgate.v1.actions_pb2 import BudgetAction
from budgetgate.v1.decisions_pb2 import Decision
from budgetgate.v1.lifecycle_pb2 import LifecycleEvent
from budgetgate.v1.metering_pb2 import MeteringSample
from budgetgate.v1.policies_pb2 import PolicyBundlePublished
from budgetgate.v1.reconciliations_pb2 import Reconciliation
from budgetgate.v1.usage_pb2 import UsageRecord

log = logging.getLogger(__name__)

DECISIONS = "budget.decisions.v1"
LIFECYCLE = "workload.lifecycle.v1"
METERING = "metering.samples.v1"
USAGE = "usage.records.v1"
RECONCILIATIONS = "budget.reconciliations.v1"
ACTIONS = "budget.actions.v1"
POLICIES = "budget.policies.v1"

DLQ_SUFFIX = ".dlq"

MESSAGE_TYPES: Mapping[str, type[Message]] = MappingProxyType(
    {
        DECISIONS: Decision,
        LIFECYCLE: LifecycleEvent,
        METERING: MeteringSample,
        USAGE: UsageRecord,
        RECONCILIATIONS: Reconciliation,
        ACTIONS: BudgetAction,
        POLICIES: PolicyBundlePublished,
    }
)

EVENT_TOPICS: tuple[str, ...] = tuple(MESSAGE_TYPES)


def dlq(topic: str) -> str:
    """The dead-letter topic of `topic` (prefixed or not)."""
    return topic + DLQ_SUFFIX


ALL: tuple[str, ...] = EVENT_TOPICS + tuple(dlq(t) for t in EVENT_TOPICS)


@dataclass(frozen=True)
class Topics:
    """Topic names under one prefix: `Topics("t1-").decisions == "t1-budget.decisions.v1"`."""

    prefix: str = ""

    def name(self, topic: str) -> str:
        """The prefixed name of an unprefixed topic such as `DECISIONS`."""
        return self.prefix + topic

    @property
    def decisions(self) -> str:
        return self.name(DECISIONS)

    @property
    def lifecycle(self) -> str:
        return self.name(LIFECYCLE)

    @property
    def metering(self) -> str:
        return self.name(METERING)

    @property
    def usage(self) -> str:
        return self.name(USAGE)

    @property
    def reconciliations(self) -> str:
        return self.name(RECONCILIATIONS)

    @property
    def actions(self) -> str:
        return self.name(ACTIONS)

    @property
    def policies(self) -> str:
        return self.name(POLICIES)

    def all(self) -> list[str]:
        """Every topic and every dead-letter topic, prefixed."""
        return [self.name(t) for t in ALL]

    def message_class(self, topic: str) -> type[Message]:
        """The message class a prefixed topic (or its dead-letter topic) carries."""
        base = topic.removeprefix(self.prefix).removesuffix(DLQ_SUFFIX)
        if not topic.startswith(self.prefix) or base not in MESSAGE_TYPES:
            raise KeyError(f"{topic!r} is not a budgetgate topic under prefix {self.prefix!r}")
        return MESSAGE_TYPES[base]


def message_class(topic: str) -> type[Message]:
    """The message class an unprefixed topic (or its dead-letter topic) carries."""
    return Topics().message_class(topic)


async def ensure_topics(
    bootstrap: str,
    *,
    prefix: str = "",
    partitions: int | None = None,
    replication_factor: int | None = None,
    access: KafkaAccess = PLAINTEXT,
) -> list[str]:
    """Create every budgetgate topic (and DLQ) under `prefix` that does not exist yet.

    Returns the names it created; existing topics are left as they are, so running it at every
    service start is safe, also when several services race to create the same topic.
    `partitions` and `replication_factor` not given are BUDGETGATE_TOPIC_PARTITIONS and
    BUDGETGATE_TOPIC_REPLICATION_FACTOR (3 and 1 unless set): whichever process creates a topic
    first, a service at start-up or the topics job, creates it as the deployment configures.
    """
    if partitions is None or replication_factor is None:
        configured = CommonSettings()
        partitions = configured.topic_partitions if partitions is None else partitions
        replication_factor = configured.topic_replication_factor if replication_factor is None else replication_factor
    wanted = Topics(prefix).all()
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, client_id="budgetgate-topics", **access.aiokafka())
    try:
        await start_whole(admin.start())
        existing = set(await admin.list_topics())
        missing = [t for t in wanted if t not in existing]
        if not missing:
            return []
        response = await admin.create_topics([NewTopic(t, num_partitions=partitions, replication_factor=replication_factor) for t in missing])
    finally:
        await admin.close()
    created = []
    for topic, code, *detail in response.topic_errors:
        error = for_code(code)
        if code == 0:
            created.append(topic)
        elif error is TopicAlreadyExistsError:
            log.debug("topic %s was created concurrently", topic)
        else:
            message = detail[0] if detail and detail[0] else error.description
            raise error(f"cannot create topic {topic!r}: {message}")
    return sorted(created)
