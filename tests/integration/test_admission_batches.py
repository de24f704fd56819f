"""Group commit and resubmission: batches decided as one Redis script and one Postgres
transaction keep every invariant of a decision taken alone."""

from __future__ import annotations

import asyncio
from typing import Any

import asyncpg
import pytest

from budgetgate.services.admission.admitter import Unavailable
from budgetgate.services.admission.resubmission import Conflict
from tests.support.admission import (
    apply_policies,
    budget_yaml,
    decision_of,
    GPU_HOUR,
    held_in_postgres,
    one_batch,
    reserved_in_redis,
    submission,
    wait_for_bundle,
)

LIMIT = budget_yaml("batched", limit="gpu_hours: 100")


def body(run_id: str, *, gpus: int = 8, hours: float = 1.0, attempt: int = 1, labels: dict[str, str] | None = None) -> dict[str, Any]:
    return submission(
        run_id=run_id, attempt=attempt, labels={"team": "vision"} if labels is None else labels, resources={"gpus": gpus}, projected_runtime_hours=hours
    )


async def decisions_of(dsn: str) -> dict[str, list[tuple[int, str]]]:
    conn = await asyncpg.connect(dsn)
    try:
        rows = await conn.fetch("SELECT run_id, attempt, outcome FROM decisions ORDER BY run_id, attempt")
    finally:
        await conn.close()
    result: dict[str, list[tuple[int, str]]] = {}
    for r in rows:
        result.setdefault(r["run_id"], []).append((r["attempt"], r["outcome"]))
    return result


async def test_a_batch_mixing_duplicates_conflicts_violations_and_over_budget_runs(admission_factory, pg_dsn) -> None:
    await apply_policies(pg_dsn, {"b.yaml": LIMIT}, sha="b" * 40)
    server = await admission_factory()
    await server.wait_ready()
    assert decision_of(await server.client.post("/v1/admissions", json=body("a"))) == "ALLOW"  # 8 held
    assert decision_of(await server.client.post("/v1/admissions", json=body("d", gpus=50, hours=4.0))) == "DENY"

    answers = await one_batch(server, [
        body("r1", hours=5.0),                 # 40 -> 48 held: ALLOW
        body("r1", hours=5.0),                 # the same request again in the batch: follows r1
        body("r1", gpus=4, hours=5.0),         # same run and attempt, other GPUs: 409
        body("a"),                             # a retry of a decided run: replayed
        body("a", hours=2.0),                  # a decided run and attempt, other hours: 409
        body("d", gpus=8, hours=5.0, attempt=2),  # a higher attempt after a DENY: afresh, 40 -> 88
        body("lv", labels={"cost": "x"}),      # no team label: a label violation, DENY
        body("big", gpus=50, hours=4.0),       # 200 GPU-hours on a 100 limit: DENY
        body("r2", hours=5.0),                 # 40 more do not fit in the 12 left: DENY
        body("r3"),                            # 8 still fit: ALLOW, 96 held
        body("r1", hours=5.0, attempt=2),      # another attempt of r1 in the same batch: next batch
    ])  # fmt: skip
    r1, r1_again, r1_conflict, a, a_conflict, d2, lv, big, r2, r3, r1_next = answers
    assert r1["decision"] == "ALLOW" and r1["replayed"] is False
    assert r1_again["decision_id"] == r1["decision_id"] and r1_again["replayed"] is True
    assert isinstance(r1_conflict, Conflict) and r1_conflict.fields == ["resources.gpus"]
    assert a["replayed"] is True and a["decision"] == "ALLOW"
    assert isinstance(a_conflict, Conflict) and a_conflict.fields == ["projected_runtime_hours"]
    assert d2["decision"] == "ALLOW" and d2["replayed"] is False and d2["attempt"] == 2
    assert lv["decision"] == "DENY" and lv["evaluations"][0]["missing_labels"] == ["team"]
    assert big["decision"] == "DENY" and r2["decision"] == "DENY"
    assert r3["decision"] == "ALLOW"
    assert r1_next["decision_id"] == r1["decision_id"] and r1_next["replayed"] is True  # an ALLOW sticks

    recorded = await decisions_of(pg_dsn)
    assert set(recorded) == {"a", "d", "r1", "lv", "big", "r2", "r3"}
    assert recorded["a"] == [(1, "ALLOW")]
    assert recorded["d"] == [(1, "DENY"), (2, "ALLOW")]
    assert recorded["r1"] == [(1, "ALLOW")]
    assert recorded["lv"] == [(1, "DENY")] and recorded["big"] == [(1, "DENY")] and recorded["r2"] == [(1, "DENY")]
    held = await held_in_postgres(pg_dsn)
    assert list(held.values()) == [96 * GPU_HOUR]
    assert await reserved_in_redis(server) == held


