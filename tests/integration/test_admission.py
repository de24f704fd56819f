"""Admission against real Postgres, Redis and Kafka: the invariants of DESIGN.md."""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, datetime, timedelta

import pytest

from tests.support.kafka import drain
from tests.support.admission import GPU_HOUR, apply_policies, budget_yaml, held_in_postgres, reserved_in_redis, submission, wait_for_bundle


async def test_allow_answers_with_the_numbers(admission) -> None:
    response = await admission.submit()
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["decision"] == "ALLOW"
    assert body["replayed"] is False
    assert body["projected_gpu_hours"] == 48.0
    assert body["showback_cost"] == 188.78 and body["currency"] == "USD"
    by_policy = {e["policy_id"]: e for e in body["evaluations"]}
    assert set(by_policy) == {"gpu-budget/team-vision-prod", "cost/cc-1042", "gpu-budget/org-dry-run"}
    vision = by_policy["gpu-budget/team-vision-prod"]
    assert vision["scope_id"] == "ns=vision-prod;cost-center=1042;team=vision"
    assert vision["policy_git_sha"] == "e" * 40
    assert vision["remaining_gpu_hours"] == 500.0 and vision["admitted_gpu_hours"] == 48.0
    start, end = datetime.fromisoformat(vision["window_start"]), datetime.fromisoformat(vision["window_end"])
    decided = datetime.fromisoformat(body["decided_at"])
    # The calendar month (UTC) the decision fell in: from its first day to the next month's.
    assert start == decided.replace(day=1, hour=0, minute=0, second=0, microsecond=0) and start <= decided < end
    assert end.day == 1 and end.hour == 0 and (end.month - start.month) % 12 == 1
    assert by_policy["cost/cc-1042"]["projected"] == 188.78


async def test_same_run_id_replays_and_reserves_once(admission, pg_dsn) -> None:
    first = (await admission.submit()).json()
    again = (await admission.submit()).json()
    assert again["replayed"] is True
    assert again["decision_id"] == first["decision_id"]
    held = await held_in_postgres(pg_dsn)
    assert sorted(held.values()) == [48 * GPU_HOUR, 48 * GPU_HOUR, 188_784_000]
    assert await reserved_in_redis(admission) == held
    lookup = await admission.client.get("/v1/admissions/flyte/vision/exec-7f3a/n0")
    assert lookup.status_code == 200 and lookup.json()["decision_id"] == first["decision_id"]


async def test_concurrent_duplicates_reserve_once(admission, pg_dsn) -> None:
    answers = await asyncio.gather(*(admission.submit(run_id="dup-run") for _ in range(40)))
    bodies = [a.json() for a in answers]
    assert {b["decision_id"] for b in bodies} == {bodies[0]["decision_id"]}
    assert sum(not b["replayed"] for b in bodies) == 1
    held = await held_in_postgres(pg_dsn)
    assert sorted(held.values()) == [48 * GPU_HOUR, 48 * GPU_HOUR, 188_784_000]
    assert await reserved_in_redis(admission) == held


async def test_200_concurrent_submissions_admit_exactly_what_fits(admission_factory, pg_dsn) -> None:
    await apply_policies(pg_dsn, {"b.yaml": budget_yaml("hot", limit="gpu_hours: 100")}, sha="a" * 40)
    # Two instances on one ledger, as in production behind a load balancer.
    servers = [await admission_factory(pg_pool_max=30), await admission_factory(pg_pool_max=30)]
    for server in servers:
        await server.wait_ready()
    bodies = [submission(run_id=f"run-{i}", labels={"team": "vision"}, resources={"gpus": 8}, projected_runtime_hours=1.0) for i in range(200)]
    answers = await asyncio.gather(*(servers[i % 2].client.post("/v1/admissions", json=b) for i, b in enumerate(bodies)))
    outcomes = [a.json()["decision"] for a in answers]
    assert outcomes.count("ALLOW") == 12  # 12 × 8 GPU-hours = 96 ≤ 100 < 104
    assert outcomes.count("DENY") == 188
    held = await held_in_postgres(pg_dsn)
    assert list(held.values()) == [96 * GPU_HOUR]
    assert await reserved_in_redis(servers[0]) == held
    denied = next(a.json() for a in answers if a.json()["decision"] == "DENY")
    evaluation = denied["evaluations"][0]
    assert evaluation["remaining_gpu_hours"] == 4.0 and evaluation["deficit_gpu_hours"] == 4.0
    assert "short by 4 GPU-hours" in denied["reason"]


