"""Tenant quota and budget overrides (`GET`/`PUT /v1/tenants/{tenant}`) on real servers: the next
decision obeys them, on every instance and under concurrency; they are versioned on decisions,
logged, guarded by roles, validated, and kept or cleared by a later Git apply."""

from __future__ import annotations

import asyncio
import os

import asyncpg
import pytest

from budgetgate.core.loader import build_bundle, parse_text
from budgetgate.policies.override_store import plan_with_overrides
from budgetgate.core.principals import Role
from tests.support.databases import fetch
from tests.support.admission import apply_policies, budget_yaml, wait_for_bundle
from tests.support.cli import budgetgate
from tests.support.principals import bearer, issue
from tests.support.quotas import CLUSTER, QUOTA, physics

BIG = budget_yaml("physics-gpus", namespace="physics", labels="{team: physics}", limit="gpu_hours: 100000")
SOFT = budget_yaml("gpu-soft/physics", namespace="physics", labels="{team: physics}", limit="gpu_hours: 1000", enforcement="soft", window="{calendar: week}")


def policies(limits: str = "max_nodes: 10, max_gpus: 1600, max_concurrent_allocations: 50, fair_share_target: 0.25") -> dict[str, str]:
    return {"q.yaml": QUOTA.format(limits=limits), "c.yaml": CLUSTER, "b.yaml": BIG, "s.yaml": SOFT}


async def started(admission_factory, pg_dsn, files: dict[str, str] | None = None, **settings: object):  # type: ignore[no-untyped-def]
    await apply_policies(pg_dsn, files or policies(), sha="a" * 40)
    server = await admission_factory(pg_pool_max=30, **settings)
    await server.wait_ready()
    return server


async def submit(server, run_id: str, **kwargs: object) -> dict:  # type: ignore[no-untyped-def]
    answer = await server.client.post("/v1/admissions", json=physics(run_id, **kwargs))
    assert answer.status_code == 200, answer.text
    return answer.json()


async def test_a_lowered_quota_applies_to_the_very_next_decision_on_every_instance(admission_factory, pg_dsn) -> None:
    first = await started(admission_factory, pg_dsn)
    # Another instance on the same ledger that would not poll for a long time.
    second = await admission_factory(policy_refresh_seconds=3600)
    await second.wait_ready()
    for i in range(4):
        assert (await submit(first, f"r{i}", nodes=2))["decision"] == "ALLOW"
    put = await first.client.put("/v1/tenants/physics", json={"max_nodes": 5, "reason": "maintenance"})
    assert put.status_code == 200, put.text
    revision = put.json()["override_revision"]
    assert revision > 0 and put.json()["settings"]["max_nodes"] == {"value": 5, "source": "override", "git": 10, "policy_id": None}

    for server, run_id in ((second, "late-b"), (first, "late-a")):
        denied = await submit(server, run_id, nodes=1)
        assert denied["decision"] == "DENY"
        assert denied["reason"] == (
            'allocation rejected: tenant "physics" would exceed max_nodes quota (current: 8, requested: 1, limit: 5); usage is already at or above the '
            "limit (it may have been lowered): wait for running work to finish or ask the tenant admin to raise it"
        )
        assert denied["override_revision"] == revision and denied["policy_bundle_sha"] == "a" * 40
    # Nothing was preempted: the four runs still hold their nodes.
    held = await fetch(pg_dsn, "SELECT count(*) AS n, sum(nodes) AS nodes FROM run_holds WHERE state = 'held' AND tenant = 'physics'")
    assert (held[0]["n"], held[0]["nodes"]) == (4, 8)
    recorded = await fetch(pg_dsn, "SELECT run_id, override_revision, policy_bundle_sha FROM decisions ORDER BY run_id")
    assert {r["run_id"]: r["override_revision"] for r in recorded} == {"late-a": revision, "late-b": revision, "r0": 0, "r1": 0, "r2": 0, "r3": 0}

    raised = await second.client.put("/v1/tenants/physics", json={"max_nodes": 20})
    assert raised.status_code == 200
    allowed = await submit(first, "after-raise", nodes=10)
    assert allowed["decision"] == "ALLOW" and allowed["override_revision"] == raised.json()["override_revision"]
    # The decision is explained identically from its recorded revision.
    explained = (await first.client.get("/v1/admissions/late-a/explain")).json()
    assert explained["identical"] is True, explained["differences"]


