"""What every HTTP-serving budgetgate process shares: its command line, its operational routes
(`/healthz`, `/readyz`, `/metrics`) and stopping its background tasks."""

from __future__ import annotations

import argparse
import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse

from budgetgate.telemetry import Telemetry


def serve(*, prog: str, settings_cls: type[Any], create_app: Callable[[Any], FastAPI]) -> None:
    """`python -m budgetgate.services.<name> [--host H] [--port P]`: settings from BUDGETGATE_*
    variables, the two flags winning, then uvicorn."""
    import uvicorn

    parser = argparse.ArgumentParser(prog=prog)
    parser.add_argument("--host")
    parser.add_argument("--port", type=int)
    args = parser.parse_args()
    overrides = {k: v for k, v in {"host": args.host, "port": args.port}.items() if v is not None}
    settings = settings_cls(**overrides)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_level="warning")


def add_operational_routes(app: FastAPI, *, telemetry: Telemetry, readiness: Callable[[Request], Awaitable[dict[str, str]]]) -> None:
    """Liveness, readiness (200 only when every check says "ok") and Prometheus metrics."""

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz(request: Request) -> JSONResponse:
        checks = await readiness(request)
        ok = all(v == "ok" for v in checks.values())
        return JSONResponse({"ready": ok, "checks": checks}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(telemetry.metrics_text(), media_type=telemetry.metrics_content_type)


async def stop_tasks(tasks: Iterable[asyncio.Task[Any]]) -> None:
    """Cancel background tasks and wait until each has stopped."""
    tasks = list(tasks)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
