"""HTTP ingest for exporters that cannot speak Kafka: `POST /v1/metering/samples`.

The body is `{"samples": [...]}`, each sample in the canonical protobuf JSON mapping of
MeteringSample (`runId` or `run_id`, `observedAt` as RFC 3339, `gpuSeconds`, ...). Samples get
exactly the checks of the Kafka path. Answers:

- 422, nothing recorded: the body is not JSON, has no samples, has too many, or any sample has
  a bad field; `detail` names each one (`loc` = body, samples, index, field).
- Otherwise every sample is applied in its own transaction, in order, and `results` has one
  entry per sample: accepted (with `late`), duplicate, pending (run has no decision yet) or
  rejected (a conflict or counter regression with what is recorded). The answer is 422 when
  any sample was rejected (the others are recorded, and resending them is harmless), else 202
  when any is pending, else 200. Every sample reported accepted or pending is durable.
- 503 when Postgres is unavailable: the samples before the failing one may be recorded;
  resending the whole batch is safe, the sample ids deduplicate it.
"""

from __future__ import annotations

import json
from typing import Any

import asyncpg
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from budgetgate import wire
from budgetgate.core.metering import Accepted, Duplicate, Rejected, Sample
from budgetgate.services.metering_ingest.ingest import Ingestor, Origin, Outcome, Pending
from budgetgate.services.metering_ingest.metrics import MeteringMetrics
from budgetgate.services.metering_ingest.samples import from_json
from budgetgate.v1.metering_pb2 import MeteringSample

# Errors that mean Postgres is unreachable or failed mid-call: answer 503.
BACKEND_ERRORS: tuple[type[BaseException], ...] = (
    OSError,
    TimeoutError,
    asyncpg.PostgresConnectionError,
    asyncpg.InterfaceError,
    # Shutting down, restarting, or not yet accepting connections (SQLSTATE class 57).
    asyncpg.exceptions.OperatorInterventionError,
)

_SAMPLE_SCHEMA = {
    "type": "object",
    "description": "A MeteringSample in the canonical protobuf JSON mapping (lowerCamelCase or field names).",
    "required": ["sampleId", "runId", "observedAt", "gpuSeconds"],
    "properties": {
        "sampleId": {"type": "string", "description": "the exporter's id of this sample; the dedup key"},
        "runId": {"type": "string"},
        "observedAt": {"type": "string", "format": "date-time", "description": "when the counters were read (RFC 3339)"},
        "gpuSeconds": {"type": "number", "minimum": 0, "description": "GPU-seconds since the run started (cumulative)"},
        "nodeSeconds": {"type": "number", "minimum": 0, "description": "node-seconds since the run started (cumulative)"},
        "exporter": {"type": "string"},
        "eventId": {"type": "string", "description": "optional; derived from run and sample id when missing"},
    },
}
_OPENAPI = {
    "requestBody": {
        "required": True,
        "content": {"application/json": {"schema": {"type": "object", "required": ["samples"], "properties": {"samples": {"type": "array", "items": _SAMPLE_SCHEMA}}}}},
    }
}


# What an exporter publishing the sample to Kafka would have sent with it (kept while pending).
_HEADERS = ((wire.CONTENT_TYPE, wire.PROTOBUF.encode()), (wire.MESSAGE_TYPE, MeteringSample.DESCRIPTOR.full_name.encode()))


class Unavailable(RuntimeError):
    """Postgres cannot be used right now."""


def router(*, max_batch: int, metering_topic: str) -> APIRouter:
    """The ingest route; reads the Ingestor, pool and metrics from `app.state.rt`."""
    api = APIRouter()

    @api.post("/v1/metering/samples", openapi_extra=_OPENAPI, responses={202: {"description": "some samples are pending"}, 422: {}, 503: {}})
    async def ingest_samples(request: Request) -> JSONResponse:
        rt = request.app.state.rt
        items, problems = _batch(await request.body(), max_batch)
        if problems:
            return JSONResponse({"detail": problems}, status_code=422)
        parsed, problems = _validated(rt.ingestor, rt.metrics, items)
        if problems:
            return JSONResponse({"detail": problems}, status_code=422)
        results, problems = await _apply(rt.pool, rt.ingestor, rt.metrics, parsed, metering_topic)
        rt.relay.wakeup.set()
        status = 422 if problems else 202 if any(r["status"] == "pending" for r in results) else 200
        return JSONResponse({"results": results, **({"detail": problems} if problems else {})}, status_code=status)

    return api


