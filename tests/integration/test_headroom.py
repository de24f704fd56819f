"""Pending visibility on real servers: a DELAY or a quota rejection is shown afterwards with the
limiting figures as they are now (GET /v1/admissions/{run_id}, `budgetgate status`), and when
room returns (a run ends, a limit rises) each waiting run gets one HEADROOM on
budget.actions.v1, read here from the broker; a run decided again waits no more."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

import asyncpg
from click.testing import CliRunner

from budgetgate.contracts import wire
from budgetgate.cli.actions import read_topics
from budgetgate.cli.main import cli
from budgetgate.contracts.topics import Topics
from budgetgate.v1.actions_pb2 import HEADROOM, BudgetAction
from tests.support.admission import apply_policies, budget_yaml, decision_of, submission
from tests.support.quotas import BIG_BUDGET, QUOTA, physics, started
from tests.support.reconciler import lifecycle, outbox, usage
from tests.support.reconciler import feed, reconciler_factory  # noqa: F401 - pytest fixtures
from tests.support.clock import this_month
from tests.support.waiting import wait_for


def delaying(limit: int) -> dict[str, str]:
    return {"d.yaml": budget_yaml("physics-delay", namespace="physics", labels="{team: physics}", limit=f"gpu_hours: {limit}", on_exhausted="delay")}


async def delayed_behind_big(admission_factory, pg_dsn: str, *, sha: str, **delayed: int):  # type: ignore[no-untyped-def]
    """Admission under a 10 GPU-hour delaying budget: run big (8 GPU-h) allowed, then each of
    `delayed` (run id = GPUs for an hour) delayed behind it; returns the admission server."""
    await apply_policies(pg_dsn, delaying(10), sha=sha)
    server = await admission_factory()
    await server.wait_ready()
    assert decision_of(await server.client.post("/v1/admissions", json=physics("big", gpus=8))) == "ALLOW"
    for run_id, gpus in delayed.items():
        assert decision_of(await server.client.post("/v1/admissions", json=physics(run_id, gpus=gpus))) == "DELAY"
    return server


async def headrooms(settings) -> list[BudgetAction]:  # type: ignore[no-untyped-def]
    """Every HEADROOM on the test's budget.actions.v1, as the broker has them."""
    found = []
    async for record in read_topics(settings.kafka_bootstrap, [Topics(settings.topic_prefix).actions], follow=False):
        action = wire.decode(BudgetAction, record.value, record.headers)
        if action.type == HEADROOM:
            found.append(action)
    return found


async def registered(dsn: str) -> set[tuple[str, int]]:
    conn = await asyncpg.connect(dsn)
    try:
        return {(r["run_id"], r["attempt"]) for r in await conn.fetch("SELECT run_id, attempt FROM waiting_runs")}
    finally:
        await conn.close()


async def status_cli(dsn: str, run_id: str) -> str:
    result = await asyncio.to_thread(CliRunner().invoke, cli, ["status", run_id], env={"BUDGETGATE_POSTGRES_DSN": dsn})
    assert result.exit_code == 0, result.output
    return result.stdout


