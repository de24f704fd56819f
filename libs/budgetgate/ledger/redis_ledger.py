"""The Redis side of the ledger: live reserved/consumed figures per ledger key, changed only by
the Lua scripts next to this file (one script per atomic operation).

Every key of one shard lives under its hash tag (`{prefix}` with one shard, the default;
`{prefix:i}` with several, budgetgate.core.shards), so all keys of a decision share a Redis
Cluster slot. Budgets cross tenants (a cost-center budget spans namespaces), so no finer tag
would keep every decision's keys together: a budget that roots share is carved into a lease per
root (budgetgate.ledger.escrow_leases).
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal
from importlib import resources

import redis.asyncio as aioredis
import redis.exceptions

from budgetgate.core.ledger_key import AmountOutOfRange
from budgetgate.core.shards import Shards, key_root
from budgetgate.ledger.holds import CounterRequest, HoldKeys, PoolReading, PoolRequest, counter_args, pool_args, pool_readings

log = logging.getLogger(__name__)

_SCRIPTS = ("reserve", "release", "load_key", "settle_begin", "settle_end", "consume", "allocate", "deallocate", "release_holds", "renew", "rehold", "lease")
# Lua shared by several scripts, prepended when they are registered.
_LIBRARIES = {
    "reserve": ("pools", "holds"),
    "release": ("pools", "holds"),
    "allocate": ("pools",),
    "deallocate": ("pools",),
    "release_holds": ("pools", "holds"),
    "renew": ("pools",),
    "rehold": ("pools", "holds"),
}


class LedgerNotLoaded(RuntimeError):
    """Redis does not hold the ledger (empty or restarted): rebuild it from Postgres first."""


@dataclass(frozen=True, slots=True)
class ChargeRequest:
    ledger_key: str
    amount: int
    limit: int
    hard: bool
    lease: bool = False  # an escrow lease (budgetgate.ledger.escrow_leases): tested against its size in Redis, not `limit`


@dataclass(frozen=True, slots=True)
class Reservation:
    """What one decision asks the ledger to hold, all or none."""

    run_id: str
    decision_id: str
    charges: tuple[ChargeRequest, ...]
    counters: tuple[CounterRequest, ...] = ()
    pool: PoolRequest | None = None
    # Refused elsewhere: its pool token, on the pools' shard of a ledger of several shards (see
    # Admitter._take_tokens). Read as any reservation, never held (REJECTED); no `pool` then.
    refused: bool = False


@dataclass(frozen=True, slots=True)
class LeaseRenewal:
    """A held token's lease extended to `expiry_ms` on its pool levels (most specific first)."""

    token: str
    levels: tuple[str, ...]
    expiry_ms: int


@dataclass(frozen=True, slots=True)
class ReserveResult:
    status: str  # RESERVED | REJECTED | MISSING | DUPLICATE; a check: FITS | REJECTED
    readings: tuple[tuple[int, int], ...] = ()  # (reserved, consumed) per charge, before
    missing: int | None = None  # index of the first charge whose key was never loaded
    holder: str | None = None  # decision id holding the run key, for DUPLICATE
    counters: tuple[tuple[int, int, int], ...] = ()  # (gpus, nodes, allocations) held, before
    pools: tuple[PoolReading, ...] = ()  # per pool level, before
    seq: int | None = None  # the ledger sequence this reservation advanced to, when RESERVED
    unloaded: tuple[int, ...] = ()  # a check: charges whose key Redis never loaded (read as empty)
    sizes: tuple[int | None, ...] = ()  # per charge, an escrow lease's size (its limit); None for a budget's own key
    counter_sizes: tuple[int | None, ...] = ()  # per counter, a lease's size (its limit); None for any other counter


@dataclass(frozen=True, slots=True)
class KeyChange:
    """How one settlement changes a ledger key; `held` is what the run holds on it afterwards,
    None for a key the run has no reservation on."""

    ledger_key: str
    reserved: int = 0
    consumed: int = 0
    held: int | None = None


