"""The audit views and `budgetgate audit`, from Postgres and from Marquez (the stand-in), on data
made by the real admission service and the evidence-emitter: the two sources agree."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any


from budgetgate.messaging.publisher import Publisher
from budgetgate.evidence.audit import WindowFilter, marquez_report, marquez_runs
from budgetgate.contracts.topics import Topics
from budgetgate.messaging.topic_admin import ensure_topics
from tests.support.admission import apply_policies, budget_yaml, decision_of
from tests.support.marquez import EmitterServer, admission_decision, emitter_settings, http_client, reconciliation
from tests.support.marquez import marquez  # noqa: F401 - pytest fixtures

TEAM = "ns=vision-prod;team=vision"
ORG = "ns=vision-prod"
RESEARCH = "ns=vision-research;team=vision"
POLICIES = {
    "team.yaml": budget_yaml("team", limit="gpu_hours: 100"),
    "org.yaml": budget_yaml("org", labels="{}", limit="gpu_hours: 1000", enforcement="soft"),
    "research.yaml": budget_yaml("research", namespace="vision-research", limit="gpu_hours: 60", on_exhausted="delay"),
}


def audit_cli(pg_dsn: str, cwd: Path, *args: str) -> dict[str, Any]:
    env = {"BUDGETGATE_POSTGRES_DSN": pg_dsn, "PATH": "/usr/bin:/bin"}
    done = subprocess.run(
        [sys.executable, "-m", "budgetgate.cli.main", "audit", *args, "--json"], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


async def test_postgres_and_marquez_agree(settings, pg_dsn, admission_factory, marquez, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    await ensure_topics(settings.kafka_bootstrap, prefix=settings.topic_prefix)
    await apply_policies(pg_dsn, POLICIES, sha="d" * 40)
    admission = await admission_factory()
    await admission.wait_ready()
    emitter = await EmitterServer(emitter_settings(settings), http_client(marquez.url)).start()
    try:
        answers = {}
        for run, overrides in [
            ("p1", {}),
            ("p2", {"resources": {"gpus": 4, "nodes": 1}}),
            ("p3", {}),  # 48 + 24 fit in 100; the next 48 does not
            ("p4", {"projected_runtime_hours": 1.0}),
            ("p5", {"labels": {"environment": "prod"}}),  # 8 fits; p5 lacks team
            ("r1", {"namespace": "vision-research"}),
            ("r2", {"namespace": "vision-research"}),
        ]:
            response = await admission.submit(run_id=run, **overrides)
            assert response.status_code == 200, response.text
            answers[run] = response.json()
        # r2 waits, and is resubmitted (attempt 2): it is still delayed, and counts once.
        assert decision_of(await admission.submit(run_id="r2", namespace="vision-research", attempt=2)) == "DELAY"
        assert {r: a["decision"] for r, a in answers.items()} == {
            "p1": "ALLOW",
            "p2": "ALLOW",
            "p3": "DENY",
            "p4": "ALLOW",
            "p5": "DENY",
            "r1": "ALLOW",
            "r2": "DELAY",
        }

        topics = Topics(settings.topic_prefix)
        settled = [
            reconciliation(admission_decision(answers["p1"], "p1"), "COMPLETED", actual_hours=40, provisional=True),
            reconciliation(admission_decision(answers["p1"], "p1"), "COMPLETED", actual_hours=44),  # replaces the provisional one
            reconciliation(admission_decision(answers["p2"], "p2"), "FAILED", actual_hours=30),
            reconciliation(admission_decision(answers["p4"], "p4"), "RUNNING", actual_hours=2, provisional=True),  # still running
            reconciliation(admission_decision(answers["r1"], "r1", job=("vision-research", "sweep")), "CANCELLED", actual_hours=0),
        ]
        async with Publisher(settings.kafka_bootstrap) as publisher:
            for message in settled:
                await publisher.send(topics.reconciliations, message, key=message.run_id)
        await marquez.wait_for(8 + len(settled))
        assert marquez.invalid == []
    finally:
        await emitter.stop()

    now = datetime.now(UTC).strftime("%Y-%m")
    for scope in (TEAM, ORG, RESEARCH):
        from_pg = await asyncio.to_thread(audit_cli, pg_dsn, tmp_path, "--scope", scope)
        from_marquez = await asyncio.to_thread(audit_cli, pg_dsn, tmp_path, "--scope", scope, "--marquez", marquez.url)
        assert from_pg["denial_rate"] == from_marquez["denial_rate"], scope
        assert from_pg["reservation_error"] == from_marquez["reservation_error"], scope
    paged = marquez_report(marquez_runs(marquez.url, page=2), TEAM, WindowFilter())
    assert paged["denial_rate"] == from_pg_team(pg_dsn, tmp_path)["denial_rate"]

    team = await asyncio.to_thread(audit_cli, pg_dsn, tmp_path, "--scope", TEAM, "--window", now)
    [denial] = team["denial_rate"]
    # p5 was denied for a missing label before any ledger: it counts in no team window.
    assert (denial["runs"], denial["allowed"], denial["denied"], denial["delayed"], denial["denial_rate"]) == (4, 3, 1, 0, 0.25)
    [error] = team["reservation_error"]
    # p1 reserved 48, used 44; p2 reserved 24, failed after 30; p4 is still running.
    assert (error["runs"], error["reserved_gpu_hours"], error["actual_gpu_hours"], error["error_gpu_hours"]) == (2, 72.0, 74.0, 2.0)
    assert error["policy_git_sha"] == "d" * 40 and error["provisional_runs"] == 0
    [exhausted] = team["window_exhaustion"]
    # p3 was turned away with 28 GPU-hours left, and p4 then fitted: the budget never ran out.
    assert exhausted["policy_id"] == "team" and exhausted["exhausted_at"] is None
    [by_sha] = team["decisions_by_policy_sha"]
    # What this revision of the team policy answered in the window; p5's label check, decided
    # before any window, is in no window (as in the denial rate) ...
    assert (by_sha["policy_git_sha"], by_sha["decisions"], by_sha["allowed"], by_sha["denied"]) == ("d" * 40, 4, 3, 1)
    # ... and counts when no window is asked for.
    [all_time] = (await asyncio.to_thread(from_pg_team, pg_dsn, tmp_path))["decisions_by_policy_sha"]
    assert (all_time["decisions"], all_time["allowed"], all_time["denied"]) == (5, 3, 2)

    org = await asyncio.to_thread(audit_cli, pg_dsn, tmp_path, "--scope", ORG)
    [org_denial] = org["denial_rate"]
    assert (org_denial["runs"], org_denial["denied"]) == (5, 2)  # the soft budget sees p5 too, and its denial
    [org_exhaustion] = org["window_exhaustion"]
    # 80 of 1000 GPU-hours used: not run out (whether the burn rate projects it to run out before
    # the month ends depends on the day this runs; test_audit_views covers the projection).
    assert org_exhaustion["exhausted_at"] is None
    # In GPU-hours, as a person reads them.
    assert (org_exhaustion["limit"], org_exhaustion["used"], org_exhaustion["remaining"]) == (1000.0, 80.0, 920.0)

    research = await asyncio.to_thread(audit_cli, pg_dsn, tmp_path, "--scope", RESEARCH)
    assert [(d["runs"], d["delayed"]) for d in research["denial_rate"]] == [(2, 1)]
    [cancelled] = research["reservation_error"]
    assert (cancelled["reserved_gpu_hours"], cancelled["actual_gpu_hours"], cancelled["error_ratio"]) == (48.0, 0.0, -1.0)

    elsewhere = await asyncio.to_thread(audit_cli, pg_dsn, tmp_path, "--scope", TEAM, "--window", "1999-01")
    # --window narrows every section, decisions by policy SHA included.
    for section in ("denial_rate", "reservation_error", "window_exhaustion", "decisions_by_policy_sha"):
        assert elsewhere[section] == [], section
    by_policy_id = await asyncio.to_thread(audit_cli, pg_dsn, tmp_path, "--scope", "team", "--window", now)
    assert by_policy_id["scope"] == TEAM and by_policy_id["denial_rate"] == team["denial_rate"]


def from_pg_team(pg_dsn: str, cwd: Path) -> dict[str, Any]:
    return audit_cli(pg_dsn, cwd, "--scope", TEAM)


async def test_audit_prints_tables(pg_dsn, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    await apply_policies(pg_dsn, POLICIES, sha="d" * 40)  # the scope is known from the active bundle
    env = {"BUDGETGATE_POSTGRES_DSN": pg_dsn, "PATH": "/usr/bin:/bin"}
    done = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "budgetgate.cli.main", "audit", "--scope", TEAM],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "Denial rate" in done.stdout and "(none)" in done.stdout and "Decisions by policy SHA" in done.stdout


async def test_an_unknown_scope_exits_1_with_a_clear_message(pg_dsn, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    await apply_policies(pg_dsn, POLICIES, sha="d" * 40)
    env = {"BUDGETGATE_POSTGRES_DSN": pg_dsn, "PATH": "/usr/bin:/bin"}
    done = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "budgetgate.cli.main", "audit", "--scope", "ns=typo"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert "Error: unknown scope 'ns=typo'" in done.stderr and "budgetgate budgets" in done.stderr
