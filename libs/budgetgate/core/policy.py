"""The policy model: budgets, their scopes and limits, and rate cards."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import datetime
from decimal import Decimal
from enum import StrEnum

from budgetgate.core.accounts import AccountScope, AccountTree
from budgetgate.core.quotas import Cluster, ResourcePool, SensitivePool, TenantQuota
from budgetgate.core.sources import Source
from budgetgate.core.units import Unit
from budgetgate.core.windows import WindowSpec

from budgetgate.core.scopes import ANY_VALUE, Scope

__all__ = ["ANY_VALUE", "BudgetPolicy", "Enforcement", "Limit", "OnExhausted", "PolicyBundle", "Rate", "RateCard", "Scope", "pool_chain"]


class Enforcement(StrEnum):
    HARD = "hard"
    SOFT = "soft"
    DRY_RUN = "dry-run"


class OnExhausted(StrEnum):
    DENY = "deny"
    DELAY = "delay"
    HOLD = "hold"
    HOLD_AND_DRAIN = "hold-and-drain"

    @property
    def delays(self) -> bool:
        """Whether exhaustion asks the platform to wait (DELAY) rather than give up (DENY)."""
        return self is not OnExhausted.DENY


@dataclass(frozen=True, slots=True)
class Limit:
    unit: Unit
    amount: int  # in the unit's fixed-point scale (see budgetgate.core.units)
    currency: str | None = None


@dataclass(frozen=True, slots=True)
class BudgetPolicy:
    id: str
    scope: Scope | AccountScope  # an account's: core/accounts.py
    window: WindowSpec
    limit: Limit
    enforcement: Enforcement
    on_exhausted: OnExhausted
    source: Source


@dataclass(frozen=True, slots=True)
class Rate:
    flavor: str
    rate_per_gpu_hour: Decimal
    region: str | None = None
    effective_from: datetime | None = None


@dataclass(frozen=True, slots=True)
class RateCard:
    id: str
    currency: str
    rates: tuple[Rate, ...]
    source: Source
    # What a submission naming a flavor no rate card prices gets: a warning in its answer, or a
    # refusal (422) when any card of the bundle says "reject".
    unknown_flavor: str = "warn"

    def rate_for(self, flavor: str, region: str | None, at: datetime) -> Rate | None:
        """The most specific rate in effect at `at`: a region match beats a rate with no region,
        and among those the latest `effective_from` not after `at` wins."""
        candidates = [
            rate
            for rate in self.rates
            if rate.flavor == flavor and (rate.region is None or rate.region == region) and (rate.effective_from is None or rate.effective_from <= at)
        ]
        if not candidates:
            return None
        return max(candidates, key=lambda r: _specificity(r, at))


@dataclass(frozen=True, slots=True)
class PolicyBundle:
    """Every policy document of one Git revision."""

    git_sha: str
    policies: tuple[BudgetPolicy, ...] = ()
    rate_cards: tuple[RateCard, ...] = ()
    quotas: tuple[TenantQuota, ...] = ()
    sensitive: SensitivePool | None = None
    cluster: Cluster | None = None
    pools: tuple[ResourcePool, ...] = ()
    override_revision: int = 0  # the tenant overrides applied on top of Git (core/overrides.py)
    accounts: AccountTree = field(default_factory=AccountTree)

    def restricted_to(self, keep: Callable[[BudgetPolicy], bool]) -> PolicyBundle:
        """The same bundle with only the budget policies `keep` accepts."""
        return replace(self, policies=tuple(p for p in self.policies if keep(p)))

    def quota_for(self, tenant: str | None) -> TenantQuota | None:
        return next((q for q in self.quotas if q.tenant == tenant), None) if tenant else None

    def pool_chain(self, namespace: str) -> list[ResourcePool]:
        """The declared pools an allocation in `namespace` counts against, most specific first."""
        declared = {p.namespace: p for p in self.pools}
        return [declared[ns] for ns in pool_chain(namespace) if ns in declared]

    def unpriced(self, flavor: str, region: str | None) -> str:
        """What to say of a submission whose flavor no rate card prices, the start of its answer's
        warning or of the reason it is refused."""
        known = sorted({rate.flavor for card in self.rate_cards for rate in card.rates})
        where = f" in region {region!r}" if region else ""
        return f"no rate card prices flavor {flavor!r}{where} (priced: {', '.join(known)})"

    @property
    def rejects_unknown_flavors(self) -> bool:
        return any(card.unknown_flavor == "reject" for card in self.rate_cards)

    def rate_for(self, flavor: str, region: str | None, at: datetime) -> tuple[Rate, str] | None:
        """The most specific rate in effect across all rate cards, and its currency (validation
        keeps every card in one currency, so cards can be split across files freely)."""
        best: tuple[Rate, str] | None = None
        for card in self.rate_cards:
            rate = card.rate_for(flavor, region, at)
            if rate is not None and (best is None or _specificity(rate, at) > _specificity(best[0], at)):
                best = (rate, card.currency)
        return best


def _specificity(rate: Rate, at: datetime) -> tuple[bool, datetime]:
    # A region match beats a rate for any region; then the most recent effective_from wins.
    return rate.region is not None, rate.effective_from or datetime.min.replace(tzinfo=at.tzinfo)


def pool_chain(namespace: str) -> list[str]:
    """A namespace and its ancestors, most specific first: `a:b:c` → [`a:b:c`, `a:b`, `a`]."""
    parts = namespace.split(":")
    return [":".join(parts[: i + 1]) for i in reversed(range(len(parts)))]
