"""The inbox subscribers' parser (budgetgate.messaging.subscriber.keep_header_bytes) on FastStream's own
batch parser: the records come through as they were, whatever bytes their headers hold."""

from __future__ import annotations

from aiokafka import ConsumerRecord
from faststream.kafka.message import KafkaAckableMessage
from faststream.kafka.parser import AioKafkaBatchParser

from budgetgate.messaging.subscriber import keep_header_bytes


def _record(offset: int, headers: list[tuple[str, bytes | None]]) -> ConsumerRecord:
    value = f"value-{offset}".encode()
    return ConsumerRecord("t", 0, offset, 1_000 + offset, 0, b"k", value, None, 1, len(value), headers)


async def test_a_batch_keeps_its_records_as_they_came_even_when_the_first_header_is_not_utf8() -> None:
    parser = AioKafkaBatchParser(msg_class=KafkaAckableMessage, regex=None)
    odd = ("x-blob", b"\xff\xfe\x00")
    records = (_record(7, [("event-id", b"a"), odd]), _record(8, [("event-id", b"b")]), _record(9, [odd]))
    message = await keep_header_bytes(records, parser.parse_batch)
    assert message.raw_message is records
    assert [r.headers for r in message.raw_message] == [[("event-id", b"a"), odd], [("event-id", b"b")], [odd]]
    assert message.body == [b"value-7", b"value-8", b"value-9"]
    assert message.message_id == "7-9-1007"
    assert message.headers["event-id"] == "a"  # the first record's, readable


async def test_a_header_without_a_value_on_the_first_record_is_read_as_empty() -> None:
    parser = AioKafkaBatchParser(msg_class=KafkaAckableMessage, regex=None)
    records = (_record(3, [("x-null", None), ("event-id", b"a")]), _record(4, [("x-null", None)]))
    message = await keep_header_bytes(records, parser.parse_batch)
    assert message.raw_message is records  # the records themselves keep their null
    assert [r.headers for r in message.raw_message] == [[("x-null", None), ("event-id", b"a")], [("x-null", None)]]
    assert message.headers["x-null"] == "" and message.headers["event-id"] == "a"