class SettlementPending(RuntimeError):
    """An earlier settlement of the run is parked in Redis: end it (settle_end) first."""

    def __init__(self, run_id: str, seq: int) -> None:
        super().__init__(f"settlement {seq} of run {run_id!r} is still pending in Redis")
        self.run_id = run_id
        self.seq = seq


class LedgerKeyMissing(LookupError):
    """A ledger key was never loaded into Redis: load it from Postgres, then call again.
    `ledger_keys`: every key of the call Redis lacked (the first is `ledger_key`)."""

    def __init__(self, ledger_key: str, *others: str) -> None:
        more = f" (and {len(others)} other key(s))" if others else ""
        super().__init__(f"ledger key {ledger_key!r} is not loaded in Redis{more}")
        self.ledger_key = ledger_key
        self.ledger_keys = (ledger_key, *others)


def _script(name: str, *, step: int) -> str:
    """The script's Lua, after the libraries it uses and the step its shard's ledger sequence
    advances by (SEQ_STEP, budgetgate.core.shards)."""
    folder = resources.files("budgetgate.ledger").joinpath("lua")
    parts = [f"local SEQ_STEP = {step}", *(folder.joinpath(f"{part}.lua").read_text() for part in (*_LIBRARIES.get(name, ()), name))]
    return "\n".join(parts)


class RefusingWrites(redis.exceptions.ConnectionError):
    """Redis refuses writes in its present state, with an answer redis-py has no error of its
    own for: MISCONF (its snapshots or append-only file cannot be written, e.g. a full disk),
    NOREPLICAS (fewer replicas than min-replicas-to-write), BUSY (a script running past its
    time limit). An outage (a ConnectionError, so in budgetgate.runtime.backends.BACKEND_ERRORS)."""


# What Redis answers a write it cannot take in its present state (a replica after a failover,
# memory full, a cluster resharding or failing over, a dataset loading, persistence failing),
# and the error redis-py raises for that answer to a plain command (RefusingWrites where it has
# none).
_STATE_REFUSALS: dict[str, type[redis.exceptions.RedisError]] = {
    "READONLY": redis.exceptions.ReadOnlyError,
    "OOM": redis.exceptions.OutOfMemoryError,
    "TRYAGAIN": redis.exceptions.TryAgainError,
    "CLUSTERDOWN": redis.exceptions.ClusterDownError,
    "MASTERDOWN": redis.exceptions.MasterDownError,
    "LOADING": redis.exceptions.BusyLoadingError,
    "MISCONF": RefusingWrites,
    "NOREPLICAS": RefusingWrites,
    "BUSY": RefusingWrites,
}
# At the start of the answer (the script refused before it ran), after the '-' that begins a
# command's error inside a script's, or where redis-py quotes a pipeline command's answer
# ("Command # 1 (SET ...) of pipeline caused error: ('NOREPLICAS ...',)").
_STATE_REFUSAL = re.compile(r"(?:^|-|\(')(" + "|".join(_STATE_REFUSALS) + r") ")


class _Script:
    """A registered script (EVALSHA, reloaded on NOSCRIPT) whose failures say what they are: a
    script that Redis refuses for its state comes back as a plain ResponseError ("Error running
    script ...: -READONLY You can't write against a read only replica.", "MISCONF ..."), which
    reads as a fault of the request; it is raised as the error the same refusal of a plain
    command gives (ReadOnlyError..., RefusingWrites where redis-py has none), which every
    service takes for an outage (budgetgate.runtime.backends)."""

    def __init__(self, script: Any) -> None:
        self._script = script

    async def __call__(self, *, keys: Sequence[Any], args: Sequence[Any]) -> Any:
        try:  # not the context below: a script call is on admission's path, once per batch
            return await self._script(keys=keys, args=args)
        except redis.exceptions.ResponseError as exc:
            outage = _as_outage(exc)
            if outage is exc:
                raise
            raise outage from exc


