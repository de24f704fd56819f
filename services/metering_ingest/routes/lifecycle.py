"""HTTP lifecycle feed for platforms that cannot write Kafka: `POST /v1/lifecycle/events`.

The body is `{"events": [...]}`, each a LifecycleEvent in the canonical protobuf JSON mapping
(`runId` or `run_id`, `type` as `STARTED` …, `eventTime` as RFC 3339; `eventId` optional,
derived from run, type and time when missing so a resend deduplicates). Events get the checks
the reconciler's Kafka consumer applies (budgetgate/contracts/lifecycle_rules.py). Answers:

- 422, nothing published: the body is not JSON, has no events, has too many, or any event has
  a bad field (problem details with `errors`, `loc` = body, events, index, field).
- 202: every event is in the outbox, committed in one transaction before the answer, and the
  relay publishes it to `workload.lifecycle.v1`; `results` names each event's id. The
  reconciler deduplicates on the event id, so resending a batch is harmless.
- 403, nothing published: the caller is limited to namespaces or tenants and an event is of a run
  outside them, or of a run with no decision yet (which cannot be checked); each such event is
  under `errors` (access.py).
- 503 when Postgres is unavailable: nothing was recorded; resend.
"""

from __future__ import annotations

import re
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from budgetgate.edge.auth import Action, Principal, allow
from google.protobuf import json_format

from budgetgate.contracts import lifecycle_rules as lifecycle, topics, wire

from budgetgate.messaging import outbox
from budgetgate.runtime.backends import BACKEND_ERRORS
from budgetgate.ledger.queries import owned_by
from budgetgate.services.metering_ingest import access
from budgetgate.services.metering_ingest.routes.samples import Unavailable, json_batch, problem
from budgetgate.v1.lifecycle_pb2 import LifecycleEvent

sql = owned_by("budgetgate.services.metering_ingest")

# json_format names the field it failed on by its JSON name (or by the name it was given).
_FAILED_FIELD = re.compile(r"Failed to parse (\w+) field")
_FIELD_NAMES = {name: f.name for f in LifecycleEvent.DESCRIPTOR.fields for name in (f.name, f.json_name)}
_EXAMPLE = {
    "eventId": "b7c1…",
    "runId": "flyte/vision/exec-7f3a/n0",
    "type": "STARTED",
    "eventTime": "2026-07-14T09:31:00Z",
    "gpus": 8,
    "nodes": 1,
    "flavor": "h100",
}
_EVENT_SCHEMA = {
    "type": "object",
    "description": "A LifecycleEvent in the canonical protobuf JSON mapping (lowerCamelCase or field names).",
    "required": ["runId", "type", "eventTime"],
    "properties": {
        "eventId": {"type": "string", "description": "optional; derived from run, type and event time when missing"},
        "runId": {"type": "string", "description": "the run, as admission decided it"},
        "type": {
            "type": "string",
            "enum": ["STARTED", "COMPLETED", "FAILED", "CANCELLED", "EVICTED", "READMITTED", "STORED"],
            "description": "what happened (STORED: the run's object exists, confirming a provisional hold)",
        },
        "eventTime": {"type": "string", "format": "date-time", "description": "when it happened on the platform (RFC 3339)"},
        "gpus": {"type": "integer", "minimum": 0, "description": "GPUs bound (started/readmitted; 0 = as requested)"},
        "nodes": {"type": "integer", "minimum": 0, "description": "nodes bound (started/readmitted; 0 = as requested)"},
        "flavor": {"type": "string", "description": "resource flavor bound"},
        "region": {"type": "string", "description": "region bound"},
        "reason": {"type": "string", "description": "why (failed, cancelled, evicted)"},
    },
}
_RESULTS = {
    "type": "object",
    "description": "One result per event, in the batch's order.",
    "required": ["results"],
    "properties": {"results": {"type": "array", "description": "per event, in order", "items": {
        "type": "object", "description": "What became of one event of the batch.", "required": ["index", "eventId", "runId", "status"],
        "properties": {
            "index": {"type": "integer", "description": "the event's place in the batch"},
            "eventId": {"type": "string", "description": "its event id (the one given, or the one derived)"},
            "runId": {"type": "string", "description": "the event's run"},
            "status": {"type": "string", "enum": ["accepted"], "description": "accepted: in the outbox, to be published"},
        },
    }}},
}  # fmt: skip
_OPENAPI = {
    "requestBody": {
        "required": True,
        "content": {"application/json": {
            "schema": {"type": "object", "required": ["events"], "description": "A batch of lifecycle events.",
                       "properties": {"events": {"type": "array", "items": _EVENT_SCHEMA, "description": "the events, published in order"}}},
            "example": {"events": [_EXAMPLE]},
        }},
    },
    "responses": {
        "202": {"description": "every event is durable and will be published to workload.lifecycle.v1", "content": {"application/json": {
            "schema": _RESULTS, "example": {"results": [{"index": 0, "eventId": "b7c1…", "runId": "flyte/vision/exec-7f3a/n0", "status": "accepted"}]}}}},
        "403": {"description": "the caller is no exporter, or an event is of a run outside its namespaces or tenants or of a run with no decision "
                               "yet (under `errors`); nothing recorded"},
    },
}  # fmt: skip