async def test_resubmission_over_http(admission_factory, pg_dsn) -> None:
    await apply_policies(pg_dsn, {"b.yaml": budget_yaml("small", limit="gpu_hours: 10")}, sha="1" * 40)
    server = await admission_factory(policy_refresh_seconds=0.1)
    await server.wait_ready()
    denied = (await server.client.post("/v1/admissions", json=body("run", gpus=8, hours=2.0))).json()
    assert denied["decision"] == "DENY"
    retried = (await server.client.post("/v1/admissions", json=body("run", gpus=8, hours=2.0))).json()
    assert retried["decision"] == "DENY" and retried["replayed"] is True
    conflict = await server.client.post("/v1/admissions", json=body("run", gpus=4, hours=3.0))
    assert conflict.status_code == 409
    assert conflict.json()["fields"] == ["resources.gpus", "projected_runtime_hours"]
    assert await decisions_of(pg_dsn) == {"run": [(1, "DENY")]}

    # The budget owner raises the limit, as the denial said to ask; the next attempt is decided afresh.
    await apply_policies(pg_dsn, {"b.yaml": budget_yaml("small", limit="gpu_hours: 100")}, sha="2" * 40)
    await wait_for_bundle(server, "2" * 40)
    second = (await server.client.post("/v1/admissions", json=body("run", gpus=8, hours=2.0, attempt=2))).json()
    assert second["decision"] == "ALLOW" and second["replayed"] is False
    third = (await server.client.post("/v1/admissions", json=body("run", gpus=8, hours=2.0, attempt=3))).json()
    assert third["decision_id"] == second["decision_id"] and third["replayed"] is True  # an ALLOW is not decided again
    assert list((await held_in_postgres(pg_dsn)).values()) == [16 * GPU_HOUR]
    lookup = (await server.client.get("/v1/admissions/run")).json()
    assert lookup["decision_id"] == second["decision_id"]


async def test_a_resend_asking_for_more_after_an_allow_is_a_409_naming_each_change_at_any_attempt(admission_factory, pg_dsn) -> None:
    # An admitted run (1 GPU for 1 h) resent as attempt 2 for 500 GPUs for 100 h was answered
    # 200 ALLOW, replayed: a client reading only `decision` launched the 500-GPU job.
    await apply_policies(pg_dsn, {"b.yaml": LIMIT}, sha="b" * 40)
    server = await admission_factory()
    await server.wait_ready()
    first = (await server.client.post("/v1/admissions", json=body("grow", gpus=1, hours=1.0))).json()
    assert first["decision"] == "ALLOW"
    for attempt in (2, 1, 9):
        answer = await server.client.post("/v1/admissions", json=body("grow", gpus=500, hours=100.0, attempt=attempt))
        assert answer.status_code == 409 and answer.headers["content-type"] == "application/problem+json", answer.text
        problem = answer.json()
        assert problem["fields"] == ["resources.gpus", "projected_runtime_hours"] and problem["next_attempt"] is None
        assert problem["changes"] == [
            {"field": "resources.gpus", "was": 1, "now": 500},
            {"field": "projected_runtime_hours", "was": 1.0, "now": 100.0},
        ]
        assert "resources.gpus: 1 → 500; projected_runtime_hours: 1.0 → 100.0" in problem["detail"] and "under a new run id" in problem["detail"]
    # Unchanged, a resend at a higher attempt is answered as before.
    again = (await server.client.post("/v1/admissions", json=body("grow", gpus=1, hours=1.0, attempt=2))).json()
    assert again["decision_id"] == first["decision_id"] and again["replayed"] is True
    assert await decisions_of(pg_dsn) == {"grow": [(1, "ALLOW")]}
    assert list((await held_in_postgres(pg_dsn)).values()) == [1 * GPU_HOUR]


