"""The Redis side of the ledger: live reserved/consumed figures per ledger key, changed only by
the Lua scripts next to this file (one script per atomic operation).

Every key lives under one hash tag (`{prefix}`), so all keys of a decision share a Redis Cluster
slot. Budgets cross tenants (a cost-center budget spans namespaces), so no finer tag would keep
every decision's keys together.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from importlib import resources

import redis.asyncio as aioredis

from budgetgate.ledger.holds import CounterRequest, HoldKeys, PoolReading, PoolRequest, counter_args, pool_args, pool_readings

log = logging.getLogger(__name__)

_SCRIPTS = ("reserve", "release", "load_key", "settle", "consume", "allocate", "deallocate", "release_holds")
# Lua shared by several scripts, prepended when they are registered.
_LIBRARIES = {
    "reserve": ("pools",),
    "release": ("pools", "holds"),
    "allocate": ("pools",),
    "deallocate": ("pools",),
    "release_holds": ("pools", "holds"),
}


class LedgerNotLoaded(RuntimeError):
    """Redis does not hold the ledger (empty or restarted): rebuild it from Postgres first."""


@dataclass(frozen=True, slots=True)
class ChargeRequest:
    ledger_key: str
    amount: int
    limit: int
    hard: bool


@dataclass(frozen=True, slots=True)
class ReserveResult:
    status: str  # RESERVED | REJECTED | MISSING | DUPLICATE
    readings: tuple[tuple[int, int], ...] = ()  # (reserved, consumed) per charge, before
    missing: int | None = None  # index of the first charge whose key was never loaded
    holder: str | None = None  # decision id holding the run key, for DUPLICATE
    counters: tuple[tuple[int, int, int], ...] = ()  # (gpus, nodes, allocations) held, before
    pools: tuple[PoolReading, ...] = ()  # per pool level, before


@dataclass(frozen=True, slots=True)
class KeyChange:
    """How one settlement changes a ledger key; `held` is what the run holds on it afterwards,
    None for a key the run has no reservation on."""

    ledger_key: str
    reserved: int = 0
    consumed: int = 0
    held: int | None = None


class LedgerKeyMissing(LookupError):
    """A ledger key was never loaded into Redis: load it from Postgres, then call again."""

    def __init__(self, ledger_key: str) -> None:
        super().__init__(f"ledger key {ledger_key!r} is not loaded in Redis")
        self.ledger_key = ledger_key


def _script(name: str) -> str:
    folder = resources.files("budgetgate.ledger").joinpath("lua")
    return "\n".join(folder.joinpath(f"{part}.lua").read_text() for part in (*_LIBRARIES.get(name, ()), name))


class RedisLedger:
    """Typed wrappers around the ledger's Lua scripts (EVALSHA, reloaded on NOSCRIPT)."""

    def __init__(self, client: aioredis.Redis, *, prefix: str) -> None:
        self.client = client
        self.tag = "{" + prefix + "}"
        self.keys = HoldKeys(self.tag)
        self._scripts = {name: client.register_script(_script(name)) for name in _SCRIPTS}

    @property
    def marker(self) -> str:
        return f"{self.tag}:loaded"

    def ledger(self, ledger_key: str) -> str:
        return f"{self.tag}:l:{ledger_key}"

    def run(self, run_id: str) -> str:
        return f"{self.tag}:r:{run_id}"

    async def reserve(
        self,
        *,
        run_id: str,
        decision_id: str,
        charges: Sequence[ChargeRequest],
        now_ms: int,
        counters: Sequence[CounterRequest] = (),
        pool: PoolRequest | None = None,
    ) -> ReserveResult:
        """Reserve every charge, counter and pool token, or none; raises LedgerNotLoaded when
        Redis lost the ledger."""
        levels = pool.levels if pool else ()
        keys = [
            self.marker,
            self.run(run_id),
            self.keys.holds(run_id),
            *(self.ledger(c.ledger_key) for c in charges),
            *(self.keys.counter(c.name) for c in counters),
            *(key for level in levels for key in self.keys.pool(level.namespace)),
        ]
        args: list[object] = [decision_id, now_ms, len(charges), len(counters), len(levels)]
        for c in charges:
            args += [c.amount, c.limit, 1 if c.hard else 0]
        args += counter_args(counters) + pool_args(pool)
        reply = await self._scripts["reserve"](keys=keys, args=args)
        status = _text(reply[0])
        if status == "NOT_LOADED":
            raise LedgerNotLoaded("the Redis ledger is not loaded")
        if status == "MISSING":
            return ReserveResult(status, missing=int(_text(reply[1])) - 1)
        if status == "DUPLICATE":
            return ReserveResult(status, holder=_text(reply[1]))
        n, m = 2 * len(charges), 3 * len(counters)
        ledger = [int(v) for v in reply[1 : 1 + n]]
        held = [int(v) for v in reply[1 + n : 1 + n + m]]
        return ReserveResult(
            status,
            readings=tuple(zip(ledger[::2], ledger[1::2], strict=True)),
            counters=tuple(zip(held[::3], held[1::3], held[2::3], strict=True)),
            pools=pool_readings(reply[1 + n + m :]),
        )

    async def release(self, run_id: str, *, decision_id: str = "") -> int:
        """Give back what a run holds (charges and concurrency); returns the number of keys
        released (0 if none)."""
        run_key, holds_key = self.run(run_id), self.keys.holds(run_id)
        for _ in range(5):
            held = await self.client.hgetall(run_key)
            ledger_keys = [_text(k) for k in held if not _text(k).startswith("_")]
            holds = self.keys.expand([_text(k) for k in await self.client.hkeys(holds_key)])
            reply = await self._scripts["release"](keys=[self.marker, run_key, holds_key, *ledger_keys, *holds], args=[decision_id, len(ledger_keys)])
            if isinstance(reply, list):
                status = _text(reply[0])
                if status == "NOT_LOADED":
                    raise LedgerNotLoaded("the Redis ledger is not loaded")
                if status == "OTHER_DECISION":
                    return 0
                continue  # STALE_KEYS: the run changed between read and script; read again
            return int(reply)
        raise RuntimeError(f"run {run_id!r} kept changing while being released")

    async def release_holds(self, run_id: str) -> int:
        """Give back a run's concurrency holds (quota counters, pool tokens) when it ends."""
        holds_key = self.keys.holds(run_id)
        for _ in range(5):
            holds = self.keys.expand([_text(k) for k in await self.client.hkeys(holds_key)])
            reply = await self._scripts["release_holds"](keys=[self.marker, holds_key, *holds], args=[])
            if isinstance(reply, list):
                if _text(reply[0]) == "NOT_LOADED":
                    raise LedgerNotLoaded("the Redis ledger is not loaded")
                continue
            return int(reply)
        raise RuntimeError(f"holds of run {run_id!r} kept changing while being released")

    async def allocate(self, pool: PoolRequest, *, now_ms: int) -> tuple[str, tuple[PoolReading, ...]]:
        """Allocate `pool.token` on every level or none: GRANTED, RENEWED, EXHAUSTED or CAP."""
        keys = [self.marker, *(key for level in pool.levels for key in self.keys.pool(level.namespace))]
        args = pool_args(pool)
        reply = await self._scripts["allocate"](keys=keys, args=[args[0], args[1], args[2], now_ms, args[3], *args[4:]])
        status = _text(reply[0])
        if status == "NOT_LOADED":
            raise LedgerNotLoaded("the Redis ledger is not loaded")
        return status, pool_readings(reply[1:])

    async def deallocate(self, namespaces: Sequence[str], token: str) -> int:
        """Release `token` from every given pool level; returns the levels it was held on."""
        keys = [self.marker, *(key for ns in namespaces for key in self.keys.pool(ns))]
        reply = await self._scripts["deallocate"](keys=keys, args=[token])
        if isinstance(reply, list):
            raise LedgerNotLoaded("the Redis ledger is not loaded")
        return int(reply)

    async def load_key(self, ledger_key: str, *, reserved: int, consumed: int) -> bool:
        """Load a ledger key from Postgres's figures unless present; True when loaded now."""
        reply = await self._scripts["load_key"](keys=[self.marker, self.ledger(ledger_key)], args=[reserved, consumed])
        if isinstance(reply, list):
            raise LedgerNotLoaded("the Redis ledger is not loaded")
        return bool(reply)

    async def settle(self, *, run_id: str, decision_id: str, changes: Sequence[KeyChange], drop_run: bool, now_ms: int) -> None:
        """Apply one run's settlement in one script: reserved and consumed deltas on each key, and
        the run key rewritten (or deleted when `drop_run`). Raises LedgerNotLoaded, or
        LedgerKeyMissing naming a key to load first; either way nothing changed."""
        keys = [self.marker, self.run(run_id), *(self.ledger(c.ledger_key) for c in changes)]
        args: list[object] = [decision_id, now_ms, 1 if drop_run else 0]
        for c in changes:
            args += [c.reserved, c.consumed, "" if c.held is None else c.held]
        self._check(await self._scripts["settle"](keys=keys, args=args), [c.ledger_key for c in changes])

    async def consume(self, changes: Mapping[str, int]) -> None:
        """Add to (or, when negative, take from) what ledger keys have consumed, atomically."""
        keys = list(changes)
        reply = await self._scripts["consume"](keys=[self.marker, *(self.ledger(k) for k in keys)], args=[changes[k] for k in keys])
        self._check(reply, keys)

    @staticmethod
    def _check(reply: object, ledger_keys: Sequence[str]) -> None:
        if isinstance(reply, list):
            status = _text(reply[0])
            if status == "NOT_LOADED":
                raise LedgerNotLoaded("the Redis ledger is not loaded")
            if status == "MISSING":
                raise LedgerKeyMissing(ledger_keys[int(_text(reply[1])) - 1])
            raise RuntimeError(f"unexpected answer from the ledger: {reply!r}")

    async def run_holds(self) -> dict[str, dict[str, int]]:
        """What every run key holds on ledger keys: run id → {ledger key: amount} (runs holding
        only other things, such as quota counters, are left out)."""
        prefix, ledger_prefix = f"{self.tag}:r:", f"{self.tag}:l:"
        result = {}
        async for key in self.client.scan_iter(match=f"{self.tag}:r:*", count=1000):
            fields = await self.client.hgetall(key)
            holds = {_text(k)[len(ledger_prefix):]: int(v) for k, v in fields.items() if _text(k).startswith(ledger_prefix)}
            if holds:
                result[_text(key)[len(prefix):]] = holds
        return result

    async def all_readings(self) -> dict[str, tuple[int, int]]:
        """(reserved, consumed) of every ledger key Redis holds."""
        prefix = f"{self.tag}:l:"
        keys = [_text(k)[len(prefix):] async for k in self.client.scan_iter(match=f"{self.tag}:l:*", count=1000)]
        return await self.readings(keys)

    async def invalidate(self, why: str) -> None:
        """Drop the loaded marker, so every script answers NOT_LOADED until Redis is rebuilt from
        Postgres: for when Redis may hold a change Postgres does not."""
        log.error("Redis may hold a change Postgres does not (%s); invalidating the Redis ledger", why)
        try:
            await self.client.delete(self.marker)
        except Exception as exc:  # noqa: BLE001 - the drift check finds and repairs the difference
            log.error("cannot invalidate the Redis ledger either (%s); the drift check will repair it", exc)

    async def is_loaded(self) -> bool:
        return bool(await self.client.exists(self.marker))

    async def generation(self) -> str | None:
        value = await self.client.get(self.marker)
        return _text(value) if value is not None else None

    async def readings(self, ledger_keys: Iterable[str]) -> dict[str, tuple[int, int]]:
        """(reserved, consumed) of each present ledger key."""
        keys = list(ledger_keys)
        pipe = self.client.pipeline(transaction=False)
        for key in keys:
            pipe.hmget(self.ledger(key), "reserved", "consumed")
        result = {}
        for key, (reserved, consumed) in zip(keys, await pipe.execute(), strict=True):
            if reserved is not None:
                result[key] = (int(reserved), int(consumed or 0))
        return result

    async def held_runs(self) -> dict[str, tuple[str, int]]:
        """Every run holding a reservation: run id → (decision id, reserved-at ms)."""
        prefix = f"{self.tag}:r:"
        result = {}
        async for key in self.client.scan_iter(match=f"{self.tag}:r:*", count=1000):
            decision, at = await self.client.hmget(key, "_decision", "_at")
            result[_text(key)[len(prefix):]] = (_text(decision or b""), int(at or 0))
        return result

    async def replace_all(
        self,
        *,
        ledgers: dict[str, tuple[int, int]],
        runs: dict[str, tuple[str, int, dict[str, int]]],
        generation: str,
        extra: Callable[[Any], None] | None = None,
    ) -> None:
        """Replace everything under the prefix with Postgres's state, then mark the ledger loaded.

        The marker goes first (deleted) and last (set), so no reservation is made from a
        half-written ledger: until it is set again every script answers NOT_LOADED.
        """
        await self.client.delete(self.marker)
        stale = [key async for key in self.client.scan_iter(match=f"{self.tag}:*", count=1000)]
        for start in range(0, len(stale), 500):
            await self.client.delete(*stale[start : start + 500])
        pipe = self.client.pipeline(transaction=False)
        for key, (reserved, consumed) in ledgers.items():
            pipe.hset(self.ledger(key), mapping={"reserved": reserved, "consumed": consumed})
        for run_id, (decision_id, at_ms, amounts) in runs.items():
            fields: dict[str, object] = {self.ledger(k): v for k, v in amounts.items()}
            pipe.hset(self.run(run_id), mapping={**fields, "_decision": decision_id, "_at": at_ms})
        if extra is not None:
            extra(pipe)  # more state to write before the marker goes back (concurrency holds)
        await pipe.execute()
        await self.client.set(self.marker, generation)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
