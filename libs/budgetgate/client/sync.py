"""Client: the admission API (and metering-ingest's feeds) for code without an event loop."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any, Literal, TypeVar

import httpx

from budgetgate.client import calls, endpoints, feeds, settlement_calls
from budgetgate.client.aio import answer, headers
from budgetgate.client.calls import Call
from budgetgate.client.errors import NotGranted
from budgetgate.client.retries import RetryPolicy
from budgetgate.contracts.admission import (
    AdmissionRequest,
    AdmissionResponse,
    AdmissionStatus,
    AllocationIn,
    AllocationOut,
    BudgetList,
    ChargebackReport,
    PoolStatus,
    ReleaseOut,
    ScopeUsage,
    TenantUsage,
    UserUsage,
)
from budgetgate.contracts.settlements import DeadLetterList, Resolved
from budgetgate.contracts.tenants import TenantSettingsIn, TenantSettingsOut
from budgetgate.contracts.budget_grants import GrantIn, GrantList
from budgetgate.contracts.admission import GrantOut
from budgetgate.v1.lifecycle_pb2 import LifecycleEvent
from budgetgate.v1.metering_pb2 import MeteringSample

T = TypeVar("T")


class Client:
    """The same operations as AsyncClient, blocking. Use as `with Client() as client:`."""

    def __init__(
        self,
        url: str | None = None,
        *,
        token: str | None = None,
        metering_url: str | None = None,
        reconciler_url: str | None = None,
        timeout: float = 30.0,
        retry: RetryPolicy = RetryPolicy(),
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self._url, self.metering_url = endpoints.resolved(url, metering_url)
        self._reconciler_url = reconciler_url
        self.retry = retry
        self._http = httpx.Client(timeout=timeout, headers=headers(endpoints.token(token)), transport=transport)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def send(self, call: Call[T], *, base: str | None = None, retry: RetryPolicy | None = None) -> T:
        """Send `call` (to `base`, default admission), resending it as the retry policy says."""
        url = (base or self.url) + call.path
        for attempt in (retry or self.retry).sync():
            with attempt:
                return answer(call, self._http.request(call.method, url, json=call.json, params=dict(call.params) or None))
        raise AssertionError("unreachable: the retry policy reraises")  # pragma: no cover

    def wait_ready(self, *, timeout: float = 30.0) -> dict[str, str]:
        """Wait until admission is ready (its ledger loaded and a policy bundle active); its checks.
        Raises Unavailable, naming the failing checks, when it is not ready within `timeout`."""
        return self.send(calls.readiness(), retry=RetryPolicy(attempts=1_000_000, initial=0.1, max_wait=1.0, deadline=timeout))

    def submit(self, request: AdmissionRequest | Mapping[str, Any]) -> AdmissionResponse:
        """Ask whether a workload may start; the same run id and attempt on every retry."""
        return self.send(calls.submit(request))

    def lookup(self, run_id: str) -> AdmissionStatus | None:
        """The stored decision of a run (with `waiting` for a run refused for now), or None."""
        return self.send(calls.lookup(run_id))

    def budgets(self) -> BudgetList:
        """Every budget of the active bundle in its current window."""
        return self.send(calls.budgets())

    def scope_usage(self, scope_id: str) -> ScopeUsage:
        """Every budget of a scope in its current window."""
        return self.send(calls.scope_usage(scope_id))

    def tenant_usage(self, tenant: str, *, days: int = 90) -> TenantUsage:
        """A tenant's budgets and its runs' usage over the last `days`."""
        return self.send(calls.tenant_usage(tenant, days=days))

    def chargeback(self, start: str, to: str, *, group_by: tuple[str, ...] = ("tenant",), period: str = "none") -> ChargebackReport:
        """Chargeback over [start, to): metered and reserved GPU-hours, node-hours and cost by
        the group keys (account, tenant, user, budget, flavor, region) and period (a reader token)."""
        return self.send(calls.chargeback(start, to, group_by=group_by, period=period))

    def tenant(self, name: str) -> TenantSettingsOut:
        """A tenant's quotas and budgets in force, each with its source (Git or override)."""
        return self.send(calls.tenant(name))

    def update_tenant(self, name: str, changes: TenantSettingsIn | Mapping[str, Any], *, create: bool = False) -> TenantSettingsOut:
        """Override some of a tenant's quotas and budgets (an operator or accounting token);
        `create` for a tenant neither Git nor an override names yet."""
        return self.send(calls.update_tenant(name, changes, create=create))

    def grant_budget(self, policy_id: str, grant: GrantIn | Mapping[str, Any]) -> GrantOut:
        """Add hours (or money; negative takes away) to a budget's limit in its current window or
        the one named, with a reason (an operator or accounting token)."""
        return self.send(calls.grant_budget(policy_id, grant))

    def budget_grants(self, policy_id: str, *, window: str | None = None) -> GrantList:
        """The grants made to a budget, oldest first (only the named window's, if one is named)."""
        return self.send(calls.budget_grants(policy_id, window=window))

    def user_usage(self, user: str, *, days: int = 90) -> UserUsage:
        """A user's budgets and its runs' usage over the last `days` (the tenant rules)."""
        return self.send(calls.user_usage(user, days=days))

    def allocate(self, namespace: str, request: AllocationIn | Mapping[str, Any]) -> AllocationOut:
        """Ask a pool for a token (asking again with the same token renews its lease)."""
        return self.send(calls.allocate(namespace, request))

    def release(self, namespace: str, token: str) -> ReleaseOut:
        """Give a token back (idempotent)."""
        return self.send(calls.release(namespace, token))

    def pool(self, namespace: str) -> PoolStatus:
        """A pool's quota, use and holders."""
        return self.send(calls.pool(namespace))

    @contextlib.contextmanager
    def pool_token(self, namespace: str, token: str, **request: Any) -> Iterator[AllocationOut]:
        """`with client.pool_token("snowflake:wh-1", "job-42"):` holds the token for the block
        and gives it back however the block ends; raises NotGranted when not granted."""
        try:
            granted = self.allocate(namespace, {"token": token, **request})
        except BaseException:
            with contextlib.suppress(Exception):
                self.release(namespace, token)
            raise
        if granted.status != "Granted":
            raise NotGranted(granted)
        try:
            yield granted
        finally:
            self.release(namespace, token)

    def publish_lifecycle(self, *events: LifecycleEvent) -> list[dict[str, Any]]:
        """Post lifecycle events to metering-ingest, which publishes them durably; per-event results."""
        return self.send(feeds.post_lifecycle(events), base=self._metering())

    def publish_metering(self, *samples: MeteringSample) -> list[dict[str, Any]]:
        """Post metering samples to metering-ingest; per-sample results (accepted, duplicate, pending)."""
        return self.send(feeds.post_metering(samples), base=self._metering())

    def dead_letters(self) -> DeadLetterList:
        """The settlements the reconciler dead-lettered, with what their runs hold (an operator token)."""
        return self.send(settlement_calls.dead_letters(), base=self.reconciler_url)

    def resolve_settlement(self, run_id: str, *, action: Literal["release", "settle"], reason: str) -> Resolved:
        """Resolve a run's dead-lettered settlement: release what it holds, or settle it again (an
        operator token); `reason` goes to the admin log."""
        return self.send(settlement_calls.resolve(run_id, action=action, reason=reason), base=self.reconciler_url)

    @property
    def url(self) -> str:
        """Admission's base URL (NoEndpoint when none is known: a client that only publishes needs none)."""
        return self._url or endpoints.admission_url(None)

    @property
    def reconciler_url(self) -> str:
        """The reconciler's base URL (NoEndpoint when none is known)."""
        return endpoints.reconciler_url(self._reconciler_url)

    def _metering(self) -> str:
        if self.metering_url is None:
            raise endpoints.NoEndpoint(f"no metering-ingest URL: pass metering_url or set {endpoints.METERING_VARIABLE}")
        return self.metering_url
