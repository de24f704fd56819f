"""The published HTTP contracts (issue 8, item 12): problem details for every error, a
description on every schema and field, an example on every endpoint, enums for `decision` and
`status`, operationIds for generated clients, /readyz's 503 and /metrics as text/plain."""

from __future__ import annotations

import re
from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

from budgetgate.edge.problems import problem_body
from budgetgate.services.admission.app import create_app
from budgetgate.contracts.admission import AdmissionRequest, EvaluationOut
from budgetgate.services.admission.settings import AdmissionSettings
from budgetgate.services.metering_ingest.app import create_app as create_metering_app
from budgetgate.services.metering_ingest.settings import MeteringSettings
from budgetgate.services.reconciler.app import create_app as create_reconciler_app
from budgetgate.services.reconciler.settings import ReconcilerSettings

PROBLEM = "application/problem+json"


@pytest.fixture(scope="module")
def spec() -> dict[str, Any]:
    return create_app(AdmissionSettings()).openapi()


@pytest.fixture(scope="module")
def metering_spec() -> dict[str, Any]:
    return create_metering_app(MeteringSettings()).openapi()


@pytest.fixture(scope="module")
def reconciler_spec() -> dict[str, Any]:
    return create_reconciler_app(ReconcilerSettings()).openapi()


def operations(spec: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    return [(method.upper(), path, op) for path, methods in spec["paths"].items() for method, op in methods.items()]


def test_operation_ids_are_fit_for_generated_clients(spec, metering_spec, reconciler_spec) -> None:
    ids = {f"{m} {p}": op["operationId"] for m, p, op in operations(spec)}
    assert ids["POST /v1/admissions"] == "submitAdmission"
    assert ids["GET /v1/admissions/{run_id}"] == "getAdmission"
    assert ids["GET /readyz"] == "getReadiness"
    assert [op["operationId"] for method, _path, op in operations(metering_spec) if method == "POST"] == ["ingestMeteringSamples", "publishLifecycleEvents"]
    ids = {f"{m} {p}": op["operationId"] for m, p, op in operations(reconciler_spec)}
    assert ids["GET /v1/settlements/dead-letters"] == "listDeadLetteredSettlements"
    assert ids["POST /v1/settlements/{run_id}/resolve"] == "resolveSettlement"
    for spec_ in (spec, metering_spec, reconciler_spec):
        names = [op["operationId"] for _, _, op in operations(spec_)]
        assert len(set(names)) == len(names)
        assert all(re.fullmatch(r"[a-z]+(?:[A-Z][a-z0-9]*)+", name) for name in names), names


def test_every_error_answer_is_documented_as_problem_details(spec, metering_spec, reconciler_spec) -> None:
    for spec_ in (spec, metering_spec, reconciler_spec):
        for method, path, op in operations(spec_):
            errors = {status: answer for status, answer in op["responses"].items() if int(status) >= 400}
            if op.get("requestBody") or op.get("parameters"):
                assert "422" in errors, f"{method} {path}"
            for status, answer in errors.items():
                assert list(answer["content"]) == [PROBLEM], f"{method} {path} {status}"
    problem = spec["components"]["schemas"]["Problem"]
    assert {"type", "title", "status", "detail", "errors"} <= set(problem["properties"])
    assert "HTTPValidationError" not in spec["components"]["schemas"]


def test_every_schema_and_field_has_a_description(spec, metering_spec, reconciler_spec) -> None:
    missing = described(spec) + described(metering_spec) + described(reconciler_spec)
    assert missing == []


def described(spec: dict[str, Any]) -> list[str]:
    """What lacks a description: component schemas, their fields, parameters, inline bodies."""
    missing = []
    for method, path, op in operations(spec):
        inline = [media["schema"] for media in op.get("requestBody", {}).get("content", {}).values() if "$ref" not in media["schema"]]
        inline += [m["schema"] for a in op["responses"].values() for m in a.get("content", {}).values() if m.get("schema", {}).get("properties")]
        for schema in inline:
            missing += [f"{method} {path} {where}" for where in undescribed(schema)]
    for name, schema in spec["components"]["schemas"].items():
        if not schema.get("description"):
            missing.append(name)
        missing += [f"{name}.{field}" for field, prop in schema.get("properties", {}).items() if not prop.get("description")]
    for method, path, op in operations(spec):
        missing += [f"{method} {path} {p['name']}" for p in op.get("parameters", []) if not p.get("description")]
    return missing


def undescribed(schema: dict[str, Any], at: str = "") -> list[str]:
    found = [] if schema.get("description") or not at or "$ref" in schema else [at]
    for name, prop in schema.get("properties", {}).items():
        found += undescribed(prop, f"{at}.{name}")
    if "items" in schema:
        found += [] if schema["items"].get("description") or "$ref" in schema["items"] else [f"{at}[]"]
        found += [f for f in undescribed({**schema["items"], "description": "-"}, f"{at}[]") if f != f"{at}[]"]
    return found


def test_every_endpoint_has_an_example(spec, metering_spec, reconciler_spec) -> None:
    for method, path, op in operations(spec) + operations(metering_spec) + operations(reconciler_spec):
        body = op.get("requestBody", {}).get("content", {}).get("application/json")
        if body is not None:
            assert "example" in body, f"{method} {path} request"
        [answer] = [op["responses"][s]["content"] for s in ("200", "201", "202") if s in op["responses"]][:1]
        assert any("example" in media for media in answer.values()), f"{method} {path} answer"


def test_decision_and_status_are_enums(spec) -> None:
    schemas = spec["components"]["schemas"]
    assert schemas["AdmissionResponse"]["properties"]["decision"]["enum"] == ["ALLOW", "DENY", "DELAY"]
    assert schemas["EvaluationOut"]["properties"]["decision"]["enum"] == ["ALLOW", "DENY", "DELAY"]
    assert schemas["AllocationOut"]["properties"]["status"]["enum"] == ["Granted", "Exhausted", "NamespaceQuotaExceeded"]


def test_readyz_documents_its_503_and_metrics_is_text(spec) -> None:
    readyz = spec["paths"]["/readyz"]["get"]["responses"]
    assert list(readyz["503"]["content"]) == [PROBLEM]
    metrics = spec["paths"]["/metrics"]["get"]["responses"]["200"]
    assert list(metrics["content"]) == ["text/plain"]


@pytest.mark.parametrize("resources", [{"gpus": True}, {"gpus": "8"}, {"gpus": 8, "nodes": True}, {"gpus": 0, "nodes": 0}, {"gpus": 8.5}])
def test_booleans_strings_and_zero_nodes_are_not_resources(resources: dict[str, Any]) -> None:
    body = {"run_id": "r", "namespace": "ns", "resources": resources, "projected_runtime_hours": 1.0}
    with pytest.raises(ValidationError):
        AdmissionRequest.model_validate(body)
    with pytest.raises(ValidationError):
        AdmissionRequest.model_validate({**body, "resources": {"gpus": 1}, "projected_runtime_hours": True})


def test_cpu_only_work_is_a_valid_submission() -> None:
    body = {"run_id": "r", "namespace": "ns", "resources": {"gpus": 0, "nodes": 2}, "projected_runtime_hours": 1}
    assert AdmissionRequest.model_validate(body).resources.gpus == 0


def test_validation_errors_become_a_problem_listing_the_fields() -> None:
    problem = problem_body(422, {"detail": [{"loc": ["body", "resources", "gpus"], "msg": "Input should be a valid integer", "type": "int_type"}]})
    assert list(problem)[:5] == ["type", "title", "status", "detail", "errors"]
    assert problem["status"] == 422 and problem["title"] == "Unprocessable Content"
    assert problem["errors"] == [
        {"field": "resources.gpus", "loc": ["body", "resources", "gpus"], "msg": "Input should be a valid integer", "type": "int_type"}
    ]
    assert "resources.gpus" in problem["detail"]
    # Other members stay, as extensions (metering-ingest's per-sample results).
    assert problem_body(422, {"detail": [], "results": [1]})["results"] == [1]
    assert problem_body(404, "not here")["detail"] == "not here"


def test_evaluation_keys_follow_the_model() -> None:
    from budgetgate.decisions.rendering import canonical

    stored = {
        "replayed": False,
        "run_id": "r",
        "evaluations": [{"window_end": "2026-04-01T00:00:00+00:00", "policy_id": "p"}],
        "decided_at": "2026-03-10T12:00:00.5+00:00",
    }
    answer = canonical(stored)
    # An answer stored before warnings were given reads as one with none.
    assert list(answer) == ["run_id", "replayed", "decided_at", "evaluations", "warnings"] and answer["warnings"] == []
    assert answer["decided_at"] == "2026-03-10T12:00:00.500000Z"
    assert answer["evaluations"] == [{"policy_id": "p", "window_end": "2026-04-01T00:00:00Z"}]
    assert list(EvaluationOut.model_fields)[0] == "policy_id"


def test_every_service_answers_errors_as_problem_details() -> None:
    from fastapi.testclient import TestClient

    from budgetgate.services.evidence_emitter.app import create_app as create_evidence_app
    from budgetgate.services.evidence_emitter.settings import EvidenceSettings

    # No lifespan (no `with`): the routing and error rendering alone, no backend needed.
    apps = (create_app(AdmissionSettings()), create_metering_app(MeteringSettings()), create_evidence_app(EvidenceSettings()))
    for app in (*apps, create_reconciler_app(ReconcilerSettings())):
        answer = TestClient(app).get("/no/such/route")
        assert answer.status_code == 404 and answer.headers["content-type"] == PROBLEM
        assert answer.json() == {"type": "about:blank", "title": "Not Found", "status": 404, "detail": "Not Found"}


class Thing(BaseModel):
    n: int


def test_a_body_that_is_not_json_is_said_where_and_why() -> None:
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from budgetgate.edge.problems import install_problems, where_in

    app = FastAPI()
    install_problems(app)

    @app.post("/things")
    async def things(body: Thing) -> dict[str, int]:
        return {"n": body.n}

    answer = TestClient(app).post("/things", content=b'{"n": 1,\n "m": }', headers={"content-type": "application/json"})
    assert answer.status_code == 422 and answer.headers["content-type"] == PROBLEM
    problem = answer.json()
    assert problem["detail"] == "invalid body: not valid JSON: Expecting value at line 2, column 7 (character 15)"
    assert problem["errors"] == [
        {"field": "", "loc": ["body"], "msg": "not valid JSON: Expecting value at line 2, column 7 (character 15)", "type": "json_invalid"}
    ]
    # Other validation errors are as they were: each field by its path.
    assert TestClient(app).post("/things", json={"n": "x"}).json()["errors"][0]["field"] == "n"
    assert where_in("abc", 1) == " at line 1, column 2 (character 1)"
    assert where_in(b"abc", 1) == " at character 1" and where_in("abc", None) == ""
