"""The reconciler on real Postgres, Redis and Kafka, next to a real admission service: lifecycle
events and usage records published on Kafka become actuals in the ledger (Postgres and Redis)."""

from __future__ import annotations

import asyncio
import json
import random
import re
from datetime import UTC, datetime, timedelta

import pytest

from budgetgate.services.reconciler.service import Reconciler
from budgetgate.v1 import actions_pb2, reconciliations_pb2, usage_pb2
from tests.support.admission import apply_policies, budget_yaml, decision_of
from tests.support.reconciler import H, ledger_in_postgres, ledger_in_redis, lifecycle, outbox, run_charges, settled, usage, wait_caught_up
from tests.support.reconciler import feed, reconciler_factory  # noqa: F401 - pytest fixtures
from tests.support.clock import this_month
from tests.support.waiting import wait_for

VISION_SCOPE = "ns=vision-prod;cost-center=1042;team=vision"


async def test_48_projected_16_metered_completed_leaves_16_consumed_0_reserved(admission, reconciler_factory, feed, pg_dsn) -> None:
    answer = (await admission.submit(run_id="exec-48")).json()
    assert answer["decision"] == "ALLOW" and answer["projected_gpu_hours"] == 48.0
    reconciler = await reconciler_factory()
    start = this_month(timedelta(minutes=30))
    await feed.send(
        lifecycle("exec-48", "STARTED", start, gpus=8),
        usage("exec-48", "s1", start + timedelta(minutes=10), 8),
        usage("exec-48", "s2", start + timedelta(minutes=20), 16),
        lifecycle("exec-48", "COMPLETED", start + timedelta(minutes=20)),
    )
    touched = {e["scope_id"] for e in answer["evaluations"]}

    async def actuals_visible() -> bool:
        budgets = [b for scope in touched for b in (await admission.client.get(f"/v1/scopes/{scope}/usage")).json()["budgets"]]
        return all(b["reserved"] == 0 for b in budgets) and all(b["consumed"] > 0 for b in budgets)

    await wait_for(actuals_visible, what="actuals at /v1/scopes/{id}/usage")
    [vision] = (await admission.client.get(f"/v1/scopes/{VISION_SCOPE}/usage")).json()["budgets"]
    assert (vision["reserved"], vision["consumed"], vision["remaining"]) == (0.0, 16.0, 484.0)
    ledger = await ledger_in_postgres(pg_dsn)
    gpu_keys = [k for k in ledger if k.endswith("|gpu_hours")]
    assert len(gpu_keys) == 2 and all(ledger[k] == (0, 16 * H) for k in gpu_keys)
    [cost_key] = [k for k in ledger if k.endswith("|cost")]
    assert ledger[cost_key] == (0, 62_928_000)  # 16 GPU-hours at $3.933
    assert await ledger_in_redis(reconciler) == ledger
    assert await reconciler.ledger.run_holds() == {}
    row = await settled(pg_dsn, "exec-48")
    assert row["final"] and not row["provisional"] and row["error_gpu"] == -32 * H and row["wall"] == 20 * 60_000
    [rec] = await outbox(pg_dsn, "budget.reconciliations.v1", reconciliations_pb2.Reconciliation)
    assert (rec.projected_gpu_milli_hours, rec.actual_gpu_milli_hours, rec.error_gpu_milli_hours) == (48 * H, 16 * H, -32 * H)
    assert rec.final_state == "COMPLETED" and {c.ledger_key for c in rec.charges} == set(ledger)


