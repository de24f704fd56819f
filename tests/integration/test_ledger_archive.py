"""`budgetgate ledger archive` and `restore` on real Postgres: months of decisions past the
retention go to verified files and out of Postgres, a month still worked on stays (with why), a
failure midway leaves Postgres as it was and a second run finishes; a restored month reads as it
did; an archived decision is answered as archived, not as unknown, by admission, explain and
replay."""

from __future__ import annotations

import gzip
import json
import shutil
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from budgetgate.ledger.archive import ArchiveError, Kept, archive, archived_decision, load_manifest, restore, verify_file
from budgetgate.ledger.partitions import partitions
from budgetgate.reports.chargeback import ReportError, ReportRequest, chargeback
from tests.support.cli import budgetgate_on

H = 3_600_000
JAN, FEB, MAR = (datetime(2025, m, 10, tzinfo=UTC) for m in (1, 2, 3))
RETENTION = 12  # months; the tests' clock is well past 2026-03, so January to March 2025 are older


async def _decide(
    conn: asyncpg.Connection, run_id: str, at: datetime, *, outcome: str = "ALLOW", attempt: int = 1, state: str = "reconciled", note: str = ""
) -> uuid.UUID:
    """A decision with an evaluation; an ALLOW with a reservation in `state` and a settlement to
    its end (`held`: the run is still going)."""
    decision_id = uuid.uuid4()
    request = {"run_id": run_id, "attempt": attempt, "namespace": "vision", "labels": {"team": "vision"}, "note": note}
    await conn.execute(
        "INSERT INTO decisions (decision_id, run_id, attempt, outcome, reason, namespace, labels, projected_gpu, request, response, decided_at, readings) "
        "VALUES ($1, $2, $3, $4, $5, 'vision', '{\"team\": \"vision\"}', $6, $7, $8, $9, $10)",
        decision_id, run_id, attempt, outcome, f"seeded, with a line break\nand \"quotes\", {note}", 2 * H, json.dumps(request),
        json.dumps({"decision": outcome, "run_id": run_id}), at, json.dumps({"ledger": [{"ledger_key": "k", "note": "x" * 200_000}]}),
    )  # fmt: skip
    await conn.execute(
        "INSERT INTO decision_evaluations (decision_id, policy_id, policy_git_sha, scope_id, ledger_key, unit, enforcement, outcome, limit_amount, "
        "projected, remaining, admitted, decided_at) VALUES ($1, 'team-vision', 'sha', 'team=vision', 'k', 'gpu_hours', 'hard', $2, $3, $4, $5, $6, $7)",
        decision_id, outcome, 100 * H, 2 * H, 90 * H, 2 * H if outcome == "ALLOW" else 0, at,
    )  # fmt: skip
    if outcome == "ALLOW":
        await conn.execute(
            "INSERT INTO reservations (run_id, ledger_key, decision_id, amount, state, expected_end) VALUES ($1, 'k', $2, $3, $4, $5)",
            run_id, decision_id, 2 * H, state, at + timedelta(hours=2),
        )  # fmt: skip
        await conn.execute(
            "INSERT INTO run_settlements (run_id, decision_id, phase, final, projected_gpu) VALUES ($1, $2, $3, $4, $5)",
            run_id, decision_id, "running" if state == "held" else "ended", state != "held", 2 * H,
        )  # fmt: skip
    return decision_id


async def _sample(conn: asyncpg.Connection, run_id: str, at: datetime, sample_id: str = "s1") -> None:
    await conn.execute(
        "INSERT INTO usage_records (run_id, sample_id, observed_at, gpu_milli_hours, node_milli_hours, gpu_milli_hours_cumulative, "
        "node_milli_hours_cumulative, gpu_milli_hours_delta, node_milli_hours_delta, late, exporter, source, event_id) "
        "VALUES ($1, $2, $3, $4, 0, $4, 0, $4, 0, false, 'test', 'http', $1 || '/' || $2)",
        run_id, sample_id, at, H,
    )  # fmt: skip


async def _rows(conn: asyncpg.Connection, table: str, start: datetime, end: datetime) -> list[Any]:
    return [
        r[0] for r in await conn.fetch(f"SELECT to_jsonb(t) FROM {table} t WHERE decided_at >= $1 AND decided_at < $2 ORDER BY to_jsonb(t)::text", start, end)
    ]


@pytest.fixture
async def conn(pg_dsn: str):  # type: ignore[no-untyped-def]
    conn = await asyncpg.connect(pg_dsn)
    yield conn
    await conn.close()


