"""Where evidence goes: an OpenLineageClient from openlineage-python's configuration, and what a
failed send means (wait and retry, or give up on this event).

Resolution follows openlineage-python (OPENLINEAGE_CONFIG / openlineage.yml /
OPENLINEAGE__TRANSPORT__* / OPENLINEAGE_URL), with three adjustments:

- no configuration at all means the file transport on `evidence_file` (the local stack's default),
  not openlineage-python's console fallback;
- the HTTP transport's own retries are turned off (unless configured explicitly): the sender
  retries with capped backoff itself, without blocking a thread for the whole series;
- the Kafka transport is replaced by one that raises when the broker did not take the event,
  where openlineage-python's only logs it, so an event is never marked delivered by mistake.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import attr
from openlineage.client import OpenLineageClient
from openlineage.client.transport.file import FileConfig, FileTransport
from openlineage.client.transport.http import HttpTransport
from openlineage.client.transport.kafka import KafkaTransport
from openlineage.client.transport.transport import Transport

# The emitter's own job facets only: the client would otherwise add the git location of the
# emitter's checkout to every job, which says nothing about the job itself.
BASE_CONFIG: dict[str, Any] = {"facets": {"source_code_location": {"disabled": True}}}
NO_RETRY = {"total": 0, "connect": 0, "read": 0, "status": 0, "status_forcelist": []}
# The answers that judge the event itself (Marquez: 400 for a body it cannot read, 422 for an
# event it will not take; 413 for one too large): it is refused for good and dead-lettered. Any
# other answer, 4xx included, says the receiver is not there yet as it should be (401 or 403 from
# a proxy whose credentials expired, 404 from an ingress while Marquez is redeployed, 408, 429):
# the event is sent again later, never lost, and the backlog shows the outage meanwhile.
REFUSING_STATUS = frozenset({400, 413, 422})


class Refused(Exception):
    """The receiver refused the event for good (REFUSING_STATUS): dead-letter it, do not retry."""

    def __init__(self, status: int | None, body: str) -> None:
        super().__init__(f"refused with HTTP {status}: {body[:200]}")
        self.status = status
        self.body = body


class NotDelivered(Exception):
    """The event did not get through this time (receiver down, slow, 5xx): retry later. `status`
    and `body`: the receiver's answer, when it answered."""

    def __init__(self, message: str, *, status: int | None = None, body: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.body = body

    @property
    def server_error(self) -> bool:
        """The receiver answered, with a 5xx: about this event, or about itself."""
        return self.status is not None and 500 <= self.status < 600


def build_client(evidence_file: str, *, config: dict[str, Any] | None = None) -> OpenLineageClient:
    """The client for this process's configuration; `config` (openlineage-python's format, e.g.
    {"transport": {"type": "http", "url": ...}}) takes precedence over files and environment."""
    merged = {**BASE_CONFIG, **(config or {})}
    probe = OpenLineageClient(transport=_noop(), config=merged)
    configured = bool((probe.config.transport or {}).get("type")) or bool(os.environ.get("OPENLINEAGE_URL"))
    if not configured:
        Path(evidence_file).parent.mkdir(parents=True, exist_ok=True)
        return OpenLineageClient(transport=FileTransport(FileConfig(log_file_path=evidence_file, append=True)), config=merged)
    client = OpenLineageClient(config=merged)
    client.transport = adjusted(client.transport, retry_configured=_retry_configured(probe.config.transport or {}))
    return client


def adjusted(transport: Transport, *, retry_configured: bool = False) -> Transport:
    """`transport` as the sender needs it (see the module doc)."""
    if isinstance(transport, HttpTransport) and not retry_configured:
        return HttpTransport(attr.evolve(transport.config, retry=dict(NO_RETRY)))
    if isinstance(transport, KafkaTransport) and not isinstance(transport, AckedKafkaTransport):
        return AckedKafkaTransport(transport.kafka_config)
    return transport


def _retry_configured(transport_config: dict[str, Any]) -> bool:
    return "retry" in transport_config


def _noop() -> Transport:
    from openlineage.client.transport.noop import NoopConfig, NoopTransport

    return NoopTransport(NoopConfig())


def send(client: OpenLineageClient, event: Any) -> None:
    """Emit one event; raises Refused or NotDelivered. Blocking: run it in a thread."""
    try:
        client.emit(event)
    except Exception as exc:  # noqa: BLE001 - every transport fails in its own way
        raise classify(exc) from exc


def classify(exc: BaseException) -> Refused | NotDelivered:
    """Refused for an answer that judges the event (REFUSING_STATUS), NotDelivered for anything else."""
    if isinstance(exc, (Refused, NotDelivered)):
        return exc
    response = getattr(exc, "response", None)
    status = getattr(response, "status_code", None)
    if not isinstance(status, int):
        return NotDelivered(f"{type(exc).__name__}: {exc}")
    try:
        body = str(response.text)  # type: ignore[union-attr]
    except Exception:  # noqa: BLE001 - a body that cannot be read is still an answer
        body = ""
    if status in REFUSING_STATUS:
        return Refused(status, body)
    return NotDelivered(f"{type(exc).__name__}: {exc}", status=status, body=body)


class AckedKafkaTransport(KafkaTransport):
    """openlineage-python's Kafka transport, raising NotDelivered unless the broker acknowledged."""

    def __init__(self, config: Any, *, timeout: float = 10.0) -> None:
        super().__init__(config)
        self.timeout = timeout

    def emit(self, event: Any) -> None:
        from openlineage.client.serde import Serde

        if self.producer is None:
            self._setup_producer(self.kafka_config.config)
        errors: list[Any] = []
        self.producer.produce(  # type: ignore[union-attr]
            topic=self.topic,
            key=self.message_key or self._get_message_key(event),
            value=Serde.to_json(event).encode("utf-8"),
            on_delivery=lambda err, _msg: errors.append(err) if err else None,
        )
        left = self.producer.flush(timeout=self.timeout)  # type: ignore[union-attr]
        if errors:
            raise NotDelivered(f"Kafka refused the event: {errors[0]}")
        if left:
            raise NotDelivered(f"Kafka did not acknowledge the event within {self.timeout}s")
