"""A DELAY's next eligible time through the HTTP API: the earliest instant the budget will have
room under its own rules (budgetgate.core.eligibility), read from the real ledger."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import asyncpg

from tests.support.admission import apply_policies, budget_yaml

LABELS = {"team": "vision"}


def at(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


async def mark_running(dsn: str, run_id: str, decision_id: str) -> None:
    """What the reconciler records once the run's STARTED event is settled."""
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(
            "INSERT INTO run_settlements (run_id, decision_id, phase, projected_gpu) VALUES ($1, $2, 'running', 0)",
            run_id, decision_id,
        )  # fmt: skip
    finally:
        await conn.close()


async def test_a_running_run_ending_as_projected_frees_nothing(admission_factory, pg_dsn) -> None:
    # The repro: 10 GPU-hours, delay; 1 GPU × 6 h admitted, then 1 GPU × 6 h again.
    await apply_policies(pg_dsn, {"d.yaml": budget_yaml("ten", limit="gpu_hours: 10", on_exhausted="delay")}, sha="c" * 40)
    server = await admission_factory(start_deadline_seconds=1800)
    await server.wait_ready()
    first = (await server.submit(run_id="first", labels=LABELS, resources={"gpus": 1}, projected_runtime_hours=6.0)).json()
    assert first["decision"] == "ALLOW"

    # Not started yet: it gives its reservation back at its start deadline unless it starts.
    waiting = (await server.submit(run_id="second", labels=LABELS, resources={"gpus": 1}, projected_runtime_hours=6.0)).json()
    assert waiting["decision"] == "DELAY"
    [evaluation] = waiting["evaluations"]
    # (the reservation row's time, a moment after the decision's own clock reading)
    assert abs(at(evaluation["next_eligible_time"]) - (at(first["decided_at"]) + timedelta(seconds=1800))) < timedelta(seconds=2)

    # Running: at its projected end its reservation becomes consumption of the same size, so the
    # budget has room again only in the next calendar window.
    await mark_running(pg_dsn, "first", first["decision_id"])
    later = (await server.submit(run_id="third", labels=LABELS, resources={"gpus": 1}, projected_runtime_hours=6.0)).json()
    assert later["decision"] == "DELAY"
    [evaluation] = later["evaluations"]
    assert evaluation["next_eligible_time"] == evaluation["window_end"]
    assert f"Resubmit at or after {evaluation['window_end'].replace('+00:00', 'Z')}" in later["reason"]


async def test_rolling_window_waits_for_recorded_usage_to_age_out(admission_factory, pg_dsn) -> None:
    policy = budget_yaml("weekly", limit="gpu_hours: 10", on_exhausted="delay", window="{rolling_days: 7}")
    await apply_policies(pg_dsn, {"r.yaml": policy}, sha="d" * 40)
    server = await admission_factory()
    await server.wait_ready()
    # Warm the key so it exists, then record 9 GPU-hours of usage five days ago, as the
    # reconciler would: an hour bucket on the run's charges and the key's consumed.
    first = (await server.submit(run_id="tiny", labels=LABELS, resources={"gpus": 1}, projected_runtime_hours=0.5)).json()
    assert first["decision"] == "ALLOW"
    [charged] = first["evaluations"]
    key = f"{charged['scope_id']}|rolling-7d|gpu_hours"
    bucket = datetime.now(UTC).replace(minute=0, second=0, microsecond=0) - timedelta(days=5)
    conn = await asyncpg.connect(pg_dsn)
    try:
        await conn.execute("INSERT INTO run_charges (run_id, ledger_key, bucket, amount) VALUES ('old', $1, $2, $3)", key, bucket, 9 * 3_600_000)
        await conn.execute("UPDATE ledger_entries SET consumed = consumed + $2 WHERE ledger_key = $1", key, 9 * 3_600_000)
        await mark_running(pg_dsn, "tiny", first["decision_id"])
    finally:
        await conn.close()
    await server.rt.ledger.invalidate("usage seeded in Postgres")
    delayed = (await server.submit(run_id="next", labels=LABELS, resources={"gpus": 1}, projected_runtime_hours=1.0)).json()
    assert delayed["decision"] == "DELAY", delayed
    [evaluation] = delayed["evaluations"]
    # 0.5 free, 1 needed: the old bucket must leave the window, a whole hour after it + 7 days.
    assert at(evaluation["next_eligible_time"]) == bucket + timedelta(days=7, hours=1)
