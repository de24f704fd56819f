"""The audit views on seeded data, and every SQL panel of the provisioned Grafana dashboards run
against the real schema; the Prometheus panels name metrics the services really export."""

from __future__ import annotations

import json
import re
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from tests.support.marquez import EmitterServer, emitter_settings, http_client, marquez  # noqa: F401 - pytest fixture
from tests.support.metering import metering, metering_factory, metrics_after_one_sample  # noqa: F401 - pytest fixtures

ROOT = Path(__file__).resolve().parents[2]
DASHBOARDS = sorted((ROOT / "deploy" / "grafana" / "dashboards").glob("*.json"))
H = 3_600_000
SCOPE, PAST_SCOPE = "ns=seed;team=a", "ns=seed;team=b"
NOW = datetime.now(UTC)
START = NOW - timedelta(days=1)


def sql_targets() -> list[tuple[str, str, dict[str, Any]]]:
    """(dashboard, panel title, target) of every Postgres query, template variables included."""
    found = []
    for path in DASHBOARDS:
        board = json.loads(path.read_text())
        for variable in board.get("templating", {}).get("list", []):
            if variable.get("datasource", {}).get("uid") == "budgetgate-ledger":
                found.append((path.name, f"variable {variable['name']}", {"rawSql": variable["query"], "format": "table"}))
        for panel in board["panels"]:
            for target in panel.get("targets", []):
                if target.get("datasource", {}).get("uid") == "budgetgate-ledger":
                    found.append((path.name, panel["title"], target))
    return found


def rendered(sql: str) -> str:
    """The query as Grafana would send it for the last 60 days and every seeded scope."""
    sql = re.sub(r"\$__timeFilter\(([^)]+)\)", r"\1 BETWEEN now() - interval '60 days' AND now() + interval '1 day'", sql)
    sql = sql.replace("$__timeFrom()", "now() - interval '60 days'").replace("$__timeTo()", "now() + interval '1 day'")
    leftover = re.findall(r"\$\w+", sql.replace("$scope", ""))
    assert not leftover, f"unhandled macros or variables {leftover}"
    return sql.replace("$scope", f"'{SCOPE}','{PAST_SCOPE}'")


