"""Budgets you can list and alert on: `GET /v1/budgets`, `budgetgate budgets`, `usage --scope
POLICY_ID`, and the per-budget Prometheus gauges of the admission service."""

from __future__ import annotations

import asyncio
import json
import re

import asyncpg
from click.testing import CliRunner, Result

from budgetgate.cli.main import cli
from budgetgate.ledger.queries import owned_by
from tests.support.admission import apply_policies, budget_yaml, decision_of, submission

sql = owned_by("budgetgate.services.reconciler")  # its own queries, then the shared ledger's

POLICIES = {
    "b.yaml": "---\n".join(
        [
            budget_yaml("roomy", labels="{team: vision}", limit="gpu_hours: 1000"),
            budget_yaml("tight", labels='{cost-center: "1042"}', limit="gpu_hours: 55"),
            budget_yaml("full", labels="{environment: prod}", limit="gpu_hours: 48"),
            budget_yaml("paused", namespace="other", labels="{team: vision}", limit="gpu_hours: 10", on_exhausted="hold"),
            budget_yaml("money", namespace="other", labels="{team: vision}", limit="cost: 100, currency: USD", enforcement="soft"),
            "apiVersion: budgetgate/v1\nkind: RateCard\nmetadata: {id: r}\nspec: {currency: USD, rates: [{flavor: h100, rate_per_gpu_hour: 2.5}]}\n",
        ]
    )  # fmt: skip
}


async def invoke(dsn: str, args: list[str]) -> Result:
    # In a thread: the command runs its own event loop, and this test's loop serves admission.
    return await asyncio.to_thread(CliRunner().invoke, cli, args, env={"BUDGETGATE_POSTGRES_DSN": dsn})


async def _seed(pg_dsn: str, admission_factory) -> object:  # type: ignore[no-untyped-def]
    await apply_policies(pg_dsn, POLICIES, sha="b" * 40)
    server = await admission_factory()
    await server.wait_ready()
    assert decision_of(await server.client.post("/v1/admissions", json=submission(run_id="r1"))) == "ALLOW"
    other = submission(
        run_id="r2", namespace="other", labels={"team": "vision"}, resources={"gpus": 1, "nodes": 1, "flavor": "h100"}, projected_runtime_hours=2.0
    )
    assert decision_of(await server.client.post("/v1/admissions", json=other)) == "ALLOW"
    conn = await asyncpg.connect(pg_dsn)
    try:
        key = await conn.fetchval("SELECT ledger_key FROM ledger_entries WHERE policy_id = 'paused'")
        await conn.execute(sql("insert_hold"), key, "paused", "ns=other;team=vision", "hold")
    finally:
        await conn.close()
    return server


async def test_budgets_list_every_budget_in_human_units_with_its_state(pg_dsn: str, admission_factory) -> None:  # type: ignore[no-untyped-def]
    server = await _seed(pg_dsn, admission_factory)
    response = await server.client.get("/v1/budgets")
    assert response.status_code == 200
    by_id = {b["policy_id"]: b for b in response.json()["budgets"]}
    fields = ("scope_id", "unit", "limit", "reserved", "consumed", "remaining", "committed", "committed_percent", "consumed_percent", "alerts", "state")
    assert {k: by_id["tight"][k] for k in fields} == {
        "scope_id": "ns=vision-prod;cost-center=1042", "unit": "gpu_hours", "limit": 55.0, "reserved": 48.0, "consumed": 0.0,
        "remaining": 7.0, "committed": 48.0, "committed_percent": 87.3, "consumed_percent": 0.0, "alerts": ["committed 80%"], "state": "alerting"}  # fmt: skip
    assert by_id["tight"]["used_percent"] == by_id["tight"]["committed_percent"]  # the first name of the measure
    # "full": every GPU-hour committed (reserved), none consumed: new work does not fit, nothing is exhausted.
    assert {p: b["state"] for p, b in by_id.items()} == {"roomy": "ok", "tight": "alerting", "full": "full", "paused": "held", "money": "ok"}
    assert (by_id["money"]["reserved"], by_id["money"]["currency"], by_id["money"]["used_percent"]) == (5.0, "USD", 5.0)
    assert by_id["roomy"]["window_key"] and by_id["roomy"]["window_start"] < by_id["roomy"]["window_end"]

    shown = await invoke(pg_dsn, ["budgets", "--json"])
    assert shown.exit_code == 0, shown.output
    assert json.loads(shown.stdout)["budgets"] == response.json()["budgets"]
    text = (await invoke(pg_dsn, ["budgets"])).stdout
    assert re.search(r"tight\s+ns=vision-prod;cost-center=1042\s+\S+\s+gpu-hours\s+55\s+48\s+0\s+7\s+87\.3%\s+0\.0%\s+alerting", text), text


async def test_usage_accepts_a_policy_id(pg_dsn: str, admission_factory) -> None:  # type: ignore[no-untyped-def]
    await _seed(pg_dsn, admission_factory)
    by_id = await invoke(pg_dsn, ["usage", "--scope", "tight", "--json"])
    assert by_id.exit_code == 0, by_id.output
    assert [b["policy_id"] for b in json.loads(by_id.stdout)["budgets"]] == ["tight"]
    unknown = await invoke(pg_dsn, ["usage", "--scope", "nope"])
    assert unknown.exit_code == 1 and "no budget policy of the active bundle has scope or id 'nope'" in unknown.stderr


async def test_budget_gauges_are_exported_per_budget(pg_dsn: str, admission_factory) -> None:  # type: ignore[no-untyped-def]
    server = await _seed(pg_dsn, admission_factory)
    await server.rt.board.refresh()
    metrics = (await server.client.get("/metrics")).text

    def gauge(name: str, policy: str) -> float:
        match = re.search(rf'^{name}\{{([^}}]*policy_id="{re.escape(policy)}"[^}}]*)\}} (\S+)$', metrics, re.M)
        assert match, f"{name} for {policy} not in /metrics"
        assert 'unit="' in match.group(1) and 'scope_id="' in match.group(1)
        return float(match.group(2))

    assert gauge("budgetgate_budget_committed_ratio", "tight") == round(48 / 55, 6)
    assert gauge("budgetgate_budget_consumed_ratio", "tight") == 0.0
    assert gauge("budgetgate_budget_remaining", "tight") == 7.0
    assert gauge("budgetgate_budget_remaining", "money") == 95.0
    assert (gauge("budgetgate_budget_held", "paused"), gauge("budgetgate_budget_held", "tight")) == (1.0, 0.0)
