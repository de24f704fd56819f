"""An external accounting system's remaining budget for a tenant's soft GPU-hour budget, against a
real stand-in server: used when it answers in time, the ledger's figure when it is slow, down
or wrong (and the decision says which), a circuit breaker that stops asking, and a cache; the
decision message and its evidence in Marquez name the figure the decision was made on."""

from __future__ import annotations

import asyncio
import time

import pytest

from budgetgate.core.units import MILLI_PER_HOUR
from budgetgate.evidence import events
from budgetgate.messaging.topic_admin import ensure_topics
from budgetgate.v1 import decisions_pb2
from tests.support.accounting import AccountingStandIn
from tests.support.admission import apply_policies, budget_yaml, published_decisions
from tests.support.marquez import EmitterServer, emitter_settings, http_client, require_spec, wait_evidence_settled
from tests.support.marquez import marquez  # noqa: F401 - pytest fixture
from tests.support.quotas import physics

POLICIES = {
    "b.yaml": budget_yaml("physics-gpus", namespace="physics", labels="{team: physics}", limit="gpu_hours: 100000"),
    "s.yaml": budget_yaml(
        "gpu-soft/physics", namespace="physics", labels="{team: physics}", limit="gpu_hours: 1000", enforcement="soft", window="{calendar: week}"
    ),
}


@pytest.fixture
async def stand_in():  # type: ignore[no-untyped-def]
    server = AccountingStandIn()
    await server.start()
    yield server
    await server.stop()


async def started(admission_factory, pg_dsn, stand_in, **settings: object):  # type: ignore[no-untyped-def]
    await apply_policies(pg_dsn, POLICIES, sha="c" * 40)
    values = {"accounting_url": stand_in.url, "accounting_timeout_seconds": 0.3, "accounting_cache_seconds": 0, "accounting_failure_threshold": 3, **settings}
    server = await admission_factory(**values)
    await server.wait_ready()
    return server


async def submit(server, run_id: str) -> dict:  # type: ignore[no-untyped-def]
    answer = await server.client.post("/v1/admissions", json=physics(run_id))
    assert answer.status_code == 200, answer.text
    return answer.json()


def soft(answer: dict) -> dict:
    return next(e for e in answer["evaluations"] if e["policy_id"] == "gpu-soft/physics")


async def test_the_accounting_figure_is_used_when_it_answers_in_time(admission_factory, pg_dsn, stand_in) -> None:
    server = await started(admission_factory, pg_dsn, stand_in)
    answer = await submit(server, "in-time")
    assert answer["decision"] == "ALLOW"
    assert answer["accounting"] == {
        "policy_id": "gpu-soft/physics",
        "source": "external",
        "remaining_gpu_hours": 100.0,
        "detail": "remaining_budget from the accounting system",
    }
    # 1000 GPU-hours, 100 left by the accounting system's books: this hour takes it to 90.1 % used.
    assert soft(answer)["remaining"] == 100.0 and answer["priority_penalty"] == pytest.approx(0.4545)
    assert stand_in.asked == ["physics"]
    explained = (await server.client.get("/v1/admissions/in-time/explain")).json()
    assert explained["identical"] is True, explained["differences"]
    # Django REST framework writes decimals as strings; a quote asks too.
    stand_in.remaining = "-20.50"
    quoted = (await server.client.post("/v1/quotes", json=physics("quoted"))).json()
    assert quoted["accounting"]["source"] == "external" and quoted["accounting"]["remaining_gpu_hours"] == -20.5
    assert quoted["priority_penalty"] > 0.9


@pytest.mark.parametrize(
    ("mode", "detail"),
    [
        ("slow", "did not answer within 0.3 s"),
        ("not-json", "unusable data: not JSON"),
        ("missing", "unusable data: no 'remaining_budget' in the answer"),
        ("nan", "unusable data: remaining_budget is nan"),
        ("boolean", "unusable data: remaining_budget is bool, not a number"),
        ("error", "unusable data: status 500"),
        ("unknown", "has no remaining budget for tenant 'physics'"),
    ],
)
async def test_a_slow_or_wrong_source_leaves_the_ledger_in_charge(admission_factory, pg_dsn, stand_in, mode, detail) -> None:
    server = await started(admission_factory, pg_dsn, stand_in)
    stand_in.mode = mode
    began = time.monotonic()
    answer = await submit(server, f"run-{mode}")
    elapsed = time.monotonic() - began
    assert answer["decision"] == "ALLOW"
    assert answer["accounting"]["source"] == "ledger" and answer["accounting"]["remaining_gpu_hours"] is None
    assert detail in answer["accounting"]["detail"], answer["accounting"]
    assert soft(answer)["remaining"] == 1000.0 and answer["priority_penalty"] == 0.0
    # Bounded by the deadline, not by the stand-in's 5 s (a generous margin for a busy machine).
    assert elapsed < 3.0
    stored = (await server.client.get(f"/v1/admissions/run-{mode}")).json()
    assert stored["accounting"] == answer["accounting"]