async def test_under_concurrency_each_decision_obeys_the_revision_it_records(admission_factory, pg_dsn) -> None:
    server = await started(admission_factory, pg_dsn)
    racing = [asyncio.create_task(submit(server, f"race-{i}")) for i in range(12)]
    put = await server.client.put("/v1/tenants/physics", json={"max_concurrent_allocations": 7})
    assert put.status_code == 200
    revision = put.json()["override_revision"]
    after = await asyncio.gather(*(submit(server, f"after-{i}") for i in range(12)))
    answers = [*await asyncio.gather(*racing), *after]
    assert all(a["override_revision"] == revision for a in after)
    before = sum(a["decision"] == "ALLOW" for a in answers if a["override_revision"] == 0)
    under_new = sum(a["decision"] == "ALLOW" for a in answers if a["override_revision"] == revision)
    # Every decision made under the old revision committed before the change did; from then on
    # at most 7 allocations are held, counting those.
    assert under_new == max(0, 7 - before)
    held = await fetch(pg_dsn, "SELECT count(*) AS n FROM run_holds WHERE state = 'held' AND tenant = 'physics'")
    assert held[0]["n"] == max(7, before)


async def test_get_shows_each_source_and_put_logs_who_changed_what(admission_factory, pg_dsn) -> None:
    server = await started(admission_factory, pg_dsn)
    assert (await submit(server, "soft-1"))["decision"] == "ALLOW"  # opens the soft budget's window
    shown = (await server.client.get("/v1/tenants/physics")).json()
    assert shown["revision"] is None and shown["override_revision"] == 0
    assert shown["settings"]["max_nodes"]["source"] == "git" and shown["settings"]["max_nodes"]["value"] == 10
    assert shown["settings"]["gpu_hours_budget"] == {"value": 1000.0, "source": "git", "git": 1000.0, "policy_id": "gpu-soft/physics"}
    assert shown["settings"]["node_hours_budget"]["source"] == "unset"

    put = await server.client.put("/v1/tenants/physics", json={"gpu_hours_budget": 2000.5, "burst_allowance": 2, "reason": "grant 17"})
    assert put.status_code == 200, put.text
    body = put.json()
    assert body["settings"]["gpu_hours_budget"] == {"value": 2000.5, "source": "override", "git": 1000.0, "policy_id": "gpu-soft/physics"}
    assert body["settings"]["burst_allowance"]["source"] == "override" and body["changed_by"].startswith("token:")
    # The open window of the soft budget takes the new limit, and so does the next decision.
    limits = await fetch(pg_dsn, "SELECT limit_amount FROM ledger_entries WHERE policy_id = 'gpu-soft/physics'")
    assert [r["limit_amount"] for r in limits] == [2000.5 * 3_600_000]
    answer = await submit(server, "soft-2")
    soft = next(e for e in answer["evaluations"] if e["policy_id"] == "gpu-soft/physics")
    assert soft["limit"] == 2000.5 and answer["fair_share"]["burst_limit"] == 0.5
    budgets = (await server.client.get("/v1/budgets")).json()["budgets"]
    assert next(b for b in budgets if b["policy_id"] == "gpu-soft/physics")["limit"] == 2000.5

    cleared = await server.client.put("/v1/tenants/physics", json={"gpu_hours_budget": None})
    assert cleared.json()["settings"]["gpu_hours_budget"]["source"] == "git"
    assert cleared.json()["settings"]["burst_allowance"]["source"] == "override"
    logged = await fetch(pg_dsn, "SELECT actor, action, subject, details FROM admin_log WHERE action LIKE 'tenant.%' ORDER BY id")
    assert [(r["action"], r["subject"]) for r in logged] == [("tenant.override", "physics")] * 2
    first = __import__("json").loads(logged[0]["details"])
    assert first["reason"] == "grant 17" and first["before"] == {} and first["after"]["gpu_hours_budget"]["value"] == 2000.5
    assert logged[0]["actor"] == body["changed_by"]


async def test_only_operators_and_accounting_tokens_change_tenants(admission_factory, pg_dsn) -> None:
    server = await started(admission_factory, pg_dsn)
    url = "/v1/tenants/physics"
    client = server.client
    anonymous = await client.put(url, json={"max_gpus": 8}, headers={"Authorization": ""})
    assert anonymous.status_code == 401 and anonymous.headers["content-type"] == "application/problem+json"
    for role in (Role.READER, Role.SUBMITTER, Role.AUDITOR):
        refused = await client.put(url, json={"max_gpus": 8}, headers=bearer(await issue(pg_dsn, role)))
        assert refused.status_code == 403, role
        assert "needs role accounting or operator" in refused.json()["detail"]
    assert (await client.get(url, headers=bearer(await issue(pg_dsn, Role.SUBMITTER)))).status_code == 403
    assert (await client.get(url, headers=bearer(await issue(pg_dsn, Role.READER)))).status_code == 200
    accounting = bearer(await issue(pg_dsn, Role.ACCOUNTING, tenants=["physics"]))
    assert (await client.put(url, json={"max_gpus": 8}, headers=accounting)).status_code == 200
    assert (await client.put("/v1/tenants/chemistry", json={"max_gpus": 8}, headers=accounting)).status_code == 403
    operator = bearer(await issue(pg_dsn, Role.OPERATOR))
    assert (await client.put("/v1/tenants/chemistry?create=true", json={"max_gpus": 8}, headers=operator)).status_code == 200


