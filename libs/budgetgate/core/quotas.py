"""Quotas on what runs at once, fair share, and token pools toward external services.

Budgets limit GPU-hours over a window; these limit concurrency: the GPUs, nodes and allocations
a tenant holds from admission until its runs end, the GPUs or nodes sensitive work holds in
total, and the tokens held in a pool of an external service.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

from budgetgate.core.decay import Decayed, decayed_share
from budgetgate.core.sources import Source

SOFT_START = 0.8  # utilization where the soft-quota priority penalty starts


@dataclass(frozen=True, slots=True)
class TenantQuota:
    """Hard limits and fair-share terms of one tenant (the value of the tenant label)."""

    id: str
    tenant: str
    max_gpus: int | None
    max_nodes: int | None
    max_concurrent_allocations: int | None
    fair_share_target: float | None
    burst_allowance: float | None
    source: Source


@dataclass(frozen=True, slots=True)
class SensitivePool:
    """The GPUs or nodes that workloads labelled sensitive may hold in total."""

    id: str
    size: int
    unit: str  # "gpus" | "nodes"
    label_key: str
    label_value: str
    source: Source

    def covers(self, labels: Mapping[str, str]) -> bool:
        return labels.get(self.label_key) == self.label_value


@dataclass(frozen=True, slots=True)
class Cluster:
    """Cluster capacity, the denominator of fair shares."""

    id: str
    gpus: int
    nodes: int | None
    source: Source


@dataclass(frozen=True, slots=True)
class ResourcePool:
    """Tokens toward one external service namespace, e.g. `snowflake:wh-1`."""

    id: str
    namespace: str
    quota: int
    project_cap: int | None
    namespace_cap: int | None
    lease_seconds: int
    source: Source


@dataclass(frozen=True, slots=True)
class Holdings:
    """What a tenant (or the sensitive pool) holds right now."""

    gpus: int = 0
    nodes: int = 0
    allocations: int = 0


@dataclass(frozen=True, slots=True)
class Request:
    gpus: int
    nodes: int


QUOTA_FIELDS = ("max_gpus", "max_nodes", "max_concurrent_allocations")
# How every rejection by a concurrency limit begins: what platforms (and waiting runs) match on.
REJECTED = "allocation rejected: "


def quota_violation(tenant: str, quota: TenantQuota, held: Holdings, request: Request) -> str | None:
    """The rejection reason when admitting `request` would break a hard limit of `quota`, else None.

    Checked in order GPUs, nodes, allocations; the first one broken is reported, in the exact
    form platforms match on. A limit lowered below current use keeps rejecting until use drops.
    """
    for name, current, requested in (
        ("max_gpus", held.gpus, request.gpus),
        ("max_nodes", held.nodes, request.nodes),
        ("max_concurrent_allocations", held.allocations, 1),
    ):
        limit = getattr(quota, name)
        if limit is not None and current + requested > limit:
            reason = f'{REJECTED}tenant "{tenant}" would exceed {name} quota (current: {current}, requested: {requested}, limit: {limit})'
            if current >= limit:
                reason += (
                    "; usage is already at or above the limit (it may have been lowered): wait for running work to finish or ask the tenant admin to raise it"
                )
            return reason
    return None


def sensitive_violation(pool: SensitivePool, held: Holdings, request: Request, *, lease: int | None = None, tenant: str | None = None) -> str | None:
    """The rejection reason when sensitive work would hold more than the pool, else None. With
    `lease` (a ledger of several shards), `held` is what `tenant`'s sensitive runs hold, tested
    against its lease of the pool, which a refill could not grow enough: the other tenants hold
    the rest."""
    current = held.gpus if pool.unit == "gpus" else held.nodes
    requested = request.gpus if pool.unit == "gpus" else request.nodes
    if lease is not None:
        if current + requested > lease:
            return (
                f"{REJECTED}sensitive workloads would exceed sensitive_pool_size (tenant {tenant!r} holds {current} of its lease of {lease} "
                f"and requested: {requested}; other tenants' sensitive workloads hold the rest of the limit: {pool.size} {pool.unit})"
            )
        return None
    if current + requested > pool.size:
        return f"{REJECTED}sensitive workloads would exceed sensitive_pool_size (current: {current}, requested: {requested}, limit: {pool.size} {pool.unit})"
    return None


def priority_penalty(utilization: float) -> float:
    """Scheduling penalty in [0, 1] of a soft budget at `utilization` (used ÷ limit, this run
    included): 0 below 80 %, rising linearly to 0.9 at 100 %, then approaching 1 (0.99 at 123 %,
    0.9993 at 150 %) — effective starvation in the platform's scheduler, never a rejection."""
    if not math.isfinite(utilization) or utilization <= SOFT_START:
        return 0.0 if utilization <= SOFT_START else 1.0
    if utilization <= 1.0:
        return round(0.9 * (utilization - SOFT_START) / (1.0 - SOFT_START), 6)
    return round(1.0 - 0.1 * math.exp(-10.0 * (utilization - 1.0)), 6)


