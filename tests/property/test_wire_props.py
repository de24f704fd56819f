"""wire.decode reads a record's describing headers (message type, content type, event id) as
`wire.header` finds each of them, whatever the headers' order, case and repeats."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from budgetgate.contracts import wire
from budgetgate.contracts.wire import _described

names = st.sampled_from([wire.EVENT_ID, wire.CONTENT_TYPE, wire.MESSAGE_TYPE, "Event-Id", "CONTENT-TYPE", "Message-Type", "traceparent", "x-other"])
headers = st.lists(st.tuples(names, st.binary(max_size=8)), max_size=7)
leading = st.tuples(st.binary(max_size=8), st.binary(max_size=8), st.binary(max_size=8))


@given(headers)
def test_described_is_header_for_any_headers(found: list[tuple[str, bytes]]) -> None:
    assert _described(found) == (wire.header(found, wire.MESSAGE_TYPE), wire.header(found, wire.CONTENT_TYPE), wire.header(found, wire.EVENT_ID))


@given(leading, headers)
def test_described_is_header_for_headers_as_encode_writes_them(first: tuple[bytes, bytes, bytes], rest: list[tuple[str, bytes]]) -> None:
    found = [(wire.EVENT_ID, first[0]), (wire.CONTENT_TYPE, first[1]), (wire.MESSAGE_TYPE, first[2]), *rest]
    assert _described(found) == (first[2], first[1], first[0])
    assert _described(found) == (wire.header(found, wire.MESSAGE_TYPE), wire.header(found, wire.CONTENT_TYPE), wire.header(found, wire.EVENT_ID))
