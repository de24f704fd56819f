"""Policy bundles by Git SHA: a run is settled under the policies it was admitted with, and a
window's new ledger entry takes the limit of the active bundle. Waiting runs are judged under
the active bundle with the tenant overrides of the latest revision (`judging`), as admission
decides."""

from __future__ import annotations

import logging

import asyncpg

from budgetgate.core.loader import PolicyValidationError, bundle_from_json
from budgetgate.core.overrides import effective
from budgetgate.core.policy import BudgetPolicy, PolicyBundle
from budgetgate.ledger.queries import sql
from budgetgate.policies.override_store import load

log = logging.getLogger(__name__)


class Bundles:
    def __init__(self) -> None:
        self._by_sha: dict[str, PolicyBundle | None] = {}
        self.active: PolicyBundle | None = None
        # The active bundle with the latest tenant overrides applied (what admission decides
        # under), and the override revision it carries.
        self.judging: PolicyBundle | None = None

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
        if self.active is None:
            return
        revision = await conn.fetchval(sql("override_revision"))
        judging = self.judging
        if judging is None or judging.git_sha != self.active.git_sha or judging.override_revision != revision:
            self.judging = effective(self.active, await load(conn, revision))

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


def judged_under(bundle: PolicyBundle) -> str:
    """What a waiting run records it was last judged under: the bundle's Git SHA, and the override
    revision when there is one, so that a new revision (a limit may have risen) judges it again."""
    return f"{bundle.git_sha}+overrides.{bundle.override_revision}" if bundle.override_revision else bundle.git_sha
