"""The policy bundle admission decides with: the latest activation in Postgres, reloaded when
budget.policies.v1 announces a new one and checked periodically in case an announcement is missed."""

from __future__ import annotations

import logging

import asyncpg

from budgetgate.core.loader import PolicyValidationError, bundle_from_json
from budgetgate.core.policy import PolicyBundle
from budgetgate.ledger.queries import sql

log = logging.getLogger(__name__)


class PolicyCache:
    def __init__(self, pool: asyncpg.Pool) -> None:
        self.pool = pool
        self._bundle: PolicyBundle | None = None
        self._seq: int | None = None

    @property
    def current(self) -> PolicyBundle | None:
        return self._bundle

    async def refresh(self) -> bool:
        """Load the active bundle if it changed; True when it switched."""
        row = await self.pool.fetchrow(sql("active_bundle"))
        if row is None or row["seq"] == self._seq:
            return False
        try:
            bundle = bundle_from_json(row["documents"], git_sha=row["git_sha"])
        except PolicyValidationError as exc:
            # Apply validated it; a bundle this version cannot read keeps the previous one active.
            log.error("active policy bundle %s does not validate, keeping %s: %s", row["git_sha"], self._bundle and self._bundle.git_sha, exc)
            return False
        self._bundle, self._seq = bundle, row["seq"]
        log.info("policy bundle %s active (%d budgets)", bundle.git_sha, len(bundle.policies))
        return True
