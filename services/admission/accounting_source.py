"""The external accounting source of a tenant's remaining budget (Waldur-style `remaining_budget`),
asked before a submission joins a batch, as its own fault boundary: a bounded deadline (httpx's
timeouts inside an overall asyncio deadline), answers cached per tenant for a while (cachetools'
TTLCache), concurrent asks for one tenant shared, and a circuit breaker (purgatory) that stops
asking after repeated failures. Whatever goes wrong, the answer is "use the ledger", with why;
admission never waits longer than the deadline and never fails because of this source."""

from __future__ import annotations

import asyncio
import logging
import math
from decimal import Decimal
from typing import Any
from urllib.parse import quote

import httpx
from cachetools import TTLCache
from purgatory import AsyncCircuitBreakerFactory
from purgatory.domain.model import OpenedState

from budgetgate.core.accounting import EXTERNAL, LEDGER, BudgetSource
from budgetgate.core.documents import MAX_AMOUNT
from budgetgate.core.evaluation import Plan
from budgetgate.core.overrides import InvalidOverride, tenant_budget
from budgetgate.core.policy import PolicyBundle
from budgetgate.core.units import MILLI_PER_HOUR, Unit, to_amount

log = logging.getLogger(__name__)

FIELD = "remaining_budget"
CIRCUIT = "accounting"
_MOST_HOURS = Decimal(MAX_AMOUNT) / MILLI_PER_HOUR


class BadAnswer(ValueError):
    """The source answered, but not a usable remaining budget."""


class NoFigure(LookupError):
    """The source does not know the tenant (404): not a failure of the source."""


class ExternalAccounting:
    """Asks `url` (a template with `{tenant}`) for a tenant's remaining GPU-hours."""

    def __init__(
        self,
        url: str,
        *,
        token: str | None = None,
        timeout: float = 0.25,
        cache_seconds: float = 30.0,
        failure_threshold: int = 5,
        reset_seconds: float = 30.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        if "{tenant}" not in url:
            raise ValueError(f"the accounting URL {url!r} must hold {{tenant}}, where the tenant's name goes")
        self.url = url
        self.timeout = timeout
        headers = {"accept": "application/json", **({"authorization": f"Bearer {token}"} if token else {})}
        self._http = httpx.AsyncClient(timeout=httpx.Timeout(timeout), headers=headers, transport=transport, follow_redirects=False)
        self._cache: TTLCache[str, tuple[int | None, str]] = TTLCache(maxsize=10_000, ttl=cache_seconds)
        self._breakers = AsyncCircuitBreakerFactory(default_threshold=failure_threshold, default_ttl=reset_seconds, exclude=[NoFigure])
        self._asking: dict[str, asyncio.Future[tuple[int | None, str]]] = {}

    async def aclose(self) -> None:
        await self._http.aclose()

    async def source(self, bundle: PolicyBundle, plan: Plan, tenant: str | None, *, label: str) -> BudgetSource | None:
        """Which figure the tenant's soft GPU-hour budget is to be judged on, when the plan
        charges one; None otherwise (no tenant, no such budget, or it does not apply)."""
        if not tenant:
            return None
        try:
            policy = tenant_budget(bundle, tenant, Unit.GPU_HOURS, label=label)
        except InvalidOverride:
            return None
        if policy is None or not any(c.policy.id == policy.id for c in plan.charges):
            return None
        remaining, detail = await self.remaining(tenant)
        if remaining is None:
            return BudgetSource(policy.id, LEDGER, None, detail)
        return BudgetSource(policy.id, EXTERNAL, remaining, detail)

    async def remaining(self, tenant: str) -> tuple[int | None, str]:
        """The tenant's remaining budget in ledger units and where it came from, or None and
        why the ledger is to be used instead. Never raises, never takes longer than the deadline."""
        cached = self._cache.get(tenant)
        if cached is not None:
            return cached
        asking = self._asking.get(tenant)
        if asking is None:
            asking = self._asking[tenant] = asyncio.ensure_future(self._ask(tenant))
            asking.add_done_callback(lambda _f: self._asking.pop(tenant, None))
        return await asyncio.shield(asking)

    async def _ask(self, tenant: str) -> tuple[int | None, str]:
        url = self.url.replace("{tenant}", quote(tenant, safe=""))
        try:
            async with asyncio.timeout(self.timeout):
                breaker = await self._breakers.get_breaker(CIRCUIT)
                async with breaker:
                    figure = read(await self._http.get(url))
        except OpenedState:
            return None, "the accounting system failed repeatedly; its circuit breaker is open, so the ledger is used until it is tried again"
        except NoFigure:
            found: tuple[int | None, str] = (None, f"the accounting system has no remaining budget for tenant {tenant!r}")
        except (TimeoutError, httpx.TimeoutException):
            return None, f"the accounting system did not answer within {self.timeout:g} s"
        except httpx.HTTPError as exc:
            return None, f"the accounting system is unreachable: {type(exc).__name__}"
        except BadAnswer as exc:
            log.warning("accounting system answered unusable data for tenant %r: %s", tenant, exc)
            return None, f"the accounting system answered unusable data: {exc}"
        else:
            found = (figure, f"{FIELD} from the accounting system")
        self._cache[tenant] = found
        return found


def read(response: httpx.Response) -> int:
    """The remaining budget in a source's answer, in ledger units (GPU-hours × 3,600,000);
    raises NoFigure (404) or BadAnswer."""
    if response.status_code == 404:
        raise NoFigure(response.url.path)
    if response.status_code != 200:
        raise BadAnswer(f"status {response.status_code}")
    try:
        body = response.json()
    except ValueError:
        raise BadAnswer("not JSON") from None
    if not isinstance(body, dict) or FIELD not in body:
        raise BadAnswer(f"no {FIELD!r} in the answer")
    return hours_amount(body[FIELD])


def hours_amount(value: Any) -> int:
    """A `remaining_budget` (a number, or a decimal string as Django REST framework writes
    decimals) in ledger units; negative means overspent. Raises BadAnswer."""
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise BadAnswer(f"{FIELD} is {type(value).__name__}, not a number")
    if isinstance(value, float) and not math.isfinite(value):
        raise BadAnswer(f"{FIELD} is {value!r}")
    try:
        figure = Decimal(value.strip() if isinstance(value, str) else repr(value) if isinstance(value, float) else value)
    except ArithmeticError:
        raise BadAnswer(f"{FIELD} {value!r} is not a number") from None
    if not figure.is_finite() or abs(figure) > _MOST_HOURS:
        raise BadAnswer(f"{FIELD} {value!r} is out of range")
    return to_amount(Unit.GPU_HOURS, figure)
