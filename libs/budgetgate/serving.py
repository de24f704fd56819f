"""What every HTTP-serving budgetgate process shares: its command line, its operational routes
(`/healthz`, `/readyz`, `/metrics`), error answers as problem details, its published OpenAPI,
and stopping its background tasks."""

from __future__ import annotations

import argparse
import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any

from fastapi import Depends, FastAPI, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from budgetgate.backends import BACKEND_ERRORS
from budgetgate.openapi import Operation, document
from budgetgate.problems import install_problems, problem_response
from budgetgate.telemetry import Telemetry

__all__ = ["BACKEND_ERRORS", "Operation", "add_operational_routes", "serve", "stop_tasks"]


class Health(BaseModel):
    """The process is alive."""

    model_config = {"json_schema_extra": {"examples": [{"status": "ok"}]}}

    status: str = Field(description="always ok while the process answers")


class Readiness(BaseModel):
    """Every readiness check passed."""

    model_config = {"json_schema_extra": {"examples": [{"ready": True, "checks": {"postgres": "ok", "redis_ledger": "ok", "policy_bundle": "ok"}}]}}

    ready: bool = Field(description="true: every check says ok")
    checks: dict[str, str] = Field(description="each check and what it found (ok, or why not)")


_METRICS_EXAMPLE = "# HELP budgetgate_admission_decisions_total admission answers by decision\n# TYPE budgetgate_admission_decisions_total counter\n"


def serve(*, prog: str, settings_cls: type[Any], create_app: Callable[[Any], FastAPI]) -> None:
    """`python -m budgetgate.services.<name> [--host H] [--port P]`: settings from BUDGETGATE_*
    variables, the two flags winning, then uvicorn (over TLS when a certificate and key are set)."""
    import uvicorn

    parser = argparse.ArgumentParser(prog=prog)
    parser.add_argument("--host")
    parser.add_argument("--port", type=int)
    args = parser.parse_args()
    overrides = {k: v for k, v in {"host": args.host, "port": args.port}.items() if v is not None}
    settings = settings_cls(**overrides)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    tls = {"ssl_certfile": settings.tls_certfile, "ssl_keyfile": settings.tls_keyfile} if getattr(settings, "tls_certfile", None) else {}
    if tls and not settings.tls_keyfile:
        parser.error("BUDGETGATE_TLS_CERTFILE needs BUDGETGATE_TLS_KEYFILE")
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_level="warning", **tls)


def add_operational_routes(
    app: FastAPI,
    *,
    telemetry: Telemetry,
    readiness: Callable[[Request], Awaitable[dict[str, str]]],
    operations: Mapping[str, Operation] | None = None,
    protect_metrics: bool = False,
) -> None:
    """Liveness, readiness (200 only when every check says "ok", else a 503 problem naming the
    checks) and Prometheus metrics; every error answer of `app` as RFC 9457 problem details; and
    its OpenAPI published with `operations` naming its other endpoints. Health and readiness are
    open to anyone; metrics too unless `protect_metrics` (then a reader, auditor or operator)."""
    from budgetgate.auth import Action, allow

    metrics_guard = [Depends(allow(Action.METRICS))] if protect_metrics else []

    @app.get("/healthz", response_model=Health)
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz", response_model=Readiness, responses={503: {"description": "a check failed; the problem lists every check as `checks`"}})
    async def readyz(request: Request) -> JSONResponse:
        checks = await readiness(request)
        if all(v == "ok" for v in checks.values()):
            return JSONResponse({"ready": True, "checks": checks})
        failing = ", ".join(f"{name}: {found}" for name, found in checks.items() if found != "ok")
        return problem_response(503, f"not ready ({failing})", ready=False, checks=checks)

    @app.get("/metrics", dependencies=metrics_guard, response_class=Response, responses={200: {"description": "Prometheus text exposition format", "content": {"text/plain": {"schema": {"type": "string"}, "example": _METRICS_EXAMPLE}}}})
    async def metrics() -> Response:
        return Response(telemetry.metrics_text(), media_type=telemetry.metrics_content_type)

    install_problems(app)
    document(app, operations or {})


async def stop_tasks(tasks: Iterable[asyncio.Task[Any]]) -> None:
    """Cancel background tasks and wait until each has stopped."""
    tasks = list(tasks)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
