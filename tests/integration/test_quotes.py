"""Quotes and explanations against real Postgres, Redis and Kafka: a quote answers what admission
would decide and changes nothing; explain recomputes a recorded decision from its readings."""

from __future__ import annotations

import asyncpg
import pytest

from tests.support.admission import apply_policies, budget_yaml, decision_of, submission
from tests.support.quotas import BIG_BUDGET, CLUSTER, POOLS, QUOTA, physics, started

GPU_HOUR = 3_600_000


async def _count(dsn: str, query: str) -> int:
    conn = await asyncpg.connect(dsn)
    try:
        return await conn.fetchval(query)
    finally:
        await conn.close()


async def _redis_state(server) -> dict[str, tuple[int, int]]:  # type: ignore[no-untyped-def]
    ledger = server.rt.ledger
    keys = [k.decode().split(":l:", 1)[1] async for k in ledger.client.scan_iter(match=f"{ledger.tag}:l:*")]
    return await ledger.readings(keys)


async def test_quote_answers_as_admission_would_and_changes_nothing(admission, pg_dsn) -> None:
    await admission.submit(run_id="earlier")  # the budgets hold 48 GPU-hours already
    before_redis = await _redis_state(admission)
    before_rows = await _count(pg_dsn, "SELECT count(*) FROM decisions") + await _count(pg_dsn, "SELECT count(*) FROM outbox")

    quoted = await admission.client.post("/v1/quotes", json=submission(run_id="quoted"))
    assert quoted.status_code == 200, quoted.text
    q = quoted.json()
    assert q["quote"] is True and q["decision"] == "ALLOW" and q["next_eligible_time"] is None
    assert q["projected_gpu_hours"] == 48.0 and q["showback_cost"] == 188.78
    vision = {e["policy_id"]: e for e in q["evaluations"]}["gpu-budget/team-vision-prod"]
    assert vision["remaining_gpu_hours"] == 452.0  # 500 less the earlier run's hold

    assert await _redis_state(admission) == before_redis
    assert await _count(pg_dsn, "SELECT count(*) FROM decisions") + await _count(pg_dsn, "SELECT count(*) FROM outbox") == before_rows

    # The same submission for real: the very answer the quote gave, bar what only a decision has.
    real = (await admission.submit(run_id="quoted")).json()
    for key in ("decision", "reason", "evaluations", "projected_gpu_hours", "showback_cost", "priority_penalty", "fair_share", "policy_bundle_sha"):
        assert real[key] == q[key], key


async def test_quote_never_replays_and_counts_in_metrics_only(admission, pg_dsn) -> None:
    first = (await admission.submit(run_id="again")).json()
    assert first["decision"] == "ALLOW"
    q = (await admission.client.post("/v1/quotes", json=submission(run_id="again"))).json()
    assert "replayed" not in q and "decision_id" not in q
    # A fresh evaluation: the run's own hold of 48 GPU-hours is counted like any other.
    vision = {e["policy_id"]: e for e in q["evaluations"]}["gpu-budget/team-vision-prod"]
    assert vision["remaining_gpu_hours"] == 452.0
    text = (await admission.client.get("/metrics")).text
    assert [
        line for line in text.splitlines() if line.startswith("budgetgate_admission_quotes_total{") and 'decision="ALLOW"' in line and line.endswith(" 1.0")
    ]
    assert await _count(pg_dsn, "SELECT count(*) FROM decisions") == 1


async def test_quote_of_a_delay_names_the_next_eligible_time(admission_factory, pg_dsn) -> None:
    await apply_policies(pg_dsn, {"b.yaml": budget_yaml("wait", limit="gpu_hours: 50", on_exhausted="delay")}, sha="d" * 40)
    server = await admission_factory()
    await server.wait_ready()
    assert decision_of(await server.submit(run_id="fill", labels={"team": "vision"})) == "ALLOW"
    q = (await server.client.post("/v1/quotes", json=submission(run_id="next", labels={"team": "vision"}))).json()
    assert q["decision"] == "DELAY"
    assert q["next_eligible_time"] is not None and q["next_eligible_time"] == q["evaluations"][0]["next_eligible_time"]
    real = (await server.submit(run_id="next", labels={"team": "vision"})).json()
    assert real["decision"] == "DELAY" and real["reason"] == q["reason"]


async def test_quote_rejects_what_admission_rejects(admission) -> None:
    bad = await admission.client.post("/v1/quotes", json=submission(resources={"gpus": -1, "nodes": 1}))
    assert bad.status_code == 422


