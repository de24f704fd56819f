"""`budgetgate asyncapi`: every topic and its dead-letter topic, each with its message's fields."""

from __future__ import annotations

import json

from click.testing import CliRunner

from budgetgate.contracts import topics
from budgetgate.services.asyncapi import document
from budgetgate.cli.main import cli


def _resolve(doc: dict, ref: str) -> dict:  # type: ignore[type-arg]
    node = doc
    for part in ref.removeprefix("#/").split("/"):
        node = node[part]
    return node


def test_every_topic_and_its_dead_letter_topic_is_a_channel_with_its_message_fields() -> None:
    doc = document(prefix="p-")
    assert doc["asyncapi"] == "3.0.0"
    channels = {channel["address"]: channel for channel in doc["channels"].values()}
    for topic in topics.EVENT_TOPICS:
        assert f"p-{topic}" in channels and f"p-{topics.dlq(topic)}" in channels
        published = doc["channels"][f"{topic}:{topics.MESSAGE_TYPES[topic].DESCRIPTOR.full_name}"]
        assert published["address"] == f"p-{topic}"
        [message_ref] = [m["$ref"] for m in published["messages"].values()]
        payload = _resolve(doc, _resolve(doc, message_ref)["payload"]["$ref"])
        expected = {f.name for f in topics.MESSAGE_TYPES[topic].DESCRIPTOR.fields}
        assert set(payload["properties"]) == expected
    # The subscribers of metering-ingest, the reconciler and the evidence-emitter are there as the services run them.
    received = {_resolve(doc, op["channel"]["$ref"])["address"] for op in doc["operations"].values() if op["action"] == "receive"}
    assert received == {f"p-{topics.METERING}", f"p-{topics.LIFECYCLE}", f"p-{topics.USAGE}", f"p-{topics.DECISIONS}", f"p-{topics.RECONCILIATIONS}"}


def test_the_cli_prints_json_and_yaml() -> None:
    as_json = CliRunner().invoke(cli, ["asyncapi"])
    assert as_json.exit_code == 0, as_json.output
    assert json.loads(as_json.stdout)["info"]["title"] == "budgetgate"
    as_yaml = CliRunner().invoke(cli, ["asyncapi", "--format", "yaml"])
    assert as_yaml.exit_code == 0 and as_yaml.output.startswith("asyncapi: 3.0.0")