async def seed(conn: asyncpg.Connection) -> None:
    """Two budgets: one a day into a 10-day window at 20 of 100 GPU-hours, one whose past window ran out."""
    key, past = f"{SCOPE}|seed|gpu_hours", f"{PAST_SCOPE}|past|gpu_hours"
    await conn.execute(
        """INSERT INTO ledger_entries (ledger_key, scope_id, unit, window_key, window_start, window_end, policy_id, policy_git_sha, limit_amount, consumed)
           VALUES ($1, $2, 'gpu_hours', 'seed', $3, $4, 'team-a', 'sha1', $5, $6), ($7, $8, 'gpu_hours', 'past', $9, $10, 'team-b', 'sha1', $11, 0)""",
        key, SCOPE, START, START + timedelta(days=10), 100 * H, 10 * H,
        past, PAST_SCOPE, NOW - timedelta(days=40), NOW - timedelta(days=10), 50 * H,
    )  # fmt: skip
    rows = [  # run, attempt, outcome, key, scope, remaining, admitted, deficit, at, sha
        ("r1", 1, "ALLOW", key, SCOPE, 90 * H, 10 * H, None, NOW - timedelta(hours=12), "sha1"),
        ("r3", 1, "DELAY", key, SCOPE, 80 * H, 0, 0, NOW - timedelta(hours=6), "sha1"),
        ("r3", 2, "ALLOW", key, SCOPE, 90 * H, 0, None, NOW - timedelta(hours=5), "sha2"),
        ("r2", 1, "DENY", past, PAST_SCOPE, 0, 0, 48 * H, NOW - timedelta(days=20), "sha1"),
    ]
    for run, attempt, outcome, ledger_key, scope, remaining, admitted, deficit, at, sha in rows:
        decision_id = uuid.uuid4()
        await conn.execute(
            """INSERT INTO decisions (decision_id, run_id, attempt, outcome, reason, namespace, labels, job_namespace, job_name,
                                      policy_bundle_sha, projected_gpu, request, response, decided_at)
               VALUES ($1, $2, $3, $4, 'seeded', 'seed', '{}', 'seed', 'job', $5, $6, '{}', '{}', $7)""",
            decision_id, run, attempt, outcome, sha, 48 * H if outcome == "DENY" else 10 * H, at,
        )  # fmt: skip
        await conn.execute(
            """INSERT INTO decision_evaluations (decision_id, policy_id, policy_git_sha, scope_id, ledger_key, window_start, window_end,
                                                 unit, enforcement, outcome, limit_amount, projected, remaining, admitted, deficit, decided_at)
               VALUES ($1, $2, $3, $4, $5, NULL, NULL, 'gpu_hours', 'hard', $6, $7, $8, $9, $10, $11, $12)""",
            decision_id, "team-a" if scope == SCOPE else "team-b", sha, scope, ledger_key, outcome,
            100 * H if scope == SCOPE else 50 * H, 48 * H if outcome == "DENY" else 10 * H, remaining, admitted, deficit, at,
        )  # fmt: skip
        if run == "r1":
            await conn.execute(
                "INSERT INTO reservations (run_id, ledger_key, decision_id, amount, expected_end) VALUES ('r1', $1, $2, $3, $4)",
                ledger_key, decision_id, 10 * H, NOW + timedelta(hours=1),
            )  # fmt: skip
    for seq, state in enumerate(("delivered", "pending", "dead"), start=1):
        await conn.execute(
            """INSERT INTO evidence_events (source_event_id, stage, run_id, run_uuid, event_type, event_time, payload, state, created_at)
               VALUES ($1, 'decision', 'r1', $2, 'START', now(), '{}', $3, now() - interval '2 minutes')""",
            f"e{seq}", uuid.uuid4(), state,
        )  # fmt: skip
    await conn.execute("INSERT INTO evidence_dead_letters (seq, status_code, body) SELECT seq, 400, 'no' FROM evidence_events WHERE state = 'dead'")
    await conn.execute(
        """INSERT INTO evidence_reconciliations (event_id, run_id, final_state, terminal, provisional, policy_git_sha, projected_gpu, actual_gpu, reconciled_at)
           VALUES ('rec1', 'r1', 'COMPLETED', true, false, 'sha1', $1, $2, now())""",
        10 * H, 12 * H,
    )  # fmt: skip
    await conn.execute(
        """INSERT INTO evidence_reconciliation_charges (event_id, ledger_key, scope_id, window_key, policy_id, unit, amount)
           VALUES ('rec1', $1, $2, 'seed', 'team-a', 'gpu_hours', $3)""",
        key, SCOPE, 12 * H,
    )  # fmt: skip


@pytest.fixture
async def seeded(pg_dsn: str):  # type: ignore[no-untyped-def]
    conn = await asyncpg.connect(pg_dsn)
    await seed(conn)
    yield conn
    await conn.close()


