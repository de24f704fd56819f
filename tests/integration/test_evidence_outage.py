"""Marquez down, failing or stalled: admission is untouched, evidence waits with backoff, and once
Marquez is back every event arrives exactly once."""

from __future__ import annotations

import re
from collections import Counter

import asyncpg
import pytest

from budgetgate.services.admission.settings import AdmissionSettings
from budgetgate.messaging.topic_admin import ensure_topics
from tests.support.admission import apply_policies, budget_yaml
from tests.support.marquez import EmitterServer, decision, emitter_settings, http_client, publish, require_spec, wait_evidence_settled
from tests.support.marquez import marquez  # noqa: F401 - pytest fixtures
from tests.support.waiting import wait_for


def metric(text: str, name: str) -> float:
    """The value of an unlabelled sample `name` in a Prometheus text page."""
    found = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M)
    assert found, f"{name} not in the metrics page"
    return float(found.group(1))


def exactly_once(received: list[dict]) -> Counter:  # type: ignore[type-arg]
    return Counter(e["run"]["facets"]["budget"]["decision_id"] for e in received)


async def test_marquez_away_for_a_burst(settings, pg_dsn, admission_factory, marquez) -> None:  # type: ignore[no-untyped-def]
    require_spec()
    # Structurally: admission has no setting that could name Marquez or an OpenLineage endpoint.
    assert not [f for f in AdmissionSettings.model_fields if "marquez" in f or "lineage" in f or "evidence" in f]
    await ensure_topics(settings.kafka_bootstrap, prefix=settings.topic_prefix)
    await apply_policies(pg_dsn, {"team.yaml": budget_yaml("team", limit="gpu_hours: 100000")}, sha="e" * 40)
    admission = await admission_factory()
    await admission.wait_ready()
    emitter = await EmitterServer(emitter_settings(settings), http_client(marquez.url, timeout=2)).start()

    async def burst(prefix: str, count: int) -> None:
        for i in range(count):
            response = await admission.submit(run_id=f"{prefix}/{i}")
            assert response.status_code == 200 and response.json()["decision"] == "ALLOW", response.text

    try:
        await burst("before", 20)
        await marquez.wait_for(20)
        marquez.go_away()
        # Every answer in this burst is a 200 ALLOW while nothing listens on Marquez's port:
        # admission never waits on evidence (latency is measured by benchmarks, not asserted).
        await burst("outage", 40)

        seen = {}

        async def backlog_page() -> str | None:
            page = (await emitter.client.get("/metrics")).text
            seen["page"] = page
            grown = metric(page, "budgetgate_evidence_backlog") >= 40 and metric(page, "budgetgate_evidence_delivery_failures_total") >= 2
            return page if grown else None

        try:
            page = await wait_for(backlog_page, timeout=60, what="the backlog and failures to show in /metrics")
        except AssertionError:
            raise AssertionError(f"{seen.get('page')} {emitter.rt.sender.stats}") from None
        assert metric(page, "budgetgate_evidence_oldest_undelivered_age_seconds") > 0
        assert len(marquez.received()) == 20

        marquez.come_back()
        await marquez.wait_for(60)
        await wait_evidence_settled(settings)  # after this, a duplicate could not arrive any more
    finally:
        await emitter.stop()
    received = marquez.received()
    counts = exactly_once(received)
    assert len(received) == 60 and set(counts.values()) == {1}
    assert sorted(e["run"]["facets"]["budget"]["run_id"] for e in received) == sorted([f"before/{i}" for i in range(20)] + [f"outage/{i}" for i in range(40)])
    assert marquez.invalid == []


async def test_marquez_failing_then_stalled(settings, pg_dsn, marquez) -> None:  # type: ignore[no-untyped-def]
    await ensure_topics(settings.kafka_bootstrap, prefix=settings.topic_prefix)
    emitter = await EmitterServer(emitter_settings(settings), http_client(marquez.url, timeout=1)).start()
    try:
        marquez.fail(503)
        await publish(settings, *[decision(f"failing/{i}") for i in range(5)])
        await wait_for(lambda: emitter.rt.sender.stats.failures >= 3, what="503s to be retried")
        conn = await asyncpg.connect(pg_dsn)
        try:
            row = await conn.fetchrow(
                "SELECT max(attempts) AS attempts, max(last_error) AS error, count(*) FILTER (WHERE state = 'pending') AS pending FROM evidence_events"
            )
        finally:
            await conn.close()
        assert row["attempts"] >= 1 and "503" in row["error"] and row["pending"] == 5
        marquez.recover()
        await marquez.wait_for(5)

        marquez.stall()
        await publish(settings, *[decision(f"stalled/{i}") for i in range(5)])
        before = emitter.rt.sender.stats.failures
        await wait_for(lambda: emitter.rt.sender.stats.failures >= before + 2, what="stalled sends to time out")
        marquez.recover()
        await marquez.wait_for(10)
        await wait_evidence_settled(settings)
    finally:
        await emitter.stop()
    received = marquez.received()
    assert len(received) == 10 and set(exactly_once(received).values()) == {1}


@pytest.mark.parametrize("status", [401, 404])
async def test_an_answer_about_the_path_not_the_event_delays_and_loses_nothing(settings, pg_dsn, marquez, status: int) -> None:  # type: ignore[no-untyped-def]
    # A proxy whose credentials expired (401) or an ingress while Marquez is redeployed (404):
    # these once dead-lettered every event of the window for good, and a run's later events
    # then went out without its START.
    await ensure_topics(settings.kafka_bootstrap, prefix=settings.topic_prefix)
    emitter = await EmitterServer(emitter_settings(settings), http_client(marquez.url, timeout=1)).start()
    try:
        marquez.fail(status)
        await publish(settings, *[decision(f"path-{status}/{i}") for i in range(4)])
        await wait_for(lambda: emitter.rt.sender.stats.failures >= 3, what=f"{status}s to be retried")
        conn = await asyncpg.connect(pg_dsn)
        try:
            states = dict(await conn.fetch("SELECT state, count(*) FROM evidence_events GROUP BY state"))
            dead = await conn.fetchval("SELECT count(*) FROM evidence_dead_letters")
        finally:
            await conn.close()
        assert states == {"pending": 4} and dead == 0
        marquez.recover()
        await marquez.wait_for(4)
        await wait_evidence_settled(settings)
    finally:
        await emitter.stop()
    assert set(exactly_once(marquez.received()).values()) == {1}
