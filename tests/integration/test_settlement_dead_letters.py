"""A settlement dead-lettered by the reconciler never holds budget unseen: the gauge
`budgetgate_reconciler_dead_lettered` counts it (on the reconciler's /metrics), `budgetgate
settlements dead-letters` lists it with what its run holds, and `budgetgate settlements resolve`
releases the hold or settles the run again, through the ledger's transaction (Postgres and Redis
in line), logged in the admin log with the operator's principal. The commands go through the
reconciler's operator routes, with an operator token.

The failure is made as a real one is: a run's usage on last month's ledger key would take the key
past the ledger's range (another run used half of it), so its settlement is refused every time."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import asyncpg

from budgetgate.contracts import wire
from budgetgate.core.ledger_key import MAX_AMOUNT
from budgetgate.core.principals import Role
from budgetgate.services.reconciler.service import Reconciler
from budgetgate.v1 import reconciliations_pb2, usage_pb2
from tests.support.admission import AdmissionServer, apply_policies, budget_yaml, decision_of, submission
from tests.support.cli import budgetgate_on
from tests.support.metering import fetchval, metric
from tests.support.principals import issue
from tests.support.reconciler import H, ReconcilerServer, ledger_in_postgres, ledger_in_redis, lifecycle, ts
from tests.support.reconciler import feed, reconciler_factory, reconciler_server_factory  # noqa: F401 - pytest fixtures
from tests.support.waiting import wait_for

GAUGE = "budgetgate_reconciler_dead_lettered"
HALF = MAX_AMOUNT // 2 + 1  # two of these on one ledger key are beyond its range
OPERATOR = "ops-on-call"  # the operator token's name; its principal is logged as token:<name>


def _sample(run_id: str, sample_id: str, at: datetime, gpu: int) -> usage_pb2.UsageRecord:
    return usage_pb2.UsageRecord(
        event_id=f"{run_id}-{sample_id}", event_time=ts(at), run_id=run_id, sample_id=sample_id, observed_at=ts(at),
        gpu_milli_hours_cumulative=gpu, gpu_milli_hours_observed=gpu,
    )  # fmt: skip


def _last_month() -> datetime:
    """Noon on the first day of last month: a calendar window apart from this month's."""
    first = datetime.now(UTC).replace(day=1, hour=12, minute=0, second=0, microsecond=0)
    return (first - timedelta(days=1)).replace(day=1)


async def _dead_lettered(admission_factory, reconciler_server_factory, feed, pg_dsn) -> tuple[AdmissionServer, ReconcilerServer, str]:  # noqa: F811
    """Admission and the reconciler service, run `victim` dead-lettered holding 60 of the 100
    GPU-hours of budget `dl` this month; returns them and this month's ledger key of `dl`."""
    await apply_policies(pg_dsn, {"b.yaml": budget_yaml("dl", limit="gpu_hours: 100")}, sha="d" * 40)
    server = await admission_factory()
    await server.wait_ready()
    for run_id, gpus in (("hog", 1), ("victim", 6)):
        answer = (await server.submit(run_id=run_id, labels={"team": "vision"}, resources={"gpus": gpus}, projected_runtime_hours=10.0)).json()
        assert answer["decision"] == "ALLOW", answer
    [key] = await ledger_in_postgres(pg_dsn)
    reconciler = await reconciler_server_factory(settle_tries=2)
    then = _last_month()
    # `hog` settles first, using half the range of last month's key...
    ended = then + timedelta(minutes=30)
    await feed.send(lifecycle("hog", "STARTED", then), _sample("hog", "h", ended, HALF), lifecycle("hog", "COMPLETED", ended))
    await wait_for(lambda: fetchval(pg_dsn, "SELECT count(*) = 1 FROM run_settlements WHERE run_id = 'hog' AND final"), what="hog settled")
    # ...so `victim`'s bad sample `p` cannot land there; without it, it used 1 GPU-hour.
    await feed.send(
        lifecycle("victim", "STARTED", then),
        _sample("victim", "p", then + timedelta(minutes=10), HALF),
        _sample("victim", "n", then + timedelta(hours=1), H),
        lifecycle("victim", "COMPLETED", then + timedelta(hours=1)),
    )
    await wait_for(lambda: fetchval(pg_dsn, "SELECT count(*) = 1 FROM settlement_failures WHERE run_id = 'victim' AND dead"), what="victim dead-lettered")
    assert (await ledger_in_postgres(pg_dsn))[key] == (60 * H, 0)  # its reservation, still held
    return server, reconciler, key