async def test_after_a_refusal_a_changed_request_is_a_new_question_at_a_higher_attempt_only(admission_factory, pg_dsn) -> None:
    await apply_policies(pg_dsn, {"b.yaml": LIMIT}, sha="b" * 40)
    server = await admission_factory()
    await server.wait_ready()
    assert decision_of(await server.client.post("/v1/admissions", json=body("ask", gpus=50, hours=4.0))) == "DENY"
    same_attempt = await server.client.post("/v1/admissions", json=body("ask", gpus=8, hours=4.0))
    assert same_attempt.status_code == 409 and same_attempt.json()["next_attempt"] == 2, same_attempt.text
    assert "resources.gpus: 50 → 8" in same_attempt.json()["detail"] and "as attempt 2" in same_attempt.json()["detail"]
    smaller = (await server.client.post("/v1/admissions", json=body("ask", gpus=8, hours=4.0, attempt=2))).json()
    assert smaller["decision"] == "ALLOW" and smaller["replayed"] is False and smaller["attempt"] == 2
    assert await decisions_of(pg_dsn) == {"ask": [(1, "DENY"), (2, "ALLOW")]}
    # Now admitted: the old, larger request is a 409 at any attempt, never the new ALLOW replayed.
    for attempt in (1, 3):
        stale = await server.client.post("/v1/admissions", json=body("ask", gpus=50, hours=4.0, attempt=attempt))
        assert stale.status_code == 409 and stale.json()["next_attempt"] is None and "resources.gpus: 8 → 50" in stale.json()["detail"], stale.text
    assert list((await held_in_postgres(pg_dsn)).values()) == [32 * GPU_HOUR]


@pytest.fixture
async def terminating_trigger(pg_dsn):  # type: ignore[no-untyped-def]
    """A trigger that kills the recording connection when it stores run 'poison': Postgres lost
    in the middle of a batch's statement, after Redis reserved."""
    conn = await asyncpg.connect(pg_dsn)
    try:
        await conn.execute("""
            CREATE FUNCTION test_die() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN PERFORM pg_terminate_backend(pg_backend_pid()); RETURN NEW; END $$;
            CREATE TRIGGER test_die BEFORE INSERT ON decisions FOR EACH ROW
            WHEN (NEW.run_id = 'poison') EXECUTE FUNCTION test_die();
        """)  # fmt: skip
    finally:
        await conn.close()
    yield
    conn = await asyncpg.connect(pg_dsn)
    try:
        await conn.execute("DROP TRIGGER test_die ON decisions; DROP FUNCTION test_die();")
    finally:
        await conn.close()


async def test_postgres_lost_in_the_middle_of_a_batch_answers_503_to_all_and_leaks_nothing(admission_factory, pg_dsn, terminating_trigger) -> None:
    await apply_policies(pg_dsn, {"b.yaml": LIMIT}, sha="c" * 40)
    server = await admission_factory()
    await server.wait_ready()
    assert decision_of(await server.client.post("/v1/admissions", json=body("before"))) == "ALLOW"
    answers = await one_batch(server, [body("x1"), body("x2"), body("poison"), body("x3")])
    assert all(isinstance(a, Unavailable) for a in answers), answers
    assert set(await decisions_of(pg_dsn)) == {"before"}
    held = await held_in_postgres(pg_dsn)
    assert list(held.values()) == [8 * GPU_HOUR]
    # Redis reserved for the whole batch before Postgres failed: it was invalidated, and is
    # rebuilt from Postgres before the next decision, which sees only what Postgres holds.
    after = (await server.client.post("/v1/admissions", json=body("x1"))).json()
    assert after["decision"] == "ALLOW" and after["replayed"] is False
    held = await held_in_postgres(pg_dsn)
    assert list(held.values()) == [16 * GPU_HOUR]
    assert await reserved_in_redis(server) == held