def _batch(body: bytes, max_batch: int) -> tuple[list[Any], list[dict[str, Any]]]:
    """The samples of a request body, or the problems with it."""
    try:
        data = json.loads(body)
    except ValueError as exc:
        return [], [_problem(["body"], f"the body is not valid JSON: {exc}", "json_invalid")]
    samples = data.get("samples") if isinstance(data, dict) else None
    if not isinstance(samples, list) or not samples:
        return [], [_problem(["body", "samples"], "a non-empty list of samples is required", "missing")]
    if len(samples) > max_batch:
        return [], [_problem(["body", "samples"], f"{len(samples)} samples; at most {max_batch} per request", "too_long")]
    return samples, []


def _validated(ingestor: Ingestor, metrics: MeteringMetrics, items: list[Any]) -> tuple[list[tuple[MeteringSample, Sample]], list[dict[str, Any]]]:
    """Every sample parsed and checked on its own; the problems of all of them."""
    parsed, problems = [], []
    for index, item in enumerate(items):
        try:
            message = from_json(item)
            parsed.append((message, ingestor.validate(message)))
        except Rejected as exc:
            metrics.rejected(exc.reason, source="http")
            problems.extend(_problem(["body", "samples", index, *([p.field] if p.field else [])], str(p), str(p.reason)) for p in exc.problems)
    return parsed, problems


async def _apply(pool: asyncpg.Pool, ingestor: Ingestor, metrics: MeteringMetrics, parsed: list[tuple[MeteringSample, Sample]], topic: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Place each sample in a transaction of its own; per-sample results and rejections."""
    results, problems = [], []
    for index, (message, sample) in enumerate(parsed):
        origin = Origin(source="http", topic=topic, payload=message.SerializeToString(), headers=_HEADERS + ((wire.EVENT_ID, message.event_id.encode()),))
        try:
            async with pool.acquire() as conn, conn.transaction():
                outcome = await ingestor.place(conn, sample, origin)
        except Rejected as exc:
            metrics.rejected(exc.reason, source="http")
            results.append({**_identity(index, sample), "status": "rejected", "reason": str(exc.reason), "detail": str(exc)})
            problems.extend(_problem(["body", "samples", index, *([p.field] if p.field else [])], str(p), str(p.reason)) for p in exc.problems)
            continue
        except BACKEND_ERRORS as exc:
            raise Unavailable(f"Postgres unavailable after {index} of {len(parsed)} samples (resending the batch is safe): {exc}") from exc
        metrics.outcome(outcome, source="http")
        results.append({**_identity(index, sample), **_result(outcome)})
    return results, problems


def _identity(index: int, sample: Sample) -> dict[str, Any]:
    return {"index": index, "run_id": sample.run_id, "sample_id": sample.sample_id}


def _result(outcome: Outcome) -> dict[str, Any]:
    if isinstance(outcome, Accepted):
        return {
            "status": "accepted",
            "late": outcome.late,
            "gpu_milli_hours_cumulative": outcome.cumulative.gpu,
            "node_milli_hours_cumulative": outcome.cumulative.node,
            "gpu_milli_hours_delta": outcome.delta.gpu,
            "node_milli_hours_delta": outcome.delta.node,
        }
    if isinstance(outcome, Duplicate):
        return {"status": "duplicate", "duplicate_of": outcome.of}
    assert isinstance(outcome, Pending)
    return {"status": "pending", "pending_until": outcome.until.isoformat()}


def _problem(loc: list[Any], msg: str, kind: str) -> dict[str, Any]:
    return {"loc": loc, "msg": msg, "type": kind}
