"""What every HTTP-serving budgetgate process shares: its command line, its operational routes
(`/healthz`, `/readyz`, `/metrics`), error answers as problem details, its published OpenAPI,
and stopping its background tasks."""

from __future__ import annotations

import argparse
import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any

import asyncpg
from fastapi import Depends, FastAPI, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from budgetgate.runtime import garbage
from budgetgate.runtime.backends import BACKEND_ERRORS
from budgetgate.edge.openapi import document
from budgetgate.contracts.operations import Operation
from budgetgate.core.principals import Forbidden, Principal
from budgetgate.edge.problems import install_problems, problem_response
from budgetgate.runtime.telemetry import Telemetry

log = logging.getLogger(__name__)

__all__ = ["BACKEND_ERRORS", "Operation", "add_operational_routes", "postgres_check", "redis_check", "serve", "stop_tasks"]


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
    """`python -m budgetgate.services.<name> [--host H] [--port P] [--ssl-certfile F --ssl-keyfile F]`:
    settings from BUDGETGATE_* variables, the flags winning, then uvicorn (over TLS with a
    certificate and key, from the flags or BUDGETGATE_TLS_CERTFILE/KEYFILE, as a Kubernetes
    admission webhook must be served)."""
    import uvicorn

    parser = argparse.ArgumentParser(prog=prog)
    parser.add_argument("--host")
    parser.add_argument("--port", type=int)
    parser.add_argument("--ssl-certfile", help="PEM certificate (chain) to serve HTTPS with")
    parser.add_argument("--ssl-keyfile", help="PEM private key of --ssl-certfile")
    args = parser.parse_args()
    if (args.ssl_certfile is None) != (args.ssl_keyfile is None):
        parser.error("--ssl-certfile and --ssl-keyfile go together")
    overrides = {k: v for k, v in {"host": args.host, "port": args.port}.items() if v is not None}
    settings = settings_cls(**overrides)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    certfile = args.ssl_certfile or getattr(settings, "tls_certfile", None)
    keyfile = args.ssl_keyfile or getattr(settings, "tls_keyfile", None)
    if bool(certfile) != bool(keyfile):
        parser.error("TLS needs both a certificate and a key (--ssl-certfile/--ssl-keyfile or BUDGETGATE_TLS_CERTFILE/BUDGETGATE_TLS_KEYFILE)")
    tls = {"ssl_certfile": certfile, "ssl_keyfile": keyfile} if certfile else {}
    app = create_app(settings)
    garbage.settle(settings.gc_thresholds)
    # proxy_headers off: uvicorn would believe X-Forwarded-For from loopback by default; the
    # services read it themselves, from BUDGETGATE_TRUSTED_PROXIES only (budgetgate.edge.proxies).
    keep_alive = settings.http_keep_alive_seconds
    uvicorn.run(app, host=settings.host, port=settings.port, log_level="warning", proxy_headers=False, timeout_keep_alive=keep_alive, **tls)


def add_operational_routes(
    app: FastAPI,
    *,
    telemetry: Telemetry,
    readiness: Callable[[Request], Awaitable[dict[str, str]]],
    details: Callable[[Request], Mapping[str, Any]] | None = None,
    operations: Mapping[str, Operation] | None = None,
    protect_metrics: bool = False,
) -> None:
    """Liveness, readiness (200 only when every check says "ok", else a 503 problem naming the
    checks; `details`, if given, shown beside them) and Prometheus metrics; every error answer of
    `app` as RFC 9457 problem details; and its OpenAPI published with `operations` naming its other endpoints. Health and readiness are
    open to anyone; metrics too unless `protect_metrics` (then a reader, auditor or operator not
    limited to namespaces or tenants)."""
    from budgetgate.edge.auth import Action, allow

    async def unlimited(principal: Principal = Depends(allow(Action.METRICS))) -> None:
        # The gauges name every budget, tenant and pool: no label can be filtered out of a scrape.
        if not principal.unscoped:
            raise Forbidden(f"{principal.name!r} is limited to {principal.limits}; /metrics shows every budget and tenant, so it needs a token without limits")

    metrics_guard = [Depends(unlimited)] if protect_metrics else []

    @app.get("/healthz", response_model=Health)
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz", response_model=Readiness, responses={503: {"description": "a check failed; the problem lists every check as `checks`"}})
    async def readyz(request: Request) -> JSONResponse:
        checks = await readiness(request)
        more = dict(details(request)) if details is not None else {}
        if all(v == "ok" for v in checks.values()):
            return JSONResponse({"ready": True, "checks": checks, **more})
        failing = ", ".join(f"{name}: {found}" for name, found in checks.items() if found != "ok")
        return problem_response(503, f"not ready ({failing})", ready=False, checks=checks, **more)

    @app.get(
        "/metrics",
        dependencies=metrics_guard,
        response_class=Response,
        responses={
            200: {"description": "Prometheus text exposition format", "content": {"text/plain": {"schema": {"type": "string"}, "example": _METRICS_EXAMPLE}}}
        },
    )
    async def metrics() -> Response:
        return Response(telemetry.metrics_text(), media_type=telemetry.metrics_content_type)

    install_problems(app)
    document(app, operations or {})


async def postgres_check(pool: asyncpg.Pool) -> str:
    """A readiness check's word on Postgres: "ok", or why it does not answer."""
    try:
        await pool.fetchval("SELECT 1")
    except (*BACKEND_ERRORS, asyncpg.PostgresError) as exc:
        return f"unreachable: {exc}"
    return "ok"


async def redis_check(client: Any) -> str:
    """A readiness check's word on Redis (an asyncio client): "ok", or why it does not answer."""
    try:
        await client.ping()
    except BACKEND_ERRORS as exc:
        return f"unreachable: {exc}"
    return "ok"


async def stop_tasks(tasks: Iterable[asyncio.Task[Any]], *, timeout: float = 15.0) -> None:
    """Cancel background tasks and wait until each has stopped, or `timeout` seconds: a task stuck
    in its clean-up (a client waiting on a server that went away) must not keep a service from
    shutting down. One that did not stop is logged."""
    tasks = list(tasks)
    for task in tasks:
        task.cancel()
    if not tasks:
        return
    _done, stuck = await asyncio.wait(tasks, timeout=timeout)
    for task in stuck:
        log.warning("background task %s did not stop within %.0fs", task.get_name(), timeout)


async def close_within(closing: Awaitable[Any], *, what: str, timeout: float = 10.0) -> None:
    """Await a client's close (a producer, a consumer group, Redis) for at most `timeout` seconds;
    one that fails or hangs (its server went away) is logged and abandoned."""
    try:
        async with asyncio.timeout(timeout):
            await closing
    except Exception as exc:  # noqa: BLE001 - shutting down: nothing left to do about it
        log.warning("%s did not close cleanly: %s", what, type(exc).__name__ if isinstance(exc, TimeoutError) else exc)


async def close_pool(pool: asyncpg.Pool, *, timeout: float = 10.0) -> None:
    """Close a Postgres pool; one whose connections are not given back within `timeout` seconds
    (a request or task still holding one) is terminated instead of waited on for ever."""
    try:
        async with asyncio.timeout(timeout):
            await pool.close()
    except TimeoutError:
        log.warning("Postgres pool did not close within %.0fs; terminated", timeout)
        pool.terminate()