async def test_usage_on_both_sides_of_a_month_boundary_settles_in_each_window(admission, reconciler_factory, feed, pg_dsn) -> None:
    """A run that started before this month began, metered on both sides of its first instant:
    its usage lands in the windows of two months, neither of whose ledger entries existed (the
    keys of the month before are created by this settlement, in its transaction). The run ended,
    so each try gives its holds back in Redis before it finds the keys Redis lacks; a try that
    fails then is rolled back and Redis rebuilt, which drops the keys loaded for it. Loading only
    the key the last try named went round the keys for ever (seen on every 1st, at midnight)."""
    answer = (await admission.submit(run_id="exec-month")).json()
    assert answer["decision"] == "ALLOW"
    reconciler = await reconciler_factory()
    month = datetime.now(UTC).replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    start = month - timedelta(minutes=30)
    await feed.send(
        lifecycle("exec-month", "STARTED", start, gpus=8),
        usage("exec-month", "s1", start + timedelta(minutes=10), 8),
        usage("exec-month", "s2", start + timedelta(minutes=40), 16),
        lifecycle("exec-month", "COMPLETED", start + timedelta(minutes=40)),
    )

    async def ended() -> bool:
        return bool((row := await settled(pg_dsn, "exec-month")) and row["final"])

    await wait_for(ended, what="the run settled")
    ledger = await ledger_in_postgres(pg_dsn)
    before, this = (f"{(month - timedelta(days=1)).replace(day=1):%Y-%m-%dT%H:%M:%SZ}/{month:%Y-%m-%dT%H:%M:%SZ}", f"{month:%Y-%m-%dT%H:%M:%SZ}/")
    gpu = {k: v for k, v in ledger.items() if k.endswith("|gpu_hours")}
    assert sorted(gpu.values()) == [(0, 8 * H)] * 4, ledger  # two budgets, 8 GPU-hours in each month
    assert sum(before in k for k in gpu) == 2 and sum(this in k for k in gpu) == 2, sorted(gpu)
    assert await ledger_in_redis(reconciler) == ledger


def _stream(run_id: str, start: datetime) -> list[object]:
    """A run that starts, is evicted, re-admitted, and completes, metered along the way."""
    return [
        lifecycle(run_id, "STARTED", start, gpus=4, event_id=f"{run_id}-start"),
        usage(run_id, "a", start + timedelta(minutes=30), 2),
        lifecycle(run_id, "EVICTED", start + timedelta(minutes=40), event_id=f"{run_id}-evict"),
        usage(run_id, "b", start + timedelta(minutes=40), 2.5),
        lifecycle(run_id, "READMITTED", start + timedelta(minutes=70), event_id=f"{run_id}-readmit"),
        usage(run_id, "c", start + timedelta(minutes=100), 4.5),
        lifecycle(run_id, "COMPLETED", start + timedelta(minutes=110), event_id=f"{run_id}-done"),
        usage(run_id, "d", start + timedelta(minutes=110), 5.25),
    ]


async def test_duplicated_reordered_late_stream_gives_the_clean_ledger(admission, reconciler_factory, feed, pg_dsn) -> None:
    for run_id in ("clean", "messy"):
        assert decision_of(await admission.submit(run_id=run_id, resources={"gpus": 4, "flavor": "h100"}, projected_runtime_hours=2.0)) == "ALLOW"
    reconciler = await reconciler_factory()
    start = this_month(timedelta(hours=3))
    await feed.send(*_stream("clean", start))
    messy = _stream("messy", start)
    shuffled = random.Random(7).sample(messy, len(messy))
    # The completion and the first usage record arrive first; everything is sent twice, the
    # second copies with new event ids for the samples (a resend by the exporter).
    await feed.send(messy[6], messy[1], *shuffled)
    await feed.send(
        *[
            usage("messy", u.sample_id, u.observed_at.ToDatetime(tzinfo=UTC), u.gpu_milli_hours_observed / H) if isinstance(u, usage_pb2.UsageRecord) else u
            for u in shuffled
        ]
    )

    async def both_final() -> bool:
        rows = [await settled(pg_dsn, r) for r in ("clean", "messy")]
        return all(r is not None and r["final"] for r in rows) and len(await run_charges(pg_dsn, "messy")) == len(await run_charges(pg_dsn, "clean")) > 0

    await wait_for(both_final, what="both runs settled")
    await wait_caught_up(reconciler)  # every straggler of the duplicates consumed, and settled
    assert await run_charges(pg_dsn, "messy") == await run_charges(pg_dsn, "clean")
    clean, messy_row = await settled(pg_dsn, "clean"), await settled(pg_dsn, "messy")
    for column in ("wall", "actual_gpu", "error_gpu", "final_state", "over_running", "provisional"):
        assert clean[column] == messy_row[column], column
    assert clean["wall"] == (40 + 40) * 60_000 and clean["actual_gpu"] == int(5.25 * H)
    ledger = await ledger_in_postgres(pg_dsn)
    assert all(reserved == 0 for reserved, _ in ledger.values())
    assert ledger[next(k for k in ledger if k.startswith(VISION_SCOPE) and k.endswith("gpu_hours"))] == (0, 2 * int(5.25 * H))
    assert await ledger_in_redis(reconciler) == ledger


