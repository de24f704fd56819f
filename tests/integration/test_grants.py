"""Budget grants (`POST`/`GET /v1/budgets/{policy_id}/grants`) on real Postgres, Redis and Kafka:
a grant raises or lowers a window's limit for the very next decision on every instance, in the
Redis check and the Postgres ledger alike; it is versioned, logged with who, why, before and
after, guarded by roles, and a bad one changes nothing."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

import asyncpg
import pytest

from budgetgate.core.principals import Role
from tests.support.databases import fetch
from tests.support.admission import GPU_HOUR, apply_policies, budget_yaml, wait_for_bundle
from tests.support.principals import bearer, issue
from tests.support.quotas import physics
from tests.support.reconciler import feed, reconciler_factory  # noqa: F401 - pytest fixtures

POLICY = "gpu-budget/physics"
HARD = budget_yaml(POLICY, namespace="physics", labels="{team: physics}", limit="gpu_hours: 10", window="{calendar: month}")
FISCAL = budget_yaml("gpu-year/physics", namespace="physics", labels="{team: physics}", limit="node_hours: 1000", window="{fiscal_year: {start_month: 4}}")
URL = f"/v1/budgets/{POLICY}/grants"


async def started(admission_factory, pg_dsn, **settings: object):  # type: ignore[no-untyped-def]
    await apply_policies(pg_dsn, {"b.yaml": HARD}, sha="a" * 40)
    server = await admission_factory(**settings)
    await server.wait_ready()
    return server


async def decide(server, run_id: str, gpus: int = 1) -> dict:  # type: ignore[no-untyped-def]
    answer = await server.client.post("/v1/admissions", json=physics(run_id, gpus=gpus))
    assert answer.status_code == 200, answer.text
    return answer.json()


async def limits(dsn: str) -> list[int]:
    return [r["limit_amount"] for r in await fetch(dsn, "SELECT limit_amount FROM ledger_entries WHERE policy_id = $1", POLICY)]


async def test_a_grant_opens_a_full_budget_and_a_negative_one_closes_it_on_every_instance(admission_factory, pg_dsn) -> None:
    first = await started(admission_factory, pg_dsn)
    # Another instance on the same ledger that would not poll for an hour: it learns of a grant
    # from the revision every batch reads as it begins.
    second = await admission_factory(policy_refresh_seconds=3600)
    await second.wait_ready()
    assert (await decide(first, "fill", gpus=10))["decision"] == "ALLOW"  # 10 of 10 GPU-hours
    full = await decide(second, "full-1")
    assert full["decision"] == "DENY"

    granted = await first.client.post(URL, json={"amount": 5, "reason": "allocation committee 17"})
    assert granted.status_code == 200, granted.text
    grant = granted.json()
    assert (grant["amount"], grant["limit_before"], grant["limit_after"]) == (5.0, 10.0, 15.0)
    assert grant["policy_id"] == POLICY and grant["scope_id"] == "ns=physics;team=physics" and grant["reason"] == "allocation committee 17"
    # The open window's ledger entry holds the new limit, and both instances decide under it.
    assert await limits(pg_dsn) == [15 * GPU_HOUR]
    for server, run_id in ((second, "after-grant-b"), (first, "after-grant-a")):
        answer = await decide(server, run_id, gpus=2)
        assert answer["decision"] == "ALLOW", answer
        assert answer["override_revision"] == grant["revision"]
        assert answer["evaluations"][0]["limit"] == 15.0
    # 14 of 15 used: taking 10 away leaves 5, below what is used. Nothing held is undone, and the
    # next submission is refused as the budget says (deny).
    taken = await second.client.post(URL, json={"amount": -10, "reason": "hours moved to chemistry"})
    assert taken.status_code == 200, taken.text
    assert (taken.json()["limit_before"], taken.json()["limit_after"]) == (15.0, 5.0)
    assert await limits(pg_dsn) == [5 * GPU_HOUR]
    for server, run_id in ((first, "after-take-a"), (second, "after-take-b")):
        answer = await decide(server, run_id)
        assert answer["decision"] == "DENY" and answer["evaluations"][0]["limit"] == 5.0, answer
    held = await fetch(pg_dsn, "SELECT sum(amount) AS held FROM reservations WHERE state = 'held'")
    assert held[0]["held"] == 14 * GPU_HOUR

    listed = (await first.client.get(URL)).json()
    assert [(g["amount"], g["limit_after"]) for g in listed["grants"]] == [(5.0, 15.0), (-10.0, 5.0)]
    # The budgets and the admin log show them: the limit as policy + grants, who, why, before, after.
    budget = next(b for b in (await first.client.get("/v1/budgets")).json()["budgets"] if b["policy_id"] == POLICY)
    assert (budget["limit"], budget["policy_limit"], budget["granted"]) == (5.0, 10.0, -5.0)
    assert [g["reason"] for g in budget["grants"]] == ["allocation committee 17", "hours moved to chemistry"]
    logged = await fetch(pg_dsn, "SELECT actor, subject, details FROM admin_log WHERE action = 'budget.grant' ORDER BY id")
    import json

    details = [json.loads(r["details"]) for r in logged]
    assert [(d["before"], d["after"], d["reason"]) for d in details] == [
        ({"limit": 10.0}, {"limit": 15.0}, "allocation committee 17"),
        ({"limit": 15.0}, {"limit": 5.0}, "hours moved to chemistry"),
    ]
    assert all(r["subject"] == POLICY and r["actor"].startswith("token:") for r in logged)
    # A decision made under a grant is explained identically from its recorded revision.
    explained = (await first.client.get("/v1/admissions/after-take-a/explain")).json()
    assert explained["identical"] is True, explained["differences"]


async def test_bad_grants_are_refused_naming_the_field_and_change_nothing(admission_factory, pg_dsn) -> None:
    server = await started(admission_factory, pg_dsn)
    assert (await decide(server, "opens-the-window", gpus=4))["decision"] == "ALLOW"
    before = (await limits(pg_dsn), await fetch(pg_dsn, "SELECT count(*) AS n FROM admin_log"))
    cases = [
        (URL, {"amount": -11, "reason": "too much"}, 422, "amount"),
        (URL, {"amount": 0, "reason": "nothing"}, 422, "amount"),
        (URL, {"amount": 5}, 422, "reason"),
        (URL, {"amount": 5, "reason": "   "}, 422, "reason"),
        (URL, {"amount": 5, "reason": "r", "window": "2020-01-01"}, 422, "window"),
        (URL, {"amount": 5, "reason": "r", "window": "2030-01-02T00:00:00Z/2030-02-01T00:00:00Z"}, 422, "window"),
        (URL, {"amount": 5, "reason": "r", "window": "next tuesday"}, 422, "window"),
        (URL, {"amount": 5, "reason": "r", "scope_id": "ns=chemistry"}, 422, "scope_id"),
        ("/v1/budgets/gpu-budget/physcis/grants", {"amount": 5, "reason": "r"}, 404, "did you mean 'gpu-budget/physics'?"),
    ]
    for url, body, status, named in cases:
        answer = await server.client.post(url, json=body)
        assert answer.status_code == status, (body, answer.text)
        assert answer.headers["content-type"] == "application/problem+json"
        assert named in answer.text, (body, answer.text)
    assert (await limits(pg_dsn), await fetch(pg_dsn, "SELECT count(*) AS n FROM admin_log")) == before
    assert (await fetch(pg_dsn, "SELECT count(*) AS n FROM budget_grants"))[0]["n"] == 0
    # Taking exactly the whole limit is allowed: the limit is then zero.
    whole = await server.client.post(URL, json={"amount": -10, "reason": "budget frozen"})
    assert whole.status_code == 200 and whole.json()["limit_after"] == 0.0, whole.text
    assert (await decide(server, "frozen"))["decision"] == "DENY"


async def test_a_grant_for_a_later_window_waits_for_it_and_only_operators_and_accounting_grant(admission_factory, pg_dsn) -> None:
    server = await started(admission_factory, pg_dsn)
    now = datetime.now(UTC)
    later = f"{now.year + 1}-01-15"
    ahead = await server.client.post(URL, json={"amount": 90, "reason": "next year's allocation", "window": later})
    assert ahead.status_code == 200, ahead.text
    assert ahead.json()["window_start"] == f"{now.year + 1}-01-01T00:00:00Z" and ahead.json()["limit_after"] == 100.0
    # This window is untouched by it.
    assert (await decide(server, "now", gpus=10))["decision"] == "ALLOW"
    assert (await decide(server, "now-2"))["decision"] == "DENY"
    only_later = (await server.client.get(URL, params={"window": later})).json()["grants"]
    assert [g["amount"] for g in only_later] == [90.0]
    assert (await server.client.get(URL, params={"window": now.isoformat()})).json()["grants"] == []

    for role in (Role.READER, Role.SUBMITTER, Role.AUDITOR):
        refused = await server.client.post(URL, json={"amount": 1, "reason": "r"}, headers=bearer(await issue(pg_dsn, role)))
        assert refused.status_code == 403 and "needs role accounting or operator" in refused.json()["detail"], role
    accounting = bearer(await issue(pg_dsn, Role.ACCOUNTING))
    assert (await server.client.get(URL, headers=accounting)).status_code == 200
    assert (await server.client.post(URL, json={"amount": 1, "reason": "r"}, headers=accounting)).status_code == 200
    elsewhere = bearer(await issue(pg_dsn, Role.ACCOUNTING, tenants=["chemistry"]))
    assert (await server.client.post(URL, json={"amount": 1, "reason": "r"}, headers=elsewhere)).status_code == 403
    assert len((await server.client.get(URL)).json()["grants"]) == 2


async def test_a_fiscal_year_budget_is_charged_in_its_year_and_takes_grants_for_it(admission_factory, pg_dsn) -> None:
    await apply_policies(pg_dsn, {"f.yaml": FISCAL}, sha="f" * 40)
    server = await admission_factory()
    await server.wait_ready()
    now = datetime.now(UTC)
    began = now.year if now.month >= 4 else now.year - 1
    key = f"{began}-04-01T00:00:00Z/{began + 1}-04-01T00:00:00Z"
    answer = await decide(server, "fiscal-1")
    assert answer["decision"] == "ALLOW"
    evaluation = answer["evaluations"][0]
    assert (evaluation["window_start"], evaluation["window_end"]) == (f"{began}-04-01T00:00:00Z", f"{began + 1}-04-01T00:00:00Z")
    url = "/v1/budgets/gpu-year/physics/grants"
    granted = await server.client.post(url, json={"amount": 250.5, "reason": "ad-hoc credit, ticket 4411", "window": key})
    assert granted.status_code == 200, granted.text
    assert (granted.json()["ledger_key"], granted.json()["limit_after"]) == (f"ns=physics;team=physics|{key}|node_hours", 1250.5)
    assert (await decide(server, "fiscal-2"))["evaluations"][0]["limit"] == 1250.5
    # The next fiscal year starts from the policy's limit again.
    following = await server.client.post(url, json={"amount": 1, "reason": "r", "window": f"{began + 1}-04-01"})
    assert following.json()["limit_before"] == 1000.0 and following.json()["limit_after"] == 1001.0


async def test_the_cli_and_the_client_grant_through_the_api_and_budgets_show_it(admission_factory, pg_dsn, tmp_path, monkeypatch) -> None:
    import json

    from budgetgate.client import AsyncClient, InvalidRequest
    from tests.support.cli import budgetgate

    server = await started(admission_factory, pg_dsn)
    monkeypatch.setenv("BUDGETGATE_ADMISSION_URL", server.url)
    monkeypatch.setenv("BUDGETGATE_POSTGRES_DSN", pg_dsn)
    monkeypatch.setenv("BUDGETGATE_TOKEN", await issue(pg_dsn, Role.ACCOUNTING, name="finance"))
    done = await asyncio.to_thread(budgetgate, "grant", "add", POLICY, "2.5", "--reason", "ad-hoc credit", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert f"granted +2.5 gpu_hours to {POLICY}" in done.stdout and "limit 10 -> 12.5" in done.stdout, done.stdout
    taken = await asyncio.to_thread(budgetgate, "grant", "add", "--reason", "correction", "--", POLICY, "-0.5", cwd=tmp_path)
    assert taken.returncode == 0 and "limit 12.5 -> 12" in taken.stdout, taken.stderr
    # Usage errors say what is wrong and send nothing.
    for args, said in (
        (["grant", "add", POLICY, "0", "--reason", "r"], "non-zero"),
        (["grant", "add", POLICY, "lots", "--reason", "r"], "not a number"),
        (["grant", "add", POLICY, "1"], "--reason"),
    ):
        refused = await asyncio.to_thread(budgetgate, *args, cwd=tmp_path)
        assert refused.returncode == 2 and said in refused.stderr, (args, refused.stderr)
    too_much = await asyncio.to_thread(budgetgate, "grant", "add", "--reason", "r", "--", POLICY, "-100", cwd=tmp_path)
    assert too_much.returncode == 1 and "amount" in too_much.stderr and "at most" in too_much.stderr, too_much.stderr
    listed = await asyncio.to_thread(budgetgate, "grant", "list", POLICY, cwd=tmp_path)
    assert listed.returncode == 0 and "finance: ad-hoc credit" in listed.stdout and "finance: correction" in listed.stdout, listed.stdout
    budgets = await asyncio.to_thread(budgetgate, "budgets", "--json", cwd=tmp_path)
    assert budgets.returncode == 0, budgets.stderr
    line = json.loads(budgets.stdout)["budgets"][0]
    assert (line["limit"], line["policy_limit"], line["granted"], len(line["grants"])) == (12.0, 10.0, 2.0, 2)
    usage = await asyncio.to_thread(budgetgate, "usage", "--scope", POLICY, "--json", cwd=tmp_path)
    assert usage.returncode == 0, usage.stderr
    assert [(b["limit"], b["granted"]) for b in json.loads(usage.stdout)["budgets"]] == [(12.0, 2.0)]

    logged = await asyncio.to_thread(budgetgate, "admin-log", "--json", cwd=tmp_path)
    entries = [e for e in json.loads(logged.stdout) if e["action"] == "budget.grant"]
    assert [(e["subject"], e["details"]["before"], e["details"]["after"], e["details"]["reason"]) for e in entries] == [
        (POLICY, {"limit": 12.5}, {"limit": 12.0}, "correction"),
        (POLICY, {"limit": 10.0}, {"limit": 12.5}, "ad-hoc credit"),
    ]
    assert all(e["actor"] == "token:finance" for e in entries)

    async with AsyncClient(server.url, token=server.token) as client:
        made = await client.grant_budget(POLICY, {"amount": 1, "reason": "from the client"})
        assert made.limit_after == 13.0
        assert [g.reason for g in (await client.budget_grants(POLICY)).grants] == ["ad-hoc credit", "correction", "from the client"]
        scope = await client.scope_usage("ns=physics;team=physics")
        assert (scope.budgets[0].limit, scope.budgets[0].policy_limit, scope.budgets[0].granted) == (13.0, 10.0, 3.0)
        with pytest.raises(InvalidRequest, match="reason"):
            await client.grant_budget(POLICY, {"amount": 1})


async def test_a_grant_that_makes_room_sends_headroom_to_the_delayed_run(admission_factory, reconciler_factory, settings, pg_dsn) -> None:  # noqa: F811
    from budgetgate.cli.actions import read_topics
    from budgetgate.contracts import wire
    from budgetgate.contracts.topics import Topics
    from budgetgate.v1.actions_pb2 import HEADROOM, BudgetAction
    from tests.support.waiting import wait_for

    delaying = budget_yaml(POLICY, namespace="physics", labels="{team: physics}", limit="gpu_hours: 10", on_exhausted="delay")
    await apply_policies(pg_dsn, {"d.yaml": delaying}, sha="d" * 40)
    server = await admission_factory()
    await server.wait_ready()
    assert (await decide(server, "big", gpus=8))["decision"] == "ALLOW"
    assert (await decide(server, "w", gpus=4))["decision"] == "DELAY"
    await reconciler_factory()

    async def waiting() -> bool:
        return bool(await fetch(pg_dsn, "SELECT 1 FROM waiting_runs WHERE run_id = 'w'"))

    async def headrooms() -> list[str]:
        found = []
        async for record in read_topics(settings.kafka_bootstrap, [Topics(settings.topic_prefix).actions], follow=False):
            action = wire.decode(BudgetAction, record.value, record.headers)
            if action.type == HEADROOM:
                found.append(action.run_id)
        return found

    await wait_for(waiting, what="w registered as waiting")
    assert (await server.client.post(URL, json={"amount": 1, "reason": "not enough"})).status_code == 200
    status = (await server.client.get("/v1/admissions/w")).json()["waiting"]
    assert status["limiting"][0]["limit"] == 11 and status["headroom"] is False
    assert (await server.client.post(URL, json={"amount": 2, "reason": "enough"})).status_code == 200

    async def heard() -> bool:
        return "w" in await headrooms()

    await wait_for(heard, what="HEADROOM after the grant made room")
    assert await headrooms() == ["w"]
    status = (await server.client.get("/v1/admissions/w")).json()["waiting"]
    assert status["limiting"][0]["limit"] == 13 and status["headroom"] is True


async def test_under_concurrency_each_decision_obeys_the_grants_of_the_revision_it_records(admission_factory, pg_dsn) -> None:
    server = await started(admission_factory, pg_dsn, pg_pool_max=30)
    racing = [asyncio.create_task(decide(server, f"race-{i}")) for i in range(12)]
    taken = await server.client.post(URL, json={"amount": -4, "reason": "cut to 6"})
    assert taken.status_code == 200, taken.text
    revision = taken.json()["revision"]
    after = await asyncio.gather(*(decide(server, f"after-{i}") for i in range(12)))
    answers = [*await asyncio.gather(*racing), *after]
    assert all(a["override_revision"] == revision for a in after)
    before = sum(a["decision"] == "ALLOW" for a in answers if a["override_revision"] < revision)
    under_new = sum(a["decision"] == "ALLOW" for a in answers if a["override_revision"] == revision)
    # Decisions made before the grant committed first; from then on at most 6 GPU-hours are held,
    # counting theirs, and none of theirs was undone.
    assert under_new == max(0, 6 - before)
    held = await fetch(pg_dsn, "SELECT count(*) AS n FROM reservations WHERE state = 'held'")
    assert held[0]["n"] == max(6, before)


async def test_a_git_apply_keeps_the_grants_on_top_of_the_new_limit(admission_factory, pg_dsn) -> None:
    server = await started(admission_factory, pg_dsn)
    assert (await decide(server, "opens", gpus=10))["decision"] == "ALLOW"
    assert (await server.client.post(URL, json={"amount": 5, "reason": "committee"})).status_code == 200
    raised = budget_yaml(POLICY, namespace="physics", labels="{team: physics}", limit="gpu_hours: 20", window="{calendar: month}")
    await apply_policies(pg_dsn, {"b.yaml": raised}, sha="b" * 40)
    await wait_for_bundle(server, "b" * 40)
    assert await limits(pg_dsn) == [25 * GPU_HOUR]
    answer = await decide(server, "after-apply", gpus=15)
    assert answer["decision"] == "ALLOW" and answer["evaluations"][0]["limit"] == 25.0, answer
    assert (await decide(server, "full"))["decision"] == "DENY"


async def test_a_window_the_reconciler_opens_takes_the_grants_made_to_it_ahead(admission_factory, pg_dsn) -> None:
    from budgetgate.ledger.queries import owned_by

    sql = owned_by("budgetgate.services.reconciler")
    server = await started(admission_factory, pg_dsn)
    later = f"{datetime.now(UTC).year + 1}-03-10"
    made = (await server.client.post(URL, json={"amount": 4, "reason": "ahead", "window": later})).json()
    conn = await asyncpg.connect(pg_dsn)
    try:
        # Usage lands in that window before any decision opened it: its entry has the grant.
        await conn.execute(sql("create_entry"), made["ledger_key"], made["scope_id"], "gpu_hours", made["ledger_key"].split("|")[1],
                           datetime.fromisoformat(made["window_start"]), datetime.fromisoformat(made["window_end"]), POLICY, "a" * 40,
                           10 * GPU_HOUR)  # fmt: skip
        limit = await conn.fetchval("SELECT limit_amount FROM ledger_entries WHERE ledger_key = $1", made["ledger_key"])
    finally:
        await conn.close()
    assert limit == 14 * GPU_HOUR
