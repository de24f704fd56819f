"""The Redis ledger's shards as one: a RedisLedger and a LedgerSync per shard, and which shard
holds a root's, a run's or a ledger key's state (budgetgate.core.shards, docs/scale-out.md).

One shard (the default) is the ledger as it always was. With several, a decision's keys are all
on its tenant's shard, so each decision stays one script on one slot, all or none; each shard is
loaded, rebuilt, checked for drift and swept of orphans on its own, under its own ledger lock,
while the others decide on.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping

import asyncpg
import redis.asyncio as aioredis
import redis.exceptions

from budgetgate.core.shards import MAX_SHARDS, Shards, key_root, run_root
from budgetgate.ledger.redis_ledger import RedisLedger
from budgetgate.ledger.redis_sync import LedgerSync
from budgetgate.ledger.queries import sql


class ShardedLedger:
    """Every shard of the Redis ledger of one prefix."""

    def __init__(
        self,
        pool: asyncpg.Pool,
        client: aioredis.Redis,
        *,
        prefix: str,
        count: int = 1,
        tenant_label: str = "team",
        wait: float = 5.0,
        roots: Mapping[str, str] | None = None,
    ) -> None:
        self.shards = Shards(prefix, count, dict(roots or {}))
        self.tenant_label = tenant_label
        self.parts = tuple(RedisLedger(client, prefix=prefix, shard=i, shards=self.shards, tenant_label=tenant_label) for i in range(count))
        self.syncs = tuple(LedgerSync(pool, part, wait=wait) for part in self.parts)

    @classmethod
    async def open(
        cls, pool: asyncpg.Pool, client: aioredis.Redis, *, prefix: str, count: int = 1, tenant_label: str = "team", wait: float = 5.0
    ) -> ShardedLedger:
        """The ledger with the roots pinned in Postgres (`ledger_roots`), read once: they change
        only with every process stopped (`budgetgate ledger roots --apply`)."""
        return cls(pool, client, prefix=prefix, count=count, tenant_label=tenant_label, wait=wait, roots=await pinned_roots(pool))

    @classmethod
    def of(cls, pool: asyncpg.Pool, ledger: RedisLedger, *, wait: float = 5.0) -> ShardedLedger:
        """The ledger whose one shard is `ledger` (made elsewhere, e.g. by a test)."""
        made = cls.__new__(cls)
        made.shards, made.tenant_label = ledger.shards, ledger.tenant_label
        made.parts, made.syncs = (ledger,), (LedgerSync(pool, ledger, wait=wait),)
        return made

    def __iter__(self) -> Iterator[RedisLedger]:
        return iter(self.parts)

    def __len__(self) -> int:
        return len(self.parts)

    @property
    def single(self) -> RedisLedger:
        """The one shard of a ledger that has one; for what has no root to place it by."""
        if len(self.parts) > 1:
            raise RuntimeError(f"the Redis ledger has {len(self.parts)} shards: ask for a root's, a run's or a key's")
        return self.parts[0]

    def of_root(self, root: str) -> RedisLedger:
        """The shard of a tenant's keys (placed by its pinned root; "" for what no tenant owns)."""
        return self.parts[self.shards.of_root(root)] if len(self.parts) > 1 else self.parts[0]

    def of_labels(self, labels: Mapping[str, str]) -> RedisLedger:
        """The shard of a run with these labels: its tenant's."""
        return self.of_root(run_root(labels, self.tenant_label)) if len(self.parts) > 1 else self.parts[0]

    def of_key(self, ledger_key: str) -> RedisLedger:
        """The shard of a ledger key: its root's (key_root)."""
        return self.of_root(key_root(ledger_key, self.tenant_label)) if len(self.parts) > 1 else self.parts[0]

    def sync_of(self, ledger: RedisLedger) -> LedgerSync:
        """The LedgerSync of one of these shards."""
        return self.syncs[ledger.shard]

    @property
    def rebuilds(self) -> int:
        """Rebuilds this process made of every shard (drift repairs included), for /metrics."""
        return sum(sync.rebuilds for sync in self.syncs)


class OneShard:
    """`ledger` and `sync` of a holder of a ShardedLedger (`ledgers`) that has one shard: what
    places nothing by root (the tests of one shard, tools) reaches the ledger by."""

    ledgers: ShardedLedger

    @property
    def ledger(self) -> RedisLedger:
        """The Redis ledger, when it has one shard."""
        return self.ledgers.single

    @property
    def sync(self) -> LedgerSync:
        """The Redis ledger's LedgerSync, when it has one shard."""
        return self.ledgers.sync_of(self.ledgers.single)


async def pinned_roots(conn: asyncpg.Pool | asyncpg.Connection) -> dict[str, str]:
    """The roots pinned in Postgres: tenant -> the organisation whose shard holds its keys."""
    return {r["tenant"]: r["root"] for r in await conn.fetch(sql("pinned_roots"))}


async def forget_former_shards(client: aioredis.Redis, shards: Shards) -> int:
    """Delete the keys under the tags of the prefix's shards that `shards` no longer has (left in
    Redis when the number of shards changed: `{prefix}` after one, `{prefix:i}` for i past the
    count); the number deleted. One SCAN of the keyspace (every master's, on a cluster)."""
    current = {shards.tag(i) for i in range(shards.count)}
    former = {Shards(shards.prefix).tag(0), *(Shards(shards.prefix, MAX_SHARDS).tag(i) for i in range(MAX_SHARDS))} - current
    pattern = "{" + re.sub(r"([*?\[\]\\])", r"\\\1", shards.prefix) + "*"
    stale: dict[str, list[bytes | str]] = {}
    async for key in client.scan_iter(match=pattern, count=1000):
        text = key.decode() if isinstance(key, bytes) else key
        tag = text[: text.find("}") + 1]
        if tag in former:
            stale.setdefault(tag, []).append(key)
    for keys in stale.values():  # a tag's keys share a slot: deleted together, a chunk at a time
        for start in range(0, len(keys), 500):
            await client.delete(*keys[start : start + 500])
    return sum(len(keys) for keys in stale.values())


FULL_COVERAGE = "cluster-require-full-coverage"


async def whole_cluster_stops(client: aioredis.Redis, count: int) -> str | None:
    """A warning for a ledger of `count` shards on a Redis Cluster whose masters require full
    coverage (Redis's default): every node then refuses every command from the moment a lost
    master is marked failed until its replica is promoted, so one shard's failover stops every
    shard. None when the ledger has one shard, Redis is not a cluster, every master says no, or
    the setting cannot be read (a managed service may refuse CONFIG)."""
    if count <= 1 or not isinstance(client, aioredis.RedisCluster):
        return None
    await client.initialize()  # (its view of the cluster: every master, not only the one named)
    requiring = []
    for node in client.get_primaries():
        try:
            found = await client.config_get(FULL_COVERAGE, target_nodes=node)
        except redis.exceptions.ResponseError:
            return None
        if str(found.get(FULL_COVERAGE, "")).lower() == "yes":
            requiring.append(node.name)
    if not requiring:
        return None
    return (
        f"the Redis Cluster's masters {', '.join(sorted(requiring))} have {FULL_COVERAGE} yes: while one master is lost, until its "
        f"replica is promoted, every node refuses every command, so every one of the ledger's {count} shards stops, not only "
        f"that master's; set it to no on every node (docs/operations.md, Redis Cluster)"
    )