async def test_metering_stops_reservation_stays_admission_decides_then_converges(admission_factory, reconciler_factory, feed, pg_dsn) -> None:
    await apply_policies(pg_dsn, {"b.yaml": budget_yaml("lag", limit="gpu_hours: 100")}, sha="a" * 40)
    server = await admission_factory()
    await server.wait_ready()
    reconciler = await reconciler_factory(provisional_grace_seconds=6 * 3600)
    body = {"labels": {"team": "vision"}, "resources": {"gpus": 8}, "projected_runtime_hours": 10.0}
    assert decision_of(await server.submit(run_id="long", **body)) == "ALLOW"
    start = this_month(timedelta(hours=4))
    await feed.send(lifecycle("long", "STARTED", start), usage("long", "1", start + timedelta(hours=1), 8))
    [key] = (await ledger_in_postgres(pg_dsn)).keys()

    async def figures_are(expected: tuple[int, int]) -> bool:
        return (await ledger_in_postgres(pg_dsn))[key] == expected

    await wait_for(lambda: figures_are((72 * H, 8 * H)), what="first sample charged")
    # Metering stops; the run goes on and ends. The reservation stays the upper bound and
    # admission keeps deciding from it: 20 more GPU-hours do not fit, 20 is the room left.
    await feed.send(lifecycle("long", "COMPLETED", start + timedelta(hours=3)))
    await wait_for(lambda: _phase_is(pg_dsn, "long", "ended"), what="completion recorded")
    assert (await ledger_in_postgres(pg_dsn))[key] == (72 * H, 8 * H)
    denied = (await server.submit(run_id="blocked", labels={"team": "vision"}, resources={"gpus": 21}, projected_runtime_hours=1.0)).json()
    assert denied["decision"] == "DENY" and denied["evaluations"][0]["remaining_gpu_hours"] == 20.0
    # Samples resume: the ledger converges on the actuals.
    await feed.send(usage("long", "2", start + timedelta(hours=2), 15), usage("long", "3", start + timedelta(hours=3), 23))
    await wait_for(lambda: figures_are((0, 23 * H)), what="actuals after metering resumed")

    # A settlement frees Redis's reservation in its second half, after Postgres has committed
    # (Redis is tighter than Postgres in between, on purpose): Redis follows a moment later.
    async def redis_agrees() -> bool:
        return await ledger_in_redis(reconciler) == await ledger_in_postgres(pg_dsn)

    await wait_for(redis_agrees, what="Redis equal to Postgres")
    assert (await server.submit(run_id="fits-now", labels={"team": "vision"}, resources={"gpus": 7}, projected_runtime_hours=11.0)).json()[
        "decision"
    ] == "ALLOW"


async def _phase_is(dsn: str, run_id: str, phase: str) -> bool:
    row = await settled(dsn, run_id)
    return row is not None and row["phase"] == phase


