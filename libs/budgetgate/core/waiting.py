"""Runs refused for now, and whether they would fit now.

A run whose latest decision is a DELAY waits for budget; one refused by a concurrency limit (a
tenant quota, the sensitive pool) waits for quota headroom. Either may be resubmitted with a
higher attempt once room returns. `judge` measures what refused a waiting run against the
limits and figures as they are now: the active bundle's limits, each refusing budget's figures
in its current window, what the tenant (or sensitive work) holds now.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime

from budgetgate.core.evaluation import Reading, ledger_key
from budgetgate.core.policy import BudgetPolicy, Enforcement, PolicyBundle
from budgetgate.core.quotas import QUOTA_FIELDS, REJECTED, Holdings
from budgetgate.core.units import Unit, display
from budgetgate.core.windows import window_at

BUDGET, QUOTA = "budget", "quota"
STATES = {BUDGET: "waiting for budget", QUOTA: "waiting for quota headroom"}


def waiting_for(outcome: str, reason: str) -> str | None:
    """What a run decided `outcome` for `reason` waits for (BUDGET, QUOTA), or None: an ALLOW
    and a DENY no change of figures cures (labels, a budget that denies) wait for nothing."""
    if outcome == "DELAY":
        return BUDGET
    if outcome == "DENY" and reason.startswith(REJECTED):
        return QUOTA
    return None


@dataclass(frozen=True, slots=True)
class BudgetNeed:
    """What a waiting run asks of one budget that refused it, in the budget's ledger unit."""

    policy_id: str
    unit: str
    amount: int


def budget_needs(evaluations: Iterable[tuple[str, str, str, str, int]]) -> tuple[BudgetNeed, ...]:
    """The needs of a decision's refusing budgets, from its evaluations as (policy id, unit,
    enforcement, outcome, projected amount): the hard ones that did not allow it."""
    return tuple(
        BudgetNeed(policy_id, unit, amount) for policy_id, unit, enforcement, outcome, amount in evaluations if enforcement == "hard" and outcome != "ALLOW"
    )


@dataclass(frozen=True, slots=True)
class WaitingRun:
    run_id: str
    attempt: int
    decision_id: str
    waiting_for: str  # BUDGET | QUOTA
    tenant: str | None
    labels: Mapping[str, str]
    gpus: int
    nodes: int
    needs: tuple[BudgetNeed, ...]  # for BUDGET
    decided_at: datetime

    @property
    def state(self) -> str:
        return STATES[self.waiting_for]

    def sensitive(self, bundle: PolicyBundle) -> bool:
        return self.waiting_for == QUOTA and bundle.sensitive is not None and bundle.sensitive.covers(self.labels)


@dataclass(frozen=True, slots=True)
class Limiting:
    """One limit that refused a waiting run, as it stands now. Budget amounts are ledger units
    (`reserved` and `consumed` set); quota amounts are GPUs, nodes or allocations."""

    kind: str  # budget | quota | sensitive_pool
    name: str  # the budget's policy id, or the quota's field (max_nodes, sensitive_pool_size)
    unit: str
    limit: int
    used: int
    requested: int
    scope_id: str | None = None
    tenant: str | None = None
    reserved: int | None = None
    consumed: int | None = None

    @property
    def fits(self) -> bool:
        return self.used + self.requested <= self.limit

    def describe(self) -> str:
        if self.kind == "budget":
            unit = Unit(self.unit)
            fig = lambda amount: f"{display(unit, amount):g}"  # noqa: E731
            what = f"budget {self.name!r} ({self.unit}): {fig(self.used)} of {fig(self.limit)} used, needs {fig(self.requested)}"
        elif self.kind == "quota":
            what = f'tenant "{self.tenant}" {self.name}: {self.used} of {self.limit} held, needs {self.requested}'
        else:
            what = f"sensitive pool ({self.unit}): {self.used} of {self.limit} held, needs {self.requested}"
        return f"{what}: {'fits' if self.fits else 'does not fit'}"


@dataclass(frozen=True, slots=True)
class Headroom:
    """A waiting run beside what refused it, now: it fits when every limit has room for it."""

    run: WaitingRun
    limiting: tuple[Limiting, ...]

    @property
    def fits(self) -> bool:
        return all(limit.fits for limit in self.limiting)

    def describe(self) -> str:
        return "; ".join(limit.describe() for limit in self.limiting) or "nothing that refused it limits it any more"


def current_keys(run: WaitingRun, bundle: PolicyBundle, now: datetime) -> dict[str, str]:
    """For each budget that refused the run and still could (the policy is in the bundle, hard,
    in the same unit): the ledger key of its window now, by policy id."""
    return {need.policy_id: ledger_key(policy, window_at(policy.window, now)) for need, policy in _refusing(run, bundle)}


def judge(
    run: WaitingRun,
    bundle: PolicyBundle,
    *,
    now: datetime,
    ledger: Mapping[str, Reading],
    tenant_held: Holdings,
    sensitive_held: Holdings,
) -> Headroom:
    """How what refused `run` stands now: `ledger` has the figures of `current_keys` (a key
    without a row is empty), `tenant_held` what the run's tenant holds, `sensitive_held` what
    sensitive work holds."""
    limiting: list[Limiting] = []
    for need, policy in _refusing(run, bundle):
        key = ledger_key(policy, window_at(policy.window, now))
        limit = bundle.limit_of(policy, key)  # the policy's plus the window's grants
        reading = ledger.get(key) or Reading(limit, 0, 0)
        limiting.append(
            Limiting("budget", policy.id, need.unit, limit, reading.reserved + reading.consumed, need.amount,
                     scope_id=policy.scope.scope_id, reserved=reading.reserved, consumed=reading.consumed)
        )  # fmt: skip
    if run.waiting_for == QUOTA:
        quota = bundle.quota_for(run.tenant)
        asked = {"max_gpus": run.gpus, "max_nodes": run.nodes, "max_concurrent_allocations": 1}
        held = {"max_gpus": tenant_held.gpus, "max_nodes": tenant_held.nodes, "max_concurrent_allocations": tenant_held.allocations}
        units = {"max_gpus": "gpus", "max_nodes": "nodes", "max_concurrent_allocations": "allocations"}
        for name in QUOTA_FIELDS if quota is not None else ():
            limit = getattr(quota, name)
            if limit is not None:
                limiting.append(Limiting("quota", name, units[name], limit, held[name], asked[name], tenant=run.tenant))
        if run.sensitive(bundle):
            pool = bundle.sensitive
            assert pool is not None
            used, requested = (sensitive_held.gpus, run.gpus) if pool.unit == "gpus" else (sensitive_held.nodes, run.nodes)
            limiting.append(Limiting("sensitive_pool", "sensitive_pool_size", pool.unit, pool.size, used, requested))
    return Headroom(run, tuple(limiting))


def _refusing(run: WaitingRun, bundle: PolicyBundle) -> list[tuple[BudgetNeed, BudgetPolicy]]:
    policies = {p.id: p for p in bundle.policies}
    found = []
    for need in run.needs:
        policy = policies.get(need.policy_id)
        if policy is not None and policy.enforcement is Enforcement.HARD and str(policy.limit.unit) == need.unit:
            found.append((need, policy))
    return found
