"""What a submission asks of concurrency limits (tenant quota, sensitive pool, token pool), and
what the atomic step's readings say about it: a rejection, a soft penalty, a fair share."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from budgetgate.core.decay import Decayed
from budgetgate.core.evaluation import Decision, Plan, Reading
from budgetgate.core.policy import Enforcement, PolicyBundle
from budgetgate.core.quotas import (
    FairShare,
    Holdings,
    PoolOutcome,
    Request,
    fair_share,
    pool_rejection,
    quota_violation,
    sensitive_violation,
    soft_penalty,
)
from budgetgate.ledger.holds import SENSITIVE, CounterRequest, PoolLevel, PoolRequest, sensitive_lease, tenant_counter
from budgetgate.ledger.redis_ledger import ReserveResult
from budgetgate.contracts.admission import RUN_TOKEN_PREFIX, AdmissionRequest


class NoSuchPool(LookupError):
    """A submission or allocation names a pool namespace no ResourcePool declares."""


class NoSensitiveTenant(ValueError):
    """A sensitive submission names no tenant, on a ledger of several shards: the sensitive pool
    is carved into tenants' leases there, and it has none to count on."""


@dataclass(frozen=True)
class Asks:
    """The concurrency a submission holds if admitted."""

    tenant: str | None
    sensitive: bool
    counters: tuple[CounterRequest, ...] = ()
    pool: PoolRequest | None = None
    # The pool token is taken apart from the rest: on a ledger of several shards the pools' keys
    # are on the empty root's shard, the run's on its tenant's. Admission takes the token there
    # first and gives it back if the decision holds nothing (Admitter._take_tokens).
    pool_apart: bool = False

    @property
    def any(self) -> bool:
        return bool(self.counters) or self.pool is not None

    @property
    def sensitive_counter(self) -> CounterRequest | None:
        """The counter it counts on for the sensitive pool: the pool's, or its tenant's lease of it."""
        return next((c for c in self.counters if c.name == SENSITIVE or c.lease), None) if self.sensitive else None


def pool_request(
    bundle: PolicyBundle,
    namespace: str,
    *,
    token: str,
    project: str,
    sub_namespace: str,
    constraints: dict[str, int | None],
    lease_seconds: int | None,
    now: datetime,
) -> PoolRequest:
    """A token request on a namespace and its declared ancestors; caps are the tighter of the
    pool's own and the request's constraints."""
    chain = bundle.pool_chain(namespace)
    if not chain:
        raise NoSuchPool(f"no ResourcePool declares namespace {namespace!r} or any of its parents")
    levels = tuple(
        PoolLevel(
            namespace=pool.namespace,
            quota=pool.quota,
            project_cap=_tighter(pool.project_cap, constraints.get("project")),
            namespace_cap=_tighter(pool.namespace_cap, constraints.get("namespace")),
        )
        for pool in chain
    )
    lease = lease_seconds or chain[0].lease_seconds
    expiry = now + timedelta(seconds=lease)
    return PoolRequest(levels=levels, token=token, project=project, sub_namespace=sub_namespace, expiry_ms=int(expiry.timestamp() * 1000), lease_seconds=lease)


def _tighter(a: int | None, b: int | None) -> int | None:
    values = [v for v in (a, b) if v is not None]
    return min(values) if values else None


def asks(bundle: PolicyBundle, request: AdmissionRequest, *, tenant_label: str, now: datetime, leased: bool = False) -> Asks:
    """What `request` holds if admitted. `leased`: the ledger has several shards, so a sensitive
    run counts on its tenant's escrow lease of the sensitive pool (holds.sensitive_lease), on its
    tenant's shard (raises NoSensitiveTenant for one that names no tenant), and its pool token
    is taken apart, on the pools' shard (`Asks.pool_apart`)."""
    res = request.resources
    tenant = request.labels.get(tenant_label)
    counters = []
    if tenant:
        quota = bundle.quota_for(tenant)
        limits = (quota.max_gpus, quota.max_nodes, quota.max_concurrent_allocations) if quota else (None, None, None)
        counters.append(CounterRequest(tenant_counter(tenant), res.gpus, res.nodes, 1, limits))
    sensitive = bundle.sensitive is not None and bundle.sensitive.covers(request.labels)
    if sensitive:
        size = bundle.sensitive.size  # type: ignore[union-attr]
        limits = (size, None, None) if bundle.sensitive.unit == "gpus" else (None, size, None)  # type: ignore[union-attr]
        if not leased:
            counters.append(CounterRequest(SENSITIVE, res.gpus, res.nodes, 1, limits))
        elif not tenant:
            raise NoSensitiveTenant(
                f"a sensitive workload must name its tenant (label {tenant_label!r}): "
                "on a ledger of several shards the sensitive pool is carved into tenants' leases"
            )
        else:
            counters.append(CounterRequest(sensitive_lease(tenant), res.gpus, res.nodes, 1, limits, lease=True))
    pool = None
    if request.pool_token is not None:
        ask = request.pool_token
        pool = pool_request(
            bundle,
            ask.namespace,
            token=RUN_TOKEN_PREFIX + request.run_id,
            project=ask.project or "",
            sub_namespace=ask.sub_namespace or "",
            constraints=ask.constraints.model_dump() if ask.constraints else {},
            lease_seconds=ask.lease_seconds,
            now=now,
        )
    return Asks(tenant=tenant, sensitive=sensitive, counters=tuple(counters), pool=pool, pool_apart=leased and pool is not None)


