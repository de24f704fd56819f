"""The admission HTTP service: create_app(settings) wires adapters to the admitter."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime

import asyncpg
import redis.asyncio as aioredis
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from opentelemetry.metrics import Observation

from budgetgate import wire
from budgetgate.ledger.redis_ledger import RedisLedger
from budgetgate.ledger.sync import LedgerSync
from budgetgate.services.admission.middleware import BodyLimit, ServerSpans
from budgetgate.services.admission.admitter import BACKEND_ERRORS, Admitter, InvalidSubmission, Unavailable
from budgetgate.services.admission.policies import PolicyCache
from budgetgate.outbox import OutboxRelay
from budgetgate.services.admission.concurrency import NoSuchPool
from budgetgate.services.admission.pools import TokenPools
from budgetgate.services.admission.schemas import AllocationIn, AdmissionRequest, AdmissionResponse, Problem, ScopeUsage
from budgetgate.services.admission.settings import AdmissionSettings
from budgetgate.services.admission.tenants import add_tenant_routes
from budgetgate.services.admission.usage import scope_usage
from budgetgate.serving import add_operational_routes, stop_tasks
from budgetgate.telemetry import Telemetry, setup_telemetry
from budgetgate.topics import Topics

log = logging.getLogger(__name__)


@dataclass
class Runtime:
    """What the service holds while it runs."""

    pool: asyncpg.Pool
    redis: aioredis.Redis
    ledger: RedisLedger
    sync: LedgerSync
    policies: PolicyCache
    admitter: Admitter
    relay: OutboxRelay
    publisher: wire.Publisher
    pools: TokenPools


def create_app(settings: AdmissionSettings, *, telemetry: Telemetry | None = None) -> FastAPI:
    """The admission service for `settings`; connections open when the app starts."""
    telemetry = telemetry or setup_telemetry(service_name=settings.service_name, otlp_endpoint=settings.otlp_endpoint)
    meter = telemetry.meter("budgetgate.admission")
    decisions = meter.create_counter("budgetgate_admission_decisions", description="admission answers by decision")
    latency = meter.create_histogram("budgetgate_admission_latency", unit="s", description="time to answer a submission")
    held = {"count": 0}
    meter.create_observable_gauge(
        "budgetgate_reservations_held",
        callbacks=[lambda _options: [Observation(held["count"])]],
        description="reservations held by admitted runs not yet reconciled",
    )
    topics = Topics(settings.topic_prefix)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # No reset query on release: every use ends its transaction, advisory locks are
        # transaction-scoped and no session state is set, so the reset round trip buys nothing.
        pool = await asyncpg.create_pool(settings.postgres_dsn, min_size=settings.pg_pool_min, max_size=settings.pg_pool_max, command_timeout=10, reset=_no_reset)
        client = aioredis.from_url(settings.redis_url, socket_timeout=5, socket_connect_timeout=2)
        ledger = RedisLedger(client, prefix=settings.redis_prefix)
        sync = LedgerSync(pool, ledger)
        policies = PolicyCache(pool)
        publisher = wire.Publisher(settings.kafka_bootstrap, client_id=settings.service_name)
        rt = Runtime(pool, client, ledger, sync, policies, Admitter(pool=pool, ledger=ledger, sync=sync, policies=policies, unmatched=settings.unmatched, tenant_label=settings.tenant_label), OutboxRelay(pool=pool, publisher=publisher, topics=topics), publisher, TokenPools(pool=pool, ledger=ledger, sync=sync, policies=policies))
        app.state.rt = rt
        tasks = [
            asyncio.create_task(_keep_ready(rt, settings, held), name="keep-ready"),
            asyncio.create_task(_relay(rt), name="outbox-relay"),
            asyncio.create_task(_policy_announcements(rt, settings, topics), name="policy-announcements"),
        ]
        try:
            yield
        finally:
            await stop_tasks(tasks)
            await publisher.stop()
            await client.aclose()
            await pool.close()

    app = FastAPI(title="budgetgate admission", version="1", lifespan=lifespan)

    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)
    app.add_middleware(ServerSpans, tracer=telemetry.tracer("budgetgate.admission"))

    @app.exception_handler(Unavailable)
    async def unavailable(_request: Request, exc: Unavailable) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=503, headers={"Retry-After": "1"})

    @app.exception_handler(RequestValidationError)
    async def bad_request(_request: Request, exc: RequestValidationError) -> JSONResponse:
        # FastAPI's default echoes each bad input back, which fails on NaN and repeats
        # oversized values; the location and message name the problem well enough.
        detail = [{"loc": list(err["loc"]), "msg": err["msg"], "type": err["type"]} for err in exc.errors()]
        return JSONResponse({"detail": detail}, status_code=422)

    @app.exception_handler(InvalidSubmission)
    async def invalid(_request: Request, exc: InvalidSubmission) -> JSONResponse:
        loc = ["body", *exc.field.split(".")]
        return JSONResponse({"detail": [{"loc": loc, "msg": str(exc), "type": "value_error"}]}, status_code=422)

    @app.post("/v1/admissions", response_model=AdmissionResponse, responses={422: {}, 503: {"model": Problem}})
    async def submit(body: AdmissionRequest, request: Request) -> JSONResponse:
        started = time.perf_counter()
        answer = await request.app.state.rt.admitter.admit(body)
        decisions.add(1, {"decision": answer["decision"], "replayed": str(answer["replayed"]).lower()})
        latency.record(time.perf_counter() - started, {"decision": answer["decision"]})
        request.app.state.rt.relay.wakeup.set()
        # Built here rather than by FastAPI: the body is already exactly the documented model,
        # and validating it again costs more than the decision's own Python work.
        return JSONResponse(answer)

    @app.get("/v1/admissions/{run_id:path}", response_model=AdmissionResponse, responses={404: {"model": Problem}})
    async def lookup(run_id: str, request: Request) -> dict | JSONResponse:
        try:
            answer = await request.app.state.rt.admitter.lookup(run_id)
        except BACKEND_ERRORS as exc:
            raise Unavailable(f"Postgres unavailable: {exc}") from exc
        if answer is None:
            return JSONResponse({"detail": f"no decision for run {run_id!r}"}, status_code=404)
        return answer

    @app.get("/v1/scopes/{scope_id}/usage", response_model=ScopeUsage, responses={404: {"model": Problem}})
    async def usage(scope_id: str, request: Request) -> dict | JSONResponse:
        rt: Runtime = request.app.state.rt
        if rt.policies.current is None:
            raise Unavailable("no policy bundle has been applied yet")
        try:
            result = await scope_usage(rt.pool, rt.policies.current, scope_id, datetime.now(UTC))
        except BACKEND_ERRORS as exc:
            raise Unavailable(f"Postgres unavailable: {exc}") from exc
        if result is None:
            return JSONResponse({"detail": f"no budget policy has scope {scope_id!r} in bundle {rt.policies.current.git_sha}"}, status_code=404)
        return result

    @app.post("/v1/pools/{namespace}/allocations", responses={404: {"model": Problem}, 503: {"model": Problem}})
    async def allocate(namespace: str, body: AllocationIn, request: Request) -> JSONResponse:
        """Granted | Exhausted | NamespaceQuotaExceeded, in `status`; idempotent per token."""
        try:
            return JSONResponse(await request.app.state.rt.pools.allocate(namespace, body))
        except NoSuchPool as exc:
            return JSONResponse({"detail": str(exc)}, status_code=404)

    @app.delete("/v1/pools/{namespace}/allocations/{token:path}", responses={503: {"model": Problem}})
    async def deallocate(namespace: str, token: str, request: Request) -> JSONResponse:
        return JSONResponse(await request.app.state.rt.pools.release(namespace, token))

    @app.get("/v1/pools/{namespace}", responses={404: {"model": Problem}})
    async def pool_status(namespace: str, request: Request) -> JSONResponse:
        found = await request.app.state.rt.pools.status(namespace)
        if found is None:
            return JSONResponse({"detail": f"no ResourcePool declares namespace {namespace!r}"}, status_code=404)
        return JSONResponse(found)

    add_operational_routes(app, telemetry=telemetry, readiness=lambda request: _readiness(request.app.state.rt))

    add_tenant_routes(app, settings)
    return app


async def _no_reset(_conn: asyncpg.Connection) -> None:
    return None


async def _readiness(rt: Runtime) -> dict[str, str]:
    checks = {}
    try:
        await rt.pool.fetchval("SELECT 1")
        checks["postgres"] = "ok"
    except BACKEND_ERRORS as exc:
        checks["postgres"] = f"unreachable: {exc}"
    try:
        checks["redis_ledger"] = "ok" if await rt.ledger.is_loaded() else "not loaded"
    except BACKEND_ERRORS as exc:
        checks["redis_ledger"] = f"unreachable: {exc}"
    checks["policy_bundle"] = "ok" if rt.policies.current is not None else "none applied"
    return checks


async def _keep_ready(rt: Runtime, settings: AdmissionSettings, held: dict[str, int]) -> None:
    """Load policies and the Redis ledger, and keep them current, outliving any outage."""
    # Orphaned Redis holds (a process died between reserving and committing) are swept by the
    # reconciler, which owns leak protection; a retry of the same run releases its orphan here.
    while True:
        try:
            await rt.policies.refresh()
            await rt.sync.ensure_loaded()
            held["count"] = await rt.pool.fetchval("SELECT count(*) FROM reservations WHERE state = 'held'")
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - retried on the next tick
            log.warning("readiness upkeep failed: %s", exc)
        await asyncio.sleep(settings.policy_refresh_seconds if rt.policies.current else 0.5)


async def _relay(rt: Runtime) -> None:
    while True:
        try:
            await rt.publisher.start()
            break
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - Kafka may come later; decisions wait in the outbox
            log.warning("Kafka not reachable yet (%s); outbox rows wait", exc)
            await asyncio.sleep(2)
    await rt.relay.run()


async def _policy_announcements(rt: Runtime, settings: AdmissionSettings, topics: Topics) -> None:
    """Switch bundles as soon as budget.policies.v1 announces one (polling is the safety net)."""
    from aiokafka import AIOKafkaConsumer

    while True:
        consumer = AIOKafkaConsumer(topics.policies, bootstrap_servers=settings.kafka_bootstrap, group_id=None, auto_offset_reset="latest", enable_auto_commit=False)
        try:
            await consumer.start()
            async for _record in consumer:
                await rt.policies.refresh()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001
            log.warning("policy announcements unavailable (%s); relying on polling", exc)
            await asyncio.sleep(5)
        finally:
            with contextlib.suppress(Exception):
                await consumer.stop()