async def test_views_answer_the_design_questions(seeded: asyncpg.Connection) -> None:
    denial = {(r["scope_id"], r["window_key"]): r for r in await seeded.fetch("SELECT * FROM audit_denial_rate")}
    assert (denial[(SCOPE, "seed")]["runs"], denial[(SCOPE, "seed")]["denied"]) == (2, 0)  # r3 counts once, by its ALLOW
    assert float(denial[(PAST_SCOPE, "past")]["denial_rate"]) == 1.0
    [error] = await seeded.fetch("SELECT * FROM audit_reservation_error")
    assert (error["scope_id"], error["runs"], error["error_gpu"], float(error["error_ratio"])) == (SCOPE, 1, 2 * H, 0.2)
    exhaustion = {r["policy_id"]: r for r in await seeded.fetch("SELECT * FROM audit_window_exhaustion")}
    # 20 GPU-hours (10 consumed, 10 held) of 100 in the first day or so: at that rate the budget is
    # gone after five times as long.
    elapsed = await seeded.fetchval("SELECT now()") - START
    projected = exhaustion["team-a"]["projected_exhaustion_at"]
    assert exhaustion["team-a"]["exhausted_at"] is None and abs(projected - (START + 5 * elapsed)) < timedelta(minutes=1)
    assert exhaustion["team-a"]["burn_per_hour"] == pytest.approx(20 * H / 24, rel=0.01)
    # The past budget ran out when it turned away a run that would have fitted it empty.
    assert exhaustion["team-b"]["exhausted_at"] is not None and exhaustion["team-b"]["projected_exhaustion_at"] is None
    by_sha = {(r["policy_id"], r["policy_git_sha"]): r for r in await seeded.fetch("SELECT * FROM audit_decisions_by_policy_sha")}
    assert (by_sha[("team-a", "sha1")]["allowed"], by_sha[("team-a", "sha1")]["delayed"], by_sha[("team-a", "sha2")]["allowed"]) == (1, 1, 1)
    backlog = await seeded.fetchrow("SELECT * FROM audit_evidence_backlog")
    assert (backlog["pending"], backlog["dead"], backlog["delivered"]) == (1, 1, 1) and backlog["oldest_pending_seconds"] >= 100


@pytest.mark.parametrize(("dashboard", "title", "target"), sql_targets(), ids=lambda v: v if isinstance(v, str) else None)
async def test_every_sql_panel_runs_on_the_real_schema(seeded: asyncpg.Connection, dashboard: str, title: str, target: dict[str, Any]) -> None:
    rows = await seeded.fetch(rendered(target["rawSql"]))
    assert rows, f"{dashboard} / {title} returned nothing on seeded data"
    if target.get("format") == "time_series":
        assert list(rows[0].keys())[0] == "time" and isinstance(rows[0]["time"], datetime)


def test_dashboards_have_sql_panels() -> None:
    assert len(DASHBOARDS) >= 2 and len(sql_targets()) >= 8


async def test_prometheus_panels_name_exported_metrics(settings, admission, marquez, metering) -> None:  # type: ignore[no-untyped-def]
    assert (await admission.submit()).status_code == 200
    emitter = await EmitterServer(emitter_settings(settings), http_client(marquez.url)).start()
    try:
        exported = (await admission.client.get("/metrics")).text + (await emitter.client.get("/metrics")).text
        exported += await metrics_after_one_sample(metering, settings.postgres_dsn)
    finally:
        await emitter.stop()
    names = set()
    for path in DASHBOARDS:
        for panel in json.loads(path.read_text())["panels"]:
            for target in panel.get("targets", []):
                names |= set(re.findall(r"budgetgate_[a-z_]+", target.get("expr", "")))
    assert names, "no Prometheus panels found"
    missing = sorted(n for n in names if not re.search(rf"^{n}[{{ ]", exported, re.M))
    assert not missing, f"panels query metrics nobody exports: {missing}"


async def test_denial_rate_over_time_counts_runs_as_the_table_does(seeded: asyncpg.Connection) -> None:
    [target] = [t for _, title, t in sql_targets() if title == "Denial rate over time"]
    points = [(r["time"], r["denial_rate"]) for r in await seeded.fetch(rendered(target["rawSql"]))]
    latest = await seeded.fetch("SELECT DISTINCT ON (run_id) outcome, date_trunc('hour', decided_at) AS hour FROM decisions ORDER BY run_id, attempt DESC")
    # Each run once, at its latest decision: r3's DELAY, later allowed on attempt 2, is no point of its own.
    assert points == sorted((r["hour"], 1.0 if r["outcome"] == "DENY" else 0.0) for r in latest)
    assert len(points) == 3
