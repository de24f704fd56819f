"""The AsyncAPI document of every Kafka topic budgetgate uses, made by FastStream from a broker
that is described, never connected (`budgetgate asyncapi` prints it).

The services' real FastStream routers are included (their subscribers, with the settings they
run with); every topic is also declared with the message it carries (its protobuf message as a
JSON schema of the canonical JSON mapping) and who produces and consumes it; every topic's
dead-letter topic too. It lives beside the services, not in the library, because it imports
three of them.
"""

from __future__ import annotations

import json
import typing
from datetime import datetime
from importlib.metadata import version
from typing import Any

from faststream.kafka import KafkaBroker
from faststream.specification import AsyncAPI
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from pydantic import BaseModel, Field, create_model

from budgetgate.contracts import topics
from budgetgate.services.evidence_emitter import consumers as evidence_consumers
from budgetgate.services.evidence_emitter.settings import EvidenceSettings
from budgetgate.services.metering_ingest import consumers as metering_consumers
from budgetgate.services.metering_ingest.settings import MeteringSettings
from budgetgate.services.reconciler import consumers as reconciler_consumers
from budgetgate.services.reconciler.settings import ReconcilerSettings

# Who writes and who reads each topic (the design's table of services).
_ROLES: dict[str, tuple[str, str]] = {
    topics.DECISIONS: ("admission (transactional outbox)", "reconciler, evidence-emitter, audit consumers"),
    topics.LIFECYCLE: ("platform lifecycle feeds", "reconciler"),
    topics.METERING: ("metering exporters (binary protobuf or its canonical JSON mapping)", "metering-ingest"),
    topics.USAGE: ("metering-ingest (transactional outbox)", "reconciler"),
    topics.RECONCILIATIONS: ("reconciler (transactional outbox)", "evidence-emitter, audit consumers"),
    topics.ACTIONS: ("reconciler (transactional outbox)", "platform adapters (hold, drain, alerts)"),
    topics.POLICIES: ("budgetgate policy apply", "admission, reconciler"),
}
_DESCRIPTION = (
    "Admission-time GPU budget enforcement: the Kafka topics between admission, metering-ingest, the reconciler and "
    "the evidence emitter, and the feeds from outside (metering exporters, platform lifecycle events). Every message "
    "carries an event id, an event time and W3C trace context; consumers deduplicate on the event id."
)
_HEADERS = (
    "Headers: content-type (application/x-protobuf, or application/json on ingest topics), message-type (the protobuf "
    "message's full name), event-id (the body's event_id, which consumers deduplicate on) and the W3C trace context "
    "(traceparent, tracestate). Keyed by run id where the message has one."
)


def document(*, prefix: str = "") -> dict[str, Any]:
    """The AsyncAPI 3.0 document of every topic under `prefix`, as JSON-ready data."""
    broker = KafkaBroker("kafka:9092", description="budgetgate's Kafka topics: versioned names, protobuf messages, a dead-letter topic each.")
    names = topics.Topics(prefix)
    settings = MeteringSettings(topic_prefix=prefix)
    broker.include_router(metering_consumers.subscription(settings, names).router(_described_only))
    broker.include_router(reconciler_consumers.subscription(ReconcilerSettings(topic_prefix=prefix), names).router(_described_only))
    broker.include_router(evidence_consumers.subscription(EvidenceSettings(topic_prefix=prefix), names).router(_described_only))
    for topic in topics.EVENT_TOPICS:
        message = topics.MESSAGE_TYPES[topic]
        producer, consumer = _ROLES[topic]
        broker.publisher(
            names.name(topic),
            title=f"{topic}:{message.DESCRIPTOR.full_name}",
            description=f"{message.DESCRIPTOR.full_name}. Produced by {producer}; consumed by {consumer}. {_HEADERS}",
            schema=_model(message.DESCRIPTOR),
        )
        broker.publisher(
            names.name(topics.dlq(topic)),
            title=f"{topics.dlq(topic)}:dead letters",
            description=(
                f"Records of {topic} a consumer could not use, as they came (key, value, headers), plus dlq-reason, "
                "dlq-source-topic, dlq-partition and dlq-offset headers. Written by that topic's consumers; read by operators."
            ),
            schema=bytes,
        )
    spec = AsyncAPI(broker, title="budgetgate", version=version("budgetgate"), description=_DESCRIPTION, schema_version="3.0.0")
    data = json.loads(spec.to_specification().to_json())
    return {"asyncapi": data.pop("asyncapi"), **data}


def _described_only() -> Any:
    raise RuntimeError("this broker only describes the topics; it never consumes")


_SCALARS: dict[int, Any] = {
    FieldDescriptor.TYPE_DOUBLE: float,
    FieldDescriptor.TYPE_FLOAT: float,
    FieldDescriptor.TYPE_INT32: int,
    FieldDescriptor.TYPE_SINT32: int,
    FieldDescriptor.TYPE_SFIXED32: int,
    FieldDescriptor.TYPE_UINT32: int,
    FieldDescriptor.TYPE_FIXED32: int,
    # The JSON mapping writes 64-bit integers as strings and reads either.
    FieldDescriptor.TYPE_INT64: int | str,
    FieldDescriptor.TYPE_SINT64: int | str,
    FieldDescriptor.TYPE_SFIXED64: int | str,
    FieldDescriptor.TYPE_UINT64: int | str,
    FieldDescriptor.TYPE_FIXED64: int | str,
    FieldDescriptor.TYPE_BOOL: bool,
    FieldDescriptor.TYPE_STRING: str,
    FieldDescriptor.TYPE_BYTES: str,  # base64
}


def _model(descriptor: Descriptor, _seen: dict[str, type[BaseModel]] | None = None) -> type[BaseModel]:
    """A pydantic model of `descriptor`'s canonical JSON mapping (field names as in the .proto)."""
    seen = {} if _seen is None else _seen
    if descriptor.full_name in seen:
        return seen[descriptor.full_name]
    fields: dict[str, Any] = {}
    for field in descriptor.fields:
        kind = _field_type(field, seen)
        fields[field.name] = (kind | None, Field(default=None, description=f"JSON name {field.json_name}"))
    model = create_model(descriptor.full_name.replace(".", "_"), __doc__=f"{descriptor.full_name} (protobuf)", **fields)
    seen[descriptor.full_name] = model
    return model


def _field_type(field: FieldDescriptor, seen: dict[str, type[BaseModel]]) -> Any:
    if field.message_type is not None and field.message_type.GetOptions().map_entry:
        value = field.message_type.fields_by_name["value"]
        return dict[str, _field_type(value, seen)]  # type: ignore[misc]
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        if field.message_type.full_name == "google.protobuf.Timestamp":
            single: Any = datetime
        else:
            single = _model(field.message_type, seen)
    elif field.type == FieldDescriptor.TYPE_ENUM:
        single = typing.Literal[tuple(v.name for v in field.enum_type.values)]
    else:
        single = _SCALARS[field.type]
    repeated = field.is_repeated
    return list[single] if repeated else single  # type: ignore[valid-type]