async def test_three_policies_reserve_on_all_or_none(admission_factory, pg_dsn) -> None:
    policies = {
        "team.yaml": budget_yaml("team", labels="{team: vision}", limit="gpu_hours: 1000"),
        "cc.yaml": budget_yaml("cc", labels="{cost-center: '1042'}", limit="gpu_hours: 50"),
        "org.yaml": budget_yaml("org", labels="{environment: '*'}", limit="gpu_hours: 1000"),
    }
    await apply_policies(pg_dsn, policies, sha="b" * 40)
    server = await admission_factory()
    await server.wait_ready()
    first = (await server.submit(run_id="r1", resources={"gpus": 8}, projected_runtime_hours=5.0)).json()
    assert first["decision"] == "ALLOW" and len(first["evaluations"]) == 3
    before = await held_in_postgres(pg_dsn)
    assert sorted(before.values()) == [40 * GPU_HOUR] * 3
    second = (await server.submit(run_id="r2", resources={"gpus": 8}, projected_runtime_hours=5.0)).json()
    assert second["decision"] == "DENY"
    blocking = [e for e in second["evaluations"] if e["decision"] == "DENY"]
    assert [e["policy_id"] for e in blocking] == ["cc"]
    assert all(e["admitted_gpu_hours"] == 0 for e in second["evaluations"])
    assert await held_in_postgres(pg_dsn) == before
    assert await reserved_in_redis(server) == before


async def test_missing_labels_are_a_recorded_violation(admission, pg_dsn) -> None:
    response = await admission.submit(run_id="no-labels", labels={"team": "vision"})
    body = response.json()
    assert body["decision"] == "DENY"
    assert "cost-center" in body["reason"] and "gpu-budget/team-vision-prod" in body["reason"]
    violated = next(e for e in body["evaluations"] if e["missing_labels"])
    assert violated["missing_labels"] == ["cost-center"]
    stored = await admission.client.get("/v1/admissions/no-labels")
    assert stored.json()["decision_id"] == body["decision_id"]
    assert await held_in_postgres(pg_dsn) == {}


async def test_exhausted_delay_budget_delays_until_room(admission_factory, pg_dsn) -> None:
    await apply_policies(pg_dsn, {"d.yaml": budget_yaml("wait", limit="gpu_hours: 10", on_exhausted="delay")}, sha="c" * 40)
    server = await admission_factory()
    await server.wait_ready()
    allowed = (await server.submit(run_id="big", labels={"team": "vision"}, resources={"gpus": 8}, projected_runtime_hours=1.0)).json()
    assert allowed["decision"] == "ALLOW"
    delayed = (await server.submit(run_id="later", labels={"team": "vision"}, resources={"gpus": 4}, projected_runtime_hours=1.0)).json()
    assert delayed["decision"] == "DELAY"
    evaluation = delayed["evaluations"][0]
    # The admitted run has not started: it gives its reservation back at its start deadline (an
    # hour from now), or the month ends first (within an hour of its end) and frees it all.
    eligible, window_end = (datetime.fromisoformat(evaluation[k].replace("Z", "+00:00")) for k in ("next_eligible_time", "window_end"))
    deadline = datetime.now(UTC) + timedelta(hours=1, seconds=1)  # (answered in whole seconds, rounded up)
    assert eligible <= min(window_end, deadline) and (eligible < window_end or window_end <= deadline), (eligible, window_end)
    assert evaluation["deficit_gpu_hours"] == 2.0
    again = (await server.submit(run_id="later", labels={"team": "vision"}, resources={"gpus": 4}, projected_runtime_hours=1.0)).json()
    assert again["replayed"] is True and again["decision"] == "DELAY"
    retry = (await server.submit(run_id="later", attempt=2, labels={"team": "vision"}, resources={"gpus": 1}, projected_runtime_hours=1.0)).json()
    assert retry["replayed"] is False and retry["decision"] == "ALLOW" and retry["attempt"] == 2