async def _gauge_shows(reconciler: ReconcilerServer, value: int) -> bool:
    return metric(await reconciler.metrics(), GAUGE) == value


async def _as_operator(reconciler: ReconcilerServer, pg_dsn: str) -> dict[str, str]:
    """What `budgetgate settlements` needs besides the backends: the reconciler's URL and an operator token."""
    return {"BUDGETGATE_RECONCILER_URL": reconciler.url, "BUDGETGATE_TOKEN": await issue(pg_dsn, Role.OPERATOR, name=OPERATOR)}


async def _remaining(server: AdmissionServer) -> float:
    [budget] = [b for b in (await server.client.get("/v1/budgets")).json()["budgets"] if b["policy_id"] == "dl"]
    return budget["remaining"]


async def _admin_log(dsn: str) -> list[dict[str, Any]]:
    """The admin log's entries about settlements (applying the test's policies logs one too)."""
    conn = await asyncpg.connect(dsn)
    try:
        rows = await conn.fetch("SELECT actor, action, subject, details FROM admin_log WHERE action LIKE 'settlement.%' ORDER BY id")
        return [{**dict(r), "details": json.loads(r["details"])} for r in rows]
    finally:
        await conn.close()


async def _in_line(reconciler: Reconciler, dsn: str) -> None:
    """Redis holds the ledger (never invalidated), as Postgres has it, quota counters and pools too."""
    assert await reconciler.ledger.is_loaded()
    assert await ledger_in_redis(reconciler) == await ledger_in_postgres(dsn)
    assert (await reconciler.sync.check_drift(repair=False)).clean


async def test_a_dead_lettered_hold_is_counted_listed_and_released(
    admission_factory, reconciler_server_factory, feed, pg_dsn, settings, tmp_path: Path
) -> None:
    server, reconciler, key = await _dead_lettered(admission_factory, reconciler_server_factory, feed, pg_dsn)
    operator = await _as_operator(reconciler, pg_dsn)
    await wait_for(lambda: _gauge_shows(reconciler, 1), what=f"{GAUGE} at 1")
    assert await _remaining(server) == 40.0
    big = {"run_id": "big", "labels": {"team": "vision"}, "resources": {"gpus": 5}, "projected_runtime_hours": 10.0}
    assert decision_of(await server.client.post("/v1/admissions", json=submission(**big, attempt=1))) != "ALLOW"  # 50 do not fit in 40

    listed = await budgetgate_on(settings, "settlements", "dead-letters", cwd=tmp_path, variables=operator)
    assert listed.returncode == 0, listed.stderr
    assert "victim" in listed.stdout and "hog" not in listed.stdout and "60 gpu-hours" in listed.stdout and "budget dl" in listed.stdout, listed.stdout
    as_json = await budgetgate_on(settings, "settlements", "dead-letters", "--json", cwd=tmp_path, variables=operator)
    [dead] = json.loads(as_json.stdout)
    assert (dead["run_id"], dead["tries"]) == ("victim", 2) and "range" in dead["reason"]
    assert dead["dead_since"] and dead["failing_since"] <= dead["dead_since"]
    assert [(r["policy_id"], r["ledger_key"], r["amount"], r["unit"]) for r in dead["reservations"]] == [("dl", key, 60.0, "gpu_hours")]

    # An unknown run, and one whose settlement is not dead-lettered: refused, nothing changed.
    for run_id, why in (("nosuch", "no run 'nosuch' is known"), ("hog", "run 'hog' has no dead-lettered settlement")):
        refused = await budgetgate_on(settings, "settlements", "resolve", run_id, "--release", "--reason", "cleanup", cwd=tmp_path, variables=operator)
        assert refused.returncode == 1 and why in refused.stderr and "Traceback" not in refused.stderr, refused.stderr
    assert await _admin_log(pg_dsn) == []
    assert (await ledger_in_postgres(pg_dsn))[key] == (60 * H, 0)

    released = await budgetgate_on(
        settings, "settlements", "resolve", "victim", "--release", "--reason", "bad exporter sample, ticket OPS-7", cwd=tmp_path, variables=operator
    )
    assert released.returncode == 0, released.stderr
    assert "released" in released.stdout and "60 gpu-hours" in released.stdout, released.stdout
    assert (await ledger_in_postgres(pg_dsn))[key] == (0, 0)
    await _in_line(reconciler.rt, pg_dsn)
    assert await _remaining(server) == 100.0
    assert decision_of(await server.client.post("/v1/admissions", json=submission(**big, attempt=2))) == "ALLOW"
    [logged] = await _admin_log(pg_dsn)
    assert (logged["action"], logged["subject"], logged["actor"]) == ("settlement.release", "victim", f"token:{OPERATOR}")
    assert logged["details"]["reason"] == "bad exporter sample, ticket OPS-7" and logged["details"]["held"] == {key: 60 * H}
    assert "range" in logged["details"]["failure"]
    await wait_for(lambda: _gauge_shows(reconciler, 0), what=f"{GAUGE} back at 0")
    assert await fetchval(pg_dsn, "SELECT count(*) FROM settlement_failures") == 0
    assert await fetchval(pg_dsn, "SELECT count(*) FROM runs_to_settle WHERE run_id = 'victim'") == 0
    why = await fetchval(pg_dsn, "SELECT end_reason FROM reservations WHERE run_id = 'victim' AND state = 'released'")
    assert why == "released by an operator: bad exporter sample, ticket OPS-7"
    # The release is on the record as a reconciliation of the run, as any release is.
    conn = await asyncpg.connect(pg_dsn)
    try:
        rows = await conn.fetch("SELECT payload FROM outbox WHERE topic LIKE '%budget.reconciliations.v1' AND key = 'victim'")
    finally:
        await conn.close()
    [record] = [wire.decode(reconciliations_pb2.Reconciliation, r["payload"], None) for r in rows]
    assert (record.final_state, record.released, list(record.charges)) == ("RELEASED", True, [])
    emptied = await budgetgate_on(settings, "settlements", "dead-letters", "--json", cwd=tmp_path, variables=operator)
    assert json.loads(emptied.stdout) == []


