"""`budgetgate bench admission --scenario shared` end to end with tiny numbers, in a file of its own
so that it runs beside the other benchmark smoke tests (tests/integration/test_bench_smoke.py)."""

from __future__ import annotations

import json

from tests.support.bench import assert_nothing_left, bench_env, bench_json


async def test_the_shared_scenario_charges_every_submission_on_two_budgets_and_audits_both(
    postgres_admin_dsn: str, redis_server_url: str, kafka_server_bootstrap: str
) -> None:
    """`--scenario shared` on three shards: every submission falls under its team's budget and
    the one they all share, which budgetgate carves into each team's escrow lease and the
    baseline locks after the team's row. Both admit exactly what the team budgets fit (the
    shared one never refuses: its limit is above their sum, so a refusal would be escrow's, not
    the budget's), the shared budget is audited whole (its leases added up), and nothing is left."""
    env = bench_env(postgres_admin_dsn, redis_server_url, kafka_server_bootstrap)
    report = json.loads(bench_json(["admission", "--requests", "60", "--concurrency", "4", "--warmup", "10", "--scenario", "shared",
                                "--budgets", "6", "--ledger-shards", "3", "--no-ceiling", "--json"], env))  # fmt: skip
    assert report["correct"] is True and {r["system"] for r in report["results"]} == {"baseline", "budgetgate"}
    for result in report["results"]:
        assert result["scenario"] == "shared" and result["errors"] == 0
        assert result["allowed"] == result["expected_allowed"] and result["correctness"]["problems"] == [], result
        assert result["correctness"]["budgets"] == 7  # six teams' and the shared one, judged whole
    await assert_nothing_left(postgres_admin_dsn, report["run_tag"], redis_url=redis_server_url)
