"""Callers that try to get in: every route refuses a missing, unknown, revoked or expired token,
the wrong role, another namespace or tenant, and a JWT with the wrong audience, issuer or
signature; and each refusal changes nothing in the ledger (Postgres rows, Redis keys)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from datetime import timedelta
from typing import Any

import asyncpg
import httpx
import pytest

from budgetgate.core.principals import Role
from budgetgate.access.tokens import revoke_token
from budgetgate.edge.auth import gate_of
from tests.support.admission import (  # noqa: F401 - pytest fixtures
    admission,
    admission_factory,
    apply_policies,
    budget_yaml,
    decision_of,
    example_policies,
    held_in_postgres,
    reserved_in_redis,
    submission,
)
from tests.support.metering import as_json, decide, metering, metering_factory, sample, usage_rows  # noqa: F401 - pytest fixtures
from tests.support.principals import bearer, issue, ledger_state
from tests.support.waiting import wait_for

OPEN = {"/healthz", "/readyz", "/metrics", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"}
POOLS = """apiVersion: budgetgate/v1
kind: ResourcePool
metadata: {id: warehouse}
spec: {namespace: "snowflake:wh-1", quota: 5}
"""


@pytest.fixture
async def anonymous(admission) -> AsyncIterator[httpx.AsyncClient]:  # type: ignore[no-untyped-def]
    async with httpx.AsyncClient(base_url=admission.url, timeout=30) as client:
        yield client


def _example_path(path: str) -> str:
    return (
        path.replace("{run_id}", "runs/x")
        .replace("{token}", "t-1")
        .replace("{scope_id}", "ns=vision-prod;team=vision")
        .replace("{tenant}", "vision")
        .replace("{namespace}", "snowflake:wh-1")
    )


def _routes(app: Any) -> list[tuple[str, str]]:
    """Every route the service publishes in its OpenAPI document, but the open ones."""
    paths = app.openapi()["paths"]
    return sorted((method.upper(), _example_path(path)) for path, operations in paths.items() if path not in OPEN for method in operations)


async def test_every_route_refuses_a_caller_without_a_valid_token_and_changes_nothing(admission, anonymous, settings, pg_dsn) -> None:
    routes = _routes(admission.app)
    assert ("POST", "/v1/admissions") in routes and ("DELETE", "/v1/pools/snowflake:wh-1/allocations/t-1") in routes and len(routes) >= 8
    before = await ledger_state(pg_dsn, settings.redis_url, settings.redis_prefix)
    bodies = {"/v1/admissions": submission(run_id="intruder"), "/v1/pools/snowflake:wh-1/allocations": {"token": "t-1"}}
    for headers in ({}, {"Authorization": "Bearer bg_not-a-token"}, {"Authorization": "Basic dXNlcjpwYXNz"}, {"Authorization": "Bearer not.a.jwt"}):
        for method, path in routes:
            response = await anonymous.request(method, path, json=bodies.get(path), headers=headers)
            assert response.status_code == 401, (method, path, headers, response.text)
            assert response.headers["content-type"] == "application/problem+json"
            assert response.headers["www-authenticate"].startswith("Bearer")
            assert response.json()["status"] == 401
    assert await ledger_state(pg_dsn, settings.redis_url, settings.redis_prefix) == before
    assert (await anonymous.get("/healthz")).status_code == 200 and (await anonymous.get("/readyz")).status_code == 200
    assert (await anonymous.get("/metrics")).status_code == 200  # open unless BUDGETGATE_METRICS_REQUIRE_AUTH


async def test_revoked_and_expired_tokens_are_refused_on_every_instance_within_seconds(admission_factory, pg_dsn, settings) -> None:
    await apply_policies(pg_dsn, example_policies(), sha="e" * 40)
    servers = [await admission_factory(token_cache_seconds=1.0) for _ in range(2)]
    for server in servers:
        await server.wait_ready()
    secret = await issue(pg_dsn, Role.READER, name="soon-revoked")
    for server in servers:  # cached as valid on both
        assert (await server.client.get("/v1/budgets", headers=bearer(secret))).status_code == 200
    conn = await asyncpg.connect(pg_dsn)
    try:
        assert await revoke_token(conn, name="soon-revoked", revoked_by="test")
        expired = await issue(pg_dsn, Role.SUBMITTER, name="expired", expires_in=timedelta(hours=1))
        await conn.execute("UPDATE api_tokens SET expires_at = now() - interval '1 second' WHERE name = 'expired'")
    finally:
        await conn.close()
    before = await ledger_state(pg_dsn, settings.redis_url, settings.redis_prefix)
    pending = set(range(len(servers)))

    async def refused_everywhere() -> bool:
        for i in sorted(pending):
            if (await servers[i].client.get("/v1/budgets", headers=bearer(secret))).status_code == 401:
                pending.discard(i)
        return not pending

    await wait_for(refused_everywhere, timeout=5, what="the revoked token refused on every instance")
    for server in servers:
        refused = await server.client.post("/v1/admissions", json=submission(run_id="expired"), headers=bearer(expired))
        assert refused.status_code == 401 and "revoked or expired" in refused.json()["detail"]
    assert await ledger_state(pg_dsn, settings.redis_url, settings.redis_prefix) == before
    log = await _admin_log(pg_dsn)
    assert ("tests", "token.create", "soon-revoked") in log and ("test", "token.revoke", "soon-revoked") in log


async def _admin_log(dsn: str) -> list[tuple[str, str, str]]:
    conn = await asyncpg.connect(dsn)
    try:
        return [(r["actor"], r["action"], r["subject"]) for r in await conn.fetch("SELECT actor, action, subject FROM admin_log")]
    finally:
        await conn.close()


async def test_wrong_role_is_refused_naming_the_role_needed(admission, anonymous, settings, pg_dsn) -> None:
    reader, exporter, auditor = [await issue(pg_dsn, role) for role in (Role.READER, Role.EXPORTER, Role.AUDITOR)]
    before = await ledger_state(pg_dsn, settings.redis_url, settings.redis_prefix)
    for secret in (reader, exporter, auditor):
        # Both ways in: the plain ASGI fast path and the documented FastAPI route (a bad body).
        for body in (submission(run_id="not-mine"), {**submission(run_id="not-mine"), "attempt": 0}):
            refused = await anonymous.post("/v1/admissions", json=body, headers=bearer(secret))
            assert refused.status_code == 403 and "needs role submitter" in refused.json()["detail"], refused.text
        allocation = await anonymous.post("/v1/pools/snowflake:wh-1/allocations", json={"token": "x"}, headers=bearer(secret))
        assert allocation.status_code == 403
    refused = await anonymous.get("/v1/budgets", headers=bearer(exporter))
    assert refused.status_code == 403 and "reader" in refused.json()["detail"]
    assert (await anonymous.get("/v1/budgets", headers=bearer(auditor))).status_code == 200
    assert await ledger_state(pg_dsn, settings.redis_url, settings.redis_prefix) == before


async def test_other_namespace_or_tenant_is_refused_and_reads_are_limited(admission, anonymous, settings, pg_dsn) -> None:
    vision_only = await issue(pg_dsn, Role.SUBMITTER, namespaces=["vision-*"])
    nlp_tenant = await issue(pg_dsn, Role.SUBMITTER, Role.READER, tenants=["nlp"])
    allowed = await anonymous.post("/v1/admissions", json=submission(run_id="vision/ok"), headers=bearer(vision_only))
    assert allowed.status_code == 200 and allowed.json()["decision"] == "ALLOW"
    before = await ledger_state(pg_dsn, settings.redis_url, settings.redis_prefix)
    outside = await anonymous.post(
        "/v1/admissions", json=submission(run_id="nlp/x", namespace="nlp-prod", labels={"team": "nlp", "cost-center": "2001"}), headers=bearer(vision_only)
    )
    assert outside.status_code == 403 and "namespace 'nlp-prod'" in outside.json()["detail"]
    other_tenant = await anonymous.post("/v1/admissions", json=submission(run_id="vision/x"), headers=bearer(nlp_tenant))
    assert other_tenant.status_code == 403 and "tenant 'vision'" in other_tenant.json()["detail"]
    vision_scope = next(e["scope_id"] for e in allowed.json()["evaluations"] if "team=vision" in e["scope_id"])
    for path in ("/v1/tenants/vision/usage", f"/v1/scopes/{vision_scope}/usage", "/v1/admissions/vision/ok"):
        refused = await anonymous.get(path, headers=bearer(nlp_tenant))
        assert refused.status_code == 403 and "vision" in refused.json()["detail"], (path, refused.text)
    assert (await anonymous.get("/v1/tenants/nlp/usage", headers=bearer(nlp_tenant))).status_code == 200
    seen = (await anonymous.get("/v1/budgets", headers=bearer(nlp_tenant))).json()["budgets"]
    assert seen and all("team=nlp" in b["scope_id"] for b in seen)
    assert decision_of(await anonymous.get("/v1/admissions/vision/ok", headers=bearer(vision_only))) == "ALLOW"
    assert await ledger_state(pg_dsn, settings.redis_url, settings.redis_prefix) == before


async def test_a_run_id_of_another_namespace_or_tenant_is_neither_replayed_nor_taken_over(admission, anonymous, settings, pg_dsn) -> None:
    # The scope check reads the submission's namespace and tenant, and a run's earlier decision
    # was found by its run id alone: a submitter limited to vision-* that named nlp's run id with
    # its own namespace got nlp's stored answer (a new attempt after an ALLOW replays it), or
    # decided nlp's refused run afresh as its own (its owner's retry then a 409).
    nlp = {"namespace": "nlp-prod", "labels": {"team": "nlp", "cost-center": "2001", "environment": "prod"}}
    admitted = await admission.submit(run_id="nlp/admitted", **nlp)
    huge = {"resources": {"gpus": 512, "nodes": 64, "flavor": "h100", "region": "us-east-1"}, "projected_runtime_hours": 10.0}
    refused = await admission.submit(run_id="nlp/refused", **nlp, **huge)
    assert (admitted.json()["decision"], refused.json()["decision"]) == ("ALLOW", "DENY"), (admitted.text, refused.text)
    vision_only = await issue(pg_dsn, Role.SUBMITTER, namespaces=["vision-*"])
    vision_tenant = await issue(pg_dsn, Role.SUBMITTER, tenants=["vision"])
    before = await ledger_state(pg_dsn, settings.redis_url, settings.redis_prefix)
    attempts = [
        (vision_only, submission(run_id="nlp/admitted", attempt=2), "namespace"),  # its own namespace
        (vision_only, submission(run_id="nlp/refused", attempt=2), "namespace"),
        (vision_tenant, submission(run_id="nlp/admitted", attempt=2, namespace="nlp-prod"), "labels.team"),  # its own tenant
        (vision_tenant, submission(run_id="nlp/refused", attempt=2, namespace="nlp-prod"), "labels.team"),
    ]
    for token, body, field in attempts:
        taken = await anonymous.post("/v1/admissions", json=body, headers=bearer(token))
        assert taken.status_code == 409 and field in taken.json()["fields"], taken.text
        assert "decided in another" in taken.json()["detail"] and "evaluations" not in taken.json()
    assert await ledger_state(pg_dsn, settings.redis_url, settings.redis_prefix) == before
    # The owner's own retry replays its run, and its new attempt of the refused one is decided.
    again = await admission.submit(run_id="nlp/admitted", attempt=2, **nlp)
    assert again.json()["decision"] == "ALLOW" and again.json()["replayed"] is True
    retried = await admission.submit(run_id="nlp/refused", attempt=2, **nlp)
    assert retried.json()["decision"] == "ALLOW" and retried.json()["replayed"] is False


async def test_one_tenant_cannot_release_or_renew_another_tenants_pool_token(admission_factory, pg_dsn, settings) -> None:
    await apply_policies(pg_dsn, {**example_policies(), "pools.yaml": POOLS}, sha="p" * 40)
    server = await admission_factory()
    await server.wait_ready()
    vision, nlp, operator = await issue(pg_dsn, Role.SUBMITTER), await issue(pg_dsn, Role.SUBMITTER), await issue(pg_dsn, Role.OPERATOR)
    url = "/v1/pools/snowflake:wh-1/allocations"
    granted = await server.client.post(url, json={"token": "vision-job"}, headers=bearer(vision))
    assert granted.json()["status"] == "Granted"
    before = await ledger_state(pg_dsn, settings.redis_url, settings.redis_prefix)
    stolen = await server.client.delete(f"{url}/vision-job", headers=bearer(nlp))
    assert stolen.status_code == 403 and "does not hold token 'vision-job'" in stolen.json()["detail"]
    renewed = await server.client.post(url, json={"token": "vision-job"}, headers=bearer(nlp))
    assert renewed.status_code == 403
    assert await ledger_state(pg_dsn, settings.redis_url, settings.redis_prefix) == before
    assert (await server.client.get("/v1/pools/snowflake:wh-1", headers=bearer(vision))).json()["used"] == 1
    assert (await server.client.post(url, json={"token": "vision-job"}, headers=bearer(vision))).json()["renewed"] is True
    assert (await server.client.delete(f"{url}/vision-job", headers=bearer(operator))).json()["released"] is True
    assert (await server.client.post(url, json={"token": "nlp-job"}, headers=bearer(nlp))).json()["status"] == "Granted"
    assert (await server.client.delete(f"{url}/nlp-job", headers=bearer(nlp))).json()["released"] is True


async def test_usage_posted_without_the_exporter_role_is_refused(metering, pg_dsn, settings) -> None:
    await decide(pg_dsn, "run-a")
    body = {"samples": [as_json(sample("run-a", "s1", 36.0))]}
    async with httpx.AsyncClient(base_url=metering.url, timeout=30) as client:
        for headers in ({}, bearer(await issue(pg_dsn, Role.SUBMITTER, Role.READER, Role.OPERATOR, Role.AUDITOR))):
            refused = await client.post("/v1/metering/samples", json=body, headers=headers)
            assert refused.status_code in (401, 403) and refused.headers["content-type"] == "application/problem+json", refused.text
            assert (refused.status_code == 401) == (not headers)
        assert await usage_rows(pg_dsn) == []
        accepted = await client.post("/v1/metering/samples", json=body, headers=bearer(await issue(pg_dsn, Role.EXPORTER)))
        assert accepted.status_code == 200, accepted.text
    assert len(await usage_rows(pg_dsn)) == 1


async def test_a_chunked_body_past_the_limit_is_refused_without_being_read_whole(metering_factory, pg_dsn) -> None:
    server = await metering_factory(max_body_bytes=64 * 1024)
    sent = 0

    async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: a streamed body
        nonlocal sent
        yield b'{"samples": ['
        for _ in range(4096):  # 4096 × 1 KiB = 4 MiB offered
            sent += 1024
            yield b" " * 1024

    response = await server.client.post("/v1/metering/samples", content=chunks(), headers={"content-type": "application/json"})
    assert response.status_code == 413 and response.headers["content-type"] == "application/problem+json"
    assert await usage_rows(pg_dsn) == []


@pytest.mark.parametrize("scope", ["cluster", "instance"])
async def test_rate_limit_per_principal_answers_429_with_retry_after(admission_factory, pg_dsn, scope: str) -> None:
    await apply_policies(pg_dsn, example_policies(), sha="e" * 40)
    server = await admission_factory(rate_limit="3/minute", rate_limit_scope=scope)
    await server.wait_ready()
    busy, other = await issue(pg_dsn, Role.READER), await issue(pg_dsn, Role.READER)
    answers = [(await server.client.get("/v1/budgets", headers=bearer(busy))).status_code for _ in range(4)]
    assert answers == [200, 200, 200, 429]
    limited = await server.client.get("/v1/budgets", headers=bearer(busy))
    assert limited.status_code == 429 and 1 <= int(limited.headers["retry-after"]) <= 60
    assert (await server.client.get("/v1/budgets", headers=bearer(other))).status_code == 200  # per principal
    # A submission is counted once, also when the fast path hands a bad body to FastAPI's route.
    submitter = await issue(pg_dsn, Role.SUBMITTER)
    statuses = [(await server.client.post("/v1/admissions", json=body, headers=bearer(submitter))).status_code
                for body in ({**submission(run_id="r0"), "attempt": 0}, submission(run_id="r1"), submission(run_id="r2"), submission(run_id="r3"))]  # fmt: skip
    assert statuses == [422, 200, 200, 429]


async def test_a_submission_far_below_its_limit_is_refused_in_its_batch_past_it_having_reserved_nothing(admission_factory, pg_dsn) -> None:
    # While its caller is far below its limit, a submission's count on it is awaited by its batch
    # (after planning and the batch's read of Postgres), not before; one that passes the limit
    # that way (other instances counted the caller meanwhile) is refused there, 429, with
    # nothing reserved or recorded.
    await apply_policies(pg_dsn, {"b.yaml": budget_yaml("vision", limit="gpu_hours: 100000")}, sha="d" * 40)
    server = await admission_factory(rate_limit="20/minute")
    await server.wait_ready()
    name = f"busy-{uuid.uuid4().hex[:8]}"  # (its count is kept in Redis for a minute)
    secret = await issue(pg_dsn, Role.SUBMITTER, name=name)
    name = f"token:{name}"  # the principal's
    gate, batches = gate_of(server.app), server.rt.admitter.batches
    hits = gate.hits
    assert hits is not None and gate.limiter is not None and not hits.far_below(name)  # not counted yet: awaited first
    assert decision_of(await server.client.post("/v1/admissions", json=submission(run_id="r/first"), headers=bearer(secret))) == "ALLOW"
    assert hits.far_below(name)  # 1 of 20
    await gate.limiter.storage.incr(hits.item.key_for(name), hits.item.get_expiry(), amount=19)  # the caller's hits elsewhere
    before = batches.items
    over = await server.client.post("/v1/admissions", json=submission(run_id="r/over"), headers=bearer(secret))
    assert over.status_code == 429 and 1 <= int(over.headers["retry-after"]) <= 60
    assert batches.items == before + 1  # counted in its batch
    async with asyncpg.create_pool(pg_dsn, min_size=1, max_size=1) as pool:
        assert [row["run_id"] for row in await pool.fetch("SELECT run_id FROM decisions")] == ["r/first"]
        assert await pool.fetchval("SELECT count(*) FROM reservations WHERE state = 'held'") == 1
    assert await held_in_postgres(pg_dsn) == {k: v for k, v in (await reserved_in_redis(server)).items() if v}
    # Past its limit now: the next one is refused before it is planned, in no batch.
    assert not hits.far_below(name)
    assert (await server.client.post("/v1/admissions", json=submission(run_id="r/late"), headers=bearer(secret))).status_code == 429
    assert batches.items == before + 1


@pytest.mark.parametrize("scope", ["cluster", "instance"])
async def test_concurrent_hits_are_counted_together_and_exactly(redis_url: str, redis_prefix: str, scope: str) -> None:
    from limits import parse
    from limits.aio.storage import MemoryStorage, RedisStorage
    from limits.aio.strategies import FixedWindowRateLimiter

    from budgetgate.edge.auth import CoalescedHits, close_storage

    url = redis_url.replace("redis://", "async+redis://", 1)
    storage = MemoryStorage() if scope == "instance" else RedisStorage(url, implementation="redispy", key_prefix=f"{{{redis_prefix}}}:ratelimit")
    limiter = FixedWindowRateLimiter(storage)
    item = parse("1000/minute")
    hits = CoalescedHits(limiter, item)
    places = await asyncio.gather(*(hits.hit("p") for _ in range(300)), *(hits.hit("q") for _ in range(7)))
    # Each hit reached its own count, as if counted alone; far fewer round trips than hits.
    assert sorted(places[:300]) == list(range(1, 301)) and sorted(places[300:]) == list(range(1, 8))
    assert await storage.get(item.key_for("p")) == 300 and await storage.get(item.key_for("q")) == 7
    assert (await limiter.get_window_stats(item, "p")).remaining == 700
    # A hit whose caller went away before it was counted is not counted; the others are, with no gap.
    waiting = [asyncio.ensure_future(hits.hit("p")) for _ in range(5)]
    waiting[0].cancel()
    done = await asyncio.gather(*waiting, return_exceptions=True)
    assert isinstance(done[0], asyncio.CancelledError) and sorted(done[1:]) == list(range(301, 305))
    assert await storage.get(item.key_for("p")) == 304
    if scope == "cluster":
        await storage.reset()
        await close_storage(storage)


async def test_a_submission_whose_count_was_cancelled_is_answered_unavailable_not_its_whole_batch(admission_factory, pg_dsn) -> None:
    from datetime import UTC, datetime

    from budgetgate.contracts.admission import AdmissionRequest
    from budgetgate.services.admission.admitter import Unavailable

    await apply_policies(pg_dsn, {"b.yaml": budget_yaml("vision", limit="gpu_hours: 100000")}, sha="d" * 40)
    server = await admission_factory()
    await server.wait_ready()
    admitter = server.rt.admitter
    stopped, counted = asyncio.get_running_loop().create_future(), asyncio.get_running_loop().create_future()
    stopped.cancel()
    counted.set_result(None)
    pending = [admitter._prepare(AdmissionRequest.model_validate(submission(run_id=f"r/{i}")), datetime.now(UTC)) for i in range(2)]
    pending[0].counted, pending[1].counted = stopped, counted
    await admitter._commit(pending)
    answers = await asyncio.gather(*(p.answer for p in pending), return_exceptions=True)
    assert isinstance(answers[0], Unavailable) and answers[1]["decision"] == "ALLOW"


async def test_a_principal_is_far_below_its_limit_up_to_half_of_it() -> None:
    from limits import parse
    from limits.aio.storage import MemoryStorage
    from limits.aio.strategies import FixedWindowRateLimiter

    from budgetgate.edge.auth import CoalescedHits

    hits = CoalescedHits(FixedWindowRateLimiter(MemoryStorage()), parse("4/minute"))
    assert not hits.far_below("p")  # never counted
    assert [await hits.hit("p"), hits.far_below("p"), await hits.hit("p"), hits.far_below("p")] == [1, True, 2, True]
    assert [await hits.hit("p"), hits.far_below("p"), hits.far_below("q")] == [3, False, False]


async def test_metrics_can_be_protected(admission_factory, pg_dsn) -> None:
    server = await admission_factory(metrics_require_auth=True)
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
        assert (await client.get("/metrics")).status_code == 401
        assert (await client.get("/metrics", headers=bearer(await issue(pg_dsn, Role.SUBMITTER)))).status_code == 403
        assert (await client.get("/metrics", headers=bearer(await issue(pg_dsn, Role.READER)))).status_code == 200
        assert (await client.get("/healthz")).status_code == 200