@dataclass(frozen=True, slots=True)
class FairShare:
    share: float  # the tenant's share of cluster GPUs before this run (what it holds now)
    share_after: float
    target: float
    burst_limit: float
    deficit: float  # target − decayed share (raw share without one): positive means below target, so first in line
    preemptible: bool  # admitted above the target, on burst: preempt these first
    decayed_share: float | None = None  # its past GPU usage, decayed, as a share of the cluster
    half_life_hours: float | None = None


def fair_share(quota: TenantQuota, cluster: Cluster, held: Holdings, request: Request, usage: Decayed | None = None) -> FairShare | None:
    """Where a tenant stands against its fair-share target, if it has one. `usage` is its decayed
    GPU usage reckoned at the decision's instant; with it, the deficit is measured on the decayed
    share (a tenant that used much lately waits behind one that did not), else on the raw share."""
    if quota.fair_share_target is None:
        return None
    share = held.gpus / cluster.gpus
    after = (held.gpus + request.gpus) / cluster.gpus
    target = quota.fair_share_target
    decayed = decayed_share(usage.amount, cluster.gpus, usage.half_life) if usage is not None else None
    return FairShare(
        share=round(share, 6),
        share_after=round(after, 6),
        target=target,
        burst_limit=round(target * (quota.burst_allowance or 1.0), 6),
        deficit=round(target - (share if decayed is None else decayed), 6),
        preemptible=after > target,
        decayed_share=None if decayed is None else round(decayed, 6),
        half_life_hours=None if usage is None else round(usage.half_life / timedelta(hours=1), 6),
    )


@dataclass(frozen=True, slots=True)
class PoolOutcome:
    """How one pool level judged a token request (from the atomic step)."""

    namespace: str
    check: str  # OK | HELD | EXHAUSTED | CAP
    used: int
    quota: int


def pool_rejection(outcomes: list[PoolOutcome]) -> str | None:
    """Why a token request is refused: the pool (or an ancestor) is full, or a project or
    sub-namespace cap is reached while the pool has room. None when every level has room."""
    for outcome in outcomes:
        if outcome.check == "EXHAUSTED":
            return f'token pool "{outcome.namespace}" is exhausted (used: {outcome.used}, quota: {outcome.quota})'
    for outcome in outcomes:
        if outcome.check == "CAP":
            return f'token pool "{outcome.namespace}" has room but the project or sub-namespace cap is reached'
    return None


# How a token request refused because another holder has the token begins (the rest of that
# reason is written where the pool's readings are read: decisions/concurrency.py).
TOKEN_TAKEN = 'token "'
TENANT_QUOTA, SENSITIVE_POOL, TOKEN_POOL = "tenant quota", "sensitive pool", "token pool"


def concurrency_limit(reason: str) -> str | None:
    """Which concurrency limit refused a decision whose reason is `reason` (TENANT_QUOTA,
    SENSITIVE_POOL or TOKEN_POOL), or None when no concurrency limit did: a refusal by one of
    them replaces the decision's reason with the limit's own (the messages above)."""
    if reason.startswith(REJECTED + "tenant "):
        return TENANT_QUOTA
    if reason.startswith(REJECTED + "sensitive "):
        return SENSITIVE_POOL
    if reason.startswith('token pool "') or (reason.startswith(TOKEN_TAKEN) and '" of pool "' in reason):
        return TOKEN_POOL
    if reason.startswith(REJECTED):
        return "concurrency limit"
    return None


def soft_penalty(utilizations: list[float]) -> float:
    """The worse-of rule: the most used soft budget drives the penalty (0 with none)."""
    return max((priority_penalty(u) for u in utilizations), default=0.0)
