"""Protobuf messages to Kafka records and back, without a broker."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime

import pytest
from google.protobuf import json_format
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider

from budgetgate.messaging import outbox

from budgetgate.contracts import wire
from budgetgate.messaging.publisher import Publisher
from budgetgate.contracts.topics import DECISIONS, METERING, dlq
from budgetgate.v1.common_pb2 import ALLOW, Job, Resources
from budgetgate.v1.decisions_pb2 import Decision
from budgetgate.v1.lifecycle_pb2 import LifecycleEvent
from budgetgate.v1.metering_pb2 import MeteringSample
from budgetgate.v1.policies_pb2 import PolicyBundlePublished
from budgetgate.contracts.wire import WireError, context_from_headers, dead_letter, decode, encode


def _when() -> datetime:
    return datetime(2025, 3, 1, 12, 30, tzinfo=UTC)


def _decision() -> Decision:
    d = Decision(
        event_id="evt-1",
        decision_id="dec-1",
        run_id="run-1",
        attempt=2,
        outcome=ALLOW,
        labels={"team": "vision", "cost-center": "cc-7"},
        job=Job(namespace="ml", name="train"),
        resources=Resources(gpus=8, nodes=1, flavor="h100-80gb", region="us-east"),
        projected_runtime_hours=6.0,
        projected_gpu_milli_hours=48 * 3_600_000,
        showback_cost_micros=188_784_000,
        currency="USD",
        preemptible=True,
    )
    d.event_time.FromDatetime(_when())
    ev = d.evaluations.add(policy_id="team-vision", limit_amount=100 * 3_600_000, outcome=ALLOW)
    ev.window_start.FromDatetime(datetime(2025, 3, 1, tzinfo=UTC))
    ev.missing_labels.append("project")
    return d


def _sample(**overrides: object) -> MeteringSample:
    s = MeteringSample(event_id="evt-s", sample_id="s-1", run_id="run-1", gpu_seconds=7200.5, exporter="dcgm")
    s.event_time.FromDatetime(_when())
    s.observed_at.FromDatetime(_when())
    for name, value in overrides.items():
        setattr(s, name, value)
    return s


@pytest.fixture
def tracer() -> Iterator[trace.Tracer]:
    provider = TracerProvider()
    yield provider.get_tracer("test")
    provider.shutdown()


def test_binary_round_trip_keeps_every_field() -> None:
    original = _decision()
    record = encode(original, key="run-1")

    decoded = decode(Decision, record.value, record.headers)

    assert decoded == original
    assert decoded.labels["cost-center"] == "cc-7"
    assert decoded.evaluations[0].missing_labels == ["project"]
    assert decoded.event_time.ToDatetime(tzinfo=UTC) == _when()
    assert record.key == b"run-1"


def test_encode_headers_describe_the_message() -> None:
    record = encode(_decision(), key=None)

    assert record.key is None
    assert record.header("content-type") == b"application/x-protobuf"
    assert record.header("event-id") == b"evt-1"
    assert record.header("message-type") == b"budgetgate.v1.Decision"
    # No span is current, so there is no trace context to send.
    assert record.header("traceparent") is None
    assert all(isinstance(k, str) and isinstance(v, bytes) for k, v in record.headers)


def test_json_mapping_is_accepted_on_ingest() -> None:
    original = _sample()
    body = json_format.MessageToJson(original).encode()

    decoded = decode(MeteringSample, body, [("content-type", b"application/json; charset=utf-8")])

    assert decoded == original


def test_json_as_an_outside_exporter_writes_it() -> None:
    # camelCase names, RFC 3339 times, an int64-style string, and a field from a newer schema.
    body = json.dumps(
        {
            "eventId": "exp-9",
            "eventTime": "2025-03-01T12:30:00Z",
            "sampleId": "s-9",
            "runId": "run-9",
            "observedAt": "2025-03-01T12:29:58.250Z",
            "gpuSeconds": 3600,
            "node_seconds": "1800.5",
            "exporter": "dcgm",
            "someFutureField": {"x": 1},
        }
    ).encode()

    s = decode(MeteringSample, body, [("Content-Type", b"application/json")])

    assert (s.event_id, s.sample_id, s.run_id, s.exporter) == ("exp-9", "s-9", "run-9", "dcgm")
    assert s.gpu_seconds == 3600.0
    assert s.node_seconds == 1800.5
    assert s.observed_at.ToDatetime(tzinfo=UTC) == datetime(2025, 3, 1, 12, 29, 58, 250_000, tzinfo=UTC)


def test_record_without_content_type_is_read_as_binary() -> None:
    original = _sample()
    assert decode(MeteringSample, original.SerializeToString(), []) == original
    assert decode(MeteringSample, original.SerializeToString(), None) == original


@pytest.mark.parametrize(
    ("value", "headers", "reason_part"),
    [
        (b"\xff\xff\xff\xff", [], "binary protobuf"),
        (b"{not json", [("content-type", b"application/json")], "protobuf JSON"),
        (b'{"eventId": 5}', [("content-type", b"application/json")], "protobuf JSON"),
        (b'{"eventId": "e", "gpuSeconds": "lots"}', [("content-type", b"application/json")], "gpuSeconds"),
        (b"\xff\xfe", [("content-type", b"application/json")], "protobuf JSON"),
        (b"a,b,c", [("content-type", b"text/csv")], "unsupported content-type 'text/csv'"),
        (None, [], "no value"),
    ],
)
def test_unparseable_records_raise_wire_error_with_a_reason(value: bytes | None, headers: list[tuple[str, bytes]], reason_part: str) -> None:
    with pytest.raises(WireError) as caught:
        decode(MeteringSample, value, headers)
    assert reason_part in caught.value.reason
    assert "budgetgate.v1.MeteringSample" in caught.value.reason or "content-type" in caught.value.reason


def test_missing_event_id_is_refused_in_binary_and_json() -> None:
    no_id = _sample(event_id="")
    with pytest.raises(WireError, match="has no event_id"):
        decode(MeteringSample, no_id.SerializeToString(), [])
    with pytest.raises(WireError, match="has no event_id"):
        decode(MeteringSample, b'{"sampleId": "s-1"}', [("content-type", b"application/json")])


def test_encode_refuses_messages_without_event_id_or_event_time() -> None:
    with pytest.raises(WireError, match="no event_id"):
        encode(_sample(event_id=""), key=None)
    no_time = MeteringSample(event_id="evt-x")
    with pytest.raises(WireError, match="no event_time"):
        encode(no_time, key=None)


def test_record_of_another_message_type_is_refused() -> None:
    record = encode(_decision(), key="run-1")
    with pytest.raises(WireError, match="expected 'budgetgate.v1.MeteringSample'"):
        decode(MeteringSample, record.value, record.headers)


def test_event_id_header_must_match_the_body() -> None:
    record = encode(_sample(), key=None)
    forged = [(k, b"other" if k == "event-id" else v) for k, v in record.headers]
    with pytest.raises(WireError, match="event-id header"):
        decode(MeteringSample, record.value, forged)


def test_trace_context_survives_encode_and_decode(tracer: trace.Tracer) -> None:
    with tracer.start_as_current_span("publish") as producer_span:
        record = encode(_decision(), key="run-1")

    assert record.header("traceparent") is not None
    ctx = context_from_headers(record.headers)
    with tracer.start_as_current_span("consume", context=ctx) as consumer_span:
        pass

    parent = consumer_span.parent  # type: ignore[attr-defined]
    assert parent is not None
    assert parent.span_id == producer_span.get_span_context().span_id
    assert parent.trace_id == producer_span.get_span_context().trace_id
    assert parent.is_remote


def test_records_encoded_outside_a_span_start_new_traces(tracer: trace.Tracer) -> None:
    record = encode(_decision(), key=None)
    with tracer.start_as_current_span("consume", context=context_from_headers(record.headers)) as span:
        pass
    assert span.parent is None  # type: ignore[attr-defined]


@dataclass
class _Consumed:
    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, bytes]] = field(default_factory=list)


def test_dead_letter_keeps_the_original_and_says_why_and_whence() -> None:
    original = encode(_decision(), key="run-1")
    consumed = _Consumed("t1-" + DECISIONS, 2, 41, original.key, original.value, original.headers)

    parked = dead_letter(consumed, reason="policy bundle unknown: abc123")

    assert parked.value == original.value
    assert parked.key == b"run-1"
    assert parked.headers[: len(original.headers)] == original.headers
    assert parked.header("dlq-reason") == b"policy bundle unknown: abc123"
    assert parked.header("dlq-source-topic") == b"t1-budget.decisions.v1"
    assert parked.header("dlq-partition") == b"2"
    assert parked.header("dlq-offset") == b"41"
    # Still decodable, so the DLQ can be inspected and replayed.
    assert decode(Decision, parked.value, parked.headers) == _decision()


def test_dead_letter_of_a_replayed_record_tells_only_the_latest_failure() -> None:
    first = dead_letter(_Consumed(METERING, 0, 5, None, b"\xff", []), reason="garbage")
    again = dead_letter(_Consumed(METERING, 1, 9, None, first.value, first.headers), reason="still garbage")

    assert [v for k, v in again.headers if k == "dlq-reason"] == [b"still garbage"]
    assert [v for k, v in again.headers if k == "dlq-offset"] == [b"9"]
    assert dlq(METERING) == "metering.samples.v1.dlq"


def test_dead_letter_reason_is_bounded_and_utf8() -> None:
    parked = dead_letter(_Consumed(METERING, 0, 0, None, None), reason="é" * 5000)
    reason = parked.header("dlq-reason")
    assert reason is not None
    assert reason.decode("utf-8") == "é" * 1000
    assert parked.value == b""


def test_wire_error_is_a_value_error_carrying_its_reason() -> None:
    err = WireError("broken")
    assert isinstance(err, ValueError)
    assert err.reason == "broken"
    assert str(err) == "broken"


async def test_publisher_refuses_to_send_before_start() -> None:
    publisher = Publisher("127.0.0.1:1")
    with pytest.raises(RuntimeError, match="before start"):
        await publisher.send(METERING, _sample(), key=None)
    await publisher.stop()  # stopping a publisher that never started is harmless


async def test_publisher_that_cannot_connect_fails_at_start() -> None:
    from aiokafka.errors import KafkaConnectionError

    publisher = Publisher("127.0.0.1:1")  # nothing listens on port 1
    with pytest.raises(KafkaConnectionError):
        await publisher.start()
    with pytest.raises(RuntimeError, match="before start"):
        await publisher.send(METERING, _sample(), key=None)


def test_event_ids_an_inbox_cannot_store_are_refused() -> None:
    from google.protobuf.timestamp_pb2 import Timestamp

    from budgetgate.contracts import wire

    from budgetgate.v1 import lifecycle_pb2

    for bad in ("run\x00id", "x" * 300):
        message = lifecycle_pb2.LifecycleEvent(event_id=bad, event_time=Timestamp(seconds=1), run_id="r")
        with pytest.raises(wire.WireError, match="printable"):
            wire.decode(lifecycle_pb2.LifecycleEvent, message.SerializeToString(), [])


def test_a_bundle_carries_exactly_the_records_encode_gives_its_messages() -> None:
    trace = [("traceparent", b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")]
    messages = [_bundle_message(n) for n in range(3)]
    keys = [None, "run-1", "run-2"]
    bundle = outbox.bundle_messages(topic="policies", messages=messages, keys=keys, trace_headers=trace)
    records = [wire.encode(m, key=k, trace_headers=trace) for m, k in zip(messages, keys, strict=True)]
    assert bundle.keys == keys and bundle.payloads == [r.value for r in records]
    assert bundle.event_ids == [m.event_id for m in messages]
    # The relay puts each record's event id before the headers the bundle keeps once.
    shared = outbox._unpack_headers(bundle.headers)
    assert [[(wire.EVENT_ID, e.encode()), *shared] for e in bundle.event_ids] == [list(r.headers) for r in records]
    assert outbox.bundle_messages(topic="policies", messages=[], keys=[], trace_headers=trace).payloads == []


def test_a_bundle_refuses_what_encode_refuses_and_mixed_or_unkeyed_messages() -> None:
    trace: list[tuple[str, bytes]] = []
    without_id = PolicyBundlePublished(git_sha="0" * 40)
    without_id.event_time.FromDatetime(datetime.now(UTC))
    with pytest.raises(wire.WireError, match="no event_id"):
        outbox.bundle_messages(topic="policies", messages=[_bundle_message(0), without_id], keys=["a", "a"], trace_headers=trace)
    with pytest.raises(wire.WireError, match="no event_time"):
        outbox.bundle_messages(topic="policies", messages=[PolicyBundlePublished(event_id="e")], keys=["a"], trace_headers=trace)
    other = LifecycleEvent(event_id="e", run_id="r")
    other.event_time.FromDatetime(datetime.now(UTC))
    with pytest.raises(wire.WireError, match="one type"):
        outbox.bundle_messages(topic="policies", messages=[_bundle_message(0), other], keys=["a", "a"], trace_headers=trace)
    with pytest.raises(ValueError, match="2 messages with 1 keys"):
        outbox.bundle_messages(topic="policies", messages=[_bundle_message(0), _bundle_message(1)], keys=["a"], trace_headers=trace)


def _bundle_message(n: int) -> PolicyBundlePublished:
    message = PolicyBundlePublished(event_id=f"event-{n}", git_sha=f"{n:040x}")
    message.event_time.FromDatetime(datetime.now(UTC))
    return message


def test_a_dead_letter_not_whole_says_why_whence_and_what_it_left_out() -> None:
    consumed = _Consumed(METERING, 3, 77, b"run-1", b"\x00" * 5000, [("x-big", b"1"), ("dlq-reason", b"older")])

    parked = dead_letter(consumed, reason="garbage", whole=False)

    assert (parked.value, parked.key) == (b"", None)
    assert parked.headers == [
        ("dlq-reason", b"garbage"),
        ("dlq-source-topic", METERING.encode()),
        ("dlq-partition", b"3"),
        ("dlq-offset", b"77"),
        ("dlq-value-dropped", b"5000"),
    ]
    # A replay of it (still poison) is parked telling only its latest trip, with no stale size.
    again = dead_letter(_Consumed(METERING, 0, 1, None, parked.value, parked.headers), reason="still garbage")
    assert [k for k, _ in again.headers].count("dlq-value-dropped") == 0


def test_a_dead_letter_too_large_to_send_whole_is_built_without_its_value() -> None:
    # Sent directly or relayed through the outbox (metering-ingest parks expired pending samples
    # that way, where a copy too large for the producer stopped the relay), the copy fits.
    near_limit = _Consumed(METERING, 0, 12, b"run-9", b"\x00" * 1_047_000, [("x-big", b"1")])
    parked = dead_letter(near_limit, reason="unknown_run: run 'run-9' has no decision")
    assert (parked.value, parked.key) == (b"", None)
    assert parked.header("dlq-value-dropped") == b"1047000" and parked.header("dlq-offset") == b"12"
    small = dead_letter(_Consumed(METERING, 0, 13, b"run-9", b"\x00" * 1000, []), reason="garbage")
    assert small.value == b"\x00" * 1000 and small.header("dlq-value-dropped") is None