async def test_months_past_the_retention_are_archived_verified_dropped_and_restored(conn: asyncpg.Connection, tmp_path: Path) -> None:
    await _decide(conn, "jan/a", JAN, note="é ✓")
    await _decide(conn, "jan/a", JAN + timedelta(days=1), outcome="DENY", attempt=2)
    await _decide(conn, "feb/b", FEB)
    await _decide(conn, "mar/c", MAR, state="held")  # still running: its month must stay
    await _decide(conn, "now/d", datetime.now(UTC))
    await _sample(conn, "jan/a", JAN + timedelta(hours=1))
    await _sample(conn, "jan/a", JAN + timedelta(hours=2), "s2")
    await _sample(conn, "mar/c", MAR + timedelta(hours=1))
    january = await _rows(conn, "decisions", JAN.replace(day=1), FEB.replace(day=1))
    january_evaluations = await _rows(conn, "decision_evaluations", JAN.replace(day=1), FEB.replace(day=1))

    report = await archive(conn, retention_months=RETENTION, directory=tmp_path)

    archived = [(a.series, f"{a.month:%Y-%m}", a.rows) for a in report.archived]
    assert archived == [("usage", "2025-01", 2), ("decisions", "2025-01", 4), ("decisions", "2025-02", 2)]
    assert [(k.series, f"{k.month:%Y-%m}", k.refused) for k in report.kept] == [("usage", "2025-03", True), ("decisions", "2025-03", True)]
    kept = report.kept[1]
    assert {r.reason for r in kept.reasons} == {"a reservation is held", "it is not settled to its end"}
    assert all(r.examples == ("mar/c",) for r in kept.reasons)
    assert "decisions 2025-03 refused: 1 run(s) because a reservation is held ('mar/c')" in str(kept)
    with pytest.raises(ReportError, match="the usage of 2025-01 is archived"):
        await chargeback(conn, None, ReportRequest.parse("2024-12-01", "2025-03-01"), tenant_label="team", user_label="user")
    assert (await chargeback(conn, None, ReportRequest.parse("2025-03-01", "2025-04-01"), tenant_label="team", user_label="user"))["rows"]

    names = {p.name for p in await partitions(conn)}
    assert not names & {"decisions_p202501", "decisions_p202502", "decision_evaluations_p202501", "decision_evaluations_p202502"}
    assert {"decisions_p202503", "decision_evaluations_p202503"} <= names
    assert await conn.fetchval("SELECT count(*) FROM decisions WHERE decided_at < '2025-03-01Z'") == 0
    assert await conn.fetchval("SELECT count(*) FROM decision_keys") == 5  # the keys stay
    manifest_path = tmp_path / "decisions" / "2025-01" / "manifest.json"
    manifest = load_manifest(manifest_path)
    assert manifest["range"] == {"from": "2025-01-01T00:00:00Z", "to": "2025-02-01T00:00:00Z"}
    assert [(t["table"], t["partition"], t["rows"]) for t in manifest["tables"]] == [
        ("decisions", "decisions_p202501", 2),
        ("decision_evaluations", "decision_evaluations_p202501", 2),
    ]
    for t in manifest["tables"]:
        assert verify_file(manifest_path.parent / t["file"]) == (t["rows"], t["sha256"])
    with gzip.open(manifest_path.parent / "decisions_p202501.csv.gz", "rt") as f:
        assert f.readline().startswith("decision_id,run_id,attempt,outcome,")
    recorded = await conn.fetch("SELECT partition, row_count, location FROM ledger_archives ORDER BY partition")
    assert [(r["partition"], r["row_count"]) for r in recorded] == [
        ("decision_evaluations_p202501", 2), ("decision_evaluations_p202502", 1), ("decisions_p202501", 2), ("decisions_p202502", 1),
        ("usage_records_p202501", 2),
    ]  # fmt: skip
    assert {r["location"] for r in recorded if r["partition"].startswith("decision") and r["partition"].endswith("202501")} == {str(manifest_path.resolve())}

    gone = await archived_decision(conn, "jan/a")
    assert gone is not None and (gone.attempt, gone.partition, gone.location) == (2, "decisions_p202501", str(manifest_path.resolve()))
    assert await archived_decision(conn, "mar/c") is None and await archived_decision(conn, "nobody") is None

    # Again: nothing more to do, the running month still refused; an archived month is not
    # created again (a row of it would wait in the default partition).
    again = await archive(conn, retention_months=RETENTION, directory=tmp_path)
    assert again.archived == [] and [(k.series, f"{k.month:%Y-%m}") for k in again.kept] == [("usage", "2025-03"), ("decisions", "2025-03")]
    assert await conn.fetchval("SELECT budgetgate_ensure_month('decisions', $1)", JAN) is False

    restored = await restore(conn, manifest_path)
    assert (restored.series, restored.month, restored.tables) == ("decisions", "2025-01", (("decisions_p202501", 2), ("decision_evaluations_p202501", 2)))
    assert await _rows(conn, "decisions", JAN.replace(day=1), FEB.replace(day=1)) == january
    assert await _rows(conn, "decision_evaluations", JAN.replace(day=1), FEB.replace(day=1)) == january_evaluations
    assert await archived_decision(conn, "jan/a") is None
    assert await conn.fetchval("SELECT count(*) FROM ledger_archives") == 3
    usage = await restore(conn, tmp_path / "usage" / "2025-01" / "manifest.json")
    assert usage.tables == (("usage_records_p202501", 2),)
    assert await conn.fetchval("SELECT count(*) FROM usage_records WHERE run_id = 'jan/a'") == 2
    with pytest.raises(ArchiveError, match="decisions_p202501 exists"):
        await restore(conn, manifest_path)

    # A file changed, or cut short, since it was archived is refused before anything is loaded.
    february = tmp_path / "decisions" / "2025-02"
    cut = tmp_path / "cut"
    shutil.copytree(february, cut)
    whole = (cut / "decisions_p202502.csv.gz").read_bytes()
    (cut / "decisions_p202502.csv.gz").write_bytes(whole[: len(whole) // 2])
    with pytest.raises(ArchiveError, match="cannot be read whole"):
        await restore(conn, cut / "manifest.json")
    with open(february / "decisions_p202502.csv.gz", "ab") as f:
        f.write(b"\0")
    with pytest.raises(ArchiveError, match="not the one archived"):
        await restore(conn, february / "manifest.json")
    assert "decisions_p202502" not in {p.name for p in await partitions(conn)}


async def test_a_failure_midway_leaves_postgres_as_it_was_and_a_second_run_finishes(conn: asyncpg.Connection, pg_dsn: str, tmp_path: Path) -> None:
    await _decide(conn, "jan/a", JAN)
    await archive(conn, retention_months=RETENTION, directory=tmp_path, dry_run=True)  # changes nothing
    assert "decisions_p202501" not in {p.name for p in await partitions(conn)}  # still in the default partition
    await conn.execute("SELECT budgetgate_ensure_partitions('decisions', 0), budgetgate_ensure_partitions('decision_evaluations', 0)")
    # A reader keeps `decisions` open: the detach, after the files are written, is not granted its lock.
    reader = await asyncpg.connect(pg_dsn)
    try:
        tx = reader.transaction()
        await tx.start()
        await reader.fetchval("SELECT count(*) FROM decisions")
        report = await archive(conn, retention_months=RETENTION, directory=tmp_path, lock_timeout=0.2, tries=2)
        [kept] = report.kept
        assert report.archived == [] and kept.refused and "a lock was not granted within 0.2s, 2 times" in str(kept)
        assert (tmp_path / "decisions" / "2025-01" / "decisions_p202501.csv.gz").exists()  # written, then rolled back around it
        assert {"decisions_p202501", "decision_evaluations_p202501"} <= {p.name for p in await partitions(conn)}
        assert await conn.fetchval("SELECT count(*) FROM ledger_archives") == 0
        assert await conn.fetchval("SELECT count(*) FROM decisions WHERE run_id = 'jan/a'") == 1
        await tx.rollback()
    finally:
        await reader.close()
    report = await archive(conn, retention_months=RETENTION, directory=tmp_path)
    assert [f"{a.month:%Y-%m}" for a in report.archived] == ["2025-01"] and report.kept == []
    assert await conn.fetchval("SELECT count(*) FROM decisions WHERE run_id = 'jan/a'") == 0


async def test_a_month_whose_runs_have_usage_in_a_kept_month_waits(conn: asyncpg.Connection, tmp_path: Path) -> None:
    # Chargeback of this month reads the decisions of the runs it metered: a run decided in a month
    # past the retention whose usage goes on into a kept month keeps its month waiting (no error).
    await _decide(conn, "jan/long", JAN)
    await conn.execute(
        "INSERT INTO usage_records (run_id, sample_id, observed_at, gpu_milli_hours, node_milli_hours, gpu_milli_hours_cumulative, "
        "node_milli_hours_cumulative, gpu_milli_hours_delta, node_milli_hours_delta, late, exporter, source, event_id) "
        "VALUES ('jan/long', 's1', now(), 1, 0, 1, 0, 1, 0, false, 'test', 'http', 'e1')"
    )
    report = await archive(conn, retention_months=RETENTION, directory=tmp_path)
    [kept] = report.kept
    assert isinstance(kept, Kept) and not kept.refused and report.refused == [] and report.archived == []
    assert "decisions 2025-01 waits: 1 run(s) because its run has usage in a month kept" in str(kept)


async def test_archived_decisions_are_answered_as_archived(admission, pg_dsn: str, settings: Any, tmp_path: Path) -> None:
    # A decision made by admission, copied to a run of January 2025 and archived from there.
    assert (await admission.submit(run_id="live/1")).status_code == 200
    conn = await asyncpg.connect(pg_dsn)
    try:
        old = uuid.uuid4()
        await conn.execute(
            "INSERT INTO decisions (decision_id, run_id, attempt, outcome, reason, namespace, labels, job_namespace, job_name, policy_bundle_sha, "
            "projected_gpu, showback_micros, currency, request, response, decided_at, gpus, nodes, flavor, region, readings, override_revision) "
            "SELECT $1, 'old/1', attempt, outcome, reason, namespace, labels, job_namespace, job_name, policy_bundle_sha, projected_gpu, showback_micros, "
            "currency, jsonb_set(request, '{run_id}', '\"old/1\"'), jsonb_set(response, '{run_id}', '\"old/1\"'), $2, gpus, nodes, flavor, region, "
            "readings, override_revision FROM decisions WHERE run_id = 'live/1'",
            old, JAN,
        )  # fmt: skip
        await conn.execute(
            "INSERT INTO decision_evaluations SELECT (jsonb_populate_record(e, jsonb_build_object('decision_id', $1::uuid, 'decided_at', $2::timestamptz))).* "
            "FROM decision_evaluations e JOIN decisions d ON d.decision_id = e.decision_id WHERE d.run_id = 'live/1'",
            old, JAN,
        )  # fmt: skip
        evaluations = await conn.fetchval("SELECT count(*) FROM decision_evaluations WHERE decision_id = $1", old)
        assert evaluations > 0
    finally:
        await conn.close()
    archives = tmp_path / "archives"
    done = await budgetgate_on(settings, "ledger", "archive", "--to", str(archives), "--retention-months", str(RETENTION), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    manifest = archives / "decisions" / "2025-01" / "manifest.json"
    assert f"archived decisions 2025-01: decisions_p202501 (1 rows), decision_evaluations_p202501 ({evaluations} rows) -> {manifest}" in done.stdout, (
        done.stdout
    )

    explained = await budgetgate_on(settings, "explain", "old/1", cwd=tmp_path)
    assert explained.returncode == 1 and "is archived" in explained.stderr and str(manifest.resolve()) in explained.stderr, explained.stderr
    replayed = await budgetgate_on(settings, "replay", "--since", "2024-12-01", "--json", cwd=tmp_path)
    [month] = json.loads(replayed.stdout)["archived"]
    assert (month["partition"], month["from"], month["rows"], month["archive"]) == ("decisions_p202501", "2025-01-01T00:00:00Z", 1, str(manifest.resolve()))
    said = await budgetgate_on(settings, "replay", "--since", "2024-12-01", cwd=tmp_path)
    assert "not read: 1 row(s) of 2025-01 are archived in" in said.stdout, said.stdout

    resent = await admission.submit(run_id="old/1")
    assert resent.status_code == 410 and "is archived" in resent.json()["detail"] and resent.json()["next_attempt"] is None, resent.text
    lookup = await admission.client.get("/v1/admissions/old/1")
    assert lookup.status_code == 410 and lookup.json()["archive"] == str(manifest.resolve()), lookup.text
    explain = await admission.client.get("/v1/admissions/old/1/explain")
    assert explain.status_code == 410 and explain.json()["decided_at"] == "2025-01-10T00:00:00Z", explain.text
    assert (await admission.client.get("/v1/admissions/never/1")).status_code == 404

    back = await budgetgate_on(settings, "ledger", "restore", str(manifest), cwd=tmp_path)
    assert back.returncode == 0 and "restored decisions 2025-01: decisions_p202501 (1 rows)" in back.stdout, back.stdout + back.stderr
    assert (await admission.client.get("/v1/admissions/old/1")).status_code == 200
    assert (await budgetgate_on(settings, "explain", "old/1", cwd=tmp_path)).returncode == 0


async def test_without_a_retention_nothing_is_archived(settings: Any, tmp_path: Path) -> None:
    done = await budgetgate_on(settings, "ledger", "archive", "--to", str(tmp_path), cwd=tmp_path)
    assert done.returncode == 0 and "no retention set" in done.stdout
    listed = await budgetgate_on(settings, "ledger", "partitions", cwd=tmp_path)
    assert listed.returncode == 0 and "decisions_default" in listed.stdout, listed.stderr


async def _outbox_row(conn: asyncpg.Connection, at: datetime, *, published: bool) -> int:
    return await conn.fetchval(
        "INSERT INTO outbox (topic, key, payload, created_at, published_at) VALUES ('budget.decisions.v1', 'k', '\\x01', $1, $2) RETURNING id",
        at, at + timedelta(seconds=1) if published else None,
    )  # fmt: skip


async def test_an_outbox_month_is_archived_once_everything_in_it_is_published(conn: asyncpg.Connection, tmp_path: Path) -> None:
    # The outbox has no default partition: a row of a month not created is refused, with
    # Postgres's error naming the table and the instant.
    with pytest.raises(asyncpg.CheckViolationError, match='no partition of relation "outbox" found for row'):
        await _outbox_row(conn, JAN, published=True)
    await conn.execute("SELECT budgetgate_ensure_month('outbox', $1)", JAN)
    await _outbox_row(conn, JAN, published=True)
    waiting = await _outbox_row(conn, JAN + timedelta(hours=1), published=False)

    report = await archive(conn, retention_months=RETENTION, directory=tmp_path)
    [kept] = report.kept
    assert report.archived == [] and kept.refused and str(kept) == f"outbox 2025-01 refused: 1 row(s) because it is not published yet ('{waiting}')"

    await conn.execute("UPDATE outbox SET published_at = now() WHERE id = $1", waiting)
    report = await archive(conn, retention_months=RETENTION, directory=tmp_path)
    assert [(a.series, f"{a.month:%Y-%m}", a.rows) for a in report.archived] == [("outbox", "2025-01", 2)] and report.kept == []
    assert "outbox_p202501" not in {p.name for p in await partitions(conn)}
    assert await conn.fetchval("SELECT to_regclass('outbox_p202501')") is None
    restored = await restore(conn, tmp_path / "outbox" / "2025-01" / "manifest.json")
    assert restored.tables == (("outbox_p202501", 2),) and await conn.fetchval("SELECT count(*) FROM outbox WHERE created_at < '2025-02-01Z'") == 2


async def test_an_outbox_detach_stopped_half_way_or_a_partition_left_detached_is_finished(conn: asyncpg.Connection, pg_dsn: str, tmp_path: Path) -> None:
    await conn.execute("SELECT budgetgate_ensure_month('outbox', $1), budgetgate_ensure_month('outbox', $2)", JAN, FEB)
    await _outbox_row(conn, JAN, published=True)
    await _outbox_row(conn, FEB, published=True)
    # A snapshot that has seen the outbox keeps a CONCURRENTLY detach waiting in its second
    # transaction; cancelled there, the partition is left "detach pending".
    reader = await asyncpg.connect(pg_dsn)
    try:
        tx = reader.transaction(isolation="repeatable_read")
        await tx.start()
        await reader.fetchval("SELECT count(*) FROM outbox")
        await conn.execute("SET statement_timeout = '500ms'")
        with pytest.raises(asyncpg.QueryCanceledError):
            await conn.execute("ALTER TABLE outbox DETACH PARTITION outbox_p202501 CONCURRENTLY")
        await conn.execute("RESET statement_timeout")
        assert await conn.fetchval("SELECT inhdetachpending FROM pg_inherits WHERE inhrelid = 'outbox_p202501'::regclass") is True
        await tx.rollback()
    finally:
        await reader.close()
    # And one detached whole, as by a run stopped before it dropped it.
    await conn.execute("ALTER TABLE outbox DETACH PARTITION outbox_p202502")

    report = await archive(conn, retention_months=RETENTION, directory=tmp_path)

    assert [(a.series, f"{a.month:%Y-%m}", a.rows) for a in report.archived] == [("outbox", "2025-01", 1), ("outbox", "2025-02", 1)]
    assert await conn.fetchval("SELECT count(*) FROM pg_class WHERE relname IN ('outbox_p202501', 'outbox_p202502')") == 0
    assert [r["partition"] for r in await conn.fetch("SELECT partition FROM ledger_archives ORDER BY 1")] == ["outbox_p202501", "outbox_p202502"]
    for month in ("2025-01", "2025-02"):
        [t] = load_manifest(tmp_path / "outbox" / month / "manifest.json")["tables"]
        assert verify_file(tmp_path / "outbox" / month / t["file"]) == (1, t["sha256"])