async def test_quota_rejection_is_visible_now_and_hears_headroom_once_when_a_run_ends(
    admission_factory,
    reconciler_factory,  # noqa: F811
    feed,  # noqa: F811
    settings,
    pg_dsn,
) -> None:
    server = await started(admission_factory, pg_dsn, {"q.yaml": QUOTA.format(limits="max_nodes: 4"), "b.yaml": BIG_BUDGET})
    assert decision_of(await server.client.post("/v1/admissions", json=physics("r1", nodes=3))) == "ALLOW"
    refused = (await server.client.post("/v1/admissions", json=physics("w", nodes=2))).json()
    assert refused["decision"] == "DENY" and refused["reason"].startswith("allocation rejected")

    before = (await server.client.get("/v1/admissions/w")).json()
    assert before["decision"] == "DENY" and before["decision_id"] == refused["decision_id"]
    waiting = before["waiting"]
    assert waiting["state"] == "waiting for quota headroom" and waiting["headroom"] is False
    assert waiting["limiting"] == [
        {"kind": "quota", "name": "max_nodes", "scope_id": None, "tenant": "physics", "unit": "nodes", "limit": 4, "used": 3,
         "reserved": None, "consumed": None, "requested": 2, "remaining": 1, "fits": False}
    ]  # fmt: skip
    shown = await status_cli(pg_dsn, "w")
    assert "waiting for quota headroom" in shown and 'tenant "physics" max_nodes: 3 of 4 held, needs 2: does not fit' in shown

    await reconciler_factory()
    await wait_for(lambda: _has(pg_dsn, ("w", 1)), what="w registered as waiting")
    assert decision_of(await server.client.post("/v1/admissions", json=physics("x", nodes=1))) == "ALLOW"
    start = datetime.now(UTC) - timedelta(minutes=5)
    await feed.send(lifecycle("r1", "STARTED", start, gpus=1), lifecycle("r1", "COMPLETED", start + timedelta(minutes=1)))

    async def heard() -> bool:
        return len(await headrooms(settings)) >= 1

    await wait_for(heard, what="HEADROOM for w")
    [action] = await headrooms(settings)
    assert (action.run_id, action.attempt) == ("w", 1)
    assert "max_nodes: 1 of 4 held, needs 2: fits" in action.message and "attempt 2" in action.message

    after = (await server.client.get("/v1/admissions/w")).json()["waiting"]
    assert after["headroom"] is True and after["limiting"][0]["used"] == 1 and after["limiting"][0]["fits"] is True
    assert "max_nodes: 1 of 4 held, needs 2: fits" in await status_cli(pg_dsn, "w")

    # Resubmitted and admitted: w waits no more, so the next run to end sends it nothing.
    admitted = (await server.client.post("/v1/admissions", json=physics("w", nodes=2, attempt=2))).json()
    assert admitted["decision"] == "ALLOW"
    assert (await server.client.get("/v1/admissions/w")).json()["waiting"] is None
    await feed.send(lifecycle("x", "STARTED", start, gpus=1), lifecycle("x", "COMPLETED", start + timedelta(minutes=2)))
    await wait_for(lambda: _released(pg_dsn, "x"), what="x's holds given back")
    assert [a.run_id for a in await outbox(pg_dsn, "budget.actions.v1", BudgetAction) if a.type == HEADROOM] == ["w"]
    assert [(a.run_id, a.event_id) for a in await headrooms(settings)] == [("w", action.event_id)]

    async def forgotten() -> bool:
        return await registered(pg_dsn) == set()

    await wait_for(forgotten, what="w forgotten once decided again")


async def test_budget_delay_hears_headroom_when_a_limit_rises_and_when_a_run_ends(
    admission_factory,
    reconciler_factory,  # noqa: F811
    feed,  # noqa: F811
    settings,
    pg_dsn,
) -> None:
    server = await delayed_behind_big(admission_factory, pg_dsn, sha="1" * 40, late=4, mid=9)
    waiting = (await server.client.get("/v1/admissions/late")).json()["waiting"]
    assert waiting["state"] == "waiting for budget" and waiting["headroom"] is False
    assert waiting["limiting"] == [
        {"kind": "budget", "name": "physics-delay", "scope_id": "ns=physics;team=physics", "tenant": None, "unit": "gpu_hours", "limit": 10.0,
         "used": 8.0, "reserved": 8.0, "consumed": 0.0, "requested": 4.0, "remaining": 2.0, "fits": False}
    ]  # fmt: skip

    await reconciler_factory()
    await wait_for(lambda: _has(pg_dsn, ("late", 1), ("mid", 1)), what="both registered as waiting")
    # The limit rises to 14: late (8 + 4) fits, mid (8 + 9) does not.
    await apply_policies(pg_dsn, delaying(14), sha="2" * 40)

    async def count(n: int) -> bool:
        return len(await headrooms(settings)) >= n

    await wait_for(lambda: count(1), what="HEADROOM after the limit rose")
    [raised] = await headrooms(settings)
    assert (raised.run_id, raised.attempt, raised.policy_id, raised.scope_id) == ("late", 1, "physics-delay", "ns=physics;team=physics")

    # Each instance takes up a new bundle when its announcement or periodic check arrives, so the
    # admission instance may still show the old limit when the reconciler has already spoken.
    async def shows_new_limit() -> bool:
        return (await server.client.get("/v1/admissions/late")).json()["waiting"]["limiting"][0]["limit"] == 14.0

    await wait_for(shows_new_limit, what="admission showing the risen limit")
    now = (await server.client.get("/v1/admissions/late")).json()["waiting"]
    assert now["headroom"] is True and now["limiting"][0]["limit"] == 14.0 and now["limiting"][0]["remaining"] == 6.0
    assert (await server.client.get("/v1/admissions/mid")).json()["waiting"]["headroom"] is False

    # big ends having used 1 of its 8 GPU-hours: 7 come back; late hears of it again, mid at last.
    start = this_month(timedelta(hours=2))
    await feed.send(
        lifecycle("big", "STARTED", start, gpus=8),
        usage("big", "s", start + timedelta(minutes=30), 1),
        lifecycle("big", "COMPLETED", start + timedelta(minutes=30)),
    )
    await wait_for(lambda: count(3), what="HEADROOM after big ended")
    found = await headrooms(settings)
    assert sorted(a.run_id for a in found) == ["late", "late", "mid"] and len({a.event_id for a in found}) == 3
    assert "1 of 14 used, needs 9: fits" in next(a.message for a in found if a.run_id == "mid")
    assert (await server.client.get("/v1/admissions/mid")).json()["waiting"]["limiting"][0]["used"] == 1.0
    # One per waiting run and event: what the outbox holds is what the broker has.
    assert sorted(a.event_id for a in await outbox(pg_dsn, "budget.actions.v1", BudgetAction) if a.type == HEADROOM) == sorted(a.event_id for a in found)


