"""Protobuf messages to Kafka records and back: the one place the wire format is decided.

A record's value is the binary protobuf message. Its headers say what it is (`content-type`,
`message-type`, `event-id`) and carry the W3C trace context of the code that produced it.
Ingest topics fed by outside exporters may instead carry the canonical protobuf JSON mapping,
marked `content-type: application/json`. Anything a consumer cannot use raises `WireError`,
whose reason goes with the message to the dead-letter topic.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol, TypeVar

from google.protobuf import json_format
from google.protobuf.message import DecodeError, Message
from opentelemetry.context import Context

from budgetgate.contracts.trace_context import extract_context, inject_headers

PROTOBUF = "application/x-protobuf"
JSON = "application/json"

CONTENT_TYPE = "content-type"
EVENT_ID = "event-id"
MESSAGE_TYPE = "message-type"
DLQ_REASON = "dlq-reason"
DLQ_SOURCE_TOPIC = "dlq-source-topic"
DLQ_PARTITION = "dlq-partition"
DLQ_OFFSET = "dlq-offset"
DLQ_VALUE_DROPPED = "dlq-value-dropped"  # a copy too large to park whole: the bytes its value had
_DLQ_HEADERS = frozenset({DLQ_REASON, DLQ_SOURCE_TOPIC, DLQ_PARTITION, DLQ_OFFSET, DLQ_VALUE_DROPPED})
_DESCRIBING = frozenset({CONTENT_TYPE, MESSAGE_TYPE, EVENT_ID})
_PROTOBUF_BYTES = PROTOBUF.encode()
MAX_EVENT_ID = 256
# Kafka has no limit this small, but a reason quoting a whole payload helps nobody.
_MAX_REASON_CHARS = 1000

M = TypeVar("M", bound=Message)
Headers = Sequence[tuple[str, bytes]]


class WireError(ValueError):
    """A record that cannot be turned into the expected message; `reason` says why."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class Record:
    """What goes to Kafka: value, key and headers, ready for a producer."""

    value: bytes
    key: bytes | None = None
    headers: list[tuple[str, bytes]] = field(default_factory=list)

    def header(self, name: str) -> bytes | None:
        """The first header called `name`, if any."""
        return header(self.headers, name)


class Acked(NamedTuple):
    """Where the broker put a record it acknowledged."""

    topic: str
    partition: int
    offset: int


class ConsumedRecord(Protocol):
    """The parts of a consumed Kafka record (aiokafka's ConsumerRecord has them) a DLQ needs."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: Sequence[tuple[str, bytes]]


def header(headers: Headers | None, name: str) -> bytes | None:
    """The first header called `name` (compared without case), or None."""
    wanted = name.lower()
    for key, value in headers or ():
        if key == wanted or key.lower() == wanted:  # most are lower case already: skip lower()
            return value
    return None


def encode(message: Message, *, key: str | None, trace_headers: Headers | None = None) -> Record:
    """A Kafka record for `message`, with the current trace context in its headers
    (`trace_headers`: those of `inject_headers()`, when the caller encodes many at once).

    Refuses a message without event_id or event_time: consumers deduplicate on the one and
    window on the other, so a producer that forgot them must fail here, not downstream.
    """
    event_id = _event_id(message)
    shared = _shared_headers(message.DESCRIPTOR.full_name, trace_headers)
    return Record(value=message.SerializeToString(), key=key.encode() if key is not None else None, headers=[(EVENT_ID, event_id.encode()), *shared])


def encode_many(messages: Sequence[Message], *, trace_headers: Headers) -> tuple[list[bytes], list[str], list[tuple[str, bytes]]]:
    """What `encode` gives each of `messages` (all of one type, encoded with `trace_headers`),
    split as a bundle keeps it: their values, their event ids, and the headers every one
    carries after its event-id header. No Record per message: this runs for every sample."""
    if not messages:
        return [], [], []
    full_name = messages[0].DESCRIPTOR.full_name
    values, event_ids = [], []
    for message in messages:
        if message.DESCRIPTOR.full_name != full_name:
            raise WireError(f"{message.DESCRIPTOR.full_name} among {full_name} messages: one bundle carries one type")
        event_ids.append(_event_id(message))
        values.append(message.SerializeToString())
    return values, event_ids, _shared_headers(full_name, trace_headers)


def _event_id(message: Message) -> str:
    event_id: str = getattr(message, "event_id", "")
    if not event_id:
        raise WireError(f"{message.DESCRIPTOR.full_name} has no event_id")
    if not message.HasField("event_time"):
        raise WireError(f"{message.DESCRIPTOR.full_name} {event_id} has no event_time")
    return event_id


def _shared_headers(full_name: str, trace_headers: Headers | None) -> list[tuple[str, bytes]]:
    """A record's headers after its event id: content and message type, then the trace context."""
    return [(CONTENT_TYPE, _PROTOBUF_BYTES), (MESSAGE_TYPE, full_name.encode()), *(inject_headers() if trace_headers is None else trace_headers)]


