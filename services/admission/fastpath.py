"""`POST /v1/admissions` served as plain ASGI, in front of FastAPI's routing.

The profile of the hot path showed FastAPI's request pipeline (routing, dependency solving, body
parsing into a dict then validating it, the response pipeline) costing more CPU than deciding
and committing a submission. Here the body is validated straight from its bytes by the same
pydantic model, and the answer written as JSON bytes. The route stays declared on the FastAPI
app (OpenAPI, documentation); anything this path does not handle itself goes to FastAPI: a body
that does not validate (so 422s look exactly like every other route's), and any error of the
admitter, rendered by the app's own exception handlers. The caller is checked exactly as the
route's dependency would (auth.Gate: a submitter, within its namespaces and tenants) before the
body is even read; the caller's hit on its rate limit is sent then. While the caller is far below
its limit (Gate.may_defer), the submission is planned and its batch reads Postgres before the
count is awaited, just before the batch reserves anything (Admitter._decide): the round trip to
Redis overlaps that work instead of preceding it, and a submission past the limit is still
refused (429) having changed nothing. A caller nearer its limit has the count awaited once the
body is validated, before any work, as a flood's requests should.
"""

from __future__ import annotations

import time
from typing import Any

import orjson
from pydantic import ValidationError
from starlette.requests import Request

from budgetgate.edge.auth import CHECKED, Action, gate_of
from budgetgate.services.admission.access import require_submission
from budgetgate.contracts.admission import AdmissionRequest

PATH = "/v1/admissions"
_HEADERS = [(b"content-type", b"application/json")]


class SubmissionFastPath:
    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] != PATH:
            await self.app(scope, receive, send)
            return
        fastapi_app = scope["app"]
        clock = fastapi_app.state.metrics.stage_clock(time.perf_counter())
        body = b""
        try:
            gate = gate_of(fastapi_app)
            principal, counted = await gate.begin_check(scope["headers"], Action.SUBMIT, scope=scope)
            scope.setdefault("state", {})[CHECKED] = principal  # FastAPI's route does not count it again
            body = await _read(receive)
            try:
                request = AdmissionRequest.model_validate_json(body)
            except ValidationError:
                await counted
                await self.app(scope, _replay(body), send)  # FastAPI renders the 422
                return
            deferred = gate.may_defer(principal)
            if not deferred:
                await counted
            rt = fastapi_app.state.rt
            require_submission(principal, namespace=request.namespace, labels=request.labels, tenant_label=rt.settings.tenant_label)
            started = time.perf_counter()
            if clock is not None:
                clock.read = started
            answer = await rt.admitter.admit(request, clock=clock, counted=counted if deferred else None)
        except Exception as exc:  # noqa: BLE001 - rendered by the app's handler for it, or re-raised
            handler = _handler(fastapi_app, exc)
            if handler is None:
                raise
            response = await handler(Request(scope, _replay(body)), exc)
            await response(scope, receive, send)
            return
        fastapi_app.state.metrics.observe(answer, time.perf_counter() - started)
        payload = orjson.dumps(answer)
        await send({"type": "http.response.start", "status": 200, "headers": [*_HEADERS, (b"content-length", str(len(payload)).encode())]})
        await send({"type": "http.response.body", "body": payload})
        if clock is not None:
            fastapi_app.state.metrics.observe_stages(clock, time.perf_counter())


async def _read(receive: Any) -> bytes:
    chunks = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(chunks)


def _replay(body: bytes) -> Any:
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if sent:
            return {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return receive


def _handler(app: Any, exc: Exception) -> Any:
    for cls in type(exc).__mro__:
        if cls in app.exception_handlers and cls is not Exception:
            return app.exception_handlers[cls]
    return None