async def _has(dsn: str, *runs: tuple[str, int]) -> bool:
    return set(runs) <= await registered(dsn)


async def _released(dsn: str, run_id: str) -> bool:
    conn = await asyncpg.connect(dsn)
    try:
        return await conn.fetchval("SELECT state = 'released' FROM run_holds WHERE run_id = $1", run_id) is True
    finally:
        await conn.close()


async def test_a_quota_override_that_raises_the_limit_sends_headroom(
    admission_factory,
    reconciler_factory,  # noqa: F811
    settings,
    pg_dsn,
    monkeypatch,
) -> None:
    """PUT /v1/tenants raising a hard quota is a limit rising too: the run it refused hears of it,
    once, and a run that still does not fit does not."""
    from budgetgate.services.reconciler import headroom

    # Each upkeep tick of the reconciler rechecks the waiting runs: counted, so the test can let
    # a few pass rather than sleep for them.
    rechecks = [0]
    recheck = headroom.recheck

    async def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        try:
            return await recheck(*args, **kwargs)
        finally:
            rechecks[0] += 1

    monkeypatch.setattr(headroom, "recheck", counted)
    server = await started(admission_factory, pg_dsn, {"q.yaml": QUOTA.format(limits="max_nodes: 4"), "b.yaml": BIG_BUDGET})
    assert decision_of(await server.client.post("/v1/admissions", json=physics("r1", nodes=3))) == "ALLOW"
    assert decision_of(await server.client.post("/v1/admissions", json=physics("w", nodes=2))) == "DENY"
    assert decision_of(await server.client.post("/v1/admissions", json=physics("huge", nodes=9))) == "DENY"
    await reconciler_factory()
    await wait_for(lambda: _has(pg_dsn, ("w", 1), ("huge", 1)), what="both registered as waiting")
    assert await headrooms(settings) == []

    raised = await server.client.put("/v1/tenants/physics", json={"max_nodes": 6, "reason": "more nodes"})
    assert raised.status_code == 200, raised.text

    async def heard() -> bool:
        return len(await headrooms(settings)) >= 1

    await wait_for(heard, what="HEADROOM after the override raised max_nodes")
    # A few upkeep ticks: nothing more is sent for the same revision.
    ticks = rechecks[0]
    await wait_for(lambda: rechecks[0] >= ticks + 3, what="three more upkeep ticks")
    assert [a.run_id for a in await outbox(pg_dsn, "budget.actions.v1", BudgetAction) if a.type == HEADROOM] == ["w"]
    [found] = await headrooms(settings)
    assert (found.run_id, found.attempt) == ("w", 1)
    assert (await server.client.get("/v1/admissions/w")).json()["waiting"]["limiting"][0]["limit"] == 6
    # The command line reads the same figures as the API: the limit with the override.
    assert 'tenant "physics" max_nodes: 3 of 6 held, needs 2: fits' in await status_cli(pg_dsn, "w")