async def test_provisional_actual_after_grace_then_corrected(admission_factory, reconciler_factory, feed, pg_dsn) -> None:
    await apply_policies(pg_dsn, {"b.yaml": budget_yaml("p", limit="gpu_hours: 100")}, sha="b" * 40)
    server = await admission_factory()
    await server.wait_ready()
    await reconciler_factory(provisional_grace_seconds=1)
    assert decision_of(await server.submit(run_id="quiet", labels={"team": "vision"}, resources={"gpus": 4}, projected_runtime_hours=5.0)) == "ALLOW"
    start = this_month(timedelta(hours=3))
    await feed.send(lifecycle("quiet", "STARTED", start, gpus=2), lifecycle("quiet", "COMPLETED", start + timedelta(hours=2)))
    [key] = (await ledger_in_postgres(pg_dsn)).keys()

    async def figures_are(expected: tuple[int, int]) -> bool:
        return (await ledger_in_postgres(pg_dsn))[key] == expected

    # No samples at all: after the grace, 2 bound GPUs × 2 hours, provisionally.
    await wait_for(lambda: figures_are((0, 4 * H)), what="provisional actual")
    assert (await settled(pg_dsn, "quiet"))["provisional"] is True
    await feed.send(usage("quiet", "late", start + timedelta(hours=2), 3.5))
    await wait_for(lambda: figures_are((0, int(3.5 * H))), what="correction from the late sample")
    row = await settled(pg_dsn, "quiet")
    assert row["provisional"] is False and row["actual_gpu"] == int(3.5 * H)
    recs = await outbox(pg_dsn, "budget.reconciliations.v1", reconciliations_pb2.Reconciliation)
    assert [(r.provisional, r.actual_gpu_milli_hours) for r in recs] == [(True, 4 * H), (False, int(3.5 * H))]


async def test_never_started_is_released_after_the_deadline_denied_holds_nothing(admission_factory, reconciler_factory, pg_dsn) -> None:
    await apply_policies(pg_dsn, {"b.yaml": budget_yaml("d", limit="gpu_hours: 10")}, sha="c" * 40)
    server = await admission_factory()
    await server.wait_ready()
    assert decision_of(await server.submit(run_id="idle", labels={"team": "vision"}, resources={"gpus": 8}, projected_runtime_hours=1.0)) == "ALLOW"
    assert decision_of(await server.submit(run_id="too-big", labels={"team": "vision"}, resources={"gpus": 8}, projected_runtime_hours=1.0)) == "DENY"
    reconciler = await reconciler_factory(start_deadline_seconds=1)
    [key] = (await ledger_in_postgres(pg_dsn)).keys()

    async def released() -> bool:
        return (await ledger_in_postgres(pg_dsn))[key] == (0, 0)

    async def released_in_redis() -> bool:
        return await ledger_in_redis(reconciler) == {key: (0, 0)}

    await wait_for(released, what="never-started reservation released")
    # A release reaches Redis after its Postgres commit (the second half of the settlement,
    # RedisLedger.settle_end): Redis shows it a moment after Postgres does.
    await wait_for(released_in_redis, timeout=5, what="the release in Redis")
    assert await reconciler.ledger.run_holds() == {}
    assert (await settled(pg_dsn, "idle"))["released"] is True and await settled(pg_dsn, "too-big") is None
    assert decision_of(await server.submit(run_id="after", labels={"team": "vision"}, resources={"gpus": 8}, projected_runtime_hours=1.0)) == "ALLOW"


WALL_HOLD = budget_yaml("wall", limit="wall_hours: 4", on_exhausted="hold-and-drain")


