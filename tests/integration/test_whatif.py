"""Policy what-if against real Postgres, Redis and Kafka: recorded submissions replayed against
a candidate folder, nothing live changed; and the example CI script run against the stack."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import asyncpg

from tests.support.admission import apply_policies, budget_yaml
from tests.support.policy_repos import git
from tests.support.cli import budgetgate

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "ci" / "policy-check.sh"
POLICY = budget_yaml("team", labels="{team: vision}", limit="gpu_hours: 100")


async def _history(admission_factory, pg_dsn):  # type: ignore[no-untyped-def]
    await apply_policies(pg_dsn, {"team.yaml": POLICY}, sha="b" * 40)
    server = await admission_factory()
    await server.wait_ready()
    outcomes = []
    for run_id, gpus in (("w/1", 8), ("w/2", 8), ("w/3", 2)):  # 48 + 48 + 12 GPU-hours of 100
        body = (await server.submit(run_id=run_id, labels={"team": "vision"}, resources={"gpus": gpus, "nodes": 1}, projected_runtime_hours=6.0)).json()
        outcomes.append(body["decision"])
    assert outcomes == ["ALLOW", "ALLOW", "DENY"]
    return server


async def _live(dsn: str) -> tuple:
    conn = await asyncpg.connect(dsn)
    try:
        queries = (
            "SELECT count(*) FROM decisions",
            "SELECT sum(amount) FROM reservations WHERE state = 'held'",
            "SELECT sum(consumed) FROM ledger_entries",
            "SELECT count(*) FROM policy_bundles",
        )
        return tuple([await conn.fetchval(q) for q in queries])
    finally:
        await conn.close()


def _folder(tmp_path: Path, name: str, limit: str) -> Path:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "team.yaml").write_text(budget_yaml("team", labels="{team: vision}", limit=f"gpu_hours: {limit}"))
    return folder


async def test_what_if_reports_flips_budget_changes_and_changes_nothing(admission_factory, pg_dsn, tmp_path, monkeypatch) -> None:
    server = await _history(admission_factory, pg_dsn)
    before = await _live(pg_dsn)
    redis_before = await server.rt.ledger.all_readings()
    monkeypatch.setenv("BUDGETGATE_POSTGRES_DSN", pg_dsn)

    same = budgetgate("policy", "what-if", str(_folder(tmp_path, "same", "100")), "--since", "1d", "--json", cwd=tmp_path)
    assert same.returncode == 0, same.stderr
    assert json.loads(same.stdout)["flips"] == [] and json.loads(same.stdout)["decisions"] == 3

    lower = budgetgate("policy", "what-if", str(_folder(tmp_path, "lower", "50")), "--since", "1d", "--json", cwd=tmp_path)
    report = json.loads(lower.stdout)
    assert [(f["run_id"], f["before"], f["after"]) for f in report["flips"]] == [("w/2", "ALLOW", "DENY")]
    [team] = report["by_budget"]
    assert (team["admitted_gpu_hours_before"], team["admitted_gpu_hours_after"], team["admitted_gpu_hours_change"]) == (96.0, 48.0, -48.0)
    assert team["exhausted_at"] is None  # 2 GPU-hours left; w/3's 12 were refused before and after

    higher = budgetgate("policy", "what-if", str(_folder(tmp_path, "higher", "108")), "--since", "1d", cwd=tmp_path)
    assert higher.returncode == 0, higher.stderr
    assert "1 would flip" in higher.stdout and "DENY -> ALLOW  w/3" in higher.stdout
    assert "admitted 96 -> 108 GPU-hours (+12)" in higher.stdout and "exhausted at" in higher.stdout

    assert await _live(pg_dsn) == before
    assert await server.rt.ledger.all_readings() == redis_before


async def test_the_example_ci_script_validates_diffs_and_replays(admission_factory, pg_dsn, tmp_path) -> None:
    await _history(admission_factory, pg_dsn)
    repo = tmp_path / "policy-repo"
    (repo / "policies").mkdir(parents=True)
    (repo / "policies" / "team.yaml").write_text(budget_yaml("team", labels="{team: vision}", limit="gpu_hours: 50"))
    git("init", "-q", cwd=repo)
    git("-c", "user.email=ci@example.com", "-c", "user.name=ci", "add", ".", cwd=repo)
    git("-c", "user.email=ci@example.com", "-c", "user.name=ci", "commit", "-qm", "lower the team budget", cwd=repo)
    env = {
        **os.environ,
        "BUDGETGATE_POSTGRES_DSN": pg_dsn,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "GITHUB_STEP_SUMMARY": str(tmp_path / "step.md"),
    }
    env.pop("BUDGETGATE_HOME", None)
    done = subprocess.run(["sh", str(SCRIPT), "policies", "1d"], cwd=repo, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    summary = (repo / "budgetgate-summary.md").read_text()
    assert "ok: 1 document(s), 1 budget(s)" in summary
    assert "~ budget team: limit 100 gpu-hours -> limit 50 gpu-hours" in summary
    assert "3 recorded decisions, 1 would flip" in summary and "| `w/2` | 1 |" in summary
    assert (tmp_path / "step.md").read_text() == summary

    flips = subprocess.run(
        ["sh", str(SCRIPT), "policies", "1d"], cwd=repo, env={**env, "BUDGETGATE_FAIL_ON_FLIPS": "1"}, capture_output=True, text=True, timeout=180
    )
    assert flips.returncode == 1
    (repo / "policies" / "team.yaml").write_text("apiVersion: budgetgate/v1\nkind: BudgetPolicy\nmetadata: {id: x}\nspec: {limt: 1}\n")
    broken = subprocess.run(["sh", str(SCRIPT), "policies", "1d"], cwd=repo, env=env, capture_output=True, text=True, timeout=180)
    assert broken.returncode == 1 and "policy validation failed" in (repo / "budgetgate-summary.md").read_text()