def decode(message_cls: type[M], value: bytes | None, headers: Headers | None) -> M:
    """The `message_cls` carried by a record, from binary protobuf or its JSON mapping.

    A record without a content-type header is read as binary protobuf. Raises WireError when
    the value cannot be parsed, says it is another message type, or has no event_id.
    """
    expected = message_cls.DESCRIPTOR.full_name
    declared_type, raw_content_type, declared_id = _described(headers)
    if declared_type is not None and declared_type != _type_name(message_cls) and declared_type.decode(errors="replace") != expected:
        raise WireError(f"message-type is {declared_type.decode(errors='replace')!r}, expected {expected!r}")
    if value is None:
        raise WireError(f"record has no value (expected {expected})")
    content_type = PROTOBUF if raw_content_type == _PROTOBUF_BYTES else _media_type(raw_content_type)
    message = message_cls()
    if content_type in (None, PROTOBUF):
        try:
            message.ParseFromString(value)
        except DecodeError as exc:
            raise WireError(f"not a valid {expected} in binary protobuf: {exc}") from exc
    elif content_type == JSON:
        try:
            # Unknown fields are skipped, as binary parsing does, so an exporter one schema
            # version ahead of this consumer is not dead-lettered for a field it added.
            json_format.Parse(value.decode("utf-8"), message, ignore_unknown_fields=True)
        except (UnicodeDecodeError, json_format.Error) as exc:
            raise WireError(f"not a valid {expected} in protobuf JSON: {exc}") from exc
    else:
        raise WireError(f"unsupported content-type {content_type!r} (expected {PROTOBUF} or {JSON})")
    event_id = getattr(message, "event_id", "")
    if not event_id:
        raise WireError(f"{expected} has no event_id")
    if len(event_id) > MAX_EVENT_ID or not event_id.isprintable():
        # Inboxes key on it: a NUL or a huge id would fail there on every redelivery.
        raise WireError(f"{expected} event_id is not up to {MAX_EVENT_ID} printable characters: {event_id[:80]!r}")
    if declared_id is not None and declared_id.decode(errors="replace") != event_id:
        raise WireError(f"event-id header {declared_id.decode(errors='replace')!r} != body event_id {event_id!r}")
    return message


def _type_name(message_cls: type[Message]) -> bytes:
    """The message-type header value of `message_cls`'s records."""
    name = _TYPE_NAMES.get(message_cls)
    if name is None:
        name = _TYPE_NAMES[message_cls] = message_cls.DESCRIPTOR.full_name.encode()
    return name


_TYPE_NAMES: dict[type[Message], bytes] = {}


def _described(headers: Headers | None) -> tuple[bytes | None, bytes | None, bytes | None]:
    """The first message-type, content-type and event-id headers, as `header` finds them, in one
    pass (decode runs once per consumed record)."""
    if headers and len(headers) >= 3:
        # What `encode` writes leads with exactly these three, each the first of its name.
        (first, declared_id), (second, content_type), (third, declared_type) = headers[0], headers[1], headers[2]
        if first == EVENT_ID and second == CONTENT_TYPE and third == MESSAGE_TYPE:
            return declared_type, content_type, declared_id
    found: dict[str, bytes] = {}
    for key, value in headers or ():
        name = key if key in _DESCRIBING else key.lower()
        if name in _DESCRIBING and name not in found:
            found[name] = value
    return found.get(MESSAGE_TYPE), found.get(CONTENT_TYPE), found.get(EVENT_ID)


def _media_type(raw: bytes | None) -> str | None:
    """`application/json; charset=utf-8` -> `application/json`."""
    if raw is None:
        return None
    return raw.decode("latin-1").split(";", 1)[0].strip().lower()


def context_from_headers(headers: Headers | None) -> Context:
    """The producer's trace context, to start the consumer's span under."""
    return extract_context(headers)


# What a producer here sends at most in one request (aiokafka's default max_request_size), less
# room for the record batch's own framing.
_MAX_WHOLE_DEAD_LETTER = 1_048_576 - 1_024


def dead_letter(record: ConsumedRecord, *, reason: str, whole: bool = True) -> Record:
    """A record for `dlq(record.topic)`: the original key, value and headers, plus why and whence.

    dlq-* headers from an earlier trip through a DLQ (a replayed message) are replaced, so the
    record always tells its latest failure. Not `whole` (or too large to send whole: a record
    near the size limit, with why and whence added): why and whence only, and the size of the
    value left out (`dlq-value-dropped`); the record itself stays at its source topic,
    partition and offset. Dead letters sent directly and through the outbox are both built here.
    """
    if whole and _size(record) > _MAX_WHOLE_DEAD_LETTER:
        whole = False
    whence = [
        (DLQ_REASON, reason[:_MAX_REASON_CHARS].encode("utf-8", errors="replace")),
        (DLQ_SOURCE_TOPIC, record.topic.encode()),
        (DLQ_PARTITION, str(record.partition).encode()),
        (DLQ_OFFSET, str(record.offset).encode()),
    ]
    if not whole:
        return Record(value=b"", key=None, headers=[*whence, (DLQ_VALUE_DROPPED, str(len(record.value or b"")).encode())])
    kept = [(k, v) for k, v in (record.headers or ()) if k.lower() not in _DLQ_HEADERS]
    # The topics carry no tombstones; an empty value reads the same to whoever inspects it.
    return Record(value=record.value or b"", key=record.key, headers=[*kept, *whence])


def _size(record: ConsumedRecord) -> int:
    """About what `record`'s copy takes on the wire: key, value, headers and the dlq-* headers."""
    headers = sum(len(k) + len(v or b"") for k, v in record.headers or ())
    return len(record.key or b"") + len(record.value or b"") + headers + _MAX_REASON_CHARS * 4 + 256
