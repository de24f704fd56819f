"""Authentication, role checks and per-principal rate limits for every budgetgate HTTP service.

A service calls `install_auth(app, settings)` once: the app then holds a `Gate` (built when it
starts), answers 401 / 403 / 429 as problem details, and each route names what it does with
`Depends(allow(Action.X))`, which yields the calling Principal. Plain ASGI paths call
`gate.check(scope["headers"], action)` themselves.

Credentials are bearer tokens: budgetgate API tokens (`bg_…`, hashed in Postgres) or, when an
issuer is configured, OIDC JWTs verified against its JWKS."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any, Literal

import asyncpg
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from limits import RateLimitItem, parse
from limits.aio.storage import MemoryStorage, RedisClusterStorage, RedisStorage
from limits.aio.strategies import FixedWindowRateLimiter
from pydantic import Field, field_validator

from budgetgate.runtime.backends import BACKEND_ERRORS
from budgetgate.edge.oidc import ClaimMapping, JwtVerifier
from budgetgate.core.principals import Action, Forbidden, Principal, Unauthenticated
from budgetgate.edge.proxies import TrustedProxies, parse_networks
from budgetgate.runtime.redis_client import is_cluster_url
from budgetgate.runtime.settings import ServingSettings
from budgetgate.access.tokens import PREFIX, TokenStore

__all__ = [
    "Action",
    "AuthSettings",
    "CheckUnavailable",
    "Forbidden",
    "Gate",
    "Principal",
    "RateLimited",
    "TooManyFailures",
    "Unauthenticated",
    "allow",
    "install_auth",
]

log = logging.getLogger(__name__)

CHALLENGE = 'Bearer realm="budgetgate"'
# Where a plain ASGI path leaves the principal it checked, in the request's scope["state"].
CHECKED = "budgetgate.principal"


class AuthSettings(ServingSettings):
    """Who may call an HTTP service (BUDGETGATE_ variables)."""

    # A token revoked (or expired) stops working on every instance within this many seconds.
    token_cache_seconds: float = Field(default=2.0, ge=0)
    # Requests per principal, in the `limits` notation ("1000/second", "50000/minute"); none = no limit.
    rate_limit: str | None = "1000/second"
    # Where requests are counted: "cluster" in Redis, shared by every instance (a Redis round trip
    # per request); "instance" in each process's memory (no round trip; with N instances a
    # principal gets up to N times the limit, so set the limit per instance).
    rate_limit_scope: Literal["cluster", "instance"] = "cluster"
    # Unknown or malformed API tokens per client address, counted in each instance's memory
    # ("limits" notation); past it, that address's tokens not already known good are answered 429
    # without asking Postgres, so a flood of made-up tokens cannot starve the token lookups. None = no limit.
    auth_failure_limit: str | None = "20/second"
    # Proxies (addresses or CIDR networks, JSON: '["10.0.0.0/8"]') whose X-Forwarded-For is
    # believed when counting those failures: the address counted is then the right-most hop not
    # itself a trusted proxy. None by default: the connection's peer, whatever a header says.
    trusted_proxies: list[str] = []
    # /metrics answers only a reader, auditor or operator when true.
    metrics_require_auth: bool = False
    oidc_issuer: str | None = None
    oidc_audience: str | None = None
    oidc_jwks_url: str | None = None
    oidc_algorithms: list[str] = ["RS256", "ES256"]
    oidc_subject_claim: str = "sub"
    oidc_roles_claim: str = "budgetgate_roles"
    oidc_namespaces_claim: str = "budgetgate_namespaces"
    oidc_tenants_claim: str = "budgetgate_tenants"
    # Roles by subject, for tokens without a role claim (JSON: {"system:serviceaccount:flyte:flyte-admin": ["submitter"]}).
    oidc_subject_roles: dict[str, list[str]] = {}

    @field_validator("trusted_proxies")
    @classmethod
    def _networks(cls, entries: list[str]) -> list[str]:
        parse_networks(entries)
        return entries


class RateLimited(Exception):
    def __init__(self, principal: Principal, retry_after: int) -> None:
        super().__init__(f"{principal.name!r} is over its rate limit; retry after {retry_after}s")
        self.retry_after = retry_after


class TooManyFailures(RateLimited):
    """A client address that sent too many unknown API tokens, refused before any lookup."""

    def __init__(self, client: str, retry_after: int) -> None:
        Exception.__init__(self, f"too many unknown API tokens from {client}; retry after {retry_after}s")
        self.retry_after = retry_after


class NoCredentials(Unauthenticated):
    """The request carries no Authorization header at all."""


class CheckUnavailable(Exception):
    """Postgres or Redis cannot be asked whether the caller may proceed: fail closed (503)."""


class Gate:
    """Authenticates a request's bearer credential, checks its role, and counts it against the
    principal's rate limit. Unknown API tokens are counted per client address against
    `failure_limit` (in this process's memory): past it, an address's tokens not cached as valid
    are refused before Postgres is asked."""

    def __init__(
        self,
        *,
        tokens: TokenStore,
        jwt: JwtVerifier | None = None,
        limiter: FixedWindowRateLimiter | None = None,
        limit: str | None = None,
        failure_limit: str | None = None,
        proxies: TrustedProxies | None = None,
    ) -> None:
        self.tokens = tokens
        self.proxies = proxies or TrustedProxies()
        self.jwt = jwt
        self.limiter = limiter
        self.limit = parse(limit) if limit else None
        self.hits = CoalescedHits(limiter, self.limit) if limiter is not None and self.limit is not None else None
        self.failure_limit = parse(failure_limit) if failure_limit else None
        self.failures = FixedWindowRateLimiter(MemoryStorage()) if self.failure_limit is not None else None

    async def principal(self, headers: Iterable[tuple[bytes, bytes]], *, scope: Any = None) -> Principal:
        """The caller named by the Authorization header; raises Unauthenticated or TooManyFailures.
        `scope` (the request's ASGI scope) gives the address unknown tokens are counted against."""
        value = next((v for k, v in headers if k.lower() == b"authorization"), None)
        if value is None:
            raise NoCredentials("no credentials: send `Authorization: Bearer <token>`")
        scheme, _, credential = value.decode("latin-1").strip().partition(" ")
        credential = credential.strip()
        if scheme.lower() != "bearer" or not credential:
            raise Unauthenticated("credentials must be a bearer token (`Authorization: Bearer <token>`)")
        if credential.startswith(PREFIX):
            return await self.api_token(credential, scope=scope)
        if self.jwt is None:
            raise Unauthenticated("not a budgetgate API token, and no OIDC issuer is configured")
        return await self.jwt.principal(credential)

    async def api_token(self, secret: str, *, scope: Any = None) -> Principal:
        """The principal of a budgetgate API token; raises Unauthenticated or TooManyFailures."""
        found = self.tokens.cached(secret)
        if found is not None:  # a caller known good keeps working while its address is limited
            return found
        # Only a token not answered from the cache needs the caller's address.
        client = (self.proxies.client(scope) if scope is not None else None) or "an unknown address"
        # A secret found valid before is looked up again (revoked since?) even while its address
        # is limited: callers behind one proxy share an address, and one flooding it must not
        # lock the others out each time their cached answer runs out.
        failures, limit = self.failures, self.failure_limit
        if failures is not None and limit is not None and not self.tokens.known_good(secret) and not await failures.test(limit, client):
            stats = await failures.get_window_stats(limit, client)
            raise TooManyFailures(client, max(1, int(stats.reset_time - time.time() + 0.999)))
        try:
            found = await self.tokens.principal(secret)
        except BACKEND_ERRORS as exc:
            raise CheckUnavailable(f"credentials cannot be checked: Postgres unavailable ({exc})") from exc
        if found is None:
            if self.failures is not None and self.failure_limit is not None:
                await self.failures.hit(self.failure_limit, client)
            raise Unauthenticated("API token unknown, revoked or expired")
        return found

    async def check(self, headers: Iterable[tuple[bytes, bytes]], action: Action, *, scope: Any = None) -> Principal:
        """The caller, if it may do `action` now; raises Unauthenticated, Forbidden or RateLimited."""
        principal = await self._allowed(headers, action, scope=scope)
        await self.count(principal)
        return principal

    async def _allowed(self, headers: Iterable[tuple[bytes, bytes]], action: Action, *, scope: Any) -> Principal:
        principal = await self.principal(headers, scope=scope)
        principal.require(action)
        return principal

    async def begin_check(self, headers: Iterable[tuple[bytes, bytes]], action: Action, *, scope: Any = None) -> tuple[Principal, asyncio.Future[None]]:
        """As `check`, with the caller's hit on its rate limit sent but not awaited: the caller
        awaits it (it raises RateLimited) before acting on the request, so that its round trip
        to Redis overlaps the caller's own work (reading and validating the body). An outcome
        nobody awaits (the request failed first) is retrieved, never reported as lost. Only the
        submission fast path has work to overlap: every other route uses `check`, which counts
        in line rather than through a task of its own."""
        principal = await self._allowed(headers, action, scope=scope)
        if self.hits is None:
            nothing: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            nothing.set_result(None)
            return principal, nothing
        counted = asyncio.ensure_future(self.count(principal))
        counted.add_done_callback(_retrieve)
        return principal, counted

    def may_defer(self, principal: Principal) -> bool:
        """Whether the count `begin_check` sent for `principal` may be awaited after work that
        changes nothing (admission plans a submission and reads its batch's runs meanwhile, and
        awaits it before reserving): with no limit, or while the caller's count was at most half
        its limit when last counted. A caller nearer its limit, or not counted yet (a flood, a
        window's first request after a busy one), has it awaited before any work, so a flood's
        requests past the limit cost no more than the check."""
        return self.hits is None or self.hits.far_below(principal.name)

    async def count(self, principal: Principal) -> None:
        if self.hits is None or self.limiter is None or self.limit is None:  # hits is None exactly when no limit is set
            return
        try:
            allowed = await self.hits.hit(principal.name) <= self.limit.amount
        except BACKEND_ERRORS as exc:
            # A limit protects against abuse; it is not a ledger. Redis being down must not
            # take down a service that does not otherwise need it (metering-ingest), so the
            # request goes on, and admission still fails closed on its own ledger check.
            log.warning("rate limit of %s not checked, Redis unavailable: %s", principal.name, exc)
            return
        if not allowed:
            stats = await self.limiter.get_window_stats(self.limit, principal.name)
            raise RateLimited(principal, max(1, int(stats.reset_time - time.time() + 0.999)))


def _retrieve(task: asyncio.Future[None]) -> None:
    if not task.cancelled():
        task.exception()


# The principals whose last count CoalescedHits keeps (far_below) before it forgets them all.
_MAX_REACHED = 65_536


class CoalescedHits:
    """A fixed-window limit's hits counted together: the hits on one principal's window that
    arrive while its counter is being incremented join the next increment (INCRBY n in the
    limiter's storage, under the library's own key), and each learns the count it reached, as
    if it had been counted alone. Exactly what separate hits count, with one storage round trip
    per batch instead of per request (one per request was a tenth of admission's CPU)."""

    def __init__(self, limiter: FixedWindowRateLimiter, item: RateLimitItem) -> None:
        self.storage = limiter.storage
        self.item = item
        self._waiting: dict[str, list[asyncio.Future[int]]] = {}
        self._counting: set[str] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._reached: dict[str, int] = {}  # identifier -> the count its last increment reached

    def far_below(self, identifier: str) -> bool:
        """Whether `identifier`'s count was at most half the limit when this process last
        counted it (False before its first count). Only a cost depends on it, when a request's
        own count is awaited, never whether it is: a reading older than the window, or than
        other processes' hits since, changes nothing else."""
        reached = self._reached.get(identifier)  # (by identifier: its key costs a µs to format)
        return reached is not None and 2 * reached <= self.item.amount

    async def hit(self, identifier: str) -> int:
        """Count one hit; the window's count with it."""
        key = self.item.key_for(identifier)
        found: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(key, []).append(found)
        if key not in self._counting:
            self._counting.add(key)
            task = asyncio.get_running_loop().create_task(self._count(key, identifier), name="rate-limit-count")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return await found

    async def _count(self, key: str, identifier: str) -> None:
        batch: list[asyncio.Future[int]] | None = None
        try:
            while batch := self._waiting.pop(key, None):
                try:
                    total = await self.storage.incr(key, self.item.get_expiry(), amount=len(batch))
                except Exception as exc:  # noqa: BLE001 - every hit of the batch hears of it
                    for waiter in batch:
                        if not waiter.done():
                            waiter.set_exception(exc)
                    continue
                if len(self._reached) >= _MAX_REACHED and identifier not in self._reached:
                    self._reached.clear()  # (principals seen: bounded, forgetting is only slower)
                self._reached[identifier] = total
                for place, waiter in enumerate(batch, start=total - len(batch) + 1):
                    if not waiter.done():
                        waiter.set_result(place)
        finally:
            self._counting.discard(key)
            for waiter in [*(batch or ()), *self._waiting.pop(key, ())]:  # only when this task was cancelled
                if not waiter.done():
                    waiter.cancel()


def unauthenticated_response(exc: Unauthenticated) -> JSONResponse:
    # RFC 6750: a request without credentials gets the bare challenge, a bad token the error code.
    challenge = CHALLENGE if isinstance(exc, NoCredentials) else f'{CHALLENGE}, error="invalid_token"'
    return JSONResponse({"detail": str(exc)}, status_code=401, headers={"WWW-Authenticate": challenge})


def forbidden_response(exc: Forbidden) -> JSONResponse:
    return JSONResponse({"detail": str(exc)}, status_code=403)


def unavailable_response(exc: CheckUnavailable) -> JSONResponse:
    return JSONResponse({"detail": str(exc)}, status_code=503, headers={"Retry-After": "1"})


def rate_limited_response(exc: RateLimited) -> JSONResponse:
    return JSONResponse({"detail": str(exc)}, status_code=429, headers={"Retry-After": str(exc.retry_after)})


_bearer = HTTPBearer(auto_error=False, description="a budgetgate API token (`budgetgate token create`) or an OIDC JWT")


def allow(action: Action) -> Callable[..., Any]:
    """A FastAPI dependency: the calling Principal, allowed to do `action`."""

    async def dependency(request: Request, _credentials: HTTPAuthorizationCredentials | None = Depends(_bearer)) -> Principal:
        checked = request.scope.get("state", {}).get(CHECKED)
        if checked is not None:  # a plain ASGI path checked (and counted) this request already
            checked.require(action)
            return checked
        return await gate_of(request.app).check(request.scope["headers"], action, scope=request.scope)

    return dependency


def gate_of(app: Any) -> Gate:
    gate = getattr(app.state, "gate", None)
    if gate is None:
        raise Unauthenticated("the service is starting; credentials cannot be checked yet")
    return gate


async def build_gate(settings: AuthSettings, pool: Any) -> tuple[Gate, RedisStorage | None]:
    jwt = None
    if settings.oidc_issuer:
        if not settings.oidc_audience or not settings.oidc_jwks_url:
            raise ValueError("BUDGETGATE_OIDC_ISSUER needs BUDGETGATE_OIDC_AUDIENCE and BUDGETGATE_OIDC_JWKS_URL")
        claims = ClaimMapping(
            subject=settings.oidc_subject_claim,
            roles=settings.oidc_roles_claim,
            namespaces=settings.oidc_namespaces_claim,
            tenants=settings.oidc_tenants_claim,
            subject_roles={subject: tuple(roles) for subject, roles in settings.oidc_subject_roles.items()},
        )
        jwt = JwtVerifier(
            issuer=settings.oidc_issuer, audience=settings.oidc_audience, jwks_url=settings.oidc_jwks_url, algorithms=settings.oidc_algorithms, claims=claims
        )
    storage = limiter = None
    if settings.rate_limit:
        if settings.rate_limit_scope == "instance":
            storage = MemoryStorage()
        else:
            storage = _shared_storage(settings.redis_url, key_prefix=f"{{{settings.redis_prefix}}}:ratelimit")
        limiter = FixedWindowRateLimiter(storage)
    tokens = TokenStore(pool, cache_seconds=settings.token_cache_seconds)
    gate = Gate(
        tokens=tokens,
        jwt=jwt,
        limiter=limiter,
        limit=settings.rate_limit,
        failure_limit=settings.auth_failure_limit,
        proxies=TrustedProxies(parse_networks(settings.trusted_proxies)),
    )
    return gate, storage


def _shared_storage(redis_url: str, *, key_prefix: str) -> RedisStorage:
    """The `limits` storage of a limit shared by every instance, on the ledger's Redis: a single
    server, or a cluster (`redis+cluster://`, `rediss+cluster://`), whose keys share one hash tag."""
    scheme, _, rest = redis_url.partition("://")
    if is_cluster_url(redis_url):
        tls = {"ssl": True} if scheme.lower().startswith("rediss") else {}
        return RedisClusterStorage(f"async+redis+cluster://{rest}", implementation="redispy", key_prefix=key_prefix, **tls)
    limits_scheme = {"redis": "async+redis", "rediss": "async+rediss", "unix": "async+redis+unix"}.get(scheme.lower())
    if limits_scheme is None:
        raise ValueError(
            f"BUDGETGATE_REDIS_URL: a rate limit shared by instances needs a redis://, rediss://, unix:// or redis+cluster:// URL, not {scheme}://"
        )
    return RedisStorage(f"{limits_scheme}://{rest}", implementation="redispy", key_prefix=key_prefix)


async def close_storage(storage: Any) -> None:
    """Close the Redis client of a rate limit's storage (the library leaves it open)."""
    client = getattr(getattr(storage, "bridge", None), "storage", None)
    if client is not None:
        with contextlib.suppress(Exception):
            await client.aclose()


def install_auth(app: FastAPI, settings: AuthSettings) -> None:
    """Give `app` a Gate while it runs (its own small Postgres pool for token lookups) and the
    401 / 403 / 429 answers."""
    inner = app.router.lifespan_context

    @contextlib.asynccontextmanager
    async def lifespan(app_: FastAPI) -> AsyncIterator[Any]:
        # min_size=0: a service starts (and answers 503) while Postgres is down.
        pool = await asyncpg.create_pool(settings.postgres_dsn, min_size=0, max_size=4, command_timeout=5)
        try:
            app_.state.gate, storage = await build_gate(settings, pool)
            try:
                async with inner(app_) as state:
                    yield state
            finally:
                await close_storage(storage)
        finally:
            await pool.close()

    app.router.lifespan_context = lifespan

    @app.exception_handler(Unauthenticated)
    async def _unauthenticated(_request: Request, exc: Unauthenticated) -> JSONResponse:
        return unauthenticated_response(exc)

    @app.exception_handler(Forbidden)
    async def _forbidden(_request: Request, exc: Forbidden) -> JSONResponse:
        return forbidden_response(exc)

    @app.exception_handler(CheckUnavailable)
    async def _unavailable(_request: Request, exc: CheckUnavailable) -> JSONResponse:
        return unavailable_response(exc)

    @app.exception_handler(RateLimited)
    async def _rate_limited(_request: Request, exc: RateLimited) -> JSONResponse:
        return rate_limited_response(exc)