def rejection(bundle: PolicyBundle, request: AdmissionRequest, the_asks: Asks, result: ReserveResult) -> str | None:
    """Why the concurrency limits refuse the submission, from the readings before it."""
    wanted = Request(gpus=request.resources.gpus, nodes=request.resources.nodes)
    held = dict(zip((c.name for c in the_asks.counters), result.counters, strict=True))
    sizes = dict(zip((c.name for c in the_asks.counters), result.counter_sizes or (None,) * len(the_asks.counters), strict=True))
    if the_asks.tenant and (quota := bundle.quota_for(the_asks.tenant)) is not None:
        reason = quota_violation(the_asks.tenant, quota, Holdings(*held[tenant_counter(the_asks.tenant)]), wanted)
        if reason:
            return reason
    if (counter := the_asks.sensitive_counter) is not None and bundle.sensitive is not None:
        reason = sensitive_violation(bundle.sensitive, Holdings(*held[counter.name]), wanted, lease=sizes[counter.name], tenant=the_asks.tenant)
        if reason:
            return reason
    if the_asks.pool is not None:
        taken = next((level.namespace for level, reading in zip(the_asks.pool.levels, result.pools, strict=True) if reading.check == "TAKEN"), None)
        if taken is not None:
            return f'token "{the_asks.pool.token}" of pool "{taken}" is held by another holder, not by this run'
        outcomes = [
            PoolOutcome(level.namespace, reading.check, reading.used, level.quota) for level, reading in zip(the_asks.pool.levels, result.pools, strict=True)
        ]
        return pool_rejection(outcomes)
    return None


@dataclass(frozen=True)
class Standing:
    """What the decision tells the platform's scheduler beyond allow or deny."""

    tenant: str | None
    priority_penalty: float
    preemptible: bool
    fair_share: dict[str, Any] | None = field(default=None)

    def body(self) -> dict[str, Any]:
        return {"tenant": self.tenant, "priority_penalty": self.priority_penalty, "preemptible": self.preemptible, "fair_share": self.fair_share}


def standing(
    bundle: PolicyBundle,
    request: AdmissionRequest,
    the_asks: Asks,
    the_plan: Plan,
    readings: dict[str, Reading] | None,
    result: ReserveResult | None,
    usage: Decayed | None = None,
) -> Standing:
    """Soft-budget penalty (worse of the soft budgets, this run included) and fair share, raw and
    on the tenant's decayed usage."""
    utilizations = []
    for charge in the_plan.charges:
        if charge.policy.enforcement is Enforcement.SOFT and readings is not None and charge.policy.limit.amount > 0:
            r = readings[charge.ledger_key]
            utilizations.append((r.reserved + r.consumed + charge.amount) / charge.policy.limit.amount)
    share = None
    quota = bundle.quota_for(the_asks.tenant)
    if quota is not None and bundle.cluster is not None and result is not None and result.counters:
        held = Holdings(*result.counters[0])
        share = fair_share(quota, bundle.cluster, held, Request(request.resources.gpus, request.resources.nodes), usage)
    return Standing(
        tenant=the_asks.tenant,
        priority_penalty=soft_penalty(utilizations),
        preemptible=bool(share and share.preemptible),
        fair_share=None if share is None else _fair_share_body(share),
    )


def _fair_share_body(share: FairShare) -> dict[str, float]:
    body = {"share": share.share, "share_after": share.share_after}
    if share.decayed_share is not None and share.half_life_hours is not None:
        body |= {"decayed_share": share.decayed_share, "half_life_hours": share.half_life_hours}
    return body | {"target": share.target, "burst_limit": share.burst_limit, "deficit": share.deficit}


def refused(decision: Decision, reason: str) -> Decision:
    """The decision turned into a DENY for a concurrency reason: nothing admitted anywhere."""
    from dataclasses import replace

    return replace(decision, outcome="DENY", reason=reason, evaluations=tuple(replace(e, admitted=0) for e in decision.evaluations))
