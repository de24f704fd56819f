"""The policy bundle admission decides with: the latest activation in Postgres with the tenant
overrides applied on top (core/overrides.py), reloaded when budget.policies.v1 announces a new
bundle, checked periodically in case an announcement is missed, and — for the overrides — when
the batch about to be decided reads a newer override revision (admitter.py)."""

from __future__ import annotations

import logging
from typing import Any

import asyncpg

from budgetgate.core.loader import PolicyValidationError, bundle_from_json
from budgetgate.core.overrides import NO_OVERRIDES, OverrideSet, effective
from budgetgate.core.policy import PolicyBundle
from budgetgate.ledger.queries import sql
from budgetgate.policies.override_store import load

log = logging.getLogger(__name__)


class PolicyCache:
    def __init__(self, pool: asyncpg.Pool) -> None:
        self.pool = pool
        self._git: PolicyBundle | None = None
        self._seq: int | None = None
        self._overrides: OverrideSet = NO_OVERRIDES
        self._bundle: PolicyBundle | None = None

    @property
    def current(self) -> PolicyBundle | None:
        """The active Git bundle with the overrides applied."""
        return self._bundle

    @property
    def git(self) -> PolicyBundle | None:
        """The active Git bundle as applied."""
        return self._git

    @property
    def overrides(self) -> OverrideSet:
        return self._overrides

    async def refresh(self, conn: Any = None) -> bool:
        """Load the active bundle and the overrides if either changed (on `conn`, else a pooled
        connection); True when the bundle decided with switched."""
        if conn is None:
            async with self.pool.acquire() as own:
                return await self.refresh(own)
        switched = await self._refresh_git(conn)
        revision = await conn.fetchval(sql("override_revision"))
        if revision != self._overrides.revision:
            self._overrides = await load(conn, revision)
            switched = True
        if switched and self._git is not None:
            self._bundle = effective(self._git, self._overrides)
        return switched

    async def _refresh_git(self, conn: Any) -> bool:
        row = await conn.fetchrow(sql("active_bundle"))
        if row is None or row["seq"] == self._seq:
            return False
        try:
            bundle = bundle_from_json(row["documents"], git_sha=row["git_sha"])
        except PolicyValidationError as exc:
            # Apply validated it; a bundle this version cannot read keeps the previous one active.
            log.error("active policy bundle %s does not validate, keeping %s: %s", row["git_sha"], self._git and self._git.git_sha, exc)
            return False
        self._git, self._seq = bundle, row["seq"]
        log.info("policy bundle %s active (%d budgets)", bundle.git_sha, len(bundle.policies))
        return True

    def adopt(self, git: PolicyBundle, overrides: OverrideSet) -> None:
        """Take an override set just committed on this instance (when it is the newest seen)."""
        if self._git is not None and git.git_sha == self._git.git_sha and overrides.revision > self._overrides.revision:
            self._overrides = overrides
            self._bundle = effective(self._git, overrides)
