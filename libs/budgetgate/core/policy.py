"""The policy model: budgets, their scopes and limits, rate cards, and the grants made to a
budget's window over the API (core/grants.py)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime
from decimal import Decimal
from enum import StrEnum
from typing import Any

from budgetgate.core.accounts import AccountScope, AccountTree
from budgetgate.core.quotas import Cluster, ResourcePool, SensitivePool, TenantQuota
from budgetgate.core.scopes import ANY_VALUE, Scope
from budgetgate.core.sources import Source
from budgetgate.core.units import Unit, display
from budgetgate.core.windows import WindowSpec, rfc3339

# Scope and ANY_VALUE live in core/scopes.py (core/accounts.py needs them without this module).
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
class Grant:
    """One grant as recorded: `amount` in ledger units (negative takes away), the window's limit
    before and after it, who made it and why."""

    revision: int
    policy_id: str
    scope_id: str
    unit: Unit
    ledger_key: str
    window_start: datetime
    window_end: datetime
    amount: int
    limit_before: int
    limit_after: int
    actor: str
    reason: str
    granted_at: datetime

    def view(self) -> dict[str, Any]:
        """The grant as JSON answers show it: amounts in the budget's unit (hours, or currency)."""
        return {
            "revision": self.revision,
            "policy_id": self.policy_id,
            "scope_id": self.scope_id,
            "unit": str(self.unit),
            "ledger_key": self.ledger_key,
            "window_start": rfc3339(self.window_start),
            "window_end": rfc3339(self.window_end),
            "amount": display(self.unit, self.amount),
            "limit_before": display(self.unit, self.limit_before),
            "limit_after": display(self.unit, self.limit_after),
            "actor": self.actor,
            "reason": self.reason,
            "granted_at": rfc3339(self.granted_at),
        }


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
    # The grants made over the API, by (policy id, ledger key) of the window they are for
    # (core/grants.py); each window's limit is the policy's plus its grants.
    grants: Mapping[tuple[str, str], tuple[Grant, ...]] = field(default_factory=dict, hash=False)
    # Each tenant's quota (the first listed for it), looked up for every submission.
    _quota_of: Mapping[str, TenantQuota] = field(init=False, repr=False, compare=False, hash=False, default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_quota_of", {q.tenant: q for q in reversed(self.quotas)})

    def granted(self, policy_id: str, ledger_key: str) -> tuple[Grant, ...]:
        """The grants made to `policy_id` for the window of `ledger_key`, oldest first."""
        return self.grants.get((policy_id, ledger_key), ()) if self.grants else ()

    def limit_of(self, policy: BudgetPolicy, ledger_key: str) -> int:
        """The limit of `policy` in the window of `ledger_key`: its own plus the window's grants,
        never below zero."""
        found = self.granted(policy.id, ledger_key)
        return max(0, policy.limit.amount + sum(g.amount for g in found)) if found else policy.limit.amount

    def with_grants(self, policy: BudgetPolicy, ledger_key: str) -> BudgetPolicy:
        """`policy` with its limit in the window of `ledger_key` (itself when nothing was granted)."""
        if not self.granted(policy.id, ledger_key):
            return policy
        return replace(policy, limit=replace(policy.limit, amount=self.limit_of(policy, ledger_key)))

    def restricted_to(self, keep: Callable[[BudgetPolicy], bool]) -> PolicyBundle:
        """The same bundle with only the budget policies `keep` accepts."""
        return replace(self, policies=tuple(p for p in self.policies if keep(p)))

    def quota_for(self, tenant: str | None) -> TenantQuota | None:
        return self._quota_of.get(tenant) if tenant else None

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
