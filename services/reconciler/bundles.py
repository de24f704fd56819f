"""Policy bundles by Git SHA: a run is settled under the policies it was admitted with, and a
window's new ledger entry takes the limit of the active bundle."""

from __future__ import annotations

import logging

import asyncpg

from budgetgate.core.loader import PolicyValidationError, bundle_from_json
from budgetgate.core.policy import BudgetPolicy, PolicyBundle
from budgetgate.ledger.queries import sql

log = logging.getLogger(__name__)


class Bundles:
    def __init__(self) -> None:
        self._by_sha: dict[str, PolicyBundle | None] = {}
        self.active: PolicyBundle | None = None

    async def get(self, conn: asyncpg.Connection, sha: str | None) -> PolicyBundle | None:
        """The bundle applied at `sha`, or None when it is unknown or unreadable."""
        if not sha:
            return None
        if sha not in self._by_sha:
            documents = await conn.fetchval("SELECT documents FROM policy_bundles WHERE git_sha = $1", sha)
            self._by_sha[sha] = _parse(documents, sha) if documents is not None else None
        return self._by_sha[sha]

    async def refresh(self, conn: asyncpg.Connection) -> None:
        """Pick up the latest activation."""
        row = await conn.fetchrow(sql("active_bundle"))
        if row is not None and (self.active is None or self.active.git_sha != row["git_sha"]):
            self.active = await self.get(conn, row["git_sha"]) or self.active

    def current(self, policy: BudgetPolicy) -> BudgetPolicy:
        """The active revision of a policy (its limit may have been raised), else as given."""
        if self.active is not None:
            for candidate in self.active.policies:
                if candidate.id == policy.id and candidate.limit.unit is policy.limit.unit:
                    return candidate
        return policy

    def active_policy(self, policy_id: str) -> BudgetPolicy | None:
        if self.active is None:
            return None
        return next((p for p in self.active.policies if p.id == policy_id), None)


def _parse(documents: str, sha: str) -> PolicyBundle | None:
    try:
        return bundle_from_json(documents, git_sha=sha)
    except PolicyValidationError as exc:
        log.error("policy bundle %s does not validate; runs admitted under it settle without it: %s", sha, exc)
        return None
