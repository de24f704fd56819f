"""metering-ingest's HTTP endpoint: per-sample results, 422 naming bad fields with nothing
recorded, 202 for pending samples, durable before the answer; health, readiness and metrics."""

from __future__ import annotations

import logging
from datetime import UTC, datetime, timedelta

import pytest

from budgetgate.contracts.topics import Topics
from tests.support.metering import (  # noqa: F401 - pytest fixtures
    as_json,
    decide,
    fetchval,
    metering,
    metering_factory,
    metric,
    sample,
    usage_records,
    usage_rows,
)


async def test_batch_is_recorded_before_the_answer_with_a_result_per_sample(metering, settings, pg_dsn) -> None:
    await decide(pg_dsn, "run-h")
    first, second = sample("run-h", "h1", 36.0, minute=0), sample("run-h", "h2", 72.0, minute=5, node_seconds=9.0)
    response = await metering.post(as_json(first), as_json(second), as_json(first))
    assert response.status_code == 200, response.text
    results = response.json()["results"]
    assert [(r["index"], r["sampleId"], r["status"]) for r in results] == [(0, "h1", "accepted"), (1, "h2", "accepted"), (2, "h1", "duplicate")]
    assert (results[1]["gpuMillisecondsCumulative"], results[1]["gpuMillisecondsDelta"], results[1]["late"]) == (72_000, 36_000, False)
    assert results[2]["duplicateOf"] == "h1"
    # Durable once answered: the rows are there without waiting for anything.
    assert [(r["sample_id"], r["source"]) for r in await usage_rows(pg_dsn)] == [("h1", "http"), ("h2", "http")]
    records = await usage_records(settings.kafka_bootstrap, Topics(settings.topic_prefix).usage, 2)
    assert [(r.sample_id, r.gpu_milli_hours_delta, r.node_milli_hours_cumulative) for r in records] == [("h1", 36_000, 0), ("h2", 36_000, 9_000)]


async def test_snake_case_fields_and_a_late_sample(metering, settings, pg_dsn) -> None:
    await decide(pg_dsn, "run-s")
    now = datetime.now(UTC).replace(microsecond=0)
    body = [
        {"run_id": "run-s", "sample_id": "b", "observed_at": (now - timedelta(minutes=1)).isoformat(), "gpu_seconds": 50},
        {"run_id": "run-s", "sample_id": "a", "observed_at": (now - timedelta(minutes=2)).isoformat(), "gpu_seconds": 20},
    ]
    response = await metering.post(*body)
    assert response.status_code == 200, response.text
    late = response.json()["results"][1]
    assert (late["status"], late["late"], late["gpuMillisecondsDelta"], late["gpuMillisecondsCumulative"]) == ("accepted", True, 0, 50_000)
    rows = await usage_rows(pg_dsn, "run-s")
    assert [(r["sample_id"], r["gpu_milli_hours"], r["late"]) for r in rows] == [("a", 20_000, True), ("b", 50_000, False)]
    # Announced too: cumulative unchanged and delta 0, with its own counters for windows.
    records = await usage_records(settings.kafka_bootstrap, Topics(settings.topic_prefix).usage, 2)
    assert [(r.sample_id, r.gpu_milli_hours_cumulative, r.gpu_milli_hours_delta, r.gpu_milli_hours_observed) for r in records] == [
        ("b", 50_000, 50_000, 50_000),
        ("a", 50_000, 0, 20_000),
    ]


async def test_bad_fields_are_named_and_nothing_of_the_batch_is_recorded(metering, pg_dsn) -> None:
    await decide(pg_dsn, "run-b")
    good = as_json(sample("run-b", "ok", 1.0))
    future = (datetime.now(UTC) + timedelta(days=1)).isoformat()
    response = await metering.post(
        good,
        {**good, "sampleId": "neg", "gpuSeconds": -1},
        {**good, "sampleId": "nan", "nodeSeconds": "NaN"},
        {**good, "sampleId": "fut", "observedAt": future},
        {**good, "sampleId": "typo", "gpuSeconds": "many"},
        {"sampleId": "bare"},
        "not an object",
        {**good, "sampleId": "huge", "gpuSeconds": int("9" * 400)},  # no float holds it: once a 500
        {**good, "sampleId": "zero", "observedAt": "1970-01-01T00:00:00Z"},  # a zero value, charged to 1970
        {**good, "sampleId": "year1", "observedAt": "0001-01-01T00:00:00Z"},  # Go's zero time: overflowed the windows
        {**good, "sampleId": "eid", "eventId": "a\u00a0b"},  # what the inbox refuses: kept pending, lost later
    )
    assert response.status_code == 422, response.text
    assert response.headers["content-type"] == "application/problem+json"
    found = {(tuple(d["loc"]), d["type"]) for d in response.json()["errors"]}
    assert found == {
        (("body", "samples", 1, "gpuSeconds"), "negative"),
        (("body", "samples", 2, "nodeSeconds"), "not_finite"),
        (("body", "samples", 3, "observedAt"), "future_timestamp"),
        (("body", "samples", 4, "gpuSeconds"), "unparseable"),
        (("body", "samples", 5, "runId"), "missing_field"),
        (("body", "samples", 5, "observedAt"), "missing_field"),
        (("body", "samples", 6), "unparseable"),
        (("body", "samples", 7, "gpuSeconds"), "unparseable"),
        (("body", "samples", 8, "observedAt"), "invalid_field"),
        (("body", "samples", 9, "observedAt"), "invalid_field"),
        (("body", "samples", 10, "eventId"), "invalid_field"),
    }
    assert await usage_rows(pg_dsn) == []
    text = (await metering.client.get("/metrics")).text
    assert metric(text, "budgetgate_metering_rejections_total", reason="negative", source="http") == 1
    assert metric(text, "budgetgate_metering_rejections_total", reason="unparseable", source="http") == 3


