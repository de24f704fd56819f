"""The Marquez stand-in the evidence tests use is held to Marquez's own API file
(tests/reference/marquez/openapi.yml): every route it serves is an operation there, and every
field it answers is a property of that operation's response schema."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import yaml

from tests.support.marquez import REFERENCE, MarquezStandIn

API = yaml.safe_load((REFERENCE / "marquez" / "openapi.yml").read_text())
PREFIX = "/api/v1"  # the file's server URL ends in it


def resolve(node: Any) -> Any:
    """`node` with its $ref (local to the file) followed."""
    while isinstance(node, dict) and "$ref" in node:
        target: Any = API
        for part in node["$ref"].removeprefix("#/").split("/"):
            target = target[part]
        node = target
    return node


def properties(schema: Any) -> set[str]:
    schema = resolve(schema)
    found = set(schema.get("properties", {}))
    for part in (*schema.get("allOf", []), *schema.get("anyOf", [])):
        found |= properties(part)
    return found


def success_schema(path: str, method: str) -> Any:
    operation = API["paths"][path][method]
    [(status, answer)] = [(s, a) for s, a in operation["responses"].items() if str(s).startswith("2")]
    return resolve(resolve(answer)["content"]["application/json"]["schema"])


def event(run_id: str) -> dict[str, Any]:
    return {
        "eventType": "START",
        "eventTime": "2026-07-01T00:00:00Z",
        "run": {"runId": run_id, "facets": {}},
        "job": {"namespace": "vision-prod", "name": "train"},
        "producer": "https://budgetgate.dev/tests",
        "schemaURL": "https://openlineage.io/spec/2-0-2/OpenLineage.json#/$defs/RunEvent",
    }


def test_the_stand_in_serves_marquez_routes_with_the_fields_marquez_documents() -> None:
    run_id = str(uuid.uuid4())
    with MarquezStandIn() as marquez, httpx.Client(base_url=marquez.url + PREFIX, timeout=10) as client:
        # Marquez answers 201 Created on POST /api/v1/lineage (its file lists only 200 for it).
        assert "post" in API["paths"]["/lineage"]
        assert client.post("/lineage", content=json.dumps(event(run_id)), headers={"content-type": "application/json"}).status_code == 201
        routes = {
            ("/namespaces", "/namespaces", "namespaces"),
            ("/namespaces/{namespace}/jobs", "/namespaces/vision-prod/jobs", "jobs"),
            ("/namespaces/{namespace}/jobs/{job}/runs", "/namespaces/vision-prod/jobs/train/runs", "runs"),
            ("/jobs/runs/{id}", f"/jobs/runs/{quote(run_id)}", None),
            ("/jobs/runs/{id}/facets", f"/jobs/runs/{quote(run_id)}/facets", None),
            ("/events/lineage", "/events/lineage", "events"),
        }
        for template, path, listed in routes:
            assert "get" in API["paths"][template], template
            answer = client.get(path)
            assert answer.status_code == 200, (path, answer.text)
            body, schema = answer.json(), success_schema(template, "get")
            assert set(body) <= properties(schema), (template, set(body) - properties(schema))
            if listed is not None:
                assert body[listed], path
                item = resolve(resolve(schema)["properties"][listed]).get("items")
                if properties(item):  # LineageEvent has none here: it is the OpenLineage RunEvent the stand-in validates
                    assert set(body[listed][0]) <= properties(item), (template, set(body[listed][0]) - properties(item))
        assert client.get(f"/jobs/runs/{uuid.uuid4()}").status_code == 404
    assert marquez.invalid == []


def test_the_reference_files_are_in_the_repository() -> None:
    # Nothing beside the checkout is read: a user's machine has only the repository.
    root = Path(__file__).resolve().parents[2]
    assert REFERENCE.is_relative_to(root)
    assert (REFERENCE / "openlineage-spec" / "spec" / "OpenLineage.json").is_file()
    assert json.loads((REFERENCE / "openlineage-spec" / "spec" / "OpenLineage.json").read_text())["$id"] == "https://openlineage.io/spec/2-0-2/OpenLineage.json"
    assert (REFERENCE / "LICENSE-Apache-2.0").read_text().lstrip().startswith("Apache License")
