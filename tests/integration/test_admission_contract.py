"""Admission's answers as the contract says (issue 8, items 3, 4 and 12): CPU-only work, runs too
small to show in the ledger's unit, problem details, one timestamp format and one key order."""

from __future__ import annotations

import asyncio
import re
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings

from budgetgate.contracts.admission import AdmissionResponse, AdmissionStatus, EvaluationOut
from tests.support.admission import apply_policies, budget_yaml, decision_of

ZULU = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?Z$")
VISION = {"team": "vision"}


def instants(body: dict[str, Any]) -> list[str]:
    found = [body["decided_at"]]
    for e in body["evaluations"]:
        found += [e[k] for k in ("window_start", "window_end", "next_eligible_time") if e[k] is not None]
    return found


async def test_cpu_only_work_is_charged_on_node_hours_and_zero_on_gpu_hours(admission_factory, pg_dsn) -> None:
    policies = {
        "gpu.yaml": budget_yaml("gpu", limit="gpu_hours: 1"),
        "node.yaml": budget_yaml("node", limit="node_hours: 10", window="{calendar: week}"),
    }
    await apply_policies(pg_dsn, policies, sha="f" * 40)
    server = await admission_factory()
    await server.wait_ready()
    # Use up the GPU budget (and more: the second run of 1 GPU-hour does not fit it).
    assert decision_of(await server.submit(run_id="gpu", labels=VISION, resources={"gpus": 1}, projected_runtime_hours=1.0)) == "ALLOW"
    cpu = await server.submit(run_id="cpu", labels=VISION, resources={"gpus": 0, "nodes": 2}, projected_runtime_hours=3.0)
    assert cpu.status_code == 200, cpu.text
    body = cpu.json()
    assert body["decision"] == "ALLOW" and body["projected_gpu_hours"] == 0.0
    by_policy = {e["policy_id"]: e for e in body["evaluations"]}
    assert (by_policy["gpu"]["projected"], by_policy["gpu"]["admitted"], by_policy["gpu"]["remaining"]) == (0.0, 0.0, 0.0)
    assert (by_policy["node"]["projected"], by_policy["node"]["admitted"]) == (6.0, 6.0)
    nothing = await server.submit(run_id="nothing", labels=VISION, resources={"gpus": 0, "nodes": 0}, projected_runtime_hours=3.0)
    assert nothing.status_code == 422 and nothing.headers["content-type"] == "application/problem+json"
    assert [e["field"] for e in nothing.json()["errors"]] == ["resources.nodes"]


async def test_a_run_too_small_for_the_unit_is_refused_by_an_exhausted_budget(admission_factory, pg_dsn) -> None:
    await apply_policies(pg_dsn, {"b.yaml": budget_yaml("tight", limit="gpu_hours: 1")}, sha="1" * 40)
    server = await admission_factory()
    await server.wait_ready()
    assert decision_of(await server.submit(run_id="all", labels=VISION, resources={"gpus": 1}, projected_runtime_hours=1.0)) == "ALLOW"
    tiny = (await server.submit(run_id="tiny", labels=VISION, resources={"gpus": 1}, projected_runtime_hours=1e-9)).json()
    assert tiny["decision"] == "DENY", tiny
    [evaluation] = tiny["evaluations"]
    assert evaluation["projected"] > 0 and evaluation["admitted"] == 0
    boolean = await server.submit(run_id="bool", labels=VISION, resources={"gpus": True}, projected_runtime_hours=1.0)
    assert boolean.status_code == 422 and boolean.json()["errors"][0]["field"] == "resources.gpus"


