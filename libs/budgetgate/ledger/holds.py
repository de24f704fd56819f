"""Concurrency holds in Redis: quota counters and token pools, with their key layout.

A run's concurrency holds live in its own holds key (`{tag}:h:<run id>`), apart from its budget
charges (the run key), so settling a run's charges never disturbs what it holds at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

SENSITIVE = "sensitive"

# A counter limit read from the counter's own `size` field (an escrow lease of a counter several
# tenants share: reserve.lua), not passed in.
LEASED = -2


@dataclass(frozen=True, slots=True)
class CounterRequest:
    """Add gpus, nodes and allocations to a counter, each within its limit (None = no limit)."""

    name: str  # "t:<tenant>", "sensitive", or "sensitive@<tenant>" (a tenant's lease of it)
    gpus: int
    nodes: int
    allocations: int
    limits: tuple[int | None, int | None, int | None] = (None, None, None)
    # An escrow lease (a tenant's slice of the sensitive pool on a ledger of several shards): each
    # limit given is tested against the counter's `size` field instead, what the lease holds.
    lease: bool = False


@dataclass(frozen=True, slots=True)
class PoolLevel:
    namespace: str
    quota: int
    project_cap: int | None = None
    namespace_cap: int | None = None


@dataclass(frozen=True, slots=True)
class PoolRequest:
    """One token in a pool and every declared ancestor (levels, most specific first)."""

    levels: tuple[PoolLevel, ...]
    token: str
    project: str = ""
    sub_namespace: str = ""
    expiry_ms: int = 0
    lease_seconds: int = 0  # the lease's length, which a renewal extends it by


@dataclass(frozen=True, slots=True)
class PoolReading:
    check: str  # OK | HELD | EXHAUSTED | CAP | TAKEN (the token is held by another holder than the run asking, reserving or quoting)
    used: int
    by_project: int
    by_sub_namespace: int


def tenant_counter(tenant: str) -> str:
    return f"t:{tenant}"


def sensitive_lease(tenant: str) -> str:
    """The counter of `tenant`'s escrow lease of the sensitive pool (a ledger of several shards):
    on its tenant's shard, what its sensitive runs hold and, in `size`, what they may hold."""
    if not tenant or "@" in tenant:
        raise ValueError(f"not a tenant a lease of the sensitive pool can be filed under: {tenant!r}")
    return f"{SENSITIVE}@{tenant}"


def lease_root(counter: str) -> str | None:
    """The tenant of a counter that is a lease of the sensitive pool; None for any other."""
    name, separator, root = counter.partition("@")
    return root if separator and name == SENSITIVE and root else None


class HoldKeys:
    """Key names of counters, pools and run holds under one hash tag."""

    def __init__(self, tag: str) -> None:
        self.tag = tag

    def counter(self, name: str) -> str:
        return f"{self.tag}:q:{name}"

    def holds(self, run_id: str) -> str:
        return f"{self.tag}:h:{run_id}"

    def pool(self, namespace: str) -> list[str]:
        base = f"{self.tag}:pool:{namespace}"
        return [f"{base}:leases", f"{base}:owners", f"{base}:projects", f"{base}:subns"]

    def expand(self, held_keys: Sequence[str]) -> list[str]:
        """The KEYS a release needs for what a holds key names: a pool's leases key brings its
        three siblings along."""
        keys: list[str] = []
        for key in held_keys:
            if key.endswith(":leases"):
                base = key.removesuffix(":leases")
                keys += [key, f"{base}:owners", f"{base}:projects", f"{base}:subns"]
            else:
                keys.append(key)
        return keys


def limit_arg(limit: int | None) -> int:
    return -1 if limit is None else limit


def counter_args(counters: Sequence[CounterRequest]) -> list[object]:
    args: list[object] = []
    for c in counters:
        args += [c.gpus, c.nodes, c.allocations, *(LEASED if c.lease and v is not None else limit_arg(v) for v in c.limits)]
    return args


def pool_args(pool: PoolRequest | None) -> list[object]:
    if pool is None:
        return ["", "", "", 0]
    args: list[object] = [pool.token, pool.project, pool.sub_namespace, pool.expiry_ms]
    for level in pool.levels:
        args += [level.quota, limit_arg(level.project_cap), limit_arg(level.namespace_cap)]
    return args


def pool_readings(values: Sequence[object]) -> tuple[PoolReading, ...]:
    return tuple(
        PoolReading(_text(values[i]), int(values[i + 1]), int(values[i + 2]), int(values[i + 3]))  # type: ignore[call-overload]
        for i in range(0, len(values), 4)
    )


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
