"""HTTP ingest for exporters that cannot speak Kafka: `POST /v1/metering/samples`.

The body is `{"samples": [...]}`, each sample in the canonical protobuf JSON mapping of
MeteringSample (`runId` or `run_id`, `observedAt` as RFC 3339, `gpuSeconds`, ...). Samples get
exactly the checks of the Kafka path. Answers:

- 422, nothing recorded: the body is not JSON, has no samples, has too many, or any sample has
  a bad field; the problem details (RFC 9457) list each one under `errors` (`loc` = body,
  samples, index, field).
- Otherwise every sample is applied in its own transaction, in order, and `results` has one
  entry per sample, in the lowerCamelCase naming of the samples themselves: accepted (with
  `late`, and the run's counters in GPU- and node-milliseconds: `gpuMillisecondsCumulative`,
  `gpuMillisecondsDelta`, ...), duplicate, pending (run has no decision yet) or
  rejected (a conflict or counter regression with what is recorded). The answer is 422 when
  any sample was rejected (the others are recorded, and resending them is harmless), else 202
  when any is pending, else 200. Every sample reported accepted or pending is durable.
- 403, nothing recorded: the caller is limited to namespaces or tenants and a sample is of a run
  outside them (access.py; each such sample under `errors`). Its samples of runs with no decision
  yet are kept pending with its limits, and count only if the run turns out to be within them.
- 503 when Postgres is unavailable: the samples before the failing one may be recorded;
  resending the whole batch is safe, the sample ids deduplicate it.
"""

from __future__ import annotations

import json
from typing import Any

import asyncpg
from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from budgetgate.contracts import wire
from budgetgate.edge.auth import Action, Principal, allow
from budgetgate.runtime.backends import BACKEND_ERRORS
from budgetgate.core.metering import Accepted, Duplicate, Rejected, Sample
from budgetgate.core.windows import rfc3339
from budgetgate.services.metering_ingest import access
from budgetgate.services.metering_ingest.ingest import Ingestor, Origin, Outcome, Pending
from budgetgate.services.metering_ingest.metrics import MeteringMetrics
from budgetgate.services.metering_ingest.codecs import from_json
from budgetgate.v1.metering_pb2 import MeteringSample

