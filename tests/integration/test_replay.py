"""Replay against real Postgres, Redis and Kafka: every recorded decision recomputed from its own
readings; a healthy ledger has no mismatch, one corrupted reading makes exactly one."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import asyncpg

from budgetgate.decisions.explain import replay
from tests.support.admission import apply_policies, budget_yaml, decision_of, example_policies
from tests.support.cli import budgetgate


async def _decide_a_mix(server) -> list[dict]:  # type: ignore[no-untyped-def]
    bodies = [
        dict(run_id="mix/1"),
        dict(run_id="mix/2", labels={"team": "vision"}),  # DENY: labels missing
        dict(run_id="mix/3", resources={"gpus": 64, "nodes": 8, "flavor": "h100", "region": "us-east-1"}, projected_runtime_hours=100.0),  # DENY: too big
        dict(
            run_id="mix/4",
            namespace="vision-research",
            labels={"team": "vision"},
            resources={"gpus": 8, "nodes": 1, "flavor": "h100"},
            projected_runtime_hours=14.0,
        ),
        dict(
            run_id="mix/5",
            namespace="vision-research",
            labels={"team": "vision"},
            resources={"gpus": 8, "nodes": 1, "flavor": "h100"},
            projected_runtime_hours=2.0,
        ),  # DELAY
        dict(run_id="mix/6", namespace="unknown-ns", labels={}),  # no policy covers it
        dict(run_id="mix/7"),
    ]
    return [(await server.submit(**b)).json() for b in bodies]


async def _sql(dsn: str, statement: str, *args: object) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(statement, *args)
    finally:
        await conn.close()


async def _replay(dsn: str, **kwargs: object) -> dict:
    conn = await asyncpg.connect(dsn)
    try:
        return await replay(conn, since=datetime.now(UTC) - timedelta(days=30), **kwargs)  # type: ignore[arg-type]
    finally:
        await conn.close()


async def test_healthy_ledger_replays_without_mismatch_and_one_corruption_is_one_mismatch(admission_factory, pg_dsn) -> None:
    await apply_policies(pg_dsn, example_policies() | {"extra.yaml": budget_yaml("soft-vision", enforcement="soft", limit="gpu_hours: 60")}, sha="f" * 40)
    server = await admission_factory()
    await server.wait_ready()
    answers = await _decide_a_mix(server)
    assert {a["decision"] for a in answers} == {"ALLOW", "DENY", "DELAY"}

    healthy = await _replay(pg_dsn)
    assert healthy == {"replayed": 7, "mismatches": [], "not_replayable": []}

    # One GPU-hour more held on mix/4's first budget than the script really read.
    await _sql(
        pg_dsn,
        "UPDATE decisions SET readings = jsonb_set(readings, '{ledger,0,reserved}', to_jsonb((readings #>> "
        "'{ledger,0,reserved}')::bigint + 3600000)) WHERE run_id = 'mix/4'",
    )
    corrupted = await _replay(pg_dsn)
    assert corrupted["replayed"] == 7
    [mismatch] = corrupted["mismatches"]
    assert mismatch["run_id"] == "mix/4" and mismatch["stored"] == mismatch["recomputed"] == "ALLOW"
    assert "remaining" in mismatch["reason"] and "stored" in mismatch["reason"]

    # A decision from before readings were recorded is not replayable, and no mismatch.
    await _sql(pg_dsn, "UPDATE decisions SET readings = NULL WHERE run_id = 'mix/1'")
    older = await _replay(pg_dsn)
    assert older["replayed"] == 6 and [n["run_id"] for n in older["not_replayable"]] == ["mix/1"]
    assert [m["run_id"] for m in older["mismatches"]] == ["mix/4"]

    scoped = await _replay(pg_dsn, scope="gpu-budget/team-vision-research")
    assert scoped["replayed"] == 2 and [m["run_id"] for m in scoped["mismatches"]] == ["mix/4"]


async def test_replay_and_explain_on_the_command_line(admission, pg_dsn, tmp_path, monkeypatch) -> None:
    await admission.submit(run_id="cli/1")
    await admission.submit(run_id="cli/2", labels={"team": "vision"})
    monkeypatch.setenv("BUDGETGATE_POSTGRES_DSN", pg_dsn)
    done = budgetgate("replay", "--since", "1d", "--json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"replayed": 2, "mismatches": [], "not_replayable": []}

    await _sql(pg_dsn, "UPDATE decisions SET readings = jsonb_set(readings, '{ledger,0,consumed}', to_jsonb(1)) WHERE run_id = 'cli/1'")
    text = budgetgate("replay", "--since", "1d", cwd=tmp_path)
    assert text.returncode == 1
    assert "replayed 2 decisions: 1 mismatches" in text.stdout and "cli/1" in text.stdout

    explained = budgetgate("explain", "cli/2", cwd=tmp_path)
    assert explained.returncode == 0, explained.stderr
    assert "stored DENY, recomputed DENY — identical" in explained.stdout
    assert "lacks its required label(s) cost-center" in explained.stdout


async def test_explain_says_a_soft_or_dry_run_policy_missing_labels_is_recorded_not_enforced(admission_factory, pg_dsn) -> None:
    trials = {
        f"{mode}.yaml": budget_yaml(f"{mode}-project", labels=f"{{team: vision, {label}: '*'}}", enforcement=mode, limit="gpu_hours: 1000")
        for mode, label in (("soft", "project"), ("dry-run", "owner"))
    }
    await apply_policies(pg_dsn, example_policies() | trials, sha="d" * 40)
    server = await admission_factory()
    await server.wait_ready()
    assert decision_of(await server.submit(run_id="trial/1")) == "ALLOW"  # no `project` nor `owner` label: both waived
    account = (await server.client.get("/v1/admissions/trial/1/explain")).json()["account"]
    for mode in ("soft", "dry-run"):
        [line] = [line for line in account if f"'{mode}-project'" in line and "lacks" in line]
        assert line.endswith(f"which is recorded, not enforced (a {mode} policy never blocks).") and "denies" not in line, line