BAD_BODIES = [
    ({"resources": {"gpus": 0, "nodes": 0}}, "nodes"),
    ({"resources": {"gpus": True}}, "gpus"),
    ({"resources": {"gpus": "8"}}, "gpus"),
    ({"resources": {"gpus": 8, "nodes": False}}, "nodes"),
    ({"attempt": True}, "attempt"),
    ({"projected_runtime_hours": True}, "projected_runtime_hours"),
    ({"resources": {"gpus": -3}}, "gpus"),
    ({"projected_runtime_hours": 0}, "projected_runtime_hours"),
    ({"projected_runtime_hours": -1.5}, "projected_runtime_hours"),
    ({"projected_runtime_hours": 9000}, "projected_runtime_hours"),
    ({"run_id": "x" * 300}, "run_id"),
    ({"run_id": ""}, "run_id"),
    ({"labels": {"team": "v" * 80}}, "labels"),
    ({"labels": {f"k{i}": "v" for i in range(70)}}, "labels"),
    ({"namespace": "Not_A_Namespace"}, "namespace"),
    ({"surprise": 1}, "surprise"),
]


@pytest.mark.parametrize(("override", "field"), BAD_BODIES)
async def test_bad_input_is_422_naming_the_field(admission, pg_dsn, override, field) -> None:
    response = await admission.submit(run_id=f"bad-{uuid.uuid4()}", **override) if "run_id" not in override else await admission.submit(**override)
    assert response.status_code == 422, response.text
    assert response.headers["content-type"] == "application/problem+json"
    assert any(field in ".".join(str(p) for p in err["loc"]) for err in response.json()["errors"])
    assert await held_in_postgres(pg_dsn) == {}


@pytest.mark.parametrize("raw", [b'{"run_id": "x", ', b"[]", b'{"projected_runtime_hours": NaN}', b'{"projected_runtime_hours": Infinity}'])
async def test_malformed_or_non_finite_json_is_422(admission, pg_dsn, raw) -> None:
    response = await admission.client.post("/v1/admissions", content=raw, headers={"content-type": "application/json"})
    assert response.status_code == 422, response.text
    assert await held_in_postgres(pg_dsn) == {}


async def test_unpriced_flavor_under_a_cost_budget_is_422(admission, pg_dsn) -> None:
    response = await admission.submit(run_id="odd-flavor", resources={"gpus": 1, "flavor": "tpu-v9"})
    assert response.status_code == 422
    assert response.json()["errors"][0]["loc"] == ["body", "resources", "flavor"]
    assert "tpu-v9" in response.json()["errors"][0]["msg"]
    assert await held_in_postgres(pg_dsn) == {}


async def test_a_flavor_no_rate_card_prices_is_admitted_with_a_warning(admission_factory, pg_dsn) -> None:
    """A GPU-hour budget and a rate card pricing h100 only: h200 (a typo) is admitted, said so."""
    rates = "apiVersion: budgetgate/v1\nkind: RateCard\nmetadata: {id: r}\nspec: {currency: USD, rates: [{flavor: h100, rate_per_gpu_hour: 2.5}]}\n"
    await apply_policies(pg_dsn, {"b.yaml": budget_yaml("team", labels="{team: vision}"), "r.yaml": rates}, sha="d" * 40)
    server = await admission_factory()
    await server.wait_ready()
    body = {"labels": {"team": "vision"}, "resources": {"gpus": 1, "nodes": 1, "flavor": "h200"}}
    typo = (await server.submit(run_id="typo-flavor", **body)).json()
    assert typo["decision"] == "ALLOW", typo
    assert typo["showback_cost"] is None and typo["warnings"] == ["no rate card prices flavor 'h200' (priced: h100): showback_cost is null"]
    priced = (await server.submit(run_id="right-flavor", **{**body, "resources": {"gpus": 1, "nodes": 1, "flavor": "h100"}})).json()
    assert priced["warnings"] == [] and priced["showback_cost"] is not None
    # A replay says the same.
    assert (await server.client.get("/v1/admissions/typo-flavor")).json()["warnings"] == typo["warnings"]


async def test_scope_usage_reports_the_current_window(admission) -> None:
    await admission.submit()
    response = await admission.client.get("/v1/scopes/ns=vision-prod;cost-center=1042;team=vision/usage")
    assert response.status_code == 200, response.text
    [budget] = response.json()["budgets"]
    assert budget["limit"] == 500.0 and budget["reserved"] == 48.0 and budget["consumed"] == 0.0
    assert budget["remaining"] == 452.0 and budget["utilization"] == pytest.approx(0.096)
    assert budget["policy_id"] == "gpu-budget/team-vision-prod" and budget["policy_git_sha"] == "e" * 40
    assert (await admission.client.get("/v1/scopes/ns=nowhere/usage")).status_code == 404


