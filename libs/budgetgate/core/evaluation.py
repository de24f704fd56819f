"""From a submission and a policy bundle to the charges to reserve, and from the ledger's
readings to the decision. Pure: the atomic check-and-reserve itself happens in the ledger, which
applies exactly `fits()` below to every hard charge."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from decimal import Decimal

from budgetgate.core.escrow import lease_key
from budgetgate.core.shards import shared
from budgetgate.core.ledger_key import LedgerKey, checked
from budgetgate.core.policy import BudgetPolicy, Enforcement, Grant, PolicyBundle
from budgetgate.core.eligibility import Outlook, next_eligible
from budgetgate.core.units import Unit, display, projected_cost_micros, projected_hours_amount
from budgetgate.core.windows import Window, iso, window_at


@dataclass(frozen=True, slots=True)
class Resources:
    gpus: int
    nodes: int = 1
    flavor: str | None = None
    region: str | None = None


@dataclass(frozen=True, slots=True)
class Submission:
    run_id: str
    namespace: str
    labels: Mapping[str, str]
    resources: Resources
    runtime_hours: Decimal
    at: datetime
    attempt: int = 1


@dataclass(frozen=True, slots=True)
class Charge:
    """An amount to reserve on one ledger key for one policy: the budget's own, or, with `root`,
    that root's escrow lease of it (budgetgate.core.escrow: on a ledger of several shards, a
    budget that tenants share is charged through each tenant's lease)."""

    policy: BudgetPolicy
    window: Window
    amount: int
    root: str | None = None
    # Its key, written once: a decision reads it a dozen times (the plan, Redis, the readings, the
    # rows and the message), and writing it (the window's bounds as text) was 4 % of admission's CPU.
    ledger_key: str = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        key = ledger_key(self.policy, self.window)
        object.__setattr__(self, "ledger_key", key if self.root is None else lease_key(key, self.root))

    @property
    def budget_key(self) -> str:
        """The budget's own ledger key (a lease's is filed under it)."""
        return ledger_key(self.policy, self.window)

    @property
    def hard(self) -> bool:
        """Whether the ledger checks this charge for room: a hard policy's, unless it is zero (a
        CPU-only run on a GPU budget), which no budget, not even an over-run one, can refuse."""
        return self.policy.enforcement is Enforcement.HARD and self.amount > 0


