"""Where evidence goes and what a failed send means, without servers."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
import requests
from openlineage.client.event_v2 import RunState
from openlineage.client.transport.file import FileTransport
from openlineage.client.transport.http import HttpTransport

from budgetgate.evidence import events
from budgetgate.services.evidence_emitter import transport
from budgetgate.services.evidence_emitter.sender import backoff


@pytest.fixture
def clean_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    """No OpenLineage configuration anywhere; os.environ restored afterwards (openlineage-python
    writes OPENLINEAGE__* aliases into it when OPENLINEAGE_URL is set)."""
    saved = dict(os.environ)
    for name in [n for n in os.environ if n.startswith("OPENLINEAGE")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    yield tmp_path
    os.environ.clear()
    os.environ.update(saved)


def sample_event():  # type: ignore[no-untyped-def]
    return events.run_event(
        event_type=RunState.START,
        at=datetime(2026, 3, 1, tzinfo=UTC),
        run_id="r-1",
        job=("ns", "job"),
        fields={"stage": "decision", "run_id": "r-1"},
        producer=events.producer_uri(),
    )


def test_backoff_doubles_and_is_capped() -> None:
    assert [backoff(n, initial=0.5, cap=5) for n in range(7)] == [0.0, 0.5, 1.0, 2.0, 4.0, 5, 5]
    assert backoff(10_000, initial=0.5, cap=60) == 60


def http_error(status: int, body: str) -> requests.HTTPError:
    response = requests.Response()
    response.status_code = status
    response._content = body.encode()
    return requests.HTTPError(f"{status}", response=response)


@pytest.mark.parametrize("status", [400, 413, 422])
def test_a_judgement_of_the_event_is_refused_with_its_body(status: int) -> None:
    verdict = transport.classify(http_error(status, '{"message": "bad facet"}'))
    assert isinstance(verdict, transport.Refused)
    assert verdict.status == status and "bad facet" in verdict.body


@pytest.mark.parametrize(
    "error",
    [
        http_error(503, "down"),
        http_error(500, "oops"),
        http_error(429, "slow down"),
        http_error(408, ""),
        http_error(401, "token expired"),  # a proxy's credentials: an outage of the path, not of the event
        http_error(403, "forbidden"),
        http_error(404, "no route"),  # an ingress while Marquez is redeployed
        requests.ConnectionError("refused"),
        requests.Timeout("read timed out"),
        RuntimeError("disk full"),
    ],
)
def test_everything_else_is_retried(error: Exception) -> None:
    assert isinstance(transport.classify(error), transport.NotDelivered)


def test_without_configuration_events_go_to_the_file(clean_environment: Path) -> None:
    path = clean_environment / "evidence" / "events.jsonl"
    client = transport.build_client(str(path))
    assert isinstance(client.transport, FileTransport)
    transport.send(client, sample_event())
    transport.send(client, sample_event())
    lines = path.read_text().splitlines()
    assert len(lines) == 2 and json.loads(lines[0])["run"]["facets"]["budget"]["run_id"] == "r-1"
    # The client must not stamp the emitter's own git checkout on the platform's jobs.
    assert "sourceCodeLocation" not in json.loads(lines[0])["job"]["facets"]


def test_openlineage_url_selects_http_without_the_clients_own_retries(clean_environment: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENLINEAGE_URL", "http://127.0.0.1:9")
    client = transport.build_client(str(clean_environment / "unused.jsonl"))
    assert isinstance(client.transport, HttpTransport)
    assert client.transport.config.retry["total"] == 0 and client.transport.config.retry["status_forcelist"] == []
    assert not (clean_environment / "unused.jsonl").exists()
    with pytest.raises(transport.NotDelivered):  # nothing listens on the discard port
        transport.send(client, sample_event())


def test_an_explicit_retry_configuration_is_kept(clean_environment: Path) -> None:
    config = {"transport": {"type": "http", "url": "http://127.0.0.1:9", "retry": {"total": 2}}}
    client = transport.build_client(str(clean_environment / "x"), config=config)
    assert isinstance(client.transport, HttpTransport) and client.transport.config.retry["total"] == 2


def test_kafka_is_selectable_and_waits_for_acknowledgement(clean_environment: Path) -> None:
    pytest.importorskip("confluent_kafka", reason="the Kafka transport needs confluent-kafka")
    config = {"transport": {"type": "kafka", "topic": "lineage", "config": {"bootstrap.servers": "127.0.0.1:9", "message.timeout.ms": "500"}}}
    client = transport.build_client(str(clean_environment / "x"), config=config)
    assert isinstance(client.transport, transport.AckedKafkaTransport)
    client.transport.timeout = 2.0
    with pytest.raises(transport.NotDelivered):
        transport.send(client, sample_event())
