"""From validated Quota, Cluster and ResourcePool documents to the concurrency model."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel

from budgetgate.core.documents import ClusterSpec, QuotaSpec, ResourcePoolSpec
from budgetgate.core.quotas import Cluster, ResourcePool, SensitivePool, TenantQuota
from budgetgate.core.sources import PolicyError, Source

ConcurrencyLimit = TenantQuota | SensitivePool | Cluster | ResourcePool


def concurrency_limit(doc_id: str, spec: BaseModel, source: Source) -> ConcurrencyLimit:
    if isinstance(spec, QuotaSpec):
        if spec.tenant is None:
            assert spec.sensitive_pool_size is not None
            label = spec.sensitive_label
            return SensitivePool(doc_id, spec.sensitive_pool_size, spec.sensitive_unit, label.key, label.value, source)
        return TenantQuota(
            doc_id, spec.tenant, spec.max_gpus, spec.max_nodes, spec.max_concurrent_allocations, spec.fair_share_target, spec.burst_allowance, source
        )
    if isinstance(spec, ClusterSpec):
        return Cluster(doc_id, spec.gpus, spec.nodes, source)
    if isinstance(spec, ResourcePoolSpec):
        return ResourcePool(doc_id, spec.namespace, spec.quota, spec.project_cap, spec.namespace_cap, spec.lease_seconds, source)
    raise TypeError(f"not a concurrency document: {type(spec).__name__}")


def concurrency_checks(limits: Sequence[ConcurrencyLimit], *, partial: bool = False) -> list[PolicyError]:
    """Errors across documents: one quota per tenant, one sensitive pool, one cluster, one pool
    per namespace, and fair shares only with a cluster to take them of (unless `partial`: one
    file of a folder, whose Cluster may be in another file)."""
    errors = []
    seen: dict[tuple[str, str], ConcurrencyLimit] = {}
    for limit in limits:
        if isinstance(limit, TenantQuota):
            key = ("tenant quota", limit.tenant)
        elif isinstance(limit, ResourcePool):
            key = ("resource pool", limit.namespace)
        else:
            key = (type(limit).__name__, "")
        first = seen.setdefault(key, limit)
        if first is not limit:
            what = f"{key[0]} {key[1]!r}" if key[1] else ("the sensitive pool" if isinstance(limit, SensitivePool) else "the cluster capacity")
            errors.append(PolicyError(limit.source.file, limit.source.line, f"{what} is already defined at {first.source.file}:{first.source.line}"))
    has_cluster = partial or any(isinstance(limit, Cluster) for limit in limits)
    for limit in limits:
        if isinstance(limit, TenantQuota) and limit.fair_share_target is not None and not has_cluster:
            errors.append(
                PolicyError(
                    limit.source.file,
                    limit.source.line,
                    f"quota {limit.id!r} sets a fair_share_target but no kind: Cluster document gives the capacity it is a share of",
                )
            )
    return errors


def concurrency_fields(limits: Sequence[ConcurrencyLimit]) -> dict[str, Any]:
    """The PolicyBundle fields holding these limits."""
    return {
        "quotas": tuple(limit for limit in limits if isinstance(limit, TenantQuota)),
        "sensitive": next((limit for limit in limits if isinstance(limit, SensitivePool)), None),
        "cluster": next((limit for limit in limits if isinstance(limit, Cluster)), None),
        "pools": tuple(limit for limit in limits if isinstance(limit, ResourcePool)),
    }