async def test_explain_recomputes_the_stored_decision(admission, pg_dsn) -> None:
    await admission.submit(run_id="flyte/a/1")
    denied = (await admission.submit(run_id="flyte/a/2", labels={"team": "vision"})).json()
    assert denied["decision"] == "DENY"  # the cost-center label is missing
    answer = await admission.client.get("/v1/admissions/flyte/a/1/explain")
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["identical"] is True and body["replayable"] is True and body["differences"] == []
    assert body["stored"]["decision"] == body["recomputed"]["decision"] == "ALLOW"
    vision = {r["ledger_key"]: r for r in body["readings"]}
    assert any(r["limit"] == 500 * GPU_HOUR and r["reserved"] == 0 and r["remaining"] == 500 * GPU_HOUR for r in vision.values())
    text = "\n".join(body["account"])
    assert "'gpu-budget/team-vision-prod'" in text and "matched: namespace 'vision-prod'" in text
    assert "limit 500 GPU-hours, reserved 0 GPU-hours, consumed 0 GPU-hours, remaining 500 GPU-hours" in text
    assert "Deciding: " in text

    labels = (await admission.client.get("/v1/admissions/flyte/a/2/explain")).json()
    assert labels["identical"] is True
    assert any("lacks its required label(s) cost-center" in line for line in labels["account"])
    assert (await admission.client.get("/v1/admissions/nothing/explain")).status_code == 404


async def test_explain_tells_a_corrupted_reading(admission, pg_dsn) -> None:
    await admission.submit(run_id="tampered")
    conn = await asyncpg.connect(pg_dsn)
    try:
        await conn.execute(
            "UPDATE decisions SET readings = jsonb_set(readings, '{ledger,0,reserved}', to_jsonb(((readings #>> "
            "'{ledger,0,limit}')::bigint))) WHERE run_id = 'tampered'"
        )
    finally:
        await conn.close()
    body = (await admission.client.get("/v1/admissions/tampered/explain")).json()
    assert body["identical"] is False
    assert body["differences"] and "the ledger reserved" in body["differences"][0]


async def test_quote_on_the_command_line(admission, tmp_path) -> None:
    import asyncio
    import json
    import os
    import sys

    await admission.submit(run_id="cli/earlier")
    env = {k: v for k, v in os.environ.items() if k not in ("BUDGETGATE_POSTGRES_DSN", "BUDGETGATE_HOME")} | {
        "BUDGETGATE_ADMISSION_URL": admission.url,
        "BUDGETGATE_TOKEN": admission.token,
    }
    args = [
        "quote",
        "-n",
        "vision-prod",
        "-l",
        "team=vision",
        "-l",
        "cost-center=1042",
        "--gpus",
        "8",
        "--flavor",
        "h100",
        "--region",
        "us-east-1",
        "--hours",
        "6",
    ]

    async def cli(*extra: str) -> tuple[int, str, str]:
        # The server runs in this event loop: the command must not block it.
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "budgetgate.cli.main", *args, *extra, cwd=tmp_path, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
        )
        out, err = await asyncio.wait_for(proc.communicate(), 120)
        return proc.returncode or 0, out.decode(), err.decode()

    code, out, err = await cli("--json")
    assert code == 0, err
    answer = json.loads(out)
    assert answer["quote"] is True and answer["decision"] == "ALLOW" and answer["showback_cost"] == 188.78
    code, out, err = await cli()
    assert code == 0, err
    assert out.startswith("ALLOW (a quote: nothing reserved) — 48 GPU-hours, 188.78 USD")
    assert "gpu-budget/team-vision-prod (hard): needs 48 of 452 remaining, limit 500 gpu_hours" in out


async def test_quote_gives_penalty_fair_share_and_quota_refusals_as_admission_would(admission_factory, pg_dsn) -> None:
    files = {
        "q.yaml": QUOTA.format(limits="max_gpus: 40, fair_share_target: 0.2, burst_allowance: 1.5"),
        "c.yaml": CLUSTER,
        "s.yaml": budget_yaml("soft-gpu", namespace="physics", labels="{team: physics}", limit="gpu_hours: 100", enforcement="soft"),
    }
    await apply_policies(pg_dsn, files, sha="7" * 40)
    server = await admission_factory()
    await server.wait_ready()
    assert decision_of(await server.client.post("/v1/admissions", json=physics("first", gpus=15))) == "ALLOW"

    # 15 + 10 GPUs of a 100-GPU cluster: above the 0.2 target, within the burst; 25 of 100 soft GPU-hours.
    q = (await server.client.post("/v1/quotes", json=physics("second", gpus=10))).json()
    # Nothing metered yet: no decayed usage, so the deficit (measured on it) is the whole target.
    assert q["fair_share"] == {
        "share": 0.15, "share_after": 0.25, "decayed_share": 0.0, "half_life_hours": 168.0, "target": 0.2, "burst_limit": 0.3, "deficit": 0.2
    }  # fmt: skip
    assert q["preemptible"] is True and q["priority_penalty"] == 0.0
    real = (await server.client.post("/v1/admissions", json=physics("second", gpus=10))).json()
    assert (real["fair_share"], real["preemptible"], real["priority_penalty"]) == (q["fair_share"], q["preemptible"], q["priority_penalty"])

    # 25 held + 80 asked: over the 40-GPU quota, and 105 % of the soft budget.
    refused = (await server.client.post("/v1/quotes", json=physics("third", gpus=80))).json()
    assert refused["decision"] == "DENY"
    assert refused["reason"] == 'allocation rejected: tenant "physics" would exceed max_gpus quota (current: 25, requested: 80, limit: 40)'
    assert refused["priority_penalty"] > 0.9
    assert (await server.client.post("/v1/admissions", json=physics("third", gpus=80))).json()["reason"] == refused["reason"]