_SAMPLE_SCHEMA = {
    "type": "object",
    "description": "A MeteringSample in the canonical protobuf JSON mapping (lowerCamelCase or field names).",
    "required": ["sampleId", "runId", "observedAt", "gpuSeconds"],
    "properties": {
        "sampleId": {"type": "string", "description": "the exporter's id of this sample; the dedup key"},
        "runId": {"type": "string", "description": "the run's id, as admission decided it"},
        "observedAt": {"type": "string", "format": "date-time", "description": "when the counters were read (RFC 3339)"},
        "gpuSeconds": {"type": "number", "minimum": 0, "description": "GPU-seconds since the run started (cumulative)"},
        "nodeSeconds": {"type": "number", "minimum": 0, "description": "node-seconds since the run started (cumulative)"},
        "exporter": {"type": "string", "description": "which exporter sent the sample"},
        "eventId": {"type": "string", "description": "optional; derived from run and sample id when missing"},
    },
}
_RESULT_SCHEMA = {
    "type": "object",
    "description": "What became of one sample of the batch.",
    "required": ["index", "runId", "sampleId", "status"],
    "properties": {
        "index": {"type": "integer", "description": "the sample's place in the batch"},
        "runId": {"type": "string", "description": "the sample's run"},
        "sampleId": {"type": "string", "description": "the sample's id"},
        "status": {
            "type": "string",
            "enum": ["accepted", "duplicate", "pending", "rejected"],
            "description": "accepted, duplicate (recorded before), pending (its run has no decision yet) or rejected",
        },
        "late": {"type": "boolean", "description": "accepted: observed before the run's latest sample (recorded for window attribution only)"},
        "gpuMillisecondsCumulative": {"type": "integer", "description": "accepted: the run's GPU-milliseconds so far (one GPU-hour is 3,600,000)"},
        "nodeMillisecondsCumulative": {"type": "integer", "description": "accepted: the run's node-milliseconds so far"},
        "gpuMillisecondsDelta": {"type": "integer", "description": "accepted: how much this sample raised the GPU-milliseconds"},
        "nodeMillisecondsDelta": {"type": "integer", "description": "accepted: how much this sample raised the node-milliseconds"},
        "duplicateOf": {"type": "string", "description": "duplicate: the sample id it repeats"},
        "pendingUntil": {"type": "string", "format": "date-time", "description": "pending: when it is dead-lettered if its run still has no decision"},
        "reason": {"type": "string", "description": "rejected: the reason code"},
        "detail": {"type": "string", "description": "rejected: what is wrong"},
    },
}
_SAMPLE_EXAMPLE = {
    "sampleId": "dcgm-0007",
    "runId": "flyte/vision/exec-7f3a/n0",
    "observedAt": "2026-07-14T10:00:00Z",
    "gpuSeconds": 28800,
    "nodeSeconds": 3600,
    "exporter": "dcgm",
}
_RESULTS = {
    "type": "object",
    "description": "One result per sample, in the batch's order.",
    "required": ["results"],
    "properties": {"results": {"type": "array", "items": _RESULT_SCHEMA, "description": "per sample, in order"}},
}
_RESULTS_EXAMPLE = {
    "results": [
        {
            "index": 0,
            "runId": "flyte/vision/exec-7f3a/n0",
            "sampleId": "dcgm-0007",
            "status": "accepted",
            "late": False,
            "gpuMillisecondsCumulative": 28_800_000,
            "nodeMillisecondsCumulative": 3_600_000,
            "gpuMillisecondsDelta": 28_800_000,
            "nodeMillisecondsDelta": 3_600_000,
        }
    ]
}
_OPENAPI = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {
                "schema": {
                    "type": "object",
                    "description": "A batch of metering samples.",
                    "required": ["samples"],
                    "properties": {"samples": {"type": "array", "items": _SAMPLE_SCHEMA, "description": "the samples, applied in order"}},
                },
                "example": {"samples": [_SAMPLE_EXAMPLE]},
            }
        },
    },
    "responses": {
        "200": {"description": "every sample accepted or a duplicate", "content": {"application/json": {"schema": _RESULTS, "example": _RESULTS_EXAMPLE}}},
        "202": {"description": "some samples are pending", "content": {"application/json": {"schema": _RESULTS, "example": _RESULTS_EXAMPLE}}},
        "403": {"description": "the caller is no exporter, or a sample is of a run outside its namespaces or tenants (under `errors`); nothing recorded"},
    },
}


# What an exporter publishing the sample to Kafka would have sent with it (kept while pending).
_HEADERS = ((wire.CONTENT_TYPE, wire.PROTOBUF.encode()), (wire.MESSAGE_TYPE, MeteringSample.DESCRIPTOR.full_name.encode()))


class Unavailable(RuntimeError):
    """Postgres cannot be used right now."""


def router(*, max_batch: int, metering_topic: str) -> APIRouter:
    """The ingest route; reads the Ingestor, pool and metrics from `app.state.rt`."""
    api = APIRouter()

    @api.post("/v1/metering/samples", operation_id="ingestMeteringSamples", openapi_extra=_OPENAPI, responses={403: {}, 422: {}, 503: {}})
    async def ingest_samples(request: Request, principal: Principal = Depends(allow(Action.INGEST))) -> JSONResponse:
        rt = request.app.state.rt
        items, problems = json_batch(await request.body(), "samples", max_batch)
        if problems:
            return JSONResponse({"detail": problems}, status_code=422)
        parsed, problems = _validated(rt.ingestor, rt.metrics, items)
        if problems:
            return JSONResponse({"detail": problems}, status_code=422)
        runs = [sample.run_id for _, sample in parsed]
        try:
            async with rt.pool.acquire() as conn:
                owners = await access.owners(conn, principal, runs, tenant_label=rt.ingestor.tenant_label)
        except BACKEND_ERRORS as exc:
            raise Unavailable(f"Postgres unavailable, no sample recorded (resend the batch): {exc}") from exc
        if owners is not None and (outside := access.outside(principal, runs, owners, field="samples", undecided=False)):
            return access.forbidden(principal, "samples", outside)
        # A limited caller's samples of runs without a decision are kept pending with its limits.
        senders = [principal if owners is not None and run not in owners else None for run in runs]
        results, problems = await _apply(rt.pool, rt.ingestor, rt.metrics, parsed, metering_topic, senders)
        rt.relay.wakeup.set()
        status = 422 if problems else 202 if any(r["status"] == "pending" for r in results) else 200
        return JSONResponse({"results": results, **({"detail": problems} if problems else {})}, status_code=status)

    return api