@contextlib.contextmanager
def refusals_as_outages() -> Iterator[None]:
    """Raise a refusal of Redis's state (see _STATE_REFUSALS) met by plain commands as the error
    that says so, as the scripts do (redis-py has no class for MISCONF or NOREPLICAS)."""
    try:
        yield
    except redis.exceptions.ResponseError as exc:
        outage = _as_outage(exc)
        if outage is exc:
            raise
        raise outage from exc


def _as_outage(exc: redis.exceptions.ResponseError) -> redis.exceptions.RedisError:
    """`exc` itself, or the error of the refusal of Redis's state it reports."""
    found = _STATE_REFUSAL.search(str(exc))
    if found is None or isinstance(exc, _STATE_REFUSALS[found.group(1)]):
        return exc
    return _STATE_REFUSALS[found.group(1)](str(exc))


class RedisLedger:
    """Typed wrappers around the ledger's Lua scripts (EVALSHA, reloaded on NOSCRIPT), on one
    shard of the ledger (`shard` of `shards`; the only one by default)."""

    def __init__(self, client: aioredis.Redis, *, prefix: str, shard: int = 0, shards: int | Shards = 1, tenant_label: str = "team") -> None:
        self.client = client
        # (a Shards of `prefix`, with the pinned roots, from ShardedLedger; or their count)
        self.shards = shards if isinstance(shards, Shards) else Shards(prefix, shards)
        self.shard = shard
        self.tenant_label = tenant_label  # whose value is a run's root (budgetgate.core.shards)
        self.tag = self.shards.tag(shard)
        self.keys = HoldKeys(self.tag)
        self._scripts = {name: _Script(client.register_script(_script(name, step=self.shards.step))) for name in _SCRIPTS}

    def owns_root(self, root: str) -> bool:
        """Whether the keys of `root` (a tenant, placed by its pinned root; "" for what no tenant
        owns) live on this shard."""
        return self.shards.count == 1 or self.shards.of_root(root) == self.shard

    def owns_key(self, ledger_key: str) -> bool:
        """Whether a ledger key lives on this shard (its root's, budgetgate.core.shards.key_root)."""
        return self.shards.count == 1 or self.shards.of_root(key_root(ledger_key, self.tenant_label)) == self.shard

    @property
    def marker(self) -> str:
        return f"{self.tag}:loaded"

    def ledger(self, ledger_key: str) -> str:
        return f"{self.tag}:l:{ledger_key}"

    def run(self, run_id: str) -> str:
        return f"{self.tag}:r:{run_id}"

    @property
    def sequence(self) -> str:
        """The ledger generation: advanced by every reservation, recorded by Postgres with it."""
        return f"{self.tag}:seq"

    async def reserve(
        self,
        *,
        run_id: str,
        decision_id: str,
        charges: Sequence[ChargeRequest],
        now_ms: int,
        counters: Sequence[CounterRequest] = (),
        pool: PoolRequest | None = None,
        committed_seq: int = 0,
    ) -> ReserveResult:
        """Reserve every charge, counter and pool token, or none; raises LedgerNotLoaded when
        Redis lost the ledger (or is behind `committed_seq`, see reserve_batch)."""
        [result] = await self.reserve_batch(
            [Reservation(run_id, decision_id, tuple(charges), tuple(counters), pool)], now_ms=now_ms, committed_seq=committed_seq
        )
        return result

    async def reserve_batch(self, batch: Sequence[Reservation], *, now_ms: int, committed_seq: int) -> list[ReserveResult]:
        """Check-and-reserve each of `batch` in order, all or none per reservation, in one
        script. `committed_seq` is the highest ledger sequence Postgres committed: a Redis
        behind it is not current, invalidates itself and raises LedgerNotLoaded (as an empty one)."""
        return await self._reserve_script(batch, now_ms=now_ms, committed_seq=committed_seq, mode="reserve")

    async def check(self, asked: Reservation, *, now_ms: int, committed_seq: int) -> ReserveResult:
        """What reserving `asked` would find, by the same script and checks, holding nothing: FITS
        or REJECTED with the readings (a quote). A ledger key Redis never loaded reads as empty
        and is listed in `unloaded`, for the caller to confirm against Postgres."""
        [result] = await self._reserve_script([asked], now_ms=now_ms, committed_seq=committed_seq, mode="check")
        return result

    async def _reserve_script(self, batch: Sequence[Reservation], *, now_ms: int, committed_seq: int, mode: str) -> list[ReserveResult]:
        keys: list[str] = [self.marker, self.sequence]
        args: list[object] = [committed_seq, now_ms, len(batch), mode]
        for r in batch:
            levels = r.pool.levels if r.pool else ()
            keys += [self.run(r.run_id), self.keys.holds(r.run_id), *(self.ledger(c.ledger_key) for c in r.charges)]
            keys += [self.keys.counter(c.name) for c in r.counters]
            keys += [key for level in levels for key in self.keys.pool(level.namespace)]
            if r.refused and r.pool is not None:
                raise ValueError(f"run {r.run_id!r}: a reservation refused elsewhere asks for no pool token here")
            args += [r.decision_id, len(r.charges), len(r.counters), -1 if r.refused else len(levels)]
            for c in r.charges:
                args += [c.amount, c.limit, "L" if c.lease else 1 if c.hard else 0]
            args += counter_args(r.counters) + pool_args(r.pool)
        reply = await self._scripts["reserve"](keys=keys, args=args)
        if not isinstance(reply, list):
            raise LedgerNotLoaded("the Redis ledger is not loaded, or is behind what Postgres committed")
        return [_reserve_result(r, item) for r, item in zip(batch, reply[1:], strict=True)]

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

    async def rehold(self, run_id: str, counters: Mapping[str, tuple[int, int, int]]) -> int:
        """Count a running run on its quota counters again (name → gpus, nodes, allocations),
        whatever their caps (rehold.lua): the ledger sequence that advanced Redis to, for the
        caller's transaction to record, or 0 when its holds are there already."""
        names = sorted(counters)
        args = [v for name in names for v in counters[name]]
        keys = [self.marker, self.keys.holds(run_id), self.sequence, *(self.keys.counter(n) for n in names)]
        reply = await self._scripts["rehold"](keys=keys, args=args)
        if isinstance(reply, list):
            raise LedgerNotLoaded("the Redis ledger is not loaded")
        return int(reply)

    async def allocate(self, pool: PoolRequest, *, now_ms: int, committed_seq: int = 0) -> tuple[str, tuple[PoolReading, ...], int]:
        """Allocate `pool.token` on every level or none: GRANTED, RENEWED, EXHAUSTED or CAP, the
        readings, and the ledger sequence a grant advanced Redis to (0 when refused), for the
        caller's transaction to record. Raises LedgerNotLoaded when Redis lost the ledger or is
        behind `committed_seq` (see reserve_batch)."""
        keys = [self.marker, *(key for level in pool.levels for key in self.keys.pool(level.namespace)), self.sequence]
        args = pool_args(pool)
        reply = await self._scripts["allocate"](keys=keys, args=[args[0], args[1], args[2], now_ms, args[3], *args[4:], committed_seq])
        status = _text(reply[0])
        if status == "NOT_LOADED":
            raise LedgerNotLoaded("the Redis ledger is not loaded")
        if status in ("GRANTED", "RENEWED"):
            return status, pool_readings(reply[1:-1]), int(reply[-1])
        return status, pool_readings(reply[1:]), 0

    async def deallocate(self, namespaces: Sequence[str], token: str) -> int:
        """Release `token` from every given pool level; returns the levels it was held on."""
        keys = [self.marker, *(key for ns in namespaces for key in self.keys.pool(ns))]
        reply = await self._scripts["deallocate"](keys=keys, args=[token])
        if isinstance(reply, list):
            raise LedgerNotLoaded("the Redis ledger is not loaded")
        return int(reply)

    async def renew(self, renewals: Sequence[LeaseRenewal], *, now_ms: int) -> tuple[list[bool], int]:
        """Extend the leases of held tokens, each on all its levels or none, in one script; per
        renewal, whether its token was held (one whose lease ran out by `now_ms` is not: it runs
        out, see renew.lua), and the ledger sequence the renewals advanced Redis to (0 when none
        was held), for the caller's transaction to record."""
        keys: list[str] = [self.marker]
        args: list[object] = [now_ms, len(renewals)]
        for r in renewals:
            keys += [key for namespace in r.levels for key in self.keys.pool(namespace)]
            args += [r.token, r.expiry_ms, len(r.levels)]
        keys.append(self.sequence)
        reply = await self._scripts["renew"](keys=keys, args=args)
        if reply and _text(reply[0]) == "NOT_LOADED":
            raise LedgerNotLoaded("the Redis ledger is not loaded")
        return [int(v) == 1 for v in reply[:-1]], int(reply[-1])

    async def load_key(self, ledger_key: str, *, reserved: int, consumed: int, size: int | None = None) -> bool:
        """Load a ledger key from Postgres's figures (an escrow lease's with its `size`) unless
        present; True when loaded now."""
        args = [reserved, consumed] if size is None else [reserved, consumed, size]
        reply = await self._scripts["load_key"](keys=[self.marker, self.ledger(ledger_key)], args=args)
        if isinstance(reply, list):
            raise LedgerNotLoaded("the Redis ledger is not loaded")
        return bool(reply)

    async def move_lease(
        self, lease_key: str, *, size: int, how: Literal["grow", "shrink", "void"], amount: int, committed_seq: int, counted_in: str | None = None
    ) -> tuple[int, int]:
        """Grow or shrink an escrow lease whose size Postgres holds as `size` (lease.lua): what it
        moved (a shrink takes at most what its root does not hold) and the ledger sequence a
        shrink advanced Redis to (0 for a grow), for the caller's transaction to record. A lease
        of a counter (the sensitive pool's) is named by its counter, its use and its size counted
        `counted_in` gpus or nodes; `void` empties one sized in any unit (`size` is then its size
        whatever its unit). Raises LedgerNotLoaded (also when Redis is behind `committed_seq`, or
        its size is not Postgres's: both call for a rebuild) or LedgerKeyMissing."""
        if how == "void" and counted_in is None:
            raise ValueError("only a lease of a counter is sized in a unit, and voided when its pool's unit changes")
        key = self.ledger(lease_key) if counted_in is None else self.keys.counter(lease_key)
        args: list[object] = [committed_seq, size, how, amount]
        reply = await self._scripts["lease"](keys=[self.marker, self.sequence, key], args=args if counted_in is None else [*args, counted_in])
        status = _text(reply[0])
        if status == "NOT_LOADED":
            raise LedgerNotLoaded("the Redis ledger is not loaded, or is behind what Postgres committed")
        if status == "MISSING":
            raise LedgerKeyMissing(lease_key)
        if status == "STALE":
            await self.invalidate(f"escrow lease {lease_key!r} has size {int(reply[1])} in Redis and {size} in Postgres")
            raise LedgerNotLoaded(f"lease {lease_key!r} has size {int(reply[1])} in Redis and {size} in Postgres")
        return int(reply[1]), int(reply[2])

    async def sizes(self, lease_keys: Iterable[str]) -> dict[str, int]:
        """The size of each present escrow lease (a key with no size reads 0)."""
        keys = list(lease_keys)
        pipe = self.client.pipeline(transaction=False)
        for key in keys:
            pipe.hmget(self.ledger(key), "reserved", "size")
        return {key: int(size or 0) for key, (reserved, size) in zip(keys, await pipe.execute(), strict=True) if reserved is not None}

    def pending(self, run_id: str) -> str:
        return f"{self.tag}:p:{run_id}"

    async def settle_begin(self, *, run_id: str, decision_id: str, seq: int, token: str, changes: Sequence[KeyChange], drop_run: bool, now_ms: int) -> int:
        """First half of a run's settlement, before its Postgres commit: the increases only, the
        rest parked under `seq` and `token` (this settlement's alone) for `settle_end` (see
        settle_begin.lua). Returns the ledger sequence the increases advanced Redis to, for the
        settlement's transaction to record (`record_ledger_mark`), or 0 when there were none.
        Raises LedgerNotLoaded, LedgerKeyMissing, AmountOutOfRange or SettlementPending; then
        nothing changed."""
        keys = [self.marker, self.run(run_id), self.pending(run_id), self.parked, self.sequence, *(self.ledger(c.ledger_key) for c in changes)]
        args: list[object] = [decision_id, now_ms, 1 if drop_run else 0, seq]
        for c in changes:
            args += [c.reserved, c.consumed, "" if c.held is None else c.held]
        args.append(token)
        reply = await self._scripts["settle_begin"](keys=keys, args=[str(a) for a in args])
        if isinstance(reply, list) and _text(reply[0]) == "PENDING":
            raise SettlementPending(run_id, int(_text(reply[1])))
        self._check(reply, [c.ledger_key for c in changes])
        return int(reply)

    async def settle_end(self, run_id: str, *, seq: int, committed: bool, token: str = "") -> bool:
        """Second half: apply the rest of settlement `seq` once Postgres committed it, or take its
        increases back if Postgres did not. False when it had ended already (or Redis was rebuilt).
        With `token`, only the settlement parked with it is ended; without, whichever is parked
        under `seq` (for a caller holding the run's lock)."""
        for _ in range(5):
            keys = await self.client.hget(self.pending(run_id), "keys")
            if keys is None:
                return False
            ledger_keys = json.loads(_text(keys))
            reply = await self._scripts["settle_end"](
                keys=[self.marker, self.run(run_id), self.pending(run_id), self.parked, *ledger_keys], args=[str(seq), "commit" if committed else "undo", token]
            )
            if isinstance(reply, list):
                if _text(reply[0]) == "NOT_LOADED":
                    return False  # the rebuild that follows reads Postgres, which has it right
                continue  # STALE: another settlement was parked in between; read again
            return _text(reply) == "OK"
        raise RuntimeError(f"the pending settlement of run {run_id!r} kept changing")

    @property
    def parked(self) -> str:
        """The set of pending keys of parked settlements (no SCAN of the keyspace to find them)."""
        return f"{self.tag}:parked"

    async def pending_settlements(self) -> dict[str, tuple[int, int]]:
        """Every parked settlement: run id → (sequence number, parked at ms)."""
        prefix = f"{self.tag}:p:"
        keys = sorted(_text(k) for k in await self.client.smembers(self.parked))
        pipe = self.client.pipeline(transaction=False)
        for key in keys:
            pipe.hmget(key, "seq", "at")
        result = {}
        for key, (seq, at) in zip(keys, await pipe.execute(), strict=True):
            if seq is not None:
                result[key[len(prefix) :]] = (int(seq), int(at or 0))
        return result

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
                raise LedgerKeyMissing(*(ledger_keys[int(_text(index)) - 1] for index in reply[1:]))
            if status == "OUT_OF_RANGE":
                raise AmountOutOfRange(f"a figure of ledger key {ledger_keys[int(_text(reply[1])) - 1]!r} would leave the ledger's range")
            raise RuntimeError(f"unexpected answer from the ledger: {reply!r}")

    async def run_holds(self) -> dict[str, dict[str, int]]:
        """What every run key holds on ledger keys: run id → {ledger key: amount} (runs holding
        only other things, such as quota counters, are left out)."""
        prefix, ledger_prefix = f"{self.tag}:r:", f"{self.tag}:l:"
        result = {}
        async for key in self.client.scan_iter(match=f"{self.tag}:r:*", count=1000):
            fields = await self.client.hgetall(key)
            holds = {_text(k)[len(ledger_prefix) :]: int(v) for k, v in fields.items() if _text(k).startswith(ledger_prefix)}
            if holds:
                result[_text(key)[len(prefix) :]] = holds
        return result

    async def holds_of(self, run_ids: Sequence[str]) -> dict[str, dict[str, int]]:
        """What each given run key holds on ledger keys (one pipelined round trip)."""
        ledger_prefix = f"{self.tag}:l:"
        pipe = self.client.pipeline(transaction=False)
        for run_id in run_ids:
            pipe.hgetall(self.run(run_id))
        return {
            run_id: {_text(k)[len(ledger_prefix) :]: int(v) for k, v in fields.items() if _text(k).startswith(ledger_prefix)}
            for run_id, fields in zip(run_ids, await pipe.execute(), strict=True)
        }

    async def parked_scope(self) -> tuple[set[str], set[str]]:
        """The runs and ledger keys of settlements parked between their halves (in flight)."""
        runs = set(await self.pending_settlements())
        pipe = self.client.pipeline(transaction=False)
        for run_id in runs:
            pipe.hget(self.pending(run_id), "keys")
        prefix = f"{self.tag}:l:"
        keys = {k[len(prefix) :] for found in await pipe.execute() if found for k in json.loads(_text(found))}
        return runs, keys

    async def all_readings(self) -> dict[str, tuple[int, int]]:
        """(reserved, consumed) of every ledger key Redis holds."""
        prefix = f"{self.tag}:l:"
        keys = [_text(k)[len(prefix) :] async for k in self.client.scan_iter(match=f"{self.tag}:l:*", count=1000)]
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
        """Every run holding a reservation: run id → (decision id, reserved-at ms).

        A key that is gone by the time it is read (released, settled, or a rebuild under way
        between SCAN and HMGET) is left out: it names no decision, and a hold nobody can name
        must never be taken for an orphan."""
        prefix = f"{self.tag}:r:"
        result = {}
        async for key in self.client.scan_iter(match=f"{self.tag}:r:*", count=1000):
            decision, at = await self.client.hmget(key, "_decision", "_at")
            if decision:
                result[_text(key)[len(prefix) :]] = (_text(decision), int(at or 0))
        return result


