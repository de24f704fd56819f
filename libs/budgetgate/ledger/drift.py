"""The drift check, incremental: Redis (one shard of it, each shard checked alone) is compared
with Postgres a page of ledger keys (and of runs) at a time, one query and one Redis pipeline per page, without any ledger lock. Only a page
that differs is confirmed under the exclusive ledger lock, for that page's differing entries
alone, so admission is never held for longer than one page.

A difference seen without the lock may be a change in flight: a reservation or settlement in
Redis whose transaction has not committed yet (the lock waits for those), or a settlement parked
between its two halves after its commit (settle_begin.lua; ended by the reconciler, so left out).
A confirmed difference, on a ledger key or on what a run holds, is repaired by rebuilding Redis
from Postgres (rare: it takes a crash or a lost reply). Not in place with Postgres's figures: a
key's figure in Redis also counts holds only Redis knows (a decision that never committed), and
the orphan sweeper gives those back later; a key set to Postgres's figure would give them back
twice. A rebuild drops those holds along with the key's figure.

Escrow leases' sizes (budgetgate.ledger.escrow_leases) are compared whole too, as few as
budgets shared by roots times their roots: a lease whose grant Redis lost is smaller there than
Postgres granted, which refuses more than it must until a rebuild.

Quota counters and pool tokens are compared too, whole (there are as many as tenants and pool
tokens, not as runs): Postgres's figures derived as a rebuild derives them (ledger.concurrency),
Redis's found by one SCAN of their key prefixes, since a counter or pool Postgres no longer knows
may still hold something in Redis. A Redis that loses its ledger while being compared (its keys
then read as never loaded) is found by asking again at the end: the check reports it not loaded.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TypeVar

import asyncpg

from budgetgate.ledger.concurrency_holds import concurrency_state
from budgetgate.ledger.queries import sql
from budgetgate.ledger.redis_ledger import RedisLedger

log = logging.getLogger(__name__)

PAGE = 500
Figures = tuple[int, int]
Counter = tuple[int, int, int, int, str]  # gpus, nodes, allocations held; size and its unit (a lease of the sensitive pool's, else 0, '')
NO_COUNTER: Counter = (0, 0, 0, 0, "")
Tokens = dict[str, tuple[int, str]]  # live token → (lease expiry ms, "project<TAB>sub-namespace")
Rebuild = Callable[[asyncpg.Connection], Awaitable[None]]
T = TypeVar("T")


@dataclass(frozen=True)
class Drift:
    """Where Redis differs from Postgres: ledger key → ((reserved, consumed) in Redis, in
    Postgres), run id → (what its Redis run key holds, what Postgres holds for it), quota counter
    → ((gpus, nodes, allocations) in Redis, in Postgres), pool → (its live tokens in Redis, in
    Postgres), and escrow lease → (its size in Redis, in Postgres)."""

    keys: dict[str, tuple[Figures, Figures]] = field(default_factory=dict)
    runs: dict[str, tuple[dict[str, int], dict[str, int]]] = field(default_factory=dict)
    counters: dict[str, tuple[Counter, Counter]] = field(default_factory=dict)
    pools: dict[str, tuple[Tokens, Tokens]] = field(default_factory=dict)
    repaired: bool = False
    sizes: dict[str, tuple[int, int]] = field(default_factory=dict)

    @property
    def clean(self) -> bool:
        return not self.keys and not self.runs and not self.counters and not self.pools and not self.sizes


async def check(pool: asyncpg.Pool, redis: RedisLedger, *, repair: bool, rebuild: Rebuild, page: int = PAGE) -> Drift | None:
    """Compare Redis with Postgres page by page; None when Redis is not loaded (at the start or
    by the end: a ledger lost meanwhile reads as keys never loaded, which is no proof of a match)."""
    if not await redis.is_loaded():
        return None
    keys: dict[str, tuple[Figures, Figures]] = {}
    runs: dict[str, tuple[dict[str, int], dict[str, int]]] = {}
    repaired = False
    async with pool.acquire() as conn:
        after = ""
        while rows := await conn.fetch(sql("ledger_figures_page"), after, page):
            after = rows[-1]["ledger_key"]
            if not (rows := [r for r in rows if redis.owns_key(r["ledger_key"])]):
                continue  # another shard's keys
            if _key_drift(_figures(rows), await redis.readings(r["ledger_key"] for r in rows)):
                found = await _confirm_keys(conn, redis, [r["ledger_key"] for r in rows], repair=repair, rebuild=rebuild)
                if found is None:
                    return None
                keys.update(found)
                repaired = repaired or (repair and bool(found))
        # Runs Postgres holds reservations for. Holds only Redis knows (a decision that never
        # committed) are the orphan sweeper's (LedgerSync.sweep_orphans), not scanned for here:
        # a scan walks the whole keyspace, and the check must cost what the ledger holds.
        after = ""
        while held := await conn.fetch(sql("held_runs_page"), after, page):
            after = held[-1]["run_id"]
            if ids := [r["run_id"] for r in held if redis.owns_key(r["ledger_key"])]:  # (this shard's runs)
                runs.update(await _run_page(conn, redis, ids, repair=repair, rebuild=rebuild))
        sizes = await _lease_sizes(conn, redis, repair=repair, rebuild=rebuild)
        found = await _concurrency(conn, redis, repair=repair, rebuild=rebuild)
        if sizes is None or found is None or not await redis.is_loaded():
            return None
    counters, pools = found
    return Drift(keys, runs, counters, pools, repaired=repaired or (repair and bool(runs or counters or pools or sizes)), sizes=sizes)


def _figures(rows: list[asyncpg.Record]) -> dict[str, Figures]:
    return {r["ledger_key"]: (r["reserved"], r["consumed"]) for r in rows}


def _key_drift(postgres: dict[str, Figures], in_redis: dict[str, Figures]) -> dict[str, tuple[Figures, Figures]]:
    # A key Redis never loaded gets Postgres's figures when first used: not drift.
    return {k: (in_redis[k], pg) for k, pg in postgres.items() if k in in_redis and in_redis[k] != pg}


async def _confirm_keys(
    conn: asyncpg.Connection, redis: RedisLedger, page: list[str], *, repair: bool, rebuild: Rebuild
) -> dict[str, tuple[Figures, Figures]] | None:
    """Under the exclusive ledger lock (nothing in flight), the page's keys that still differ,
    parked settlements left out; repaired (Redis rebuilt, see the module docstring) when asked.
    None when Redis was invalidated meanwhile."""
    async with conn.transaction():
        await conn.execute(sql("lock_ledger_exclusive"), redis.shard)
        if not await redis.is_loaded():
            return None
        _runs, parked = await redis.parked_scope()
        candidates = [k for k in page if k not in parked]
        confirmed = _key_drift(_figures(await conn.fetch(sql("ledger_figures_of"), candidates)), await redis.readings(candidates))
        if confirmed and repair:
            log.warning("Redis drifted from Postgres on %d ledger key(s); rebuilding it", len(confirmed))
            await rebuild(conn)
        return confirmed


async def _run_page(
    conn: asyncpg.Connection, redis: RedisLedger, run_ids: list[str], *, repair: bool, rebuild: Rebuild
) -> dict[str, tuple[dict[str, int], dict[str, int]]]:
    drifted = await _run_drift(conn, redis, run_ids)
    if not drifted:
        return {}
    async with conn.transaction():
        await conn.execute(sql("lock_ledger_exclusive"), redis.shard)
        if not await redis.is_loaded():
            return {}
        confirmed = await _run_drift(conn, redis, list(drifted))
        if confirmed and repair:
            log.warning("Redis drifted from Postgres on what %d run(s) hold; rebuilding it", len(confirmed))
            await rebuild(conn)
        return confirmed


async def _run_drift(conn: asyncpg.Connection, redis: RedisLedger, run_ids: list[str]) -> dict[str, tuple[dict[str, int], dict[str, int]]]:
    parked, _keys = await redis.parked_scope()
    held: dict[str, dict[str, int]] = {r: {} for r in run_ids}
    for row in await conn.fetch(sql("held_of_runs"), run_ids):
        if redis.owns_key(row["ledger_key"]):  # (a run's keys are on its tenant's shard)
            held[row["run_id"]][row["ledger_key"]] = row["amount"]
    in_redis = await redis.holds_of(run_ids)
    return {r: (in_redis[r], held[r]) for r in run_ids if r not in parked and in_redis[r] != held[r]}


async def _confirmed(
    conn: asyncpg.Connection, redis: RedisLedger, find: Callable[[], Awaitable[T]], *, none: T, repair: bool, rebuild: Rebuild, what: Callable[[T], str]
) -> T | None:
    """What `find` reports, when it reports anything (`none`: nothing differs), confirmed by
    finding it again under the exclusive ledger lock (every change to Redis holds it shared until
    its commit, so nothing is in flight), and repaired when asked (Redis rebuilt); None when Redis
    was invalidated meanwhile."""
    if await find() == none:
        return none
    async with conn.transaction():
        await conn.execute(sql("lock_ledger_exclusive"), redis.shard)
        if not await redis.is_loaded():
            return None
        confirmed = await find()
        if confirmed != none and repair:
            log.warning("Redis drifted from Postgres on %s; rebuilding it", what(confirmed))
            await rebuild(conn)
        return confirmed


async def _lease_sizes(conn: asyncpg.Connection, redis: RedisLedger, *, repair: bool, rebuild: Rebuild) -> dict[str, tuple[int, int]] | None:
    """Escrow leases whose size differs (_confirmed). A lease Redis never loaded gets Postgres's
    size when first used: not drift. (The sensitive pool's leases, counters, are compared with
    the quota counters: _concurrency_drift.)"""

    async def differing() -> dict[str, tuple[int, int]]:
        postgres = {r["lease_key"]: r["size"] for r in await conn.fetch(sql("escrow_sizes")) if redis.owns_key(r["lease_key"])}
        in_redis = await redis.sizes(postgres)
        return {key: (in_redis[key], size) for key, size in postgres.items() if key in in_redis and in_redis[key] != size}

    return await _confirmed(conn, redis, differing, none={}, repair=repair, rebuild=rebuild, what=lambda found: f"the size of {len(found)} escrow lease(s)")


ConcurrencyDrift = tuple[dict[str, tuple[Counter, Counter]], dict[str, tuple[Tokens, Tokens]]]


async def _concurrency(conn: asyncpg.Connection, redis: RedisLedger, *, repair: bool, rebuild: Rebuild) -> ConcurrencyDrift | None:
    """Quota counters and pool tokens that differ (_confirmed: every grant, renewal and release
    holds the ledger lock shared until its commit)."""
    return await _confirmed(
        conn, redis, lambda: _concurrency_drift(conn, redis), none=({}, {}), repair=repair, rebuild=rebuild,
        what=lambda found: f"{len(found[0])} quota counter(s) and {len(found[1])} pool(s)",
    )  # fmt: skip


async def _concurrency_drift(conn: asyncpg.Connection, redis: RedisLedger) -> ConcurrencyDrift:
    now = datetime.now(UTC)
    now_ms = int(now.timestamp() * 1000)
    state = await concurrency_state(conn, redis, now=now)
    pg_counters: dict[str, Counter] = {
        name: (gpus, nodes, allocations, *state.sizes.get(name, (0, ""))) for name, (gpus, nodes, allocations) in state.counters.items()
    }
    pg_pools: dict[str, Tokens] = {}
    for allocation in state.pools:
        lease = (round(allocation["lease_expires_at"].timestamp() * 1000), f"{allocation['project']}\t{allocation['sub_namespace']}")
        for namespace in allocation["levels"]:
            pg_pools.setdefault(namespace, {})[allocation["token"]] = lease
    in_redis_counters, in_redis_pools = await _redis_concurrency(redis, counters=set(pg_counters), pools=set(pg_pools), now_ms=now_ms)
    # A counter at zero, or a pool without live tokens, is what Postgres having none of it means.
    counters = {
        name: (in_redis_counters.get(name, NO_COUNTER), pg_counters.get(name, NO_COUNTER)) for name in sorted(set(pg_counters) | set(in_redis_counters))
    }
    pools = {namespace: (in_redis_pools.get(namespace, {}), pg_pools.get(namespace, {})) for namespace in sorted(set(pg_pools) | set(in_redis_pools))}
    return (
        {name: pair for name, pair in counters.items() if pair[0] != pair[1]},
        {namespace: pair for namespace, pair in pools.items() if not _same_tokens(*pair)},
    )


def _same_tokens(in_redis: Tokens, in_postgres: Tokens) -> bool:
    # A lease expiry goes through a float on its way into Postgres: a millisecond either way is the same lease.
    return in_redis.keys() == in_postgres.keys() and all(in_redis[t][1] == in_postgres[t][1] and abs(in_redis[t][0] - in_postgres[t][0]) <= 1 for t in in_redis)


async def _redis_concurrency(redis: RedisLedger, *, counters: set[str], pools: set[str], now_ms: int) -> tuple[dict[str, Counter], dict[str, Tokens]]:
    """Every quota counter and every pool's live tokens in Redis: those named, and those a SCAN
    of the counter and pool key prefixes finds (one walk, both prefixes start q or p)."""
    keys = redis.keys
    counter_prefix, pool_prefix = keys.counter(""), f"{redis.tag}:pool:"
    async for raw in redis.client.scan_iter(match=f"{redis.tag}:[qp]*", count=1000):
        key = raw.decode() if isinstance(raw, bytes) else raw
        if key.startswith(counter_prefix):
            counters.add(key.removeprefix(counter_prefix))
        elif key.startswith(pool_prefix) and key.endswith(":leases"):
            pools.add(key.removeprefix(pool_prefix).removesuffix(":leases"))
    names, namespaces = sorted(counters), sorted(pools)
    pipe = redis.client.pipeline(transaction=False)
    for name in names:
        pipe.hmget(keys.counter(name), "gpus", "nodes", "allocations", "size", "unit")
    for namespace in namespaces:
        leases, owners, _projects, _subns = keys.pool(namespace)
        pipe.zrangebyscore(leases, now_ms + 1, "+inf", withscores=True)
        pipe.hgetall(owners)
    replies = await pipe.execute()
    found_counters = {
        name: (int(g or 0), int(n or 0), int(a or 0), int(s or 0), _text(u or b"")) for name, (g, n, a, s, u) in zip(names, replies[: len(names)], strict=True)
    }
    rest = replies[len(names) :]
    found_pools = {
        namespace: {_text(t): (int(expiry), _text(owners.get(t, b"\t"))) for t, expiry in live}
        for namespace, live, owners in zip(namespaces, rest[::2], rest[1::2], strict=True)
    }
    return found_counters, found_pools


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