async def test_a_tenant_nothing_names_is_refused_unless_created(admission_factory, pg_dsn) -> None:
    # A typo (`physcis`) once became a new hard quota for a tenant no run carries.
    server = await started(admission_factory, pg_dsn)
    typo = await server.client.put("/v1/tenants/physcis", json={"max_gpus": 8, "reason": "grant 17"})
    assert typo.status_code == 404 and typo.headers["content-type"] == "application/problem+json", typo.text
    detail = typo.json()["detail"]
    assert "tenant 'physcis' is not known" in detail and "did you mean 'physics'?" in detail and "create=true" in detail, detail
    assert (await fetch(pg_dsn, "SELECT count(*) AS n FROM tenant_overrides"))[0]["n"] == 0
    assert (await fetch(pg_dsn, "SELECT count(*) AS n FROM admin_log WHERE action = 'tenant.override'"))[0]["n"] == 0
    # Said to be new, it is made; from then on its overrides name it, and it is known.
    created = await server.client.put("/v1/tenants/chemistry?create=true", json={"max_gpus": 8, "reason": "new group"})
    assert created.status_code == 200 and created.json()["settings"]["max_gpus"]["value"] == 8, created.text
    again = await server.client.put("/v1/tenants/chemistry", json={"max_gpus": 16})
    assert again.status_code == 200 and again.json()["settings"]["max_gpus"]["value"] == 16, again.text
    # The client and the CLI say so too.
    from budgetgate.client import AsyncClient, NotFound

    async with AsyncClient(server.url, token=server.token) as client:
        with pytest.raises(NotFound, match="is not known"):
            await client.update_tenant("biologyy", {"max_gpus": 1})
        assert (await client.update_tenant("biology", {"max_gpus": 1}, create=True)).settings.max_gpus.value == 1


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"max_nodes": -1}, "max_nodes"),
        ({"max_gpus": True}, "max_gpus"),
        ({"max_gpus": "8"}, "max_gpus"),
        ({"fair_share_target": 1.5}, "fair_share_target"),
        ({"gpu_hours_budget": 0}, "gpu_hours_budget"),
        ({"node_hours_budget": 10}, "node_hours_budget"),  # physics has no soft node-hour budget
        ({"bogus": 1}, "bogus"),
        ({"max_gpus": 1, "reason": "a\u0000b"}, "reason"),  # Postgres text holds no NUL
        ({"reason": "nothing named"}, ""),
    ],
)
async def test_bad_input_is_a_422_naming_the_field(admission_factory, pg_dsn, body, field) -> None:
    server = await started(admission_factory, pg_dsn)
    answer = await server.client.put("/v1/tenants/physics", json=body)
    assert answer.status_code == 422 and answer.headers["content-type"] == "application/problem+json", answer.text
    assert [e["field"] for e in answer.json()["errors"]] == [field]
    assert (await fetch(pg_dsn, "SELECT count(*) AS n FROM tenant_overrides"))[0]["n"] == 0


async def test_a_burst_without_a_target_and_a_bad_tenant_name_are_refused(admission_factory, pg_dsn) -> None:
    server = await started(admission_factory, pg_dsn, files={"q.yaml": QUOTA.format(limits="max_nodes: 10"), "b.yaml": BIG})
    burst = await server.client.put("/v1/tenants/physics", json={"burst_allowance": 2})
    assert burst.status_code == 422 and [e["field"] for e in burst.json()["errors"]] == ["burst_allowance"]
    target = await server.client.put("/v1/tenants/physics", json={"fair_share_target": 0.5})
    assert target.status_code == 422 and "Cluster" in target.json()["detail"]
    assert (await server.client.put("/v1/tenants/a*b", json={"max_gpus": 1})).status_code == 422