@dataclass(frozen=True, slots=True)
class Violation:
    """A hard policy covers the submission's namespace but required labels are missing."""

    policy: BudgetPolicy
    missing: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Waived:
    """A soft or dry-run policy the submission breaks (required labels missing, or a cost limit
    with no rate for the run): recorded on its own evaluation, never charged, never blocking."""

    policy: BudgetPolicy
    reason: str
    missing: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Plan:
    submission: Submission
    bundle_sha: str
    charges: tuple[Charge, ...]
    violations: tuple[Violation, ...]
    projected_gpu: int
    showback_micros: int | None
    currency: str | None
    override_revision: int = 0  # the bundle's tenant override revision
    waived: tuple[Waived, ...] = ()
    warnings: tuple[str, ...] = ()  # said in the answer, never blocking (a flavor no rate card prices)
    # By ledger key, for the windows that have grants (core/grants.py): the policy's own limit
    # and the grants its charge's limit adds up (carried with the decision, for the evidence).
    granted: Mapping[str, tuple[int, tuple[Grant, ...]]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Reading:
    """A ledger key as the atomic reservation saw it, before this decision."""

    limit: int
    reserved: int
    consumed: int

    @property
    def remaining(self) -> int:
        return self.limit - self.reserved - self.consumed


class UnknownFlavor(ValueError):
    """A cost budget applies but no rate card prices the submission's flavor."""


def ledger_key(policy: BudgetPolicy, window: Window) -> str:
    """The ledger key (scope, window, unit) a policy's charges in a window are filed under."""
    return LedgerKey.text_of(policy, window)


def fits(amount: int, reading: Reading) -> bool:
    """Whether a budget has room for `amount`: the one rule the ledger enforces atomically on
    hard charges. Nothing always fits."""
    return amount <= 0 or amount <= reading.remaining


class NoTenant(ValueError):
    """A budget tenants share applies on a ledger of several shards, but the run names no tenant
    whose escrow lease it could be charged through."""


def plan(bundle: PolicyBundle, submission: Submission, *, lease_root: str | None = None, tenant_label: str = "team") -> Plan:
    """Which budgets a submission falls under, and how much it would reserve on each (projected
    amounts are rounded up to the ledger's unit, never down to nothing). Only a hard policy can
    block: its missing labels are violations and a cost it cannot price raises UnknownFlavor;
    a soft or dry-run policy's are only recorded (`Plan.waived`). Raises AmountOutOfRange for
    an amount beyond what the ledger holds.

    With `lease_root` (a ledger of several shards: the run's tenant), a budget tenants share
    (`shards.shared`) is charged through that tenant's escrow lease of it; NoTenant when the run
    names none ("")."""
    res = submission.resources
    # Every amount within what the ledger's integers hold (AmountOutOfRange, a ValueError):
    # a year of a million GPUs, or a cost at a high rate, is past it.
    projected_gpu = checked(projected_hours_amount(res.gpus, submission.runtime_hours), "the projected GPU-hours (gpus × runtime)")
    priced = bundle.rate_for(res.flavor, res.region, submission.at) if res.flavor else None
    showback = checked(projected_cost_micros(projected_gpu, priced[0].rate_per_gpu_hour), "the projected cost in micro-units") if priced else None
    warnings: tuple[str, ...] = ()
    if priced is None and res.flavor and bundle.rate_cards:
        # Priced by no card (a typo such as h200 for h100, or a card that does not cover it yet).
        if bundle.rejects_unknown_flavors:
            raise UnknownFlavor(bundle.unpriced(res.flavor, res.region) + ", and a rate card of the bundle rejects unknown flavors")
        warnings = (bundle.unpriced(res.flavor, res.region) + ": showback_cost is null",)
    charges: list[Charge] = []
    violations: list[Violation] = []
    waived: list[Waived] = []
    granted: dict[str, tuple[int, tuple[Grant, ...]]] = {}
    for policy in bundle.policies:
        scope = policy.scope
        hard = policy.enforcement is Enforcement.HARD
        if scope.namespaces and scope.covers_namespace(submission.namespace):
            missing = scope.missing_labels(submission.labels)
            if missing:
                if hard:
                    violations.append(Violation(policy, missing))
                else:
                    waived.append(Waived(policy, _requires(policy, missing, submission.namespace), missing))
                continue
        if not scope.matches(submission.namespace, submission.labels):
            continue
        try:
            amount = _amount(policy, submission, projected_gpu, showback)
        except UnknownFlavor as exc:
            if hard:
                raise
            waived.append(Waived(policy, str(exc)))
            continue
        window = window_at(policy.window, submission.at)
        if bundle.grants:  # the window's limit: the policy's plus what was granted to it
            key = ledger_key(policy, window)
            found = bundle.granted(policy.id, key)
            if found:
                granted[key] = (policy.limit.amount, found)
                policy = bundle.with_grants(policy, key)
        root = None
        if lease_root is not None and shared(policy, tenant_label):
            if not lease_root:
                raise NoTenant(
                    f"budget {policy.id!r} is shared by tenants and the ledger has several shards, so each tenant's runs are charged "
                    f"through its own lease of it: the submission must name its tenant in label {tenant_label!r}"
                )
            root = lease_root
        charges.append(Charge(policy, window, amount, root))
    return Plan(
        submission=submission,
        bundle_sha=bundle.git_sha,
        charges=tuple(charges),
        violations=tuple(violations),
        projected_gpu=projected_gpu,
        showback_micros=showback,
        currency=priced[1] if priced else None,
        override_revision=bundle.override_revision,
        waived=tuple(waived),
        warnings=warnings,
        granted=granted,
    )


def _amount(policy: BudgetPolicy, submission: Submission, projected_gpu: int, showback: int | None) -> int:
    unit = policy.limit.unit
    if unit is Unit.GPU_HOURS:
        return projected_gpu
    # GPU-hours and cost were bounded once for the plan; these are bounded here (the messages
    # are constants: this runs for every charge of every submission).
    if unit is Unit.NODE_HOURS:
        return checked(projected_hours_amount(submission.resources.nodes, submission.runtime_hours), "the projected node-hours (nodes × runtime)")
    if unit is Unit.WALL_HOURS:
        return checked(projected_hours_amount(1, submission.runtime_hours), "the projected wall-hours (runtime)")
    if showback is None:
        flavor = submission.resources.flavor
        raise UnknownFlavor(
            f"policy {policy.id!r} limits cost but no rate card prices flavor {flavor!r}"
            + (f" in region {submission.resources.region!r}" if submission.resources.region else "")
            if flavor
            else f"policy {policy.id!r} limits cost, so the submission must name a resources.flavor"
        )
    return showback


@dataclass(frozen=True, slots=True)
class Evaluation:
    policy_id: str
    policy_git_sha: str
    scope_id: str
    ledger_key: str | None
    window_start: datetime | None
    window_end: datetime | None
    unit: Unit
    enforcement: Enforcement
    on_exhausted: str
    limit: int
    projected: int
    remaining: int | None
    admitted: int
    outcome: str
    deficit: int | None = None
    next_eligible_time: datetime | None = None
    missing_labels: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Decision:
    outcome: str  # ALLOW | DENY | DELAY
    reason: str
    evaluations: tuple[Evaluation, ...]

    @property
    def admitted(self) -> bool:
        return self.outcome == "ALLOW"

    @property
    def reserves(self) -> bool:
        """Whether the decision reserves on budgets: an ALLOW that some budget covers (even for a
        zero amount, the run is then held on the ledger)."""
        return self.admitted and any(e.ledger_key is not None for e in self.evaluations)


def deciding_index(decision: Decision) -> int | None:
    """Which evaluation decided: for a DENY a hard policy's missing-labels one, else the denying
    budget (hard first) most short of the run; for a DELAY the delaying budget (hard first) that
    waits longest; otherwise the charged hard budget (else any) with the least room left after
    the run, relative to its limit. Ties go to the smallest policy id, so the answer does not
    depend on the order of the policy files. None when no policy applied (an admission whose
    only evaluations are waived soft or dry-run policies included)."""
    indexed = list(enumerate(decision.evaluations))
    if not indexed:
        return None
    if decision.outcome == "DENY":
        labels = [(i, e) for i, e in indexed if e.missing_labels and e.enforcement is Enforcement.HARD]
        if labels:
            return _first(labels, lambda e: 0)
        denied = _hard_first([(i, e) for i, e in indexed if e.outcome == "DENY"])
        if denied:
            return _first(denied, lambda e: -((e.deficit or 0) / e.projected if e.projected > 0 else 0.0))
    if decision.outcome == "DELAY":
        delayed = _hard_first([(i, e) for i, e in indexed if e.outcome == "DELAY"])
        if delayed:
            return _first(delayed, lambda e: -(e.next_eligible_time.timestamp() if e.next_eligible_time else 0))
    # Only a charged budget decides an admission: a waived soft or dry-run policy did not apply.
    charged = _hard_first([(i, e) for i, e in indexed if e.ledger_key is not None])
    return _first(charged, lambda e: ((e.remaining or 0) - e.projected) / max(e.limit, 1)) if charged else None


def _first(indexed: list[tuple[int, Evaluation]], rank: Callable[[Evaluation], float]) -> int:
    # The lowest rank; the policy id breaks ties (ids are unique in a bundle).
    return min(indexed, key=lambda ie: (rank(ie[1]), ie[1].policy_id, ie[0]))[0]


def _hard_first(indexed: list[tuple[int, Evaluation]]) -> list[tuple[int, Evaluation]]:
    return [(i, e) for i, e in indexed if e.enforcement is Enforcement.HARD] or indexed


def decide(
    plan: Plan,
    readings: Mapping[str, Reading] | None,
    *,
    outlooks: Mapping[str, Outlook] | None = None,
) -> Decision:
    """The decision for a plan given each ledger key's reading before this decision.

    `readings` is None when the ledger was not consulted (a label violation denies first).
    `outlooks` tells, per ledger key that lacks room, how its usage changes with time alone
    (see budgetgate.core.eligibility), so a DELAY can name the earliest instant room appears.
    """
    sha = plan.bundle_sha
    # Waived policies come last, after the charges, and only add to the reason.
    waived = tuple(_violation_evaluation(w, sha) for w in plan.waived)
    if plan.violations:
        evaluations = tuple(_violation_evaluation(v, sha) for v in plan.violations) + tuple(
            _evaluation(c, sha, None, admitted=0, outcome="ALLOW") for c in plan.charges
        )
        return Decision("DENY", _noted(plan, _violation_reason(plan)), evaluations + waived)
    if not plan.charges:
        return Decision("ALLOW", _noted(plan, f"admitted: no budget policy covers namespace {plan.submission.namespace!r} with these labels"), waived)
    if readings is None:
        # A ValueError, not an assert: a decision recorded without readings (an old label denial
        # by a policy that no longer blocks) is reported as not recomputable, not a crash.
        raise ValueError("a plan with charges needs ledger readings")
    blocked = [c for c in plan.charges if c.hard and not fits(c.amount, readings[c.ledger_key])]
    if not blocked:
        evaluations = tuple(_evaluation(c, sha, readings[c.ledger_key], admitted=c.amount, outcome=_soft_outcome(c, readings)) for c in plan.charges)
        return Decision("ALLOW", _noted(plan, _allow_reason(plan, readings)), evaluations + waived)
    # Waiting helps only when every blocking budget says so and the run fits each one at all.
    outcome = "DELAY" if all(_can_wait(c) for c in blocked) else "DENY"
    outlooks = outlooks or {}
    evaluations = []
    for charge in plan.charges:
        reading = readings[charge.ledger_key]
        if charge in blocked or (charge.policy.enforcement is Enforcement.DRY_RUN and not fits(charge.amount, reading)):
            own = "DELAY" if _can_wait(charge) else "DENY"
            eligible = eligible_at(charge, reading, outlooks.get(charge.ledger_key, Outlook()), plan.submission.at)
            evaluations.append(_evaluation(charge, sha, reading, admitted=0, outcome=own, deficit=charge.amount - reading.remaining, eligible=eligible))
        else:
            evaluations.append(_evaluation(charge, sha, reading, admitted=0, outcome="ALLOW"))
    return Decision(outcome, _noted(plan, _blocked_reason(outcome, blocked, readings, evaluations)), tuple(evaluations) + waived)


def _can_wait(charge: Charge) -> bool:
    """Whether a blocked charge should wait (DELAY): its policy says so and the run fits the
    budget at all; a run larger than the whole limit would wait forever."""
    return charge.policy.on_exhausted.delays and charge.amount <= charge.policy.limit.amount


def _soft_outcome(charge: Charge, readings: Mapping[str, Reading]) -> str:
    # A dry-run policy records what it would have decided; it never blocks.
    if charge.policy.enforcement is Enforcement.DRY_RUN and not fits(charge.amount, readings[charge.ledger_key]):
        return "DELAY" if charge.policy.on_exhausted.delays else "DENY"
    return "ALLOW"


def eligible_at(charge: Charge, reading: Reading, outlook: Outlook, now: datetime) -> datetime | None:
    """The earliest instant a charge that lacks room could fit its budget (None: never, the run
    is larger than the whole limit)."""
    return next_eligible(
        amount=charge.amount,
        limit=charge.policy.limit.amount,
        remaining=reading.remaining,
        window=charge.window,
        rolling_days=charge.policy.window.rolling_days,
        outlook=outlook,
        now=now,
    )


def _evaluation(
    charge: Charge, sha: str, reading: Reading | None, *, admitted: int, outcome: str, deficit: int | None = None, eligible: datetime | None = None
) -> Evaluation:
    policy = charge.policy
    return Evaluation(
        policy_id=policy.id,
        policy_git_sha=sha,
        scope_id=policy.scope.scope_id,
        ledger_key=charge.ledger_key,
        window_start=charge.window.start,
        window_end=charge.window.end,
        unit=policy.limit.unit,
        enforcement=policy.enforcement,
        on_exhausted=str(policy.on_exhausted),
        limit=policy.limit.amount,
        projected=charge.amount,
        remaining=reading.remaining if reading else None,
        admitted=admitted,
        outcome=outcome,
        deficit=deficit,
        next_eligible_time=eligible,
    )


def _violation_evaluation(violation: Violation | Waived, sha: str) -> Evaluation:
    # Judged before any ledger: no key, no window, nothing projected. A waived policy's own
    # verdict is DENY too (what it would decide were it hard); only the decision ignores it.
    policy = violation.policy
    return Evaluation(
        policy_id=policy.id,
        policy_git_sha=sha,
        scope_id=policy.scope.scope_id,
        ledger_key=None,
        window_start=None,
        window_end=None,
        unit=policy.limit.unit,
        enforcement=policy.enforcement,
        on_exhausted=str(policy.on_exhausted),
        limit=policy.limit.amount,
        projected=0,
        remaining=None,
        admitted=0,
        outcome="DENY",
        missing_labels=violation.missing,
    )


def describe(unit: Unit, amount: int, currency: str | None = None) -> str:
    """An amount as a person writes it: `48 GPU-hours`, `188.78 USD`."""
    value = display(unit, amount)
    text = f"{value:,.2f}".rstrip("0").rstrip(".") if unit is not Unit.COST else f"{value:,.2f}"
    names = {Unit.GPU_HOURS: "GPU-hours", Unit.NODE_HOURS: "node-hours", Unit.WALL_HOURS: "wall-hours"}
    return f"{text} {names[unit]}" if unit is not Unit.COST else f"{text} {currency or ''}".rstrip()


def _requires(policy: BudgetPolicy, missing: Sequence[str], namespace: str) -> str:
    return f"policy {policy.id!r} requires label{'s' if len(missing) > 1 else ''} {', '.join(missing)} in namespace {namespace!r}"


def _violation_reason(plan: Plan) -> str:
    parts = [_requires(v.policy, v.missing, plan.submission.namespace) for v in plan.violations]
    return "denied: " + "; ".join(parts) + ". Add the missing labels to the submission and resubmit."


def _noted(plan: Plan, reason: str) -> str:
    """`reason` and what the soft and dry-run policies the run breaks would have said."""
    if not plan.waived:
        return reason
    return f"{reason.rstrip('.')}. Recorded, not enforced: " + "; ".join(f"{w.policy.enforcement} {w.reason}" for w in plan.waived) + "."


_RESERVED = "admitted: reserved on "
# What a decision's reason says, and what it says of a dry run, which reserves nothing.
_HYPOTHETICAL = ((_RESERVED, "would be admitted: would reserve on "), ("admitted: ", "would be admitted: "), ("denied: ", "would be denied: "),
                 ("delayed: ", "would be delayed: "))  # fmt: skip


def hypothetical(reason: str) -> str:
    """A decision's reason as said of a dry run: "would reserve on 2 budgets", not "reserved"."""
    for said, would in _HYPOTHETICAL:
        if reason.startswith(said):
            return would + reason.removeprefix(said)
    return reason


def _allow_reason(plan: Plan, readings: Mapping[str, Reading]) -> str:
    candidates = [c for c in plan.charges if c.hard] or list(plan.charges)
    tightest = min(candidates, key=lambda c: ((readings[c.ledger_key].remaining - c.amount) / max(c.policy.limit.amount, 1), c.policy.id))
    left = readings[tightest.ledger_key].remaining - tightest.amount
    unit, cur = tightest.policy.limit.unit, tightest.policy.limit.currency
    n = len(plan.charges)
    return (
        f"{_RESERVED}{n} budget{'s' if n > 1 else ''}; tightest is {tightest.policy.id!r} with "
        f"{describe(unit, left, cur)} of {describe(unit, tightest.policy.limit.amount, cur)} left after this run"
    )


def _blocked_reason(outcome: str, blocked: Sequence[Charge], readings: Mapping[str, Reading], evaluations: Sequence[Evaluation]) -> str:
    by_key = {e.ledger_key: e for e in evaluations}
    parts = []
    for charge in blocked:
        reading = readings[charge.ledger_key]
        unit, cur = charge.policy.limit.unit, charge.policy.limit.currency
        window = charge.window
        parts.append(
            f"budget {charge.policy.id!r} (scope {charge.policy.scope.scope_id}, window {iso(window.start)} to {iso(window.end)}) "
            f"has {describe(unit, max(reading.remaining, 0), cur)} of {describe(unit, charge.policy.limit.amount, cur)} left "
            f"and this run needs {describe(unit, charge.amount, cur)} (short by {describe(unit, charge.amount - reading.remaining, cur)})"
        )
    eligible = [by_key[c.ledger_key].next_eligible_time for c in blocked]
    if outcome == "DELAY":
        # One budget the run can never fit makes every other budget's reset moot.
        when = None if any(e is None for e in eligible) else max(e for e in eligible if e is not None)
        hint = f"Resubmit at or after {iso(when)}." if when else "This run is larger than the whole budget; reduce it or ask to raise the limit."
        return "delayed: " + "; ".join(parts) + ". " + hint
    if any(c.amount > c.policy.limit.amount for c in blocked):
        return "denied: " + "; ".join(parts) + ". This run is larger than the whole budget; reduce it or ask the budget owner to raise the limit."
    return "denied: " + "; ".join(parts) + ". Reduce the request, wait for the window to reset, or ask the budget owner to raise the limit."
