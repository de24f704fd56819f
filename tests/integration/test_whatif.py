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


QUOTA = "apiVersion: budgetgate/v1\nkind: Quota\nmetadata: {id: tenant-vision}\nspec: {tenant: vision, max_gpus: 12}\n"


async def _quota_history(admission_factory, pg_dsn):  # type: ignore[no-untyped-def]
    """w/1 holds 8 of the tenant's 12 GPUs, so admission refuses w/2 (8) for the quota; w/3 (4)
    fits both. 48 + 24 of the 100 GPU-hours are taken."""
    await apply_policies(pg_dsn, {"team.yaml": POLICY, "quota.yaml": QUOTA}, sha="e" * 40)
    server = await admission_factory()
    await server.wait_ready()
    answers = []
    for run_id, gpus in (("q/1", 8), ("q/2", 8), ("q/3", 4)):
        answers.append(
            (await server.submit(run_id=run_id, labels={"team": "vision"}, resources={"gpus": gpus, "nodes": 1}, projected_runtime_hours=6.0)).json()
        )
    assert [a["decision"] for a in answers] == ["ALLOW", "DENY", "ALLOW"]
    assert answers[1]["reason"].startswith('allocation rejected: tenant "vision" would exceed max_gpus quota')
    return server


async def test_a_quota_refusal_is_reported_apart_never_as_a_flip(admission_factory, pg_dsn, tmp_path, monkeypatch) -> None:
    await _quota_history(admission_factory, pg_dsn)
    monkeypatch.setenv("BUDGETGATE_POSTGRES_DSN", pg_dsn)
    unchanged = tmp_path / "unchanged"
    unchanged.mkdir()
    (unchanged / "team.yaml").write_text(POLICY)
    (unchanged / "quota.yaml").write_text(QUOTA)
    # Replayed without the quota, q/2 would be admitted and its 48 GPU-hours would leave q/3 no room.
    done = budgetgate("policy", "what-if", str(unchanged), "--since", "1d", "--json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["decisions"] == 3 and report["flips"] == []
    [skipped] = report["not_simulated"]
    assert (skipped["run_id"], skipped["outcome"], skipped["decided_by"], skipped["budgets_after"]) == ("q/2", "DENY", "tenant quota", "ALLOW")
    assert "max_gpus quota" in skipped["reason"] and report["not_simulated_by"] == {"tenant quota": 1}
    [team] = report["by_budget"]
    assert (team["admitted_gpu_hours_before"], team["admitted_gpu_hours_after"]) == (72.0, 72.0)

    text = budgetgate("policy", "what-if", str(unchanged), "--since", "1d", cwd=tmp_path)
    assert "3 decisions replayed, 0 would flip, 1 not simulated" in text.stdout
    assert "1 by tenant quota" in text.stdout and "= DENY  q/2 (attempt 1," in text.stdout

    # A budget change still flips what the budget decides: at 50 GPU-hours q/3's 24 no longer fit.
    (unchanged / "team.yaml").write_text(budget_yaml("team", labels="{team: vision}", limit="gpu_hours: 50"))
    lower = json.loads(budgetgate("policy", "what-if", str(unchanged), "--since", "1d", "--json", cwd=tmp_path).stdout)
    assert [(f["run_id"], f["before"], f["after"]) for f in lower["flips"]] == [("q/3", "ALLOW", "DENY")]
    assert [n["run_id"] for n in lower["not_simulated"]] == ["q/2"]


async def test_the_ci_script_passes_an_unchanged_repository_despite_quota_refusals(admission_factory, pg_dsn, tmp_path) -> None:
    await _quota_history(admission_factory, pg_dsn)
    repo = tmp_path / "policy-repo"
    (repo / "policies").mkdir(parents=True)
    (repo / "policies" / "team.yaml").write_text(POLICY)
    (repo / "policies" / "quota.yaml").write_text(QUOTA)
    git("init", "-q", cwd=repo)
    git("-c", "user.email=ci@example.com", "-c", "user.name=ci", "add", ".", cwd=repo)
    git("-c", "user.email=ci@example.com", "-c", "user.name=ci", "commit", "-qm", "policies as applied", cwd=repo)
    env = {
        **os.environ,
        "BUDGETGATE_POSTGRES_DSN": pg_dsn,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "BUDGETGATE_FAIL_ON_FLIPS": "1",
    }
    env.pop("BUDGETGATE_HOME", None)
    env.pop("GITHUB_STEP_SUMMARY", None)
    done = subprocess.run(["sh", str(SCRIPT), "policies", "1d"], cwd=repo, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    summary = (repo / "budgetgate-summary.md").read_text()
    assert "3 recorded decisions, 0 would flip" in summary
    assert "1 not simulated (1 by tenant quota)" in summary and "| `q/2` | 1 |" in summary
