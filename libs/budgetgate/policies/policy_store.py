"""The one policy store every reader of policies shares: admission deciding, explain and replay,
the reconciler settling and judging waiting runs.

It holds the active Git bundle and the tenant overrides in force (their combination is what
admission decides under, `current`), refreshed from Postgres when an announcement, a periodic check
or a newer override revision says so; and any bundle by its Git SHA, with the overrides of a
revision, as a decision was made under it. Each bundle is read from Postgres and validated once."""

from __future__ import annotations

import logging
from typing import Any

from budgetgate.core.loader import PolicyValidationError, bundle_from_json
from budgetgate.core.overrides import NO_OVERRIDES, OverrideSet, effective
from budgetgate.core.policy import BudgetPolicy, PolicyBundle
from budgetgate.ledger.queries import owned_by
from budgetgate.policies.override_store import load

sql = owned_by("budgetgate.policies")

log = logging.getLogger(__name__)


class PolicyStore:
    """Policy bundles as Postgres holds them; `pool` lets `refresh()` take its own connection."""

    def __init__(self, pool: Any = None) -> None:
        self.pool = pool
        self._by_sha: dict[str, PolicyBundle | None] = {}
        self._under: dict[tuple[str, int], PolicyBundle | None] = {}
        self._seq: int | None = None
        self._active: PolicyBundle | None = None
        self._overrides: OverrideSet = NO_OVERRIDES
        self._current: PolicyBundle | None = None

    # -- the active bundle ------------------------------------------------------------------

    @property
    def active(self) -> PolicyBundle | None:
        """The active Git bundle, as applied."""
        return self._active

    @property
    def overrides(self) -> OverrideSet:
        """The tenant overrides in force (at the latest revision read)."""
        return self._overrides

    @property
    def current(self) -> PolicyBundle | None:
        """The active Git bundle with the overrides in force: what admission decides under."""
        return self._current

    async def refresh(self, conn: Any = None) -> bool:
        """Read the latest activation and override revision (on `conn`, else one of the pool's);
        True when `current` changed."""
        if conn is None:
            async with self.pool.acquire() as own:
                return await self.refresh(own)
        switched = False
        row = await conn.fetchrow(sql("active_bundle"))
        if row is not None and row["seq"] != self._seq:
            bundle = self._remember(row["git_sha"], row["documents"])
            if bundle is not None:
                self._active, self._seq, switched = bundle, row["seq"], True
                log.info("policy bundle %s active (%d budgets)", bundle.git_sha, len(bundle.policies))
            else:  # apply validated it: a bundle this version cannot read keeps the previous one active
                log.error("active policy bundle %s does not validate, keeping %s", row["git_sha"], self._active and self._active.git_sha)
        revision = await conn.fetchval(sql("override_revision"))
        if revision != self._overrides.revision:
            self._overrides = await load(conn, revision)
            switched = True
        if switched and self._active is not None:
            self._current = effective(self._active, self._overrides)
        return switched

    def adopt(self, active: PolicyBundle, overrides: OverrideSet) -> None:
        """Take an override set just committed in this process (when it is the newest seen)."""
        if self._active is not None and active.git_sha == self._active.git_sha and overrides.revision > self._overrides.revision:
            self._overrides = overrides
            self._current = effective(self._active, overrides)

    def revision_of(self, policy: BudgetPolicy) -> BudgetPolicy:
        """The active bundle's revision of `policy` (its limit may have been raised), else `policy`."""
        if self._active is not None:
            for candidate in self._active.policies:
                if candidate.id == policy.id and candidate.limit.unit is policy.limit.unit:
                    return candidate
        return policy

    def active_policy(self, policy_id: str) -> BudgetPolicy | None:
        """The active bundle's policy of that id, if it has one."""
        if self._active is None:
            return None
        return next((p for p in self._active.policies if p.id == policy_id), None)

    # -- any bundle, by Git SHA ----------------------------------------------------------------

    async def at(self, conn: Any, sha: str | None) -> PolicyBundle | None:
        """The bundle applied at `sha`; None when it is unknown or this version cannot read it."""
        if not sha:
            return None
        if sha not in self._by_sha:
            self._remember(sha, await conn.fetchval(sql("bundle_documents"), sha))
        return self._by_sha[sha]

    async def under(self, conn: Any, sha: str | None, revision: int | None) -> PolicyBundle | None:
        """The bundle at `sha` with the overrides of `revision`: what a decision was made under."""
        bundle = await self.at(conn, sha)
        if bundle is None or not revision:
            return bundle
        key = (bundle.git_sha, revision)
        if key not in self._under:
            self._under[key] = effective(bundle, await load(conn, revision))
        return self._under[key]

    def _remember(self, sha: str, documents: str | None) -> PolicyBundle | None:
        bundle = None
        if documents is not None:
            try:
                bundle = bundle_from_json(documents, git_sha=sha)
            except PolicyValidationError as exc:
                log.error("policy bundle %s does not validate; what was decided under it is read without it: %s", sha, exc)
        self._by_sha[sha] = bundle
        return bundle


def judged_under(bundle: PolicyBundle) -> str:
    """What a waiting run records it was last judged under: the bundle's Git SHA, and the override
    revision when there is one, so that a new revision (a limit may have risen) judges it again."""
    return f"{bundle.git_sha}+overrides.{bundle.override_revision}" if bundle.override_revision else bundle.git_sha
