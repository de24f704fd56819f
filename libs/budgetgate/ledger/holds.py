"""Concurrency holds in Redis: quota counters and token pools, with their key layout.

A run's concurrency holds live in its own holds key (`{tag}:h:<run id>`), apart from its budget
charges (the run key), so settling a run's charges never disturbs what it holds at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

SENSITIVE = "sensitive"


@dataclass(frozen=True, slots=True)
class CounterRequest:
    """Add gpus, nodes and allocations to a counter, each within its limit (None = no limit)."""

    name: str  # "t:<tenant>" or "sensitive"
    gpus: int
    nodes: int
    allocations: int
    limits: tuple[int | None, int | None, int | None] = (None, None, None)


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
        args += [c.gpus, c.nodes, c.allocations, *(limit_arg(v) for v in c.limits)]
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
