"""The fault campaign's Marquez stand-in (budgetgate.chaos.lineage_sink) and its outages, met by
the evidence-emitter's own HTTP transport: while down it keeps nothing and the transport reports
the event not delivered (a 5xx, or no answer at all), never refused; once back it keeps it."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime

import pytest

from budgetgate.chaos.lineage_sink import LineageSink
from budgetgate.evidence import events
from budgetgate.services.evidence_emitter import transport
from tests.support.marquez import http_client


@pytest.fixture
def sink() -> Iterator[LineageSink]:
    started = LineageSink().start()
    yield started
    started.close()


def _event(run_id: str) -> object:
    fields = {"stage": "decision", "run_id": run_id, "decision_id": f"d-{run_id}", "decision": "ALLOW"}
    return events.run_event(
        event_type=events.RunState.START, at=datetime.now(UTC), run_id=run_id, job=("chaos", run_id), fields=fields, producer="https://budgetgate.test"
    )


@pytest.mark.parametrize(("outage", "status"), [("503", 503), ("reset", None)])
def test_an_outage_keeps_nothing_and_is_not_delivered_then_the_event_is_kept(sink: LineageSink, outage: str, status: int | None) -> None:
    client = http_client(sink.url, timeout=5.0)
    sink.outage = outage
    with pytest.raises(transport.NotDelivered) as caught:
        transport.send(client, _event("down"))
    assert caught.value.status == status
    assert sink.events == [] and sink.refused == 1
    sink.outage = None
    transport.send(client, _event("down"))
    assert [e["decision_id"] for e in sink.decision_events()] == ["d-down"]
