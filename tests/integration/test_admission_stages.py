"""The admission service's stage histogram (`budgetgate_admission_stage_seconds`) against real
Postgres, Redis and Kafka: every submission timed is counted once in every stage, whatever it was
answered (a decision, a replay), one refused before it was decided is not, and the stages of the
submissions add up to no more than the time their answers took."""

from __future__ import annotations

import time

from budgetgate.benchmark import breakdown
from budgetgate.services.admission.stages import STAGES
from tests.support.admission import apply_policies, budget_yaml


async def _stages(server) -> dict[str, breakdown.Stage]:  # type: ignore[no-untyped-def]
    read = breakdown.parse((await server.client.get("/metrics")).text)
    return {s.name: s for s in breakdown.between(({}, {}), read)}


async def test_every_timed_submission_is_counted_once_in_every_stage(admission_factory, pg_dsn) -> None:
    await apply_policies(pg_dsn, {"b.yaml": budget_yaml("stages", limit="gpu_hours: 100")}, sha="5" * 40)
    server = await admission_factory(stage_timing_interval_seconds=0)
    await server.wait_ready()

    started = time.perf_counter()
    answers = [await server.submit(run_id=f"staged-{i}") for i in range(3)]
    answers.append(await server.submit(run_id="staged-0"))  # a replay, answered from its batch
    took = time.perf_counter() - started
    refused = await server.submit(run_id="staged-bad", projected_runtime_hours=-1.0)  # a 422 before any batch

    assert [a.status_code for a in answers] == [200] * 4 and answers[3].json()["replayed"] is True
    assert refused.status_code == 422
    found = await _stages(server)
    assert tuple(found) == STAGES
    assert {s.count for s in found.values()} == {4}
    total_ms = sum(s.mean_ms * s.count for s in found.values() if s.mean_ms is not None)
    assert 0 < total_ms <= took * 1000  # what the service spent of the time the client waited
    for waited in ("postgres_read", "postgres_write"):
        assert found[waited].mean_ms is not None and found[waited].mean_ms > 0


async def test_one_submission_per_interval_is_timed(admission_factory, pg_dsn) -> None:
    await apply_policies(pg_dsn, {"b.yaml": budget_yaml("sampled", limit="gpu_hours: 100")}, sha="6" * 40)
    server = await admission_factory(stage_timing_interval_seconds=3600)
    await server.wait_ready()

    for i in range(3):
        assert (await server.submit(run_id=f"sampled-{i}")).status_code == 200

    assert {s.count for s in (await _stages(server)).values()} == {1}