async def test_wall_budget_across_eviction_then_hold_and_drain_lifted_by_a_raise(admission_factory, reconciler_factory, feed, pg_dsn) -> None:
    await apply_policies(pg_dsn, {"w.yaml": WALL_HOLD}, sha="d" * 40)
    server = await admission_factory()
    await server.wait_ready()
    body = {"labels": {"team": "vision"}, "resources": {"gpus": 1}, "projected_runtime_hours": 1.0}
    for run_id in ("w1", "w2"):
        assert decision_of(await server.submit(run_id=run_id, **body)) == "ALLOW"
    await reconciler_factory()
    now = this_month(timedelta(hours=3.5)) + timedelta(hours=3.5)
    # w1 ran 1 h, was evicted, re-admitted 1 h later and has run 1.5 h since: 2.5 wall-hours.
    await feed.send(
        lifecycle("w1", "STARTED", now - timedelta(hours=3.5)), lifecycle("w1", "EVICTED", now - timedelta(hours=2.5)),
        lifecycle("w1", "READMITTED", now - timedelta(hours=1.5)),
    )  # fmt: skip
    await wait_for(lambda: _wall_at_least(pg_dsn, "w1", int(2.5 * H)), what="w1 wall time")
    row = await settled(pg_dsn, "w1")
    assert row["phase"] == "running" and int(2.5 * H) <= row["wall"] < int(2.6 * H)
    # Nothing consumed past a threshold yet (what admission committed alerts on its own measure).
    assert [a for a in await outbox(pg_dsn, "budget.actions.v1", actions_pb2.BudgetAction) if a.measure != "committed"] == []
    # w2 starts 2 h ago: 4.5 wall-hours in all, over the 4 h limit: hold, and drain both.
    await feed.send(lifecycle("w2", "STARTED", now - timedelta(hours=2)))

    async def actions() -> list[actions_pb2.BudgetAction]:
        return await outbox(pg_dsn, "budget.actions.v1", actions_pb2.BudgetAction)

    async def drained() -> bool:
        return sum(a.type == actions_pb2.DRAIN for a in await actions()) == 2

    await wait_for(drained, what="drain commands")
    kinds = [actions_pb2.ActionType.Name(a.type) for a in await actions()]
    assert kinds.count("HOLD") == 1
    assert {a.run_id for a in await actions() if a.type == actions_pb2.DRAIN} == {"w1", "w2"}
    # On consumed, 80 % and 100 % (committed alerts come at the reconciler's ticks: test_alert_measures.py).
    consumed = [a.threshold_percent for a in await actions() if a.type == actions_pb2.THRESHOLD_ALERT and a.measure == "consumed"]
    assert sorted(consumed) == [80, 100]
    delayed = (await server.submit(run_id="w3", **body)).json()
    assert delayed["decision"] == "DELAY"
    # Raising the limit lifts the hold.
    await apply_policies(pg_dsn, {"w.yaml": WALL_HOLD.replace("wall_hours: 4", "wall_hours: 100")}, sha="e" * 40)

    async def released() -> bool:
        return any(a.type == actions_pb2.RELEASE_HOLD for a in await actions())

    await wait_for(released, what="hold released")
    assert [actions_pb2.ActionType.Name(a.type) for a in await actions()].count("HOLD") == 1


async def _wall_at_least(dsn: str, run_id: str, wall: int) -> bool:
    row = await settled(dsn, run_id)
    return row is not None and row["wall"] >= wall


async def test_drift_check_finds_and_repairs_redis(admission, reconciler_factory, pg_dsn) -> None:
    assert decision_of(await admission.submit(run_id="drifty")) == "ALLOW"
    reconciler = await reconciler_factory()
    assert (await reconciler.sync.check_drift(repair=False)).clean
    key = next(iter(await ledger_in_postgres(pg_dsn)))
    await reconciler.redis.hincrby(reconciler.ledger.ledger(key), "consumed", 5 * H)
    await reconciler.check_drift()
    assert reconciler.stats.drifted_keys == 1 and reconciler.stats.repairs == 1
    assert await ledger_in_redis(reconciler) == await ledger_in_postgres(pg_dsn)
    assert drift_metric(reconciler) == 1.0
    await reconciler.check_drift()
    assert reconciler.stats.drifted_keys == 0 and drift_metric(reconciler) == 0.0


def drift_metric(reconciler: Reconciler) -> float:
    [value] = re.findall(r"^budgetgate_ledger_drift_keys(?:\{[^}]*\})? (\S+)$", reconciler.telemetry.metrics_text().decode(), re.M)
    return float(value)


