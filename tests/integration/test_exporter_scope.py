"""An exporter token limited to namespaces or tenants reports only runs within them, on both of
metering-ingest's routes: a sample or lifecycle event of another run is a 403 naming it, and
nothing of the request is recorded. A sample of a run with no decision yet is kept pending with
its sender's limits and counts only if the run turns out to be within them."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import httpx

from budgetgate.contracts import topics, wire
from budgetgate.core.principals import Principal, Role
from budgetgate.services.metering_ingest.ingest import Origin, Pending
from budgetgate.v1.metering_pb2 import MeteringSample
from tests.support.admission import apply_policies, budget_yaml, decision_of
from tests.support.metering import as_json, decide, fetchval, metric, sample, usage_rows
from tests.support.metering import metering, metering_factory  # noqa: F401 - pytest fixtures
from tests.support.principals import bearer, issue, ledger_state
from tests.support.waiting import wait_for

# The review's repro: a 50 GPU-hour hard budget of team-ns, and a run of 48 projected GPU-hours.
BUDGET = {"team.yaml": budget_yaml("gpu-budget/team", namespace="team-ns", labels="{team: team}", limit="gpu_hours: 50")}
TEAM_RUN = {"run_id": "v1", "namespace": "team-ns", "labels": {"team": "team"}, "job": {"namespace": "team-ns", "name": "train"}}
# What an HTTP sample is kept pending with (services/metering_ingest/routes/samples.py).
HEADERS = ((wire.CONTENT_TYPE, wire.PROTOBUF.encode()), (wire.MESSAGE_TYPE, MeteringSample.DESCRIPTOR.full_name.encode()))
AT = datetime.now(UTC).replace(microsecond=0) - timedelta(minutes=30)


def event(run_id: str, kind: str, minute: int = 0) -> dict[str, Any]:
    return {"runId": run_id, "type": kind, "eventTime": (AT + timedelta(minutes=minute)).isoformat(), "gpus": 8, "nodes": 1}


async def post(server, path: str, field: str, items: list[dict[str, Any]], secret: str) -> httpx.Response:  # type: ignore[no-untyped-def]
    return await server.client.post(path, json={field: items}, headers=bearer(secret))


def refused_items(answer: httpx.Response) -> list[tuple[tuple[Any, ...], str]]:
    """The items a 403 names (their place in the body and the kind), after checking its form."""
    assert answer.status_code == 403, answer.text
    assert answer.headers["content-type"] == "application/problem+json"
    assert "nothing of this request was recorded" in answer.json()["detail"]
    return [(tuple(e["loc"]), e["type"]) for e in answer.json()["errors"]]


async def pending_rows(dsn: str) -> list[tuple[Any, ...]]:
    conn = await asyncpg.connect(dsn)
    try:
        rows = await conn.fetch("SELECT run_id, sample_id, sender, sender_namespaces, sender_tenants FROM metering_pending ORDER BY run_id, sender")
    finally:
        await conn.close()
    return [tuple(r) for r in rows]


async def test_an_exporter_of_another_namespace_neither_charges_nor_ends_a_run(admission_factory, metering, settings, pg_dsn) -> None:
    await apply_policies(pg_dsn, BUDGET, sha="a" * 40)
    admission = await admission_factory()
    await admission.wait_ready()
    assert decision_of(await admission.submit(**TEAM_RUN)) == "ALLOW"
    before = await ledger_state(pg_dsn, settings.redis_url, settings.redis_prefix)

    elsewhere = await issue(pg_dsn, Role.EXPORTER, namespaces=["other-ns"], name="exp-b")
    started = await post(metering, "/v1/lifecycle/events", "events", [event("v1", "STARTED")], elsewhere)
    assert refused_items(started) == [(("body", "events", 0, "runId"), "out_of_scope")]
    assert "'token:exp-b'" in started.json()["detail"] and "namespaces other-ns" in started.json()["detail"]
    assert "'v1'" in started.json()["errors"][0]["msg"]
    # 200 GPU-hours against the 50 of the budget: once accepted, and the team's next submission denied.
    charged = await post(metering, "/v1/metering/samples", "samples", [as_json(sample("v1", "s1", 360_000.0, minute=50))], elsewhere)
    assert refused_items(charged) == [(("body", "samples", 0, "runId"), "out_of_scope")]
    ended = await post(metering, "/v1/lifecycle/events", "events", [event("v1", "COMPLETED", 20)], elsewhere)
    assert refused_items(ended) == [(("body", "events", 0, "runId"), "out_of_scope")]
    assert await ledger_state(pg_dsn, settings.redis_url, settings.redis_prefix) == before
    assert await pending_rows(pg_dsn) == []

    own = await issue(pg_dsn, Role.EXPORTER, namespaces=["team-*"])
    # Observed now, within what the run's 8 GPUs can have used since its decision (and the 300 s of clock slack).
    accepted = await post(metering, "/v1/metering/samples", "samples", [as_json(sample("v1", "s1", 1800.0, at=datetime.now(UTC)))], own)
    assert accepted.status_code == 200 and accepted.json()["results"][0]["status"] == "accepted", accepted.text
    published = await post(metering, "/v1/lifecycle/events", "events", [event("v1", "STARTED")], own)
    assert published.status_code == 202, published.text
    assert await fetchval(pg_dsn, "SELECT count(*) FROM outbox WHERE topic = $1 AND key = 'v1'", topics.LIFECYCLE) == 1


async def test_an_exporter_of_another_tenant_is_refused_and_a_mixed_batch_records_nothing(metering, pg_dsn) -> None:
    await decide(pg_dsn, "t1", namespace="shared-ml", labels={"team": "team"})
    await decide(pg_dsn, "t0", namespace="shared-ml")  # of no tenant
    other = await issue(pg_dsn, Role.EXPORTER, tenants=["other"])
    assert refused_items(await post(metering, "/v1/metering/samples", "samples", [as_json(sample("t1", "s1", 360_000.0))], other)) == [
        (("body", "samples", 0, "runId"), "out_of_scope")
    ]
    ended = await post(metering, "/v1/lifecycle/events", "events", [event("t1", "STARTED"), event("t1", "COMPLETED", 20)], other)
    assert refused_items(ended) == [(("body", "events", 0, "runId"), "out_of_scope"), (("body", "events", 1, "runId"), "out_of_scope")]
    assert "tenants other" in ended.json()["detail"]

    # One run within the token's tenant, one of no tenant: the whole request is refused.
    team = await issue(pg_dsn, Role.EXPORTER, tenants=["team"])
    mixed = await post(metering, "/v1/metering/samples", "samples", [as_json(sample("t1", "s1", 36.0)), as_json(sample("t0", "s1", 36.0))], team)
    assert refused_items(mixed) == [(("body", "samples", 1, "runId"), "out_of_scope")]
    mixed = await post(metering, "/v1/lifecycle/events", "events", [event("t1", "STARTED"), event("t0", "STARTED")], team)
    assert refused_items(mixed) == [(("body", "events", 1, "runId"), "out_of_scope")]
    assert await usage_rows(pg_dsn) == [] and await fetchval(pg_dsn, "SELECT count(*) FROM outbox") == 0

    accepted = await post(metering, "/v1/metering/samples", "samples", [as_json(sample("t1", "s1", 36.0))], team)
    assert accepted.status_code == 200, accepted.text
    ended = await post(metering, "/v1/lifecycle/events", "events", [event("t1", "STARTED"), event("t1", "COMPLETED", 20)], team)
    assert ended.status_code == 202, ended.text
    assert [r["sample_id"] for r in await usage_rows(pg_dsn)] == ["s1"]
    assert await fetchval(pg_dsn, "SELECT count(*) FROM outbox WHERE topic = $1", topics.LIFECYCLE) == 2


async def test_a_limited_exporters_sample_of_an_undecided_run_counts_only_within_its_limits(metering, pg_dsn) -> None:
    now = datetime.now(UTC).replace(microsecond=0)
    team = await issue(pg_dsn, Role.EXPORTER, namespaces=["team-*"], name="exp-team")
    kept = await post(
        metering, "/v1/metering/samples", "samples",
        [as_json(sample("later-in", "p1", 36.0, at=now - timedelta(seconds=60))), as_json(sample("later-out", "p1", 7200.0, at=now - timedelta(seconds=60)))],
        team,
    )  # fmt: skip
    assert kept.status_code == 202 and [r["status"] for r in kept.json()["results"]] == ["pending", "pending"], kept.text
    # The owner's own exporter reports the same sample id with other values: its sample is kept
    # beside the one of exp-team, not refused as a conflict with it.
    theirs = await metering.post(as_json(sample("later-out", "p1", 72.0, at=now - timedelta(seconds=30))))
    assert theirs.status_code == 202 and theirs.json()["results"][0]["status"] == "pending", theirs.text
    # A lifecycle event cannot wait: a limited token reports only runs with a decision.
    early = await post(metering, "/v1/lifecycle/events", "events", [event("later-in", "STARTED")], team)
    assert refused_items(early) == [(("body", "events", 0, "runId"), "undecided_run")]
    assert await pending_rows(pg_dsn) == [
        ("later-in", "p1", "token:exp-team", ["team-*"], []),
        ("later-out", "p1", "", [], []),
        ("later-out", "p1", "token:exp-team", ["team-*"], []),
    ]

    await decide(pg_dsn, "later-in", namespace="team-a", labels={"team": "team"})
    await decide(pg_dsn, "later-out", namespace="other-ns", labels={"team": "other"})

    await wait_for(lambda: nothing_pending(pg_dsn), what="the pending samples judged")
    assert [(r["run_id"], r["sample_id"], r["gpu_milli_hours"]) for r in await usage_rows(pg_dsn)] == [("later-in", "p1", 36_000), ("later-out", "p1", 72_000)]
    # exp-team's sample of the other run was never charged: dead-lettered with the reason.
    [dead] = await dead_letters(pg_dsn)
    assert wire.decode(MeteringSample, dead.value, dead.headers).gpu_seconds == 7200.0
    reason = (wire.header(dead.headers, wire.DLQ_REASON) or b"").decode()
    assert reason.startswith("out_of_scope: ") and "'token:exp-team'" in reason and "'later-out'" in reason and "other-ns" in reason, reason
    text = (await metering.client.get("/metrics")).text
    assert metric(text, "budgetgate_metering_rejections_total", reason="out_of_scope", source="http") == 1


async def test_a_limited_exporters_sample_whose_run_is_decided_after_the_check_waits_for_the_recheck(metering, pg_dsn) -> None:
    """The request found no decision, and the decision commits before the sample's transaction:
    the sample is still kept pending with its sender's limits, and the re-check judges it."""
    await decide(pg_dsn, "raced-in", namespace="team-a")
    await decide(pg_dsn, "raced-out", namespace="other-ns")
    sender = Principal.of("token:exp-team", ["exporter"], namespaces=["team-*"])
    ingestor = metering.rt.ingestor
    for run_id in ("raced-in", "raced-out"):
        message = sample(run_id, "r1", 3600.0, at=datetime.now(UTC) - timedelta(seconds=60))
        origin = Origin(source="http", topic=topics.METERING, payload=message.SerializeToString(), headers=HEADERS, sender=sender)
        async with metering.rt.pool.acquire() as conn, conn.transaction():
            assert isinstance(await ingestor.place(conn, ingestor.validate(message), origin), Pending)
    await wait_for(lambda: nothing_pending(pg_dsn), what="the pending samples judged")
    assert [(r["run_id"], r["gpu_milli_hours"]) for r in await usage_rows(pg_dsn)] == [("raced-in", 3_600_000)]
    [dead] = await dead_letters(pg_dsn)
    assert (wire.header(dead.headers, wire.DLQ_REASON) or b"").decode().startswith("out_of_scope: sample 'r1' was posted by 'token:exp-team'")


async def nothing_pending(dsn: str) -> bool:
    return await fetchval(dsn, "SELECT count(*) FROM metering_pending") == 0


async def dead_letters(dsn: str) -> list[wire.Record]:
    """The metering dead letters in the outbox (committed with the judgement that made them)."""
    conn = await asyncpg.connect(dsn)
    try:
        rows = await conn.fetch("SELECT payload, headers FROM outbox WHERE topic = $1 ORDER BY id", topics.dlq(topics.METERING))
    finally:
        await conn.close()
    return [wire.Record(value=bytes(r["payload"]), key=None, headers=[(k, v.encode("latin-1")) for k, v in json.loads(r["headers"])]) for r in rows]