async def test_first_answers_and_replays_have_one_shape(admission) -> None:
    first = await admission.submit(run_id="shape")
    again = await admission.submit(run_id="shape")
    looked_up = await admission.client.get("/v1/admissions/shape")
    bodies = [first.json(), again.json(), looked_up.json()]
    # A lookup answers the status: the same decision, then whether the run waits.
    assert list(bodies[2]) == list(AdmissionStatus.model_fields) and bodies[2].pop("waiting") is None
    for body in bodies:
        assert list(body) == list(AdmissionResponse.model_fields)
        assert all(list(e) == list(EvaluationOut.model_fields) for e in body["evaluations"])
        assert all(ZULU.match(at) for at in instants(body)), instants(body)
    assert instants(bodies[0]) == instants(bodies[1]) == instants(bodies[2])
    assert [b["replayed"] for b in bodies] == [False, True, True]


async def test_errors_are_problem_details(admission) -> None:
    answers = {
        "unknown run": await admission.client.get("/v1/admissions/never-submitted"),
        "unknown route": await admission.client.get("/v1/nothing-here"),
        "bad body": await admission.client.post("/v1/admissions", content=b"{", headers={"content-type": "application/json"}),
        "too large": await admission.client.post(
            "/v1/admissions", content=b"x" * (admission.settings.max_body_bytes + 1), headers={"content-type": "application/json"}
        ),
        "unknown pool": await admission.client.get("/v1/pools/nowhere"),
    }
    for what, answer in answers.items():
        assert answer.headers["content-type"] == "application/problem+json", what
        problem = answer.json()
        assert problem["status"] == answer.status_code and problem["type"] == "about:blank" and problem["title"] and problem["detail"], what
    assert [a.status_code for a in answers.values()] == [404, 404, 422, 413, 404]
    # A body that is not JSON says where and why, not a byte offset read as a field ("invalid 1: ...").
    assert (
        answers["bad body"].json()["detail"]
        == "invalid body: not valid JSON: Expecting property name enclosed in double quotes at line 1, column 2 (character 1)"
    )
    broken = b'{\n  "run_id": "r",\n  "attempt": 1\n  "namespace": "vision-prod"\n}'
    answer = await admission.client.post("/v1/admissions", content=broken, headers={"content-type": "application/json"})
    assert answer.status_code == 422, answer.text
    assert answer.json()["errors"] == [
        {"field": "", "loc": ["body"], "msg": "not valid JSON: Expecting ',' delimiter at line 4, column 3 (character 36)", "type": "json_invalid"}
    ]


def content_type(response: Any) -> str:
    value = response.headers.get("content-type") or ""
    return value[0] if isinstance(value, list) else value


def fuzz(url: str, spec: dict[str, Any]) -> tuple[list[str], int]:
    """Schemathesis against the running service: a bounded number of generated requests per
    operation; returns what went wrong (a 5xx, or an error that is not problem details)."""
    schema = schemathesis.openapi.from_dict(spec)
    failures: list[str] = []
    calls = []
    for result in schema.get_all_operations():
        operation = result.ok()

        @settings(
            max_examples=15, deadline=None, derandomize=True, database=None, phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck)
        )
        @given(case=operation.as_strategy())
        def check(case) -> None:  # type: ignore[no-untyped-def]
            response = case.call(base_url=url, timeout=30)
            calls.append(case.method)
            label = f"{case.method} {case.formatted_path} -> {response.status_code}"
            if response.status_code >= 500:
                failures.append(f"{label}: {response.text[:200]}")
            elif response.status_code >= 400 and content_type(response) != "application/problem+json":
                failures.append(f"{label}: {content_type(response)}")

        check()
    return failures, len(calls)


# Schemathesis draws from `random` inside its strategies, which Hypothesis deprecates.
@pytest.mark.filterwarnings("ignore::hypothesis.errors.HypothesisDeprecationWarning")
async def test_schemathesis_finds_no_server_error_and_only_problem_details(admission) -> None:
    spec = (await admission.client.get("/openapi.json")).json()
    # The generator runs in a thread with blocking HTTP calls; the service answers on this loop.
    failures, calls = await asyncio.to_thread(fuzz, admission.url, spec)
    assert failures == []
    assert calls >= 5 * len([op for methods in spec["paths"].values() for op in methods])
