"""The published OpenAPI of a budgetgate HTTP service, finished from what FastAPI generates: an
operationId fit for generated clients (`submitAdmission`), every error answer documented as
`application/problem+json` (422 wherever input is validated), each answer model's example on
the endpoint, descriptions of parameters, and the bodies of routes that answer plain JSON."""

from __future__ import annotations

import re
from collections.abc import Mapping
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from budgetgate.contracts.operations import Operation
from budgetgate.edge.problems import PROBLEM_JSON, phrase

_REF = "#/components/schemas/{model}"


PROBLEM_SCHEMA: dict[str, Any] = {
    "type": "object",
    "title": "Problem",
    "description": "An error answer, as RFC 9457 problem details; other members may follow as extensions.",
    "required": ["type", "title", "status", "detail"],
    "properties": {
        "type": {"type": "string", "description": "a URI naming the kind of problem; about:blank when the status says it all"},
        "title": {"type": "string", "description": "the status's short phrase"},
        "status": {"type": "integer", "description": "the HTTP status code"},
        "detail": {"type": "string", "description": "what went wrong, in words a person can act on"},
        "errors": {"type": "array", "items": {"$ref": _REF.format(model="ProblemField")}, "description": "the offending fields, when the input was at fault"},
    },
    "example": {"type": "about:blank", "title": "Unprocessable Content", "status": 422, "detail": "invalid resources.gpus: Input should be a valid integer",
                "errors": [{"field": "resources.gpus", "loc": ["body", "resources", "gpus"], "msg": "Input should be a valid integer", "type": "int_type"}]},
}  # fmt: skip
PROBLEM_FIELD_SCHEMA: dict[str, Any] = {
    "type": "object",
    "title": "ProblemField",
    "description": "One offending field of a request.",
    "required": ["field", "loc", "msg", "type"],
    "properties": {
        "field": {"type": "string", "description": "dotted path of the field in the body, or the parameter's name"},
        "loc": {
            "type": "array",
            "items": {"anyOf": [{"type": "string"}, {"type": "integer"}]},
            "description": "where: body, query or path, then the path to the field",
        },
        "msg": {"type": "string", "description": "what is wrong with it"},
        "type": {"type": "string", "description": "a machine-readable kind of error, e.g. int_type, missing"},
    },
}


def document(app: FastAPI, operations: Mapping[str, Operation]) -> None:
    """Publish `app`'s OpenAPI finished as the module doc says; `operations` is keyed by
    `METHOD /path` (the operational routes are named here)."""
    named = {**OPERATIONAL, **operations}

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            spec = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
            app.openapi_schema = finish(spec, named)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def finish(spec: dict[str, Any], operations: Mapping[str, Operation]) -> dict[str, Any]:
    """The OpenAPI document `spec` finished (see the module doc)."""
    schemas = spec.setdefault("components", {}).setdefault("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    schemas["Problem"] = PROBLEM_SCHEMA
    schemas["ProblemField"] = PROBLEM_FIELD_SCHEMA
    for path, methods in spec.get("paths", {}).items():
        for method, op in methods.items():
            known = operations.get(f"{method.upper()} {path}")
            op["operationId"] = known.operation_id if known else _camel(op.get("operationId", f"{method}_{path}"))
            if known and known.answer is not None:
                _add_model(schemas, known.answer)
                # Other media types the route declares (text/csv) stay beside the JSON answer.
                others = {k: v for k, v in op["responses"]["200"].get("content", {}).items() if k != "application/json"}
                op["responses"]["200"]["content"] = {"application/json": {"schema": {"$ref": _REF.format(model=known.answer.__name__)}}, **others}
            for parameter in op.get("parameters", []):
                parameter.setdefault("description", (known.parameters.get(parameter["name"]) if known else None) or parameter["name"].replace("_", " "))
            if op.get("parameters") or op.get("requestBody"):
                op["responses"].setdefault("422", {})
            if path.startswith("/v1/"):
                op["responses"].setdefault("503", {"description": "a backend (Postgres, Redis) is unavailable; retry after Retry-After"})
            _problem_answers(op)
            _examples(op, schemas)
    return spec


def _problem_answers(op: dict[str, Any]) -> None:
    for status, answer in op["responses"].items():
        if status.isdigit() and int(status) >= 400:
            if answer.get("description") in (None, "", "Validation Error", "Additional Response", HTTPStatus(int(status)).phrase):
                answer["description"] = phrase(int(status))
            answer["content"] = {PROBLEM_JSON: {"schema": {"$ref": _REF.format(model="Problem")}}}


def _examples(op: dict[str, Any], schemas: dict[str, Any]) -> None:
    media = [op.get("requestBody", {}).get("content", {}).get("application/json")]
    media += [answer.get("content", {}).get("application/json") for answer in op["responses"].values()]
    for item in media:
        if not item or "example" in item:
            continue
        ref = item.get("schema", {}).get("$ref", "")
        examples = schemas.get(ref.rsplit("/", 1)[-1], {}).get("examples") if ref else None
        if examples:
            item["example"] = examples[0]


def _add_model(schemas: dict[str, Any], model: type[BaseModel]) -> None:
    generated = model.model_json_schema(ref_template=_REF)
    for name, definition in generated.pop("$defs", {}).items():
        schemas.setdefault(name, definition)
    schemas.setdefault(model.__name__, generated)


def _camel(name: str) -> str:
    words = [w for w in re.split(r"[^A-Za-z0-9]+", name) if w]
    return words[0][:1].lower() + words[0][1:] + "".join(w[:1].upper() + w[1:] for w in words[1:]) if words else name


# The operational routes every service shares (budgetgate.edge.serving).
OPERATIONAL: dict[str, Operation] = {
    "GET /healthz": Operation("getHealth"),
    "GET /readyz": Operation("getReadiness"),
    "GET /metrics": Operation("getMetrics"),
}