def json_batch(body: bytes, field: str, max_batch: int) -> tuple[list[Any], list[dict[str, Any]]]:
    """The list `field` of a request body (its samples, its lifecycle events), or the problems
    with it: not JSON (or nested deeper than the parser goes), no such non-empty list, too long."""
    try:
        data = json.loads(body)
    except (ValueError, RecursionError) as exc:
        return [], [problem(["body"], f"the body is not valid JSON: {exc}", "json_invalid")]
    items = data.get(field) if isinstance(data, dict) else None
    if not isinstance(items, list) or not items:
        return [], [problem(["body", field], f"a non-empty list of {field} is required", "missing")]
    if len(items) > max_batch:
        return [], [problem(["body", field], f"{len(items)} {field}; at most {max_batch} per request", "too_long")]
    return items, []


def _validated(ingestor: Ingestor, metrics: MeteringMetrics, items: list[Any]) -> tuple[list[tuple[MeteringSample, Sample]], list[dict[str, Any]]]:
    """Every sample parsed and checked on its own; the problems of all of them."""
    parsed, problems = [], []
    for index, item in enumerate(items):
        try:
            message = from_json(item)
            parsed.append((message, ingestor.validate(message)))
        except Rejected as exc:
            metrics.rejected(exc.reason, source="http")
            problems.extend(problem(["body", "samples", index, *([p.field] if p.field else [])], str(p), str(p.reason)) for p in exc.problems)
    return parsed, problems


async def _apply(
    pool: asyncpg.Pool,
    ingestor: Ingestor,
    metrics: MeteringMetrics,
    parsed: list[tuple[MeteringSample, Sample]],
    topic: str,
    senders: list[Principal | None],
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Place each sample in a transaction of its own (with its limited sender, when its run is
    still to be checked against it); per-sample results and rejections."""
    results, problems = [], []
    for index, ((message, sample), sender) in enumerate(zip(parsed, senders, strict=True)):
        headers = _HEADERS + ((wire.EVENT_ID, message.event_id.encode()),)
        origin = Origin(source="http", topic=topic, payload=message.SerializeToString(), headers=headers, sender=sender)
        try:
            async with pool.acquire() as conn, conn.transaction():
                outcome = await ingestor.place(conn, sample, origin)
        except Rejected as exc:
            metrics.rejected(exc.reason, source="http")
            results.append({**_identity(index, sample), "status": "rejected", "reason": str(exc.reason), "detail": str(exc)})
            problems.extend(problem(["body", "samples", index, *([p.field] if p.field else [])], str(p), str(p.reason)) for p in exc.problems)
            continue
        except BACKEND_ERRORS as exc:
            raise Unavailable(f"Postgres unavailable after {index} of {len(parsed)} samples (resending the batch is safe): {exc}") from exc
        metrics.outcome(outcome, source="http")
        results.append({**_identity(index, sample), **_result(outcome)})
    return results, problems


def _identity(index: int, sample: Sample) -> dict[str, Any]:
    return {"index": index, "runId": sample.run_id, "sampleId": sample.sample_id}


def _result(outcome: Outcome) -> dict[str, Any]:
    if isinstance(outcome, Accepted):
        return {
            "status": "accepted",
            "late": outcome.late,
            # The ledger's milli-unit-seconds: GPU-milliseconds (one GPU-hour is 3,600,000).
            "gpuMillisecondsCumulative": outcome.cumulative.gpu,
            "nodeMillisecondsCumulative": outcome.cumulative.node,
            "gpuMillisecondsDelta": outcome.delta.gpu,
            "nodeMillisecondsDelta": outcome.delta.node,
        }
    if isinstance(outcome, Duplicate):
        return {"status": "duplicate", "duplicateOf": outcome.of}
    assert isinstance(outcome, Pending)
    return {"status": "pending", "pendingUntil": rfc3339(outcome.until)}


def problem(loc: list[Any], msg: str, kind: str) -> dict[str, Any]:
    """A problem of a request body, its fields named as the canonical JSON mapping names them
    (gpuSeconds, eventTime) past body.<list>.<index>."""
    return {"loc": [_camel(p) if isinstance(p, str) and i > 2 else p for i, p in enumerate(loc)], "msg": msg, "type": kind}


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(word.title() for word in rest)
