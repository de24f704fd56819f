"""Reads by callers limited to namespaces or tenants show only what is within their limits:
a tenant's usage, a pool's holders, the budget gauges of /metrics; and path values no submission
could carry (a NUL, a space) are a 422, never a 500 from Postgres."""

from __future__ import annotations


from budgetgate.core.principals import Role
from tests.support.admission import apply_policies, budget_yaml, decision_of, example_policies, submission
from tests.support.principals import bearer, issue

# Budgets of tenant vision outside vision-*: one over every namespace, one over a shared namespace.
VISION_ELSEWHERE = {
    "anywhere.yaml": budget_yaml("gpu-budget/vision-anywhere", labels="{team: vision}", limit="gpu_hours: 900").replace("namespace: vision-prod, ", ""),
    "shared.yaml": budget_yaml("gpu-budget/vision-shared", namespace="shared-ml", labels="{team: vision}", limit="gpu_hours: 300"),
}
POOLS = """apiVersion: budgetgate/v1
kind: ResourcePool
metadata: {id: warehouse}
spec: {namespace: "snowflake:wh-1", quota: 10}
"""
NLP = {"namespace": "nlp-prod", "labels": {"team": "nlp", "cost-center": "2001", "environment": "prod"}}


async def _server(admission_factory, pg_dsn, **settings: object):  # type: ignore[no-untyped-def]
    await apply_policies(pg_dsn, {**example_policies(), **VISION_ELSEWHERE, "pools.yaml": POOLS}, sha="s" * 40)
    server = await admission_factory(**settings)
    await server.wait_ready()
    return server


async def test_a_tenant_usage_read_never_shows_budgets_or_runs_outside_the_readers_namespaces(admission_factory, pg_dsn) -> None:
    server = await _server(admission_factory, pg_dsn)
    assert decision_of(await server.submit(run_id="vision/shared", namespace="shared-ml")) == "ALLOW"
    limited = await issue(pg_dsn, Role.READER, namespaces=["vision-*"], tenants=["vision"])
    refused = await server.client.get("/v1/tenants/vision/usage", headers=bearer(limited))
    # Its run totals count vision's run in shared-ml, and its budgets those over shared-ml and everywhere.
    assert refused.status_code == 403 and "spans namespaces" in refused.json()["detail"], refused.text
    tenant_only = await issue(pg_dsn, Role.READER, tenants=["vision"])
    seen = await server.client.get("/v1/tenants/vision/usage", headers=bearer(tenant_only))
    assert seen.status_code == 200 and seen.json()["runs"]["runs"] == 1
    assert {"gpu-budget/vision-anywhere", "gpu-budget/vision-shared"} <= {b["policy_id"] for b in seen.json()["budgets"]}


async def test_a_pool_shows_a_limited_caller_only_its_own_holders(admission_factory, pg_dsn) -> None:
    server = await _server(admission_factory, pg_dsn)
    token = {"namespace": "snowflake:wh-1", "project": "secret-project"}
    for body in (submission(run_id="vision/pooled", pool_token=token), submission(run_id="nlp/pooled", pool_token=token, **NLP)):
        assert decision_of(await server.client.post("/v1/admissions", json=body)) == "ALLOW"
    url = "/v1/pools/snowflake:wh-1"
    vision_submitter = await issue(pg_dsn, Role.SUBMITTER, tenants=["vision"])
    other = await issue(pg_dsn, Role.SUBMITTER)
    for secret, name in ((vision_submitter, "vision-own"), (other, "someone-elses")):
        granted = await server.client.post(f"{url}/allocations", json={"token": name, "project": "p"}, headers=bearer(secret))
        assert granted.json()["status"] == "Granted", granted.text
    everything = {"run:vision/pooled", "run:nlp/pooled", "vision-own", "someone-elses"}
    assert {h["token"] for h in (await server.client.get(url)).json()["holders"]} == everything
    nlp_reader = await issue(pg_dsn, Role.READER, tenants=["nlp"])
    shown = (await server.client.get(url, headers=bearer(nlp_reader))).json()
    assert shown["used"] == 4 and [h["token"] for h in shown["holders"]] == ["run:nlp/pooled"]
    shown = (await server.client.get(url, headers=bearer(vision_submitter))).json()
    assert sorted(h["token"] for h in shown["holders"]) == ["run:vision/pooled", "vision-own"]
    namespaced = await issue(pg_dsn, Role.READER, namespaces=["nlp-*"])
    assert [h["token"] for h in (await server.client.get(url, headers=bearer(namespaced))).json()["holders"]] == ["run:nlp/pooled"]


async def test_metrics_refuse_a_limited_caller_when_they_need_a_token(admission_factory, pg_dsn) -> None:
    server = await _server(admission_factory, pg_dsn, metrics_require_auth=True)
    for limits in ({"tenants": ["nlp"]}, {"namespaces": ["nlp-*"]}):
        limited = await issue(pg_dsn, Role.READER, **limits)
        refused = await server.client.get("/metrics", headers=bearer(limited))
        assert refused.status_code == 403 and "every budget" in refused.json()["detail"], refused.text
    scraped = await server.client.get("/metrics", headers=bearer(await issue(pg_dsn, Role.READER)))
    assert scraped.status_code == 200 and b"budgetgate_" in scraped.content


async def test_path_values_no_submission_could_carry_are_a_422(admission_factory, pg_dsn) -> None:
    server = await _server(admission_factory, pg_dsn)
    paths = [
        "/v1/admissions/a%00b",
        "/v1/admissions/a%00b/explain",
        "/v1/admissions/a%20b",
        "/v1/tenants/%00/usage",
        "/v1/tenants/vi%00sion/usage",
        "/v1/users/%00/usage",
        "/v1/pools/snowflake:wh%00",
    ]
    for path in paths:
        answer = await server.client.get(path)
        assert answer.status_code == 422 and answer.headers["content-type"] == "application/problem+json", (path, answer.text)
    released = await server.client.delete("/v1/pools/snowflake:wh-1/allocations/t%00")
    assert released.status_code == 422, released.text
    assert (await server.client.get("/v1/admissions/no/such/run")).status_code == 404