async def test_tenant_usage_route_and_cli(admission, reconciler_factory, feed, pg_dsn) -> None:
    assert decision_of(await admission.submit(run_id="t1")) == "ALLOW"
    assert decision_of(await admission.submit(run_id="t2", projected_runtime_hours=1.0)) == "ALLOW"
    await reconciler_factory()
    start = this_month(timedelta(hours=2))
    await feed.send(
        lifecycle("t1", "STARTED", start), usage("t1", "s", start + timedelta(hours=1), 10), lifecycle("t1", "COMPLETED", start + timedelta(hours=1))
    )
    await wait_for(lambda: _final(pg_dsn, "t1"), what="t1 settled")
    body = (await admission.client.get("/v1/tenants/vision/usage", params={"days": 30})).json()
    assert body["tenant"] == "vision" and body["label"] == "team" and body["days"] == 30
    assert body["runs"] == {"runs": 2, "admitted": 2, "reserved_gpu_hours": 8.0, "consumed_gpu_hours": 10.0, "consumed_node_hours": 0.0}
    [vision] = [b for b in body["budgets"] if b["policy_id"] == "gpu-budget/team-vision-prod"]
    assert (vision["limit"], vision["reserved"], vision["consumed"], vision["remaining"]) == (500.0, 8.0, 10.0, 482.0)
    assert (await admission.client.get("/v1/tenants/nobody/usage")).json()["runs"]["runs"] == 0
    assert (await admission.client.get("/v1/tenants/vision/usage", params={"days": 0})).status_code == 422
    from click.testing import CliRunner

    from budgetgate.cli.main import cli

    env = {"BUDGETGATE_POSTGRES_DSN": pg_dsn}

    def run(*args: str):  # type: ignore[no-untyped-def] # the CLI runs its own event loop
        return asyncio.to_thread(CliRunner().invoke, cli, list(args), env=env)

    as_json = await run("usage", "--tenant", "vision", "--days", "30", "--json")
    assert as_json.exit_code == 0, as_json.output
    assert json.loads(as_json.stdout)["runs"] == body["runs"]
    table = await run("usage", "--scope", VISION_SCOPE)
    assert table.exit_code == 0, table.output
    assert "gpu-budget/team-vision-prod" in table.output and "482" in table.output
    assert (await run("usage", "--scope", "ns=nowhere")).exit_code != 0


async def _final(dsn: str, run_id: str) -> bool:
    row = await settled(dsn, run_id)
    return row is not None and row["final"]


async def _rolled(admission_factory, reconciler_factory, feed, pg_dsn):  # type: ignore[no-untyped-def]
    """A rolling-window budget with 10 GPU-hours of usage 20 to 17 hours ago (6 of them 19 h ago),
    settled: the reconciler, the ledger key and the time the usage was fed at."""
    await apply_policies(pg_dsn, {"r.yaml": budget_yaml("roll", limit="gpu_hours: 100", window="{rolling_days: 1}")}, sha="7" * 40)
    server = await admission_factory()
    await server.wait_ready()
    assert decision_of(await server.submit(run_id="old", labels={"team": "vision"}, resources={"gpus": 8}, projected_runtime_hours=2.0)) == "ALLOW"
    reconciler = await reconciler_factory()
    now = datetime.now(UTC)
    start = now - timedelta(hours=20)
    await feed.send(
        lifecycle("old", "STARTED", start), usage("old", "1", start + timedelta(hours=1), 6),
        usage("old", "2", start + timedelta(hours=3), 10), lifecycle("old", "COMPLETED", start + timedelta(hours=3)),
    )  # fmt: skip
    [key] = (await ledger_in_postgres(pg_dsn)).keys()
    assert "|rolling-1d|" in key

    async def settled() -> bool:
        return (await ledger_in_postgres(pg_dsn))[key] == (0, 10 * H)

    await wait_for(settled, what="usage in the rolling window")
    return reconciler, key, now