def router(*, max_batch: int) -> APIRouter:
    """The lifecycle route; reads the pool, relay and ingestor (its tenant label) from `app.state.rt`."""
    api = APIRouter()

    @api.post("/v1/lifecycle/events", operation_id="publishLifecycleEvents", status_code=202, openapi_extra=_OPENAPI, responses={403: {}, 422: {}, 503: {}})
    async def publish_lifecycle(request: Request, principal: Principal = Depends(allow(Action.INGEST))) -> JSONResponse:
        rt = request.app.state.rt
        events, problems = parsed(await request.body(), max_batch)
        if problems:
            return JSONResponse({"detail": problems}, status_code=422)
        runs = [event.run_id for event in events]
        rows = [outbox.row(topic=topics.LIFECYCLE, record=wire.encode(event, key=event.run_id)) for event in events]
        outside: list[dict[str, object]] = []
        try:
            async with rt.pool.acquire() as conn:
                owners = await access.owners(conn, principal, runs, tenant_label=rt.ingestor.tenant_label)
                if owners is not None:
                    outside = access.outside(principal, runs, owners, field="events", undecided=True)
                if not outside:
                    async with conn.transaction():
                        await conn.executemany(sql("insert_outbox"), rows)
        except BACKEND_ERRORS as exc:
            raise Unavailable(f"Postgres unavailable, no event recorded (resend the batch): {exc}") from exc
        if outside:
            return access.forbidden(principal, "events", outside)
        rt.relay.wakeup.set()
        results = [{"index": i, "eventId": e.event_id, "runId": e.run_id, "status": "accepted"} for i, e in enumerate(events)]
        return JSONResponse({"results": results}, status_code=202)

    return api


def parsed(body: bytes, max_batch: int) -> tuple[list[LifecycleEvent], list[dict[str, Any]]]:
    """The events of a request body, each with its event id, or every problem with them."""
    items, problems = json_batch(body, "events", max_batch)
    if problems:
        return [], problems
    events, problems = [], []
    for index, item in enumerate(items):
        where = ["body", "events", index]
        if not isinstance(item, dict):
            problems.append(problem(where, f"an event must be a JSON object, not {type(item).__name__}", "type_error"))
            continue
        event = LifecycleEvent()
        try:
            json_format.ParseDict(item, event, ignore_unknown_fields=True)
        except json_format.ParseError as exc:
            found = _FAILED_FIELD.search(str(exc))
            field = _FIELD_NAMES.get(found.group(1)) if found else None
            problems.append(problem([*where, *([field] if field else [])], f"not a LifecycleEvent: {exc}", "value_error"))
            continue
        if not event.event_id:
            event.event_id = lifecycle.derived_event_id(event)
        elif reason := lifecycle.event_id_problem(event.event_id):
            problems.append(problem([*where, "event_id"], reason, "value_error"))
        problems.extend(problem([*where, field], msg, "value_error") for field, msg in lifecycle.problems(event))
        events.append(event)
    return events, problems