def _reserve_result(asked: Reservation, reply: list[Any]) -> ReserveResult:
    status = _text(reply[0])
    if status == "MISSING":
        return ReserveResult(status, missing=int(_text(reply[1])) - 1)
    if status == "DUPLICATE":
        return ReserveResult(status, holder=_text(reply[1]))
    n, m = 2 * len(asked.charges), 3 * len(asked.counters)
    ledger = [int(v) for v in reply[1 : 1 + n]]
    sizes: tuple[int | None, ...] = ()
    if leases := sum(1 for c in asked.charges if c.lease):  # escrow leases' sizes follow the pairs
        found = iter(int(v) for v in reply[1 + n : 1 + n + leases])
        sizes = tuple(next(found) if c.lease else None for c in asked.charges)
        reply = [reply[0], *reply[1 : 1 + n], *reply[1 + n + leases :]]
    counter_sizes: tuple[int | None, ...] = ()
    if leased := sum(1 for c in asked.counters if c.lease):  # a lease's size follows its three
        values, found_sizes, at = [], [], 1 + n
        for c in asked.counters:
            values += reply[at : at + 3]
            found_sizes.append(int(reply[at + 3]) if c.lease else None)
            at += 4 if c.lease else 3
        counter_sizes = tuple(found_sizes)
        reply = [reply[0], *reply[1 : 1 + n], *values, *reply[1 + n + m + leased :]]
    held = [int(v) for v in reply[1 + n : 1 + n + m]]
    levels = len(asked.pool.levels) if asked.pool else 0
    pools = reply[1 + n + m : 1 + n + m + 4 * levels]
    rest = reply[1 + n + m + 4 * levels :]
    return ReserveResult(
        status,
        readings=tuple(zip(ledger[::2], ledger[1::2], strict=True)),
        counters=tuple(zip(held[::3], held[1::3], held[2::3], strict=True)),
        pools=pool_readings(pools),
        seq=int(reply[-1]) if status == "RESERVED" else None,
        unloaded=tuple(int(i) - 1 for i in rest) if status in ("FITS", "REJECTED") and rest else (),
        sizes=sizes,
        counter_sizes=counter_sizes,
    )


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
