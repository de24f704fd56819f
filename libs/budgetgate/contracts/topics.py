"""The Kafka topics budgetgate uses, the message each one carries, and creating them.

Names are versioned: a breaking change to a message is a new topic, never a new meaning for an
old one. Every topic has a dead-letter topic, `<topic>.dlq`, for messages its consumers could
not use. A prefix (settings.topic_prefix) lets tests and side-by-side stacks share one broker.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from google.protobuf.message import Message

from budgetgate.v1.actions_pb2 import BudgetAction
from budgetgate.v1.decisions_pb2 import Decision
from budgetgate.v1.lifecycle_pb2 import LifecycleEvent
from budgetgate.v1.metering_pb2 import MeteringSample
from budgetgate.v1.policies_pb2 import PolicyBundlePublished
from budgetgate.v1.reconciliations_pb2 import Reconciliation
from budgetgate.v1.usage_pb2 import UsageRecord


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