async def test_a_dead_lettered_settlement_is_settled_again_once_its_cause_is_fixed(
    admission_factory, reconciler_server_factory, feed, pg_dsn, settings, tmp_path: Path
) -> None:
    server, reconciler, key = await _dead_lettered(admission_factory, reconciler_server_factory, feed, pg_dsn)
    operator = await _as_operator(reconciler, pg_dsn)
    failures = "SELECT attempts, reason, dead FROM settlement_failures WHERE run_id = 'victim'"
    before = await _row(pg_dsn, failures)

    # The cause is still there: the settlement is refused again, and nothing changes.
    still = await budgetgate_on(settings, "settlements", "resolve", "victim", "--settle", "--reason", "retry", cwd=tmp_path, variables=operator)
    assert still.returncode == 1 and "still fails to settle" in still.stderr and "range" in still.stderr and "Traceback" not in still.stderr, still.stderr
    assert await _row(pg_dsn, failures) == before
    assert await _admin_log(pg_dsn) == []
    assert (await ledger_in_postgres(pg_dsn))[key] == (60 * H, 0)
    await _in_line(reconciler.rt, pg_dsn)

    # The operator removes the bad sample; the run settles: its reservation is replaced by the
    # 1 GPU-hour it used, on last month's key.
    conn = await asyncpg.connect(pg_dsn)
    try:
        await conn.execute("DELETE FROM run_samples WHERE run_id = 'victim' AND sample_id = 'p'")
    finally:
        await conn.close()
    settled = await budgetgate_on(
        settings, "settlements", "resolve", "victim", "--settle", "--reason", "bad sample p removed", cwd=tmp_path, variables=operator
    )
    assert settled.returncode == 0, settled.stderr
    assert "settled" in settled.stdout, settled.stdout
    ledger = await ledger_in_postgres(pg_dsn)
    [last_month] = set(ledger) - {key}
    assert ledger[key] == (0, 0) and ledger[last_month] == (0, HALF + H)
    assert await fetchval(pg_dsn, "SELECT final AND actual_gpu = $1 FROM run_settlements WHERE run_id = 'victim'", H)
    await _in_line(reconciler.rt, pg_dsn)
    assert await _remaining(server) == 100.0
    [logged] = await _admin_log(pg_dsn)
    assert (logged["action"], logged["subject"], logged["details"]["reason"]) == ("settlement.settle", "victim", "bad sample p removed")
    await wait_for(lambda: _gauge_shows(reconciler, 0), what=f"{GAUGE} back at 0")
    assert await fetchval(pg_dsn, "SELECT count(*) FROM settlement_failures") == 0


async def _row(dsn: str, query: str) -> tuple[Any, ...] | None:
    conn = await asyncpg.connect(dsn)
    try:
        row = await conn.fetchrow(query)
        return tuple(row) if row else None
    finally:
        await conn.close()
