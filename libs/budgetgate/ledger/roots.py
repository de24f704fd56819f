"""The roots the Redis ledger's shards place tenants by (budgetgate.core.shards, docs/scale-out.md,
"Organisations as roots"): pinned in Postgres (`ledger_roots`, migration 0049) from one bundle's
account tree, read once by every process when it starts.

A run's organisation depends on the tree of the bundle at its Git SHA, so placing by the tree of
each submission's SHA would put one tenant's keys on two shards while two SHAs disagree, each
deciding alone against its own copy of the tenant's figures. Pinning makes the placement one
fact that every process shares until an operator changes it, as resharding a Redis Cluster is:
with every process stopped, `budgetgate ledger roots --apply` pins the tree's organisations and
rebuilds every shard, which moves each tenant's keys to its new shard (a rebuild replaces all of
a shard's keys with what Postgres says it holds)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import asyncpg

from budgetgate.core.shards import Shards
from budgetgate.ledger.queries import sql


@dataclass(frozen=True, slots=True)
class Move:
    """A tenant whose root a new placement changes (a root is the tenant itself when unpinned)."""

    tenant: str
    before: str
    after: str

    def describe(self, shards: Shards, wanted: Shards) -> str:
        moved = f", shard {shards.of_root(self.tenant)} -> {wanted.of_root(self.tenant)}" if shards.count > 1 else ""
        return f"{self.tenant}: {_name(self.tenant, self.before)} -> {_name(self.tenant, self.after)}{moved}"


def _name(tenant: str, root: str) -> str:
    return "its own root" if root == tenant else f"organisation {root}"


def moves(current: Mapping[str, str], wanted: Mapping[str, str]) -> list[Move]:
    """Every tenant whose root differs between two placements, by tenant."""
    tenants = sorted(set(current) | set(wanted))
    found = (Move(t, current.get(t, t), wanted.get(t, t)) for t in tenants)
    return [move for move in found if move.before != move.after]


class SessionsConnected(RuntimeError):
    """Other sessions are connected to the ledger's database while the roots would change."""


async def pin(conn: asyncpg.Connection, roots: Mapping[str, str], *, bundle_sha: str, force: bool = False) -> None:
    """Replace the pinned roots with `roots` (from the tree of bundle `bundle_sha`). Refuses,
    naming them, while other sessions are connected to the database (a process still running
    would place by the roots it read when it started), unless `force`."""
    others: Sequence[asyncpg.Record] = await conn.fetch(sql("other_sessions"))
    if others and not force:
        named = ", ".join(f"pid {r['pid']} ({r['application_name'] or 'no application name'}, {r['client'] or 'local'})" for r in others[:10])
        raise SessionsConnected(
            f"{len(others)} other session(s) are connected to the ledger's database: {named}. Every budgetgate process reads the "
            "roots once, when it starts, so stop them all first (or pass --force when these are not budgetgate's)"
        )
    tenants = sorted(roots)
    await conn.execute(sql("pin_roots"), tenants, [roots[t] for t in tenants], bundle_sha)
