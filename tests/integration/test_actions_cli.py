"""`budgetgate actions` and `budgetgate dlq` read the stack's topics on a real broker."""

from __future__ import annotations

import asyncio
import json
import uuid
from dataclasses import dataclass

from click.testing import CliRunner, Result
from google.protobuf.timestamp_pb2 import Timestamp

from budgetgate.messaging.publisher import Publisher
from budgetgate.cli.main import cli
from budgetgate.contracts.topics import Topics
from budgetgate.messaging.topic_admin import ensure_topics
from budgetgate.v1.actions_pb2 import ActionType, BudgetAction


@dataclass
class Consumed:
    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, bytes]]


async def invoke(bootstrap: str, prefix: str, *args: str) -> Result:
    env = {"BUDGETGATE_KAFKA_BOOTSTRAP": bootstrap, "BUDGETGATE_TOPIC_PREFIX": prefix}
    return await asyncio.to_thread(CliRunner().invoke, cli, list(args), env=env)


def action(kind: str, **fields: object) -> BudgetAction:
    stamp = Timestamp()
    stamp.FromJsonString("2026-07-14T10:00:00Z")
    return BudgetAction(event_id=str(uuid.uuid4()), event_time=stamp, type=ActionType.Value(kind), **fields)  # type: ignore[arg-type]


async def test_actions_and_dead_letters_are_listed_with_their_reasons(kafka_bootstrap: str, topic_prefix: str) -> None:
    await ensure_topics(kafka_bootstrap, prefix=topic_prefix, partitions=1)
    topics = Topics(topic_prefix)
    async with Publisher(kafka_bootstrap) as publisher:
        await publisher.send(topics.actions, action("THRESHOLD_ALERT", scope_id="ns=a", policy_id="p", threshold_percent=80, message="80% used"), key="ns=a")
        await publisher.send(topics.actions, action("DRAIN", scope_id="ns=a", policy_id="p", run_id="run-1"), key="ns=a")
        poison = Consumed(topics.metering, 0, 41, b"run-9", b"\xff\xfe", [("event-id", b"ev-9")])
        await publisher.send_dead_letter(poison, reason="not a MeteringSample: truncated message")

    shown = await invoke(kafka_bootstrap, topic_prefix, "actions")
    assert shown.exit_code == 0, shown.output
    lines = shown.stdout.splitlines()
    assert lines == [
        "2026-07-14T10:00:00Z  THRESHOLD_ALERT 80% policy p on ns=a: 80% used",
        "2026-07-14T10:00:00Z  DRAIN              policy p on ns=a, run run-1",
    ]
    assert f"budgetgate: kafka at {kafka_bootstrap}" in shown.stderr
    as_json = [json.loads(line) for line in (await invoke(kafka_bootstrap, topic_prefix, "actions", "--json")).stdout.splitlines()]
    assert [(a["type"], a.get("run_id")) for a in as_json] == [("THRESHOLD_ALERT", None), ("DRAIN", "run-1")]

    dead = await invoke(kafka_bootstrap, topic_prefix, "dlq", "--json")
    assert dead.exit_code == 0, dead.output
    [letter] = [json.loads(line) for line in dead.stdout.splitlines()]
    assert {k: letter[k] for k in ("source_topic", "source_offset", "reason", "event_id", "key")} == {
        "source_topic": topics.metering, "source_offset": "41", "reason": "not a MeteringSample: truncated message",
        "event_id": "ev-9", "key": "run-9"}  # fmt: skip
    only = await invoke(kafka_bootstrap, topic_prefix, "dlq", "--topic", "usage.records.v1")
    assert only.exit_code == 0 and only.stdout == ""
    bad = await invoke(kafka_bootstrap, topic_prefix, "dlq", "--topic", "nope")
    assert bad.exit_code == 2 and "not a budgetgate topic" in bad.output


async def test_an_unreachable_broker_is_one_line(topic_prefix: str) -> None:
    result = await invoke("127.0.0.1:1", topic_prefix, "actions")
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert [line for line in result.stderr.splitlines() if line.startswith("Error:")][0].startswith("Error: cannot reach Kafka at 127.0.0.1:1")