async def test_a_quote_uses_the_latest_override_revision_made_on_another_instance(admission_factory, pg_dsn) -> None:
    files = {"q.yaml": QUOTA.format(limits="max_gpus: 40"), "b.yaml": budget_yaml("physics-gpus", namespace="physics", labels="{team: physics}")}
    await apply_policies(pg_dsn, files, sha="8" * 40)
    first = await admission_factory()
    # Another instance on the same ledger that would not poll for a long time.
    second = await admission_factory(policy_refresh_seconds=3600)
    await first.wait_ready()
    await second.wait_ready()
    put = await first.client.put("/v1/tenants/physics", json={"max_gpus": 4, "reason": "maintenance"})
    assert put.status_code == 200, put.text
    quoted = (await second.client.post("/v1/quotes", json=physics("q", gpus=8))).json()
    real = (await second.client.post("/v1/admissions", json=physics("q", gpus=8))).json()
    assert quoted["decision"] == real["decision"] == "DENY", (quoted, real)
    assert quoted["reason"] == real["reason"] and "limit: 4" in quoted["reason"]
    assert quoted["override_revision"] == real["override_revision"] == put.json()["override_revision"]


@pytest.mark.parametrize("shards", [1, 3], ids=["one-shard", "three-shards"])
async def test_quote_refuses_a_pool_token_another_holder_has_as_the_submission_does(admission_factory, pg_dsn, shards: int) -> None:
    """A run's token (run:<run id>) held by another holder refuses its submission (the reserve
    script's TAKEN; on three shards, the token taken apart on the pools' shard); the quote must
    predict that refusal, with the same reason. The quote of a run that holds its token itself
    is not refused for it."""
    files = {"p.yaml": POOLS.format(child=5, parent=5, cap=5), "b.yaml": BIG_BUDGET}
    server = await started(admission_factory, pg_dsn, files, ledger_shards=shards)
    ask = {"namespace": "snowflake:wh-1", "project": "physics"}
    assert decision_of(await server.client.post("/v1/admissions", json=physics("holder", pool_token=ask))) == "ALLOW"
    conn = await asyncpg.connect(pg_dsn)
    try:
        # A token of run "taken" someone else holds (left by an allocation made before `run:`
        # tokens were reserved for submissions), in Redis too once rebuilt from Postgres.
        await conn.execute(
            "INSERT INTO pool_allocations (namespace, token, levels, lease_expires_at, principal, state)"
            " VALUES ('snowflake:wh-1', 'run:taken', $1, now() + interval '1 hour', 'mallory', 'held')",
            ["snowflake:wh-1", "snowflake"],
        )
    finally:
        await conn.close()
    await server.rt.ledgers.sync_of(server.rt.ledgers.of_root("")).rebuild(force=True)

    # The run holding its own token: a fresh evaluation finds the token its own (HELD), not taken.
    own = (await server.client.post("/v1/quotes", json=physics("holder", pool_token=ask))).json()
    assert own["decision"] == "ALLOW", own

    quoted = await server.client.post("/v1/quotes", json=physics("taken", pool_token=ask))
    assert quoted.status_code == 200, quoted.text
    q = quoted.json()
    assert q["decision"] == "DENY", q
    assert q["reason"] == 'token "run:taken" of pool "snowflake:wh-1" is held by another holder, not by this run'
    assert all(e["admitted_gpu_hours"] == 0 for e in q["evaluations"])
    assert {h["token"] for h in (await server.client.get("/v1/pools/snowflake:wh-1")).json()["holders"]} == {"run:holder", "run:taken"}

    # The submission for real: the very refusal the quote foretold.
    real = (await server.client.post("/v1/admissions", json=physics("taken", pool_token=ask))).json()
    for key in ("decision", "reason", "evaluations", "projected_gpu_hours", "priority_penalty", "fair_share", "policy_bundle_sha"):
        assert real[key] == q[key], key
