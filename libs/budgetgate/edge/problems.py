"""Every error answer of every budgetgate HTTP service as RFC 9457 problem details
(`application/problem+json`), whoever produced it: a route's `{"detail": ...}`, FastAPI's
validation errors (the offending fields listed under `errors`), a body too large, an unknown
route, or an unexpected exception. An HTML page (text/html) is the one exception: it is already
written for the person reading it.

One plain ASGI middleware rewrites error answers (only those: success answers pass through
untouched), so routes keep answering `{"detail": ...}` and no service can forget the format.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exception_handlers import request_validation_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

log = logging.getLogger(__name__)

PROBLEM_JSON = "application/problem+json"
_LOCATIONS = ("body", "query", "path", "header", "cookie")


def problem_body(status: int, body: Any) -> dict[str, Any]:
    """An error answer's body as problem details: `type`, `title`, `status`, `detail`, then
    `errors` (each offending field) and the answer's other members as extensions."""
    if isinstance(body, Mapping) and {"type", "title", "status", "detail"} <= body.keys():
        return dict(body)
    members = dict(body) if isinstance(body, Mapping) else {"detail": body}
    detail = members.pop("detail", None)
    errors = None
    if isinstance(detail, list):
        errors = [offending(e) for e in detail]
        detail = "invalid " + "; ".join(f"{e['field'] or 'body'}: {e['msg']}" for e in errors)
    title = phrase(status)
    problem: dict[str, Any] = {"type": "about:blank", "title": title, "status": status, "detail": str(detail) if detail not in (None, "") else title}
    if errors is not None:
        problem["errors"] = errors
    problem.update((k, v) for k, v in members.items() if k not in problem)
    return problem


def offending(error: Any) -> dict[str, Any]:
    """One offending field: `field` (dotted path in the body or the parameter's name), `loc`,
    `msg` and `type`, as FastAPI and the services name them."""
    if not isinstance(error, Mapping):
        return {"field": "", "loc": [], "msg": str(error), "type": "value_error"}
    loc = list(error.get("loc") or [])
    path = loc[1:] if loc and loc[0] in _LOCATIONS else loc
    return {"field": ".".join(str(p) for p in path), "loc": loc, "msg": str(error.get("msg", "")), "type": str(error.get("type", "value_error"))}


def problem_response(status: int, detail: Any, *, headers: Mapping[str, str] | None = None, **extensions: Any) -> JSONResponse:
    """A problem details answer built directly (the middleware leaves it as it is)."""
    body = problem_body(status, {"detail": detail, **extensions})
    return JSONResponse(body, status_code=status, headers=dict(headers or {}), media_type=PROBLEM_JSON)


class ProblemDetails:
    """Plain ASGI middleware: turns every answer with status ≥ 400 into problem details, but for
    an HTML page made for people (admission's page for tenants and finance, /ui), left as it is."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        held: dict[str, Any] = {}
        chunks: list[bytes] = []

        async def rewrite(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start" and message["status"] >= 400 and not _page(message):
                held["start"] = message
                return
            if "start" not in held or message["type"] != "http.response.body":
                await send(message)
                return
            chunks.append(message.get("body", b""))
            if message.get("more_body", False):
                return
            start = held["start"]
            body = json.dumps(problem_body(start["status"], _parsed(b"".join(chunks)))).encode()
            headers = [(k, v) for k, v in start.get("headers", []) if k.lower() not in (b"content-type", b"content-length")]
            headers += [(b"content-type", PROBLEM_JSON.encode()), (b"content-length", str(len(body)).encode())]
            await send({**start, "headers": headers})
            await send({"type": "http.response.body", "body": body})

        await self.app(scope, receive, rewrite)


def _page(start: Mapping[str, Any]) -> bool:
    return any(k.lower() == b"content-type" and v.lower().startswith(b"text/html") for k, v in start.get("headers", []))


def install_problems(app: FastAPI) -> None:
    """Problem details for every error answer of `app`; a route's own handlers stay in charge of
    what an error says, the middleware of how it is written."""
    app.add_middleware(ProblemDetails)
    # FastAPI installs a default of its own: only that one is replaced, never an app's own.
    if app.exception_handlers.get(RequestValidationError) in (None, request_validation_exception_handler):
        app.exception_handlers[RequestValidationError] = _invalid_request
    app.add_exception_handler(Exception, _unexpected)


def validation_errors(exc: RequestValidationError) -> list[dict[str, Any]]:
    """FastAPI's validation errors as `loc`, `msg` and `type`, without the bad input itself
    (FastAPI's default echoes each one back, which fails on NaN and repeats oversized values).
    A body that is not JSON is said where and why (FastAPI names only the byte offset, which
    would read as a field: "invalid 18: JSON decode error")."""
    return [_malformed(e, exc.body) if e.get("type") == "json_invalid" else {"loc": list(e["loc"]), "msg": e["msg"], "type": e["type"]} for e in exc.errors()]


def _malformed(error: Mapping[str, Any], body: Any) -> dict[str, Any]:
    loc = list(error.get("loc") or [])
    position = loc[1] if len(loc) > 1 and isinstance(loc[1], int) else None
    why = str((error.get("ctx") or {}).get("error") or "JSON decode error")
    return {"loc": loc[:1] or ["body"], "msg": f"not valid JSON: {why}{where_in(body, position)}", "type": "json_invalid"}


def where_in(text: Any, position: int | None) -> str:
    """` at line L, column C (character N)` of `position` in `text` (1-based line and column),
    ` at character N` when the text is not at hand, or nothing when the position is not known."""
    if position is None:
        return ""
    if not isinstance(text, str) or not 0 <= position <= len(text):
        return f" at character {position}"
    line = text.count("\n", 0, position) + 1
    column = position - (text.rfind("\n", 0, position) + 1) + 1
    return f" at line {line}, column {column} (character {position})"


async def _invalid_request(_request: Request, exc: RequestValidationError) -> JSONResponse:
    return JSONResponse({"detail": validation_errors(exc)}, status_code=422)


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unexpected error answering %s %s", request.method, request.url.path, exc_info=exc)
    return problem_response(500, f"unexpected error: {type(exc).__name__}")


def _parsed(body: bytes) -> Any:
    try:
        return json.loads(body)
    except ValueError:
        return body.decode("utf-8", errors="replace").strip()


# RFC 9110's names where Python's table still has the older ones.
_RFC_9110 = {413: "Content Too Large", 422: "Unprocessable Content"}


def phrase(status: int) -> str:
    """The short phrase of an HTTP status (RFC 9110)."""
    try:
        return _RFC_9110.get(status) or HTTPStatus(status).phrase
    except ValueError:
        return "Error"
