"""Concurrency holds in Postgres (the truth) and their copy in Redis: tenant and sensitive
counters, run holds, and pool allocations."""

from __future__ import annotations

import contextlib
import json
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import asyncpg

from budgetgate.ledger.holds import SENSITIVE, HoldKeys, sensitive_lease, tenant_counter
from budgetgate.ledger.queries import sql
from budgetgate.ledger.redis_ledger import LeaseRenewal, LedgerNotLoaded, RedisLedger
from budgetgate.ledger.transaction import record_ledger_mark


@dataclass
class ConcurrencyState:
    counters: dict[str, list[int]] = field(default_factory=lambda: defaultdict(lambda: [0, 0, 0]))
    holds: dict[str, dict[str, str]] = field(default_factory=lambda: defaultdict(dict))  # run → {key: value}
    pools: list[dict[str, Any]] = field(default_factory=list)
    sizes: dict[str, tuple[int, str]] = field(default_factory=dict)  # a lease counter's size and its unit ('' for none) (the sensitive pool's, carved)


def counter_names(hold: Mapping[str, Any], *, leased: bool = False) -> list[str]:
    """The counters a run hold (a run_holds row) counts on: its tenant's, and the sensitive
    pool's, or, on a ledger of several shards (`leased`), its tenant's lease of that pool."""
    tenant = hold["tenant"]
    sensitive = [] if not hold["sensitive"] else [sensitive_lease(tenant) if leased and tenant else SENSITIVE]
    return ([tenant_counter(tenant)] if tenant else []) + sensitive


async def concurrency_state(conn: asyncpg.Connection, ledger: RedisLedger, *, now: datetime) -> ConcurrencyState:
    """What Postgres says runs and pool users hold right now, on `ledger`'s shard: a run's holds
    and its tenant's counter on its tenant's, with its tenant's lease of the sensitive pool on a
    ledger of several shards (the lease's size from counter_leases, migration 0045); what no
    tenant owns (pools, and the sensitive counter on a ledger of one shard, or for a run of no
    tenant) on the shard of the empty root."""
    state, keys = ConcurrencyState(), ledger.keys
    shared, leased = ledger.owns_root(""), ledger.shards.count > 1
    for row in await conn.fetch(sql("counter_lease_sizes")) if leased else ():
        if ledger.owns_root(row["root"]):
            state.sizes[sensitive_lease(row["root"])] = (row["size"], row["unit"] or "")
            state.counters[sensitive_lease(row["root"])]  # (a lease no run holds on yet is written too)
    for row in await conn.fetch(sql("held_concurrency")):
        if not ledger.owns_root(row["tenant"] or ""):
            continue
        for name in counter_names(row, leased=leased):
            if name == SENSITIVE and not shared:
                continue
            counter = state.counters[name]
            counter[0] += row["gpus"]
            counter[1] += row["nodes"]
            counter[2] += 1
            state.holds[row["run_id"]][keys.counter(name)] = f"{row['gpus']},{row['nodes']},1"
    for row in await conn.fetch(sql("held_pool_allocations"), now) if shared else ():
        state.pools.append(dict(row))
        # A run's token is listed by its holds key on one shard; on several, its holds key is on
        # its tenant's shard and the token on this one (taken apart: Admitter._take_tokens).
        if row["run_id"] and not leased:
            for namespace in row["levels"]:
                state.holds[row["run_id"]][keys.pool(namespace)[0]] = row["token"]
    return state


def write_concurrency(pipe: Any, keys: HoldKeys, state: ConcurrencyState) -> None:
    """Queue the Redis writes that recreate `state` (into a pipeline of a rebuild)."""
    for name, (gpus, nodes, allocations) in state.counters.items():
        size, unit = state.sizes.get(name, (None, ""))
        sized = {} if size is None else {"size": size, "unit": unit} if unit else {"size": size}
        pipe.hset(keys.counter(name), mapping={"gpus": gpus, "nodes": nodes, "allocations": allocations, **sized})
    for run_id, held in state.holds.items():
        pipe.hset(keys.holds(run_id), mapping=held)
    for allocation in state.pools:
        expiry = int(allocation["lease_expires_at"].timestamp() * 1000)
        owner = f"{allocation['project']}\t{allocation['sub_namespace']}"
        for namespace in allocation["levels"]:
            leases, owners, projects, subns = keys.pool(namespace)
            pipe.zadd(leases, {allocation["token"]: expiry})
            pipe.hset(owners, allocation["token"], owner)
            if allocation["project"]:
                pipe.hincrby(projects, allocation["project"], 1)
            if allocation["sub_namespace"]:
                pipe.hincrby(subns, allocation["sub_namespace"], 1)


