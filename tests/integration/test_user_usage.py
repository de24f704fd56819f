"""Usage by user (`GET /v1/users/{user}/usage`, `budgetgate usage --user`): the same reading as
usage by tenant, on another label, with the same rolling-window rule for metered usage."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime, timedelta

from click.testing import CliRunner

from budgetgate.cli.main import cli
from budgetgate.client import AsyncClient
from budgetgate.core.principals import Role
from budgetgate.contracts.admission import UserUsage
from tests.support.admission import apply_policies, budget_yaml, decision_of, example_policies, submission
from tests.support.principals import bearer, issue
from tests.support.reconciler import usage
from tests.support.reconciler import feed, reconciler_factory  # noqa: F401 - pytest fixtures
from tests.support.waiting import wait_for

ALICE_BUDGET = budget_yaml("gpu-budget/user-alice", labels="{user: alice}", limit="gpu_hours: 200")


def labelled(run_id: str, user: str, *, hours: float = 1.0, **labels: str) -> dict[str, object]:
    base = {"cost-center": "1042", "team": "vision", "user": user}
    return submission(run_id=run_id, labels={**base, **labels}, resources={"gpus": 2, "flavor": "h100"}, projected_runtime_hours=hours)


def cli_json(dsn: str, *args: str) -> dict[str, object]:
    result = CliRunner().invoke(cli, ["usage", *args, "--json"], env={"BUDGETGATE_POSTGRES_DSN": dsn})
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


async def test_user_usage_follows_the_tenant_rules_by_api_and_cli(admission_factory, reconciler_factory, feed, pg_dsn) -> None:  # noqa: F811
    await apply_policies(pg_dsn, {**example_policies(), "alice.yaml": ALICE_BUDGET}, sha="u" * 40)
    server = await admission_factory()
    await server.wait_ready()
    for run_id, user in (("a1", "alice"), ("a2", "alice"), ("b1", "bob")):
        answer = (await server.submit(**labelled(run_id, user))).json()
        assert answer.get("decision") == "ALLOW", answer
    await reconciler_factory()
    now = datetime.now(UTC)
    # a1: 4 GPU-hours metered 40 days ago, 10 by an hour ago; b1: 3 GPU-hours an hour ago.
    await feed.send(
        usage("a1", "old", now - timedelta(days=40), 4), usage("a1", "new", now - timedelta(hours=1), 10), usage("b1", "s", now - timedelta(hours=1), 3)
    )

    async def recorded() -> bool:
        return (await server.client.get("/v1/tenants/vision/usage", params={"days": 60})).json()["runs"]["consumed_gpu_hours"] == 13.0

    await wait_for(recorded, what="the samples recorded")

    alice = (await server.client.get("/v1/users/alice/usage", params={"days": 30})).json()
    assert (alice["user"], alice["label"], alice["days"]) == ("alice", "user", 30)
    # Within the last 30 days a1 used 10 − 4; a2 holds its reservation (2 GPUs × 1 h).
    assert alice["runs"] == {"runs": 2, "admitted": 2, "reserved_gpu_hours": 2.0, "consumed_gpu_hours": 6.0, "consumed_node_hours": 0.0}
    assert (await server.client.get("/v1/users/alice/usage", params={"days": 60})).json()["runs"]["consumed_gpu_hours"] == 10.0
    [budget] = alice["budgets"]
    assert budget["policy_id"] == "gpu-budget/user-alice" and budget["scope_id"] == "ns=vision-prod;user=alice" and budget["limit"] == 200.0
    bob = (await server.client.get("/v1/users/bob/usage", params={"days": 30})).json()
    assert bob["runs"]["runs"] == 1 and bob["runs"]["consumed_gpu_hours"] == 3.0 and bob["budgets"] == []

    # The tenant's reading is the same rule over the same runs: alice's and bob's together.
    vision = (await server.client.get("/v1/tenants/vision/usage", params={"days": 30})).json()["runs"]
    assert vision["runs"] == 3 and vision["consumed_gpu_hours"] == alice["runs"]["consumed_gpu_hours"] + bob["runs"]["consumed_gpu_hours"]
    assert (await server.client.get("/v1/users/nobody/usage")).json()["runs"]["runs"] == 0
    assert (await server.client.get("/v1/users/alice/usage", params={"days": 0})).status_code == 422

    from_cli = await asyncio.to_thread(cli_json, pg_dsn, "--user", "alice", "--days", "30")
    assert from_cli["runs"] == alice["runs"] and from_cli["user"] == "alice" and from_cli["budgets"][0]["policy_id"] == "gpu-budget/user-alice"
    tenant_cli = await asyncio.to_thread(cli_json, pg_dsn, "--tenant", "vision", "--days", "30")
    assert tenant_cli["runs"] == vision and tenant_cli["tenant"] == "vision"


async def test_the_user_label_is_a_setting(admission_factory, pg_dsn) -> None:
    await apply_policies(pg_dsn, example_policies(), sha="e" * 40)
    server = await admission_factory(user_label="owner")
    await server.wait_ready()
    assert decision_of(await server.submit(**labelled("c1", "someone", owner="carol"))) == "ALLOW"
    carol = (await server.client.get("/v1/users/carol/usage")).json()
    assert carol["label"] == "owner" and carol["runs"]["runs"] == 1 and carol["days"] == 90
    assert (await server.client.get("/v1/users/someone/usage")).json()["runs"]["runs"] == 0
    result = await asyncio.to_thread(cli_json, pg_dsn, "--user", "carol", "--label", "owner")
    assert result["runs"] == carol["runs"]


async def test_only_callers_limited_to_nothing_read_a_users_usage(admission, pg_dsn) -> None:
    reader = await issue(pg_dsn, Role.READER)
    tenant_reader = await issue(pg_dsn, Role.READER, tenants=["vision"])
    namespace_reader = await issue(pg_dsn, Role.READER, namespaces=["vision-*"])
    submitter = await issue(pg_dsn, Role.SUBMITTER)
    client = admission.client
    assert (await client.get("/v1/users/alice/usage", headers=bearer(reader))).status_code == 200
    async with AsyncClient(admission.url, token=reader) as typed:
        found = await typed.user_usage("alice", days=7)
        assert isinstance(found, UserUsage) and (found.user, found.days, found.runs.runs) == ("alice", 7, 0)
    for secret in (tenant_reader, namespace_reader):
        refused = await client.get("/v1/users/alice/usage", headers=bearer(secret))
        assert refused.status_code == 403 and "spans" in refused.json()["detail"], refused.text
    refused = await client.get("/v1/users/alice/usage", headers=bearer(submitter))
    assert refused.status_code == 403 and "needs role" in refused.json()["detail"]


def cli_text(dsn: str, *args: str) -> str:
    result = CliRunner().invoke(cli, ["usage", *args], env={"BUDGETGATE_POSTGRES_DSN": dsn, "BUDGETGATE_HOME": "/nonexistent"})
    assert result.exit_code == 0, result.output
    return result.stdout


async def test_a_user_or_tenant_no_budget_names_gets_a_line_not_an_empty_table(pg_dsn) -> None:
    await apply_policies(pg_dsn, {**example_policies(), "alice.yaml": ALICE_BUDGET}, sha="u" * 40)
    alice = await asyncio.to_thread(cli_text, pg_dsn, "--user", "alice")
    header, rule, row = alice.splitlines()[:3]
    assert header.split()[:2] == ["budget", "scope"] and set(rule) == {"-", " "} and row.startswith("gpu-budget/user-alice ")
    bob = await asyncio.to_thread(cli_text, pg_dsn, "--user", "bob")
    first, blank, runs = bob.splitlines()
    assert first.startswith("no budget names user=bob in its scope; the budgets of the scopes its runs are submitted in apply")
    assert "budgetgate usage --tenant TEAM" in first and blank == "" and runs.startswith("user user=bob, last 90 days: 0 run(s)")
    assert "budget  " not in bob and "---" not in bob
    nobody = await asyncio.to_thread(cli_text, pg_dsn, "--tenant", "nobody")
    assert nobody.startswith("no budget names team=nobody in its scope") and "---" not in nobody
