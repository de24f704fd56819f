"""Creating budgetgate's Kafka topics (and their dead-letter topics) on a cluster."""

from __future__ import annotations

import logging
from typing import Any

from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import TopicAlreadyExistsError, for_code

from budgetgate.runtime.kafka_access import PLAINTEXT, KafkaAccess, start_whole
from budgetgate.runtime.settings import CommonSettings
from budgetgate.contracts.topics import Topics

log = logging.getLogger(__name__)


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
        # Every topic with its partitions, in one metadata request that asks for no topic by
        # name (a broker would create a topic a request names).
        existing = {t["topic"]: t for t in await admin.describe_topics()}
        missing = [t for t in wanted if t not in existing]
        _say_other_partition_counts([existing[t] for t in wanted if t in existing], partitions)
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


def _say_other_partition_counts(described: list[dict[str, Any]], partitions: int) -> None:
    """Warn of each existing topic whose partition count is not the configured one. Left as
    they are (a topic's partitions can only grow, and its keys then move), but said: a broker that creates the topics its clients ask for (Kafka's
    auto.create.topics.enable, Tansu always) makes them with its own count after losing them,
    before a service or the topics job could create them as configured."""
    for topic in described:
        count = len(topic.get("partitions") or ())
        if topic.get("error_code", 0) == 0 and count != partitions:
            log.warning(
                "topic %s has %d partitions where %d are configured (BUDGETGATE_TOPIC_PARTITIONS); "
                "a broker that creates topics on its own (auto.create.topics.enable) may have made it",
                topic["topic"], count, partitions,
            )  # fmt: skip