async def test_rolling_window_usage_ages_out_in_postgres_and_redis(admission_factory, reconciler_factory, feed, pg_dsn) -> None:
    from budgetgate.services.reconciler import budget_actions

    reconciler, key, now = await _rolled(admission_factory, reconciler_factory, feed, pg_dsn)

    async def figures_are(expected: tuple[int, int]) -> bool:
        return (await ledger_in_postgres(pg_dsn))[key] == expected

    # Six hours on, the first sample's hour has left the window; two more hours on, all of it.
    assert await budget_actions.age_rolling(reconciler.pool, reconciler.ledgers, now=now + timedelta(hours=6)) == {key: 6 * H}
    assert await figures_are((0, 4 * H)) and await ledger_in_redis(reconciler) == await ledger_in_postgres(pg_dsn)
    assert await budget_actions.age_rolling(reconciler.pool, reconciler.ledgers, now=now + timedelta(hours=6)) == {}
    assert await budget_actions.age_rolling(reconciler.pool, reconciler.ledgers, now=now + timedelta(hours=8)) == {key: 4 * H}
    assert await figures_are((0, 0)) and await ledger_in_redis(reconciler) == await ledger_in_postgres(pg_dsn)


async def test_ageing_a_key_redis_lost_loads_it_and_ages_it_next_tick(admission_factory, reconciler_factory, feed, pg_dsn) -> None:
    """A rolling key missing in Redis when its usage ages out: the script changes nothing, so
    Redis stays loaded; the key is loaded from Postgres and aged on the next tick. It used to
    invalidate the whole ledger and then fail loading the key, aborting the upkeep tick."""
    from budgetgate.services.reconciler import budget_actions

    reconciler, key, now = await _rolled(admission_factory, reconciler_factory, feed, pg_dsn)
    await reconciler.redis.delete(reconciler.ledger.ledger(key))
    assert await budget_actions.age_rolling(reconciler.pool, reconciler.ledgers, now=now + timedelta(hours=6)) == {}
    assert await reconciler.ledger.is_loaded()
    assert await ledger_in_redis(reconciler) == await ledger_in_postgres(pg_dsn)  # loaded, not aged yet
    assert await budget_actions.age_rolling(reconciler.pool, reconciler.ledgers, now=now + timedelta(hours=6)) == {key: 6 * H}
    assert (await ledger_in_postgres(pg_dsn))[key] == (0, 4 * H) and await ledger_in_redis(reconciler) == await ledger_in_postgres(pg_dsn)


async def test_ageing_whose_redis_reply_is_lost_invalidates_redis_and_ages_once(admission_factory, reconciler_factory, feed, pg_dsn) -> None:
    """The consume script runs but its reply never arrives: the transaction rolls back, so Redis
    must be invalidated (it had aged the key the first time, and the next tick ages it again)."""
    from budgetgate.services.reconciler import budget_actions

    reconciler, key, now = await _rolled(admission_factory, reconciler_factory, feed, pg_dsn)
    ledger = reconciler.ledger
    real_consume = ledger.consume

    async def reply_lost(amounts):  # type: ignore[no-untyped-def]
        await real_consume(amounts)
        raise ConnectionError("connection lost before the reply")

    ledger.consume = reply_lost  # type: ignore[method-assign]
    try:
        with pytest.raises(ConnectionError):
            await budget_actions.age_rolling(reconciler.pool, reconciler.ledgers, now=now + timedelta(hours=6))
    finally:
        ledger.consume = real_consume  # type: ignore[method-assign]
    assert (await ledger_in_postgres(pg_dsn))[key] == (0, 10 * H), "Postgres rolled back"
    # Invalidated; or already rebuilt from Postgres by the running reconciler's own next pass.
    rebuilt = await ledger.is_loaded() and await ledger_in_redis(reconciler) == await ledger_in_postgres(pg_dsn)
    assert rebuilt or not await ledger.is_loaded(), "Redis aged without Postgres: it must be rebuilt"
    await reconciler.sync.ensure_loaded()
    assert await budget_actions.age_rolling(reconciler.pool, reconciler.ledgers, now=now + timedelta(hours=6)) == {key: 6 * H}
    assert (await ledger_in_postgres(pg_dsn))[key] == (0, 4 * H) and await ledger_in_redis(reconciler) == await ledger_in_postgres(pg_dsn)