async def test_a_source_that_is_down_never_blocks_admission(admission_factory, pg_dsn, stand_in) -> None:
    server = await started(admission_factory, pg_dsn, stand_in)
    await stand_in.stop()
    answer = await submit(server, "down")
    assert answer["decision"] == "ALLOW" and answer["accounting"]["source"] == "ledger"
    assert "unreachable" in answer["accounting"]["detail"]


async def test_the_breaker_opens_after_repeated_failures_and_closes_when_the_source_recovers(admission_factory, pg_dsn, stand_in) -> None:
    # 5 s, not 0.3 s: this tests what the breaker counts, not time. Under a full run's load the
    # stand-in once saw 2 asks where the breaker had counted 3 failures: at 0.3 s an ask can time
    # out (a failure) before it reaches the stand-in.
    server = await started(admission_factory, pg_dsn, stand_in, accounting_reset_seconds=1.0, accounting_timeout_seconds=5.0)
    stand_in.mode = "error"
    answers = [await submit(server, f"fail-{i}") for i in range(5)]
    assert len(stand_in.asked) == 3  # the threshold; then the breaker stops asking
    assert all("circuit breaker is open" in a["accounting"]["detail"] for a in answers[3:])
    assert all(a["decision"] == "ALLOW" and a["accounting"]["source"] == "ledger" for a in answers)
    stand_in.mode = "ok"
    await asyncio.sleep(1.1)  # the breaker's reset time: the next ask is a trial
    recovered = await submit(server, "recovered")
    assert recovered["accounting"]["source"] == "external" and len(stand_in.asked) == 4


async def test_answers_are_cached_per_tenant_and_an_unknown_tenant_is_no_failure(admission_factory, pg_dsn, stand_in) -> None:
    server = await started(admission_factory, pg_dsn, stand_in, accounting_cache_seconds=60)
    first, second = await submit(server, "c1"), await submit(server, "c2")
    assert first["accounting"] == second["accounting"] and stand_in.asked == ["physics"]
    uncached = await started(admission_factory, pg_dsn, stand_in)
    stand_in.mode = "unknown"
    for i in range(5):
        assert "no remaining budget" in (await submit(uncached, f"u{i}"))["accounting"]["detail"]
    assert len(stand_in.asked) == 6  # never counted as failures: the breaker stayed closed


async def test_the_decision_message_and_its_evidence_name_the_accounting_figure(admission_factory, pg_dsn, stand_in, settings, marquez) -> None:
    require_spec()
    await ensure_topics(settings.kafka_bootstrap, prefix=settings.topic_prefix)
    # No test of time here: the stand-in's answer must count even on a busy machine (with 0.3 s,
    # the first ask timed out once in a full run and the figure fell back to the ledger's).
    server = await started(admission_factory, pg_dsn, stand_in, accounting_timeout_seconds=10)
    without = await admission_factory()  # the same ledger and topics, no accounting source
    await without.wait_ready()
    emitter = await EmitterServer(emitter_settings(settings), http_client(marquez.url)).start()
    try:
        external = await submit(server, "external")
        stand_in.mode = "error"
        fallback = await submit(server, "fallback")
        plain = await submit(without, "plain")
        assert (external["accounting"]["source"], fallback["accounting"]["source"], plain["accounting"]) == ("external", "ledger", None)

        published = await published_decisions(settings, {"external", "fallback", "plain"})
        assert published["external"].accounting == decisions_pb2.Decision.Accounting(
            policy_id="gpu-soft/physics", source="external", remaining_amount=100 * MILLI_PER_HOUR, detail="remaining_budget from the accounting system"
        )
        assert published["fallback"].accounting.source == "ledger" and not published["fallback"].accounting.HasField("remaining_amount")
        assert "unusable data: status 500" in published["fallback"].accounting.detail
        assert not published["plain"].HasField("accounting")

        await marquez.wait_for(3)
        await wait_evidence_settled(settings)
        assert marquez.invalid == []
        facets = {e["run"]["runId"]: e["run"]["facets"]["budget"] for e in marquez.received()}
        made = facets[str(events.run_uuid("external"))]
        assert made["accounting"] == {
            "policy_id": "gpu-soft/physics",
            "source": "external",
            "remaining_gpu_hours": 100.0,
            "remaining_amount": 100 * MILLI_PER_HOUR,
            "detail": "remaining_budget from the accounting system",
        }
        # The soft budget's room was the accounting system's 100 GPU-hours, not the ledger's 1000.
        evaluation = soft(made)
        assert evaluation["remaining"] == 100.0 == soft(external)["remaining"] and evaluation["reading"]["remaining"] == 1000.0
        ledger = facets[str(events.run_uuid("fallback"))]["accounting"]
        assert ledger == {"policy_id": "gpu-soft/physics", "source": "ledger", "detail": fallback["accounting"]["detail"]}
        assert "accounting" not in facets[str(events.run_uuid("plain"))]
    finally:
        await emitter.stop()