async def test_a_regression_is_rejected_while_the_rest_is_recorded(metering, pg_dsn) -> None:
    await decide(pg_dsn, "run-r")
    response = await metering.post(
        as_json(sample("run-r", "up", 100.0, minute=0)), as_json(sample("run-r", "down", 50.0, minute=1)), as_json(sample("run-r", "up2", 150.0, minute=2))
    )
    assert response.status_code == 422
    body = response.json()
    assert [r["status"] for r in body["results"]] == ["accepted", "rejected", "accepted"]
    assert body["results"][1]["reason"] == "counter_regression"
    assert [(tuple(d["loc"]), d["type"]) for d in body["errors"]] == [(("body", "samples", 1, "gpuSeconds"), "counter_regression")]
    assert [r["sample_id"] for r in await usage_rows(pg_dsn)] == ["up", "up2"]


async def test_samples_of_an_unknown_run_are_accepted_as_pending(metering, pg_dsn) -> None:
    now = datetime.now(UTC)
    response = await metering.post(as_json(sample("run-later", "p", 5.0, at=now)))
    assert response.status_code == 202
    [result] = response.json()["results"]
    assert result["status"] == "pending" and result["pendingUntil"].endswith("Z") and datetime.fromisoformat(result["pendingUntil"]) > now
    assert await fetchval(pg_dsn, "SELECT count(*) FROM metering_pending WHERE source = 'http'") == 1
    assert await usage_rows(pg_dsn) == []


async def test_a_pending_sample_sent_again_with_other_values_is_a_conflict(metering, pg_dsn) -> None:
    # The second was answered pending and silently dropped (ON CONFLICT DO NOTHING): never
    # recorded, never refused, never dead-lettered.
    now = datetime.now(UTC)
    first = await metering.post(as_json(sample("run-twice", "p", 5.0, at=now)))
    assert first.status_code == 202
    resent = await metering.post(as_json(sample("run-twice", "p", 5.0, at=now)))  # the same point, a new event id
    assert resent.status_code == 202 and resent.json()["results"][0]["status"] == "pending"
    other = await metering.post(as_json(sample("run-twice", "p", 7.0, at=now)))
    assert other.status_code == 422, other.text
    [result] = other.json()["results"]
    assert result["status"] == "rejected" and result["reason"] == "conflict", result
    assert [(tuple(d["loc"]), d["type"]) for d in other.json()["errors"]] == [(("body", "samples", 0, "sampleId"), "conflict")]
    assert await fetchval(pg_dsn, "SELECT count(*) FROM metering_pending WHERE run_id = 'run-twice'") == 1


async def test_malformed_empty_oversized_and_overlong_bodies(metering_factory) -> None:
    server = await metering_factory(max_batch_samples=2, max_body_bytes=2000)
    malformed = await server.client.post("/v1/metering/samples", content=b"{not json", headers={"content-type": "application/json"})
    assert malformed.status_code == 422 and malformed.json()["errors"][0]["loc"] == ["body"]
    deep = await server.client.post("/v1/metering/samples", content=b"[" * 1500, headers={"content-type": "application/json"})
    assert deep.status_code == 422 and deep.json()["errors"][0]["loc"] == ["body"]  # nested past the parser: once a 500
    empty = await server.client.post("/v1/metering/samples", json={"samples": []})
    assert empty.status_code == 422 and empty.json()["errors"][0]["loc"] == ["body", "samples"]
    too_many = await server.post(*[as_json(sample("r", f"s{i}", 1.0, minute=i)) for i in range(3)])
    assert too_many.status_code == 422 and "at most 2" in too_many.json()["errors"][0]["msg"]
    too_big = await server.client.post("/v1/metering/samples", content=b"x" * 2001, headers={"content-type": "application/json"})
    assert too_big.status_code == 413


async def test_health_readiness_and_openapi(metering) -> None:
    assert (await metering.client.get("/healthz")).json() == {"status": "ok"}
    ready = await metering.client.get("/readyz")
    assert ready.status_code == 200 and ready.json()["checks"] == {"postgres": "ok", "kafka_consumer": "ok"}
    spec = (await metering.client.get("/openapi.json")).json()
    assert "samples" in spec["paths"]["/v1/metering/samples"]["post"]["requestBody"]["content"]["application/json"]["schema"]["properties"]


async def test_the_kafka_clients_log_through_the_services_logging(
    metering_factory, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    caplog.set_level(logging.INFO, logger="budgetgate.messaging.kafka")  # (a service logs at INFO)
    server = await metering_factory()
    await server.wait_ready()  # the consumer was given its partitions while it started
    assert any(r.name == "budgetgate.messaging.kafka" and "assigned to partitions" in r.getMessage() for r in caplog.records)
    # Not on stdout in a format of FastStream's own, where a command's output would collect it.
    assert "assigned to partitions" not in capsys.readouterr().out
