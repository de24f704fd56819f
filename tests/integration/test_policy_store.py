"""The one policy store admission, explain, replay and the reconciler share: the active bundle
with the overrides in force, and any bundle by SHA (with a revision's overrides), each read from
Postgres once; a bundle this version cannot read keeps the previous one active."""

from __future__ import annotations

from typing import Any

import asyncpg

from budgetgate.policies.override_store import update
from budgetgate.policies.policy_store import PolicyStore
from tests.support.admission import apply_policies, budget_yaml
from tests.support.quotas import QUOTA


class Counted:
    """A connection, counting the bundles read through it."""

    def __init__(self, conn: Any) -> None:
        self.conn, self.bundle_reads = conn, 0

    async def fetchrow(self, query: str, *args: Any) -> Any:
        return await self.conn.fetchrow(query, *args)

    async def fetchval(self, query: str, *args: Any) -> Any:
        self.bundle_reads += "FROM policy_bundles" in query
        return await self.conn.fetchval(query, *args)

    async def fetch(self, query: str, *args: Any) -> Any:
        return await self.conn.fetch(query, *args)


async def test_the_active_bundle_its_overrides_and_bundles_by_sha(pg_dsn: str) -> None:
    first, second = "a" * 40, "b" * 40
    files = {"q.yaml": QUOTA.format(limits="max_gpus: 8"), "b.yaml": budget_yaml("team", labels="{team: physics}", limit="gpu_hours: 100")}
    await apply_policies(pg_dsn, files, sha=first)
    conn = await asyncpg.connect(pg_dsn)
    try:
        store = PolicyStore()
        assert store.current is None and await store.refresh(conn) is True
        assert store.active is not None and store.active.git_sha == first and store.current.git_sha == first  # type: ignore[union-attr]
        assert await store.refresh(conn) is False  # nothing new

        # An override committed elsewhere is read at the next refresh, over the same Git bundle.
        _, overrides = await update(conn, tenant="physics", changes={"max_gpus": 16}, label="team", actor="test", reason=None)
        assert await store.refresh(conn) is True
        assert store.overrides.revision == overrides.revision and store.current.quota_for("physics").max_gpus == 16  # type: ignore[union-attr]
        assert store.active.quota_for("physics").max_gpus == 8  # type: ignore[union-attr]

        # A new activation; the earlier bundle is still there by SHA, read once however often asked.
        await apply_policies(pg_dsn, {**files, "b.yaml": budget_yaml("team", labels="{team: physics}", limit="gpu_hours: 200")}, sha=second)
        assert await store.refresh(conn) is True and store.active.git_sha == second  # type: ignore[union-attr]
        assert store.revision_of(store.active_policy("team")).limit.amount == store.active.policies[0].limit.amount  # type: ignore[union-attr,arg-type]
        counted = Counted(conn)
        old = await store.at(counted, first)  # read when it was active: not again
        assert old is not None and old.git_sha == first and await store.at(counted, first) is old and counted.bundle_reads == 0
        fresh = PolicyStore()
        assert await fresh.at(counted, first) == old and await fresh.at(counted, first) is await fresh.at(counted, first) and counted.bundle_reads == 1
        under = await store.under(counted, first, overrides.revision)
        assert under is not None and under.quota_for("physics").max_gpus == 16 and await store.under(counted, first, overrides.revision) is under
        assert await store.at(counted, "f" * 40) is None and await store.at(counted, None) is None

        # A bundle this version cannot read: unknown by SHA, and the active one stays.
        await conn.execute(
            "INSERT INTO policy_bundles (git_sha, documents, source, applied_by) VALUES ($1, $2, 'test', 'test')",
            "c" * 40,
            '[{"file": "x.yaml", "line": 1, "data": {"apiVersion": "budgetgate/v1", "kind": "BudgetPolicy"}}]',
        )
        await conn.execute("INSERT INTO policy_activations (git_sha) VALUES ($1)", "c" * 40)
        assert await store.refresh(conn) is False and store.active.git_sha == second  # type: ignore[union-attr]
        assert await store.at(conn, "c" * 40) is None
    finally:
        await conn.close()