@dataclass(frozen=True)
class EndedHolds:
    """What a run gave back: the holds Postgres ended now (with the tenant and whether they
    counted against the sensitive pool), how many holds Redis released, and how many levels of
    pool tokens the pools' shard released (a ledger of several shards: `pools`)."""

    ended: bool
    tenant: str | None
    sensitive: bool
    redis_released: int
    tokens_released: int = 0


async def end_run_holds(conn: asyncpg.Connection, ledger: RedisLedger, run_id: str, *, pools: RedisLedger | None = None) -> EndedHolds:
    """A run ended: give back its concurrency holds, in Postgres (within the caller's
    transaction, which holds the ledger lock shared) and in Redis. `pools`: on a ledger of
    several shards, the pools' shard (LedgerTransaction.pools; its lock held shared too), where
    the run's pool token is given back apart from its holds, Postgres first."""
    row = await conn.fetchrow(sql("end_run_holds"), run_id)
    # Redis lost the ledger (LedgerNotLoaded): the caller holds the ledger lock shared, so the
    # rebuild that must come first runs after this commit and takes its counts from these rows.
    released = tokens_released = 0
    with contextlib.suppress(LedgerNotLoaded):
        released = await ledger.release_holds(run_id)
    if pools is not None:
        with contextlib.suppress(LedgerNotLoaded):
            for token, levels in json.loads(row["tokens"]):
                tokens_released += await pools.deallocate(levels, token)
    return EndedHolds(row["ended"], row["tenant"], row["sensitive"], released, tokens_released)


async def renew_run_token(
    conn: asyncpg.Connection, ledger: RedisLedger, *, run_id: str, alive_at: datetime, now: datetime, pool_leases: Mapping[str, int],
    pools: RedisLedger | None = None,
) -> bool:  # fmt: skip
    """Run `run_id` showed at `alive_at` that it is alive: the lease of its pool token is renewed
    to `alive_at` + the lease length it was granted with (`pool_leases`: each pool's default, for
    a token granted before that length was kept), in Postgres (within the caller's transaction,
    which holds the ledger lock shared) and in Redis: on `pools`, the pools' shard of a ledger
    of several shards (see end_run_holds). A lease that ran out by `now` is not: its place may be another
    holder's. True when renewed."""
    ledger = pools or ledger
    row = await conn.fetchrow(sql("renew_run_token"), run_id, alive_at, now, json.dumps(dict(pool_leases)))
    if row is None:
        return False
    # Redis after Postgres, before the commit: until then Redis holds the token longer than
    # Postgres says, never shorter. A caller whose transaction may still fail after this counts
    # Redis as changed (see transaction.py).
    [held], seq = await ledger.renew([LeaseRenewal(row["token"], tuple(row["levels"]), _ms(row["expires"]))], now_ms=_ms(now))
    await record_ledger_mark(conn, ledger, seq)
    if not held:
        await conn.execute(sql("restore_run_token_lease"), row["namespace"], row["token"], row["before"])
    return held


def _ms(at: datetime) -> int:
    return round(at.timestamp() * 1000)


async def rehold_run(conn: asyncpg.Connection, ledger: RedisLedger, run_id: str, decision_id: str) -> bool:
    """A run released at its start deadline is running after all (a late start, or readmitted
    after a long eviction): its quota holds count again, in Postgres (within the caller's
    transaction, which holds the ledger lock shared) and in Redis, whatever the caps, since it
    runs whether or not they have room. True when Redis counts it now."""
    row = await conn.fetchrow(sql("reopen_run_holds"), run_id, decision_id)
    if row is None:
        return False
    names = counter_names(row, leased=ledger.shards.count > 1)
    if not names:
        return False
    try:
        seq = await ledger.rehold(run_id, {name: (row["gpus"], row["nodes"], 1) for name in names})
    except LedgerNotLoaded:
        # As in end_run_holds: the rebuild that must come first runs after this commit and
        # counts the hold from its row.
        return False
    await record_ledger_mark(conn, ledger, seq)
    return bool(seq)
