"""Tenants' GPU usage decayed with the fair-share half-life, as the reconciler keeps it
(fair_share_usage), held in memory and refreshed with the policies (every
BUDGETGATE_POLICY_REFRESH_SECONDS): a decision reads it without a query, and its decayed share
lags the metered usage by at most that long (plus the reconciler's settling)."""

from __future__ import annotations

from datetime import datetime, timedelta

import asyncpg

from budgetgate.core.decay import Decayed
from budgetgate.core.policy import PolicyBundle
from budgetgate.ledger.queries import owned_by

sql = owned_by("budgetgate.services.admission")


class DecayedUsage:
    def __init__(self, *, half_life: timedelta) -> None:
        self.half_life = half_life
        self.loaded = False
        self._by_tenant: dict[str, Decayed] = {}

    async def refresh(self, pool: asyncpg.Pool) -> None:
        rows = await pool.fetch(sql("fair_share_usages"))
        self._by_tenant = {r["tenant"]: Decayed(r["decayed_gpu"], r["reckoned_at"], timedelta(seconds=r["half_life_seconds"])) for r in rows}
        self.loaded = True

    def of(self, bundle: PolicyBundle, tenant: str | None, at: datetime) -> Decayed | None:
        """The decayed GPU usage of `tenant` reckoned at `at`, when its fair share is reported
        (a quota with a fair-share target, and a Cluster); None before the first refresh."""
        quota = bundle.quota_for(tenant)
        if not self.loaded or quota is None or quota.fair_share_target is None or bundle.cluster is None:
            return None
        figure = self._by_tenant.get(tenant or "")
        if figure is None:
            return Decayed.empty(self.half_life, at)
        # The row's own half-life: it is what its figure was summed with.
        return Decayed(figure.at(at), at, figure.half_life)