async def test_group_commit_under_load_admits_exactly_what_fits(admission_factory, pg_dsn) -> None:
    await apply_policies(pg_dsn, {"b.yaml": LIMIT}, sha="e" * 40)
    server = await admission_factory(batch_wait_seconds=0.005, batches_in_flight=2)
    await server.wait_ready()
    bodies = [body(f"load-{i % 150}") for i in range(300)]  # every run submitted twice
    answers = await asyncio.gather(*(server.client.post("/v1/admissions", json=b) for b in bodies))
    assert {a.status_code for a in answers} == {200}
    by_run: dict[str, set[str]] = {}
    for b, a in zip(bodies, answers, strict=True):
        by_run.setdefault(str(b["run_id"]), set()).add(a.json()["decision_id"])
    assert all(len(ids) == 1 for ids in by_run.values())  # one decision per run id
    assert sum(a.json()["decision"] == "ALLOW" and not a.json()["replayed"] for a in answers) == 12
    held = await held_in_postgres(pg_dsn)
    assert list(held.values()) == [96 * GPU_HOUR]
    assert await reserved_in_redis(server) == held
    assert server.rt.admitter.batches.items == 300


async def test_a_submission_past_the_ledger_range_is_refused_alone(admission_factory, pg_dsn) -> None:
    # A million GPUs for a year is past what the ledger's integers hold: it once joined a batch
    # and failed it whole (a 500 to every submission in it, Redis invalidated). Now it is a 422
    # naming the problem, decided before it joins, and its neighbours are answered as usual.
    await apply_policies(pg_dsn, {"b.yaml": LIMIT}, sha="7" * 40)
    server = await admission_factory()
    await server.wait_ready()
    huge = body("huge", gpus=1_000_000, hours=8784.0)
    answers = await asyncio.gather(*(server.client.post("/v1/admissions", json=b) for b in (body("n-1"), huge, body("n-2"))))
    assert [a.status_code for a in answers] == [200, 422, 200]
    [error] = answers[1].json()["errors"]
    assert error["loc"] == ["body", "projected_runtime_hours"] and "beyond the ledger's range" in error["msg"], answers[1].text
    assert [a.json()["decision"] for a in (answers[0], answers[2])] == ["ALLOW", "ALLOW"]
    assert list((await held_in_postgres(pg_dsn)).values()) == [16 * GPU_HOUR]
    assert await server.rt.ledger.is_loaded()  # nothing failed after a Redis change
    quote = await server.client.post("/v1/quotes", json=huge)  # a quote plans the same way
    assert quote.status_code == 422


async def test_a_reservation_made_in_the_last_round_stands(admission_factory, pg_dsn, monkeypatch) -> None:
    # A key Redis loses between rounds is loaded and the batch reserved again, up to four rounds:
    # what the fourth reserved was once answered 503 (and Redis invalidated) as if it had not.
    await apply_policies(pg_dsn, {"b.yaml": LIMIT}, sha="8" * 40)
    server = await admission_factory()
    await server.wait_ready()
    assert decision_of(await server.client.post("/v1/admissions", json=body("first"))) == "ALLOW"
    [key] = await held_in_postgres(pg_dsn)
    ledger = server.rt.ledger
    reserve_batch, rounds = ledger.reserve_batch, []

    async def losing_the_key(*args, **kwargs):  # type: ignore[no-untyped-def]
        rounds.append(1)
        if len(rounds) < 4:
            await ledger.client.delete(ledger.ledger(key))  # lost again before this round
        return await reserve_batch(*args, **kwargs)

    monkeypatch.setattr(ledger, "reserve_batch", losing_the_key)
    answer = await server.client.post("/v1/admissions", json=body("fourth-round"))
    monkeypatch.setattr(ledger, "reserve_batch", reserve_batch)
    assert len(rounds) == 4
    assert answer.status_code == 200 and answer.json()["decision"] == "ALLOW", answer.text
    assert await ledger.is_loaded()
    assert await reserved_in_redis(server) == await held_in_postgres(pg_dsn) == {key: 16 * GPU_HOUR}
