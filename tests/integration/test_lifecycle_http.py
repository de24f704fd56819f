"""metering-ingest's `POST /v1/lifecycle/events`: durable in the outbox before the 202, then on
workload.lifecycle.v1 as the reconciler reads it; 422 problem details with nothing recorded."""

from __future__ import annotations

import pytest

from datetime import UTC, datetime, timedelta

from budgetgate.contracts import lifecycle_rules as lifecycle, wire
from budgetgate.client import AsyncClient, InvalidRequest, lifecycle_event
from budgetgate.contracts.topics import Topics
from budgetgate.v1.lifecycle_pb2 import LifecycleEvent, LifecycleType
from tests.support.kafka import drain
from tests.support.metering import fetchval, metering, metering_factory  # noqa: F401 - pytest fixtures

AT = datetime.now(UTC).replace(microsecond=0) - timedelta(minutes=5)
from tests.support.principals import token_in_env  # noqa: F401 - a fixture, used by name

pytestmark = pytest.mark.usefixtures("token_in_env")


async def lifecycle_records(settings, expected: int) -> list[LifecycleEvent]:  # type: ignore[no-untyped-def]
    records = await drain(settings.kafka_bootstrap, Topics(settings.topic_prefix).lifecycle, expected)
    return [wire.decode(LifecycleEvent, r.value, r.headers) for r in records]


async def outbox_rows(dsn: str) -> int:
    return int(await fetchval(dsn, "SELECT count(*) FROM outbox WHERE topic = 'workload.lifecycle.v1'"))  # type: ignore[arg-type]


async def test_events_are_durable_before_the_answer_then_on_the_topic(metering, settings, pg_dsn) -> None:
    body = {"events": [
        {"eventId": "ev-1", "runId": "run-l", "type": "STARTED", "eventTime": AT.isoformat(), "gpus": 8, "nodes": 1, "flavor": "h100"},
        {"run_id": "run-l", "type": "COMPLETED", "event_time": (AT + timedelta(minutes=4)).isoformat()},
    ]}  # fmt: skip
    response = await metering.client.post("/v1/lifecycle/events", json=body)
    assert response.status_code == 202, response.text
    results = response.json()["results"]
    assert [(r["index"], r["runId"], r["status"]) for r in results] == [(0, "run-l", "accepted"), (1, "run-l", "accepted")]
    assert results[0]["eventId"] == "ev-1"
    # The second came without an id: one derived from run, type and time, the same on a resend.
    derived = results[1]["eventId"]
    assert derived and derived == (await metering.client.post("/v1/lifecycle/events", json={"events": body["events"][1:]})).json()["results"][0]["eventId"]
    assert await outbox_rows(pg_dsn) == 3  # committed before the answers
    events = await lifecycle_records(settings, 3)
    assert [(e.event_id, LifecycleType.Name(e.type), e.gpus, e.flavor) for e in events] == [
        ("ev-1", "STARTED", 8, "h100"), (derived, "COMPLETED", 0, ""), (derived, "COMPLETED", 0, ""),
    ]  # fmt: skip
    assert events[0].event_time.ToDatetime(tzinfo=UTC) == AT
    records = await drain(settings.kafka_bootstrap, Topics(settings.topic_prefix).lifecycle, 3)
    assert {r.key for r in records} == {b"run-l"}  # keyed by run, so a run's events stay in order


async def test_bad_events_are_named_and_nothing_is_recorded(metering, pg_dsn) -> None:
    body = {"events": [
        {"runId": "ok", "type": "STARTED", "eventTime": AT.isoformat()},
        {"runId": "", "type": "STARTED", "eventTime": AT.isoformat()},
        {"runId": "r", "type": "BOGUS", "eventTime": AT.isoformat()},
        {"runId": "r", "type": "EVICTED"},
        {"runId": "r", "type": "STARTED", "eventTime": AT.isoformat(), "gpus": -1},
        "not an object",
    ]}  # fmt: skip
    response = await metering.client.post("/v1/lifecycle/events", json=body)
    assert response.status_code == 422 and response.headers["content-type"] == "application/problem+json"
    fields = sorted(e["field"] for e in response.json()["errors"])
    assert fields == ["events.1.runId", "events.2.type", "events.3.eventTime", "events.4.gpus", "events.5"]
    assert await outbox_rows(pg_dsn) == 0
    for bad in (b"{", b'{"events": []}', b"[" * 60_000):  # the last nested past the parser: once a 500
        answer = await metering.client.post("/v1/lifecycle/events", content=bad, headers={"content-type": "application/json"})
        assert answer.status_code == 422 and answer.json()["errors"]
    assert await outbox_rows(pg_dsn) == 0


async def test_the_client_publishes_lifecycle_over_http(metering, settings) -> None:
    started = lifecycle_event("run-c", "started", at=AT, gpus=2, nodes=1)
    async with AsyncClient("http://127.0.0.1:9", metering_url=metering.url) as client:
        results = await client.publish_lifecycle(started, lifecycle_event("run-c", "completed", at=AT + timedelta(hours=1)))
        assert [r["eventId"] for r in results][0] == started.event_id == lifecycle.derived_event_id(started)
        bad = LifecycleEvent(run_id="run-c", type=LifecycleType.STARTED)  # no event_time
        try:
            await client.publish_lifecycle(bad)
        except InvalidRequest as exc:
            assert [e["field"] for e in exc.errors] == ["events.0.eventTime"]
        else:
            raise AssertionError("an event without a time was accepted")
    events = await lifecycle_records(settings, 2)
    assert [(e.run_id, LifecycleType.Name(e.type)) for e in events] == [("run-c", "STARTED"), ("run-c", "COMPLETED")]