async def test_new_bundle_takes_effect_without_restart(admission_factory, pg_dsn) -> None:
    await apply_policies(pg_dsn, {"p.yaml": budget_yaml("p", limit="gpu_hours: 10")}, sha="1" * 40)
    server = await admission_factory()
    await server.wait_ready()
    first = (await server.submit(run_id="a", labels={"team": "vision"}, resources={"gpus": 8}, projected_runtime_hours=2.0)).json()
    assert first["decision"] == "DENY" and first["policy_bundle_sha"] == "1" * 40
    await apply_policies(pg_dsn, {"p.yaml": budget_yaml("p", limit="gpu_hours: 100")}, sha="2" * 40)
    await wait_for_bundle(server, "2" * 40)
    second = (await server.submit(run_id="b", labels={"team": "vision"}, resources={"gpus": 8}, projected_runtime_hours=2.0)).json()
    assert second["decision"] == "ALLOW" and second["policy_bundle_sha"] == "2" * 40
    assert second["evaluations"][0]["policy_git_sha"] == "2" * 40


async def test_redis_flushed_mid_stream_never_over_admits(admission_factory, pg_dsn) -> None:
    await apply_policies(pg_dsn, {"b.yaml": budget_yaml("flush", limit="gpu_hours: 100")}, sha="f" * 40)
    server = await admission_factory(pg_pool_max=30)
    await server.wait_ready()
    ledger = server.rt.ledger

    def body(i: int) -> dict[str, object]:
        return submission(run_id=f"f-{i}", labels={"team": "vision"}, resources={"gpus": 8}, projected_runtime_hours=1.0)

    first = await asyncio.gather(*(server.client.post("/v1/admissions", json=body(i)) for i in range(6)))
    assert [a.json()["decision"] for a in first] == ["ALLOW"] * 6

    async def flush_now() -> None:
        keys = [k async for k in ledger.client.scan_iter(match=f"{ledger.tag}:*")]
        await ledger.client.delete(*keys)

    # Redis loses everything while the next burst is being decided: the 48 GPU-hours already
    # held must not be read as free, so exactly 6 more fit, never 12.
    results = await asyncio.gather(flush_now(), *(server.client.post("/v1/admissions", json=body(i)) for i in range(6, 100)))
    answers = [r for r in results if r is not None]
    assert all(a.status_code in (200, 503) for a in answers)
    allowed = [a for a in answers if a.status_code == 200 and a.json()["decision"] == "ALLOW"]
    assert len(allowed) == 6
    held = await held_in_postgres(pg_dsn)
    assert list(held.values()) == [96 * GPU_HOUR]
    await server.rt.sync.ensure_loaded()
    assert await reserved_in_redis(server) == held


async def test_readiness_and_metrics(admission) -> None:
    ready = await admission.client.get("/readyz")
    assert ready.status_code == 200 and ready.json()["checks"]["redis_ledger"] == "ok"
    await admission.submit()
    text = (await admission.client.get("/metrics")).text
    assert 'budgetgate_admission_decisions_total{decision="ALLOW"' in text
    assert "budgetgate_admission_latency_seconds_bucket" in text
    spec = (await admission.client.get("/openapi.json")).json()
    assert "/v1/admissions" in spec["paths"]


async def test_decision_is_published_with_the_same_decision_id(admission, settings) -> None:
    from budgetgate.contracts import wire
    from budgetgate.contracts.topics import Topics
    from budgetgate.v1 import common_pb2, decisions_pb2

    body = (await admission.submit(run_id="published")).json()

    def published(record) -> bool | None:  # type: ignore[no-untyped-def]
        return wire.decode(decisions_pb2.Decision, record.value, record.headers).run_id == "published" or None

    found = [r for r in await drain(settings.kafka_bootstrap, Topics(settings.topic_prefix).decisions, 1, distinct=published) if published(r)]
    assert found, "decision never reached budget.decisions.v1"
    record = found[-1]
    message = wire.decode(decisions_pb2.Decision, record.value, record.headers)
    assert message.decision_id == body["decision_id"] == message.event_id
    assert message.outcome == common_pb2.ALLOW
    assert record.key == b"published"
    assert {e.policy_id for e in message.evaluations} == {e["policy_id"] for e in body["evaluations"]}
    assert wire.header(record.headers, "traceparent") is not None