async def test_a_budget_delay_hears_headroom_once_when_the_next_calendar_window_begins(
    admission_factory,
    reconciler_factory,  # noqa: F811
    settings,
    pg_dsn,
) -> None:
    from budgetgate.core.windows import window_at
    from budgetgate.services.reconciler import headroom

    await delayed_behind_big(admission_factory, pg_dsn, sha="3" * 40, late=4)
    reconciler = await reconciler_factory()
    await wait_for(lambda: _has(pg_dsn, ("late", 1)), what="late registered as waiting")
    [policy] = [p for p in reconciler.bundles.current.policies if p.id == "physics-delay"]
    this = window_at(policy.window, datetime.now(UTC))
    later = this.end + timedelta(minutes=5)  # the next month, where nothing is held yet

    # No window began between two instants of this one: nobody is judged.
    assert await headroom.rollover(reconciler.pool, reconciler.bundles, since=this.start + timedelta(seconds=1), now=datetime.now(UTC)) == 0
    # The next month begins: late (refused in this one) fits there, and hears it once.
    assert await headroom.rollover(reconciler.pool, reconciler.bundles, since=this.end - timedelta(minutes=1), now=later) == 1
    assert await headroom.rollover(reconciler.pool, reconciler.bundles, since=None, now=later) == 0
    [sent] = [a for a in await outbox(pg_dsn, "budget.actions.v1", BudgetAction) if a.type == HEADROOM]
    assert (sent.run_id, sent.attempt, sent.policy_id) == ("late", 1, "physics-delay")
    assert "0 of 10 used, needs 4: fits" in sent.message, sent.message


async def test_a_run_refused_by_a_quota_and_a_budget_hears_headroom_when_the_budget_frees_last(
    admission_factory,
    reconciler_factory,  # noqa: F811
    feed,  # noqa: F811
    settings,
    pg_dsn,
) -> None:
    """w is refused by physics' quota and by a budget both tenants share, so it waits for quota
    headroom with the budget among its needs. Its tenant's slot comes back first (the budget
    still full: nothing); another tenant's run ending frees the budget: w hears of it then."""
    shared = budget_yaml("shared", namespace="physics", labels="{}", limit="gpu_hours: 10", on_exhausted="delay")
    server = await started(admission_factory, pg_dsn, {"q.yaml": QUOTA.format(limits="max_concurrent_allocations: 1"), "b.yaml": shared})
    assert decision_of(await server.client.post("/v1/admissions", json=physics("p1", gpus=1))) == "ALLOW"
    chem = submission(run_id="c1", namespace="physics", labels={"team": "chem"}, resources={"gpus": 9}, projected_runtime_hours=1.0, job=None)
    assert decision_of(await server.client.post("/v1/admissions", json=chem)) == "ALLOW"
    refused = (await server.client.post("/v1/admissions", json=physics("w", gpus=4))).json()
    assert refused["decision"] == "DENY" and refused["reason"].startswith('allocation rejected: tenant "physics"')
    assert [e["decision"] for e in refused["evaluations"]] == ["DELAY"]

    await reconciler_factory()
    await wait_for(lambda: _has(pg_dsn, ("w", 1)), what="w registered as waiting")
    start = this_month(timedelta(hours=2))
    # p1 used its whole GPU-hour: physics' slot comes back, the budget's room does not.
    await feed.send(
        lifecycle("p1", "STARTED", start, gpus=1), usage("p1", "s", start + timedelta(hours=1), 1), lifecycle("p1", "COMPLETED", start + timedelta(hours=1))
    )
    await wait_for(lambda: _released(pg_dsn, "p1"), what="p1's holds given back")
    assert await headrooms(settings) == []
    # c1 used 1 of its 9: 8 come back, and w (4) fits under both now.
    await feed.send(
        lifecycle("c1", "STARTED", start, gpus=9),
        usage("c1", "s", start + timedelta(minutes=10), 1),
        lifecycle("c1", "COMPLETED", start + timedelta(minutes=10)),
    )

    async def heard() -> bool:
        return len(await headrooms(settings)) >= 1

    await wait_for(heard, what="HEADROOM for w once the budget freed")
    [action] = await headrooms(settings)
    assert (action.run_id, action.attempt) == ("w", 1)
    assert "max_concurrent_allocations: 0 of 1 held, needs 1: fits" in action.message and "2 of 10 used, needs 4: fits" in action.message, action.message