async def test_git_apply_keeps_overrides_git_left_alone_and_clears_those_it_changed(admission_factory, pg_dsn) -> None:
    server = await started(admission_factory, pg_dsn)
    assert (await server.client.put("/v1/tenants/physics", json={"max_nodes": 5, "max_gpus": 100, "gpu_hours_budget": 50})).status_code == 200
    changed = {**policies("max_nodes: 10, max_gpus: 800, max_concurrent_allocations: 50, fair_share_target: 0.25"), "s.yaml": SOFT.replace("1000", "1200")}
    documents = [doc for name, text in changed.items() for doc in parse_text(text, name)]
    new = build_bundle(documents, git_sha="b" * 40)
    conn = await asyncpg.connect(pg_dsn)
    try:
        lines = [str(c) for c in await plan_with_overrides(conn, server.rt.policies.active, new)]
    finally:
        await conn.close()
    assert "= override physics max_nodes: 5 (kept: Git unchanged at 10)" in lines
    assert "- override physics max_gpus: 100 (cleared: Git changes it: 1600 -> 800)" in lines
    assert "- override physics gpu_hours_budget: 50 (cleared: Git changes it: 1000 -> 1200)" in lines
    await apply_policies(pg_dsn, changed, sha="b" * 40)
    shown = (await server.client.get("/v1/tenants/physics")).json()
    assert shown["policy_bundle_sha"] == "b" * 40
    settings = shown["settings"]
    assert (settings["max_nodes"]["value"], settings["max_nodes"]["source"]) == (5, "override")
    assert (settings["max_gpus"]["value"], settings["max_gpus"]["source"]) == (800, "git")
    assert (settings["gpu_hours_budget"]["value"], settings["gpu_hours_budget"]["source"]) == (1200.0, "git")
    logged = await fetch(pg_dsn, "SELECT actor, action, details FROM admin_log WHERE action = 'tenant.override.clear'")
    assert [r["actor"] for r in logged] == ["test"]
    assert sorted(__import__("json").loads(logged[0]["details"])["cleared"]) == ["gpu_hours_budget", "max_gpus"]
    # The kept override still governs decisions made under the new bundle.
    await wait_for_bundle(server, "b" * 40)
    assert (await submit(server, "big", nodes=6))["reason"].startswith('allocation rejected: tenant "physics" would exceed max_nodes quota')


async def test_the_cli_updates_a_tenant_through_the_api(admission_factory, pg_dsn, tmp_path, monkeypatch) -> None:
    server = await started(admission_factory, pg_dsn)
    monkeypatch.setenv("BUDGETGATE_ADMISSION_URL", server.url)
    monkeypatch.setenv("BUDGETGATE_TOKEN", await issue(pg_dsn, Role.OPERATOR, name="ops"))
    assert os.environ["BUDGETGATE_ADMISSION_URL"] == server.url
    done = await asyncio.to_thread(budgetgate, "admin", "tenant", "update", "physics", "--max-nodes", "250", "--reason", "more", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "max_nodes" in done.stdout and "override (Git: 10)" in done.stdout
    shown = await asyncio.to_thread(budgetgate, "admin", "tenant", "show", "physics", "--json", cwd=tmp_path)
    assert __import__("json").loads(shown.stdout)["settings"]["max_nodes"]["value"] == 250
    refused = await asyncio.to_thread(budgetgate, "admin", "tenant", "update", "physics", "--node-hours-budget", "5", cwd=tmp_path)
    assert refused.returncode == 1 and "node_hours_budget" in refused.stderr
    typo = await asyncio.to_thread(budgetgate, "admin", "tenant", "update", "phyiscs", "--max-gpus", "8", cwd=tmp_path)
    assert typo.returncode == 1 and "did you mean 'physics'?" in typo.stderr and "create=true" in typo.stderr, typo.stderr
    created = await asyncio.to_thread(budgetgate, "admin", "tenant", "update", "chemistry", "--max-gpus", "8", "--create", cwd=tmp_path)
    assert created.returncode == 0 and "max_gpus" in created.stdout, created.stderr


async def test_a_window_the_reconciler_opens_takes_the_overridden_limit(admission_factory, pg_dsn) -> None:
    from budgetgate.ledger.queries import owned_by

    sql = owned_by("budgetgate.services.reconciler")

    server = await started(admission_factory, pg_dsn)
    assert (await server.client.put("/v1/tenants/physics", json={"gpu_hours_budget": 3})).status_code == 200
    conn = await asyncpg.connect(pg_dsn)
    try:
        for key, policy, unit in (("k-soft", "gpu-soft/physics", "gpu_hours"), ("k-other", "physics-gpus", "gpu_hours")):
            await conn.execute(sql("create_entry"), key, "s", unit, "2099-W01", None, None, policy, "a" * 40, 7)
        limits = dict(await conn.fetch("SELECT ledger_key, limit_amount FROM ledger_entries WHERE ledger_key LIKE 'k-%'"))
    finally:
        await conn.close()
    assert limits == {"k-soft": 3 * 3_600_000, "k-other": 7}
