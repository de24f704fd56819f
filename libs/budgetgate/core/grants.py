"""Grants: hours (or money) added to, or taken from, one budget in one window without a Git commit.

A finance or allocation team grants an amount in the budget's own unit (GPU-hours, node-hours,
wall-hours, or its currency) to one budget for its current window or a named one, with a reason.
Grants are never changed: the window's limit is the policy's limit (with a tenant override, if
any) plus the sum of its grants, never below zero. A grant is for one window; the next window
starts from the policy's limit again. Pure: grant_store.py records them.
The Grant record itself is part of the policy model (core/policy.py), beside the bundle whose
windows it adds to.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, date, datetime
from decimal import Decimal
from typing import Any

from budgetgate.core.documents import did_you_mean
from budgetgate.core.ledger_key import MAX_AMOUNT, LedgerKey
from budgetgate.core.policy import BudgetPolicy, Grant, PolicyBundle
from budgetgate.core.units import Unit, display, from_amount, smallest, to_amount, to_decimal
from budgetgate.core.windows import Window, window_at


class InvalidGrant(ValueError):
    """A grant that cannot be made; `field` names the culprit (policy_id, scope_id, window,
    amount or reason)."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(message)
        self.field = field_name


class UnknownBudget(InvalidGrant):
    """No budget of the active bundle has that policy id."""


def by_window(grants: Iterable[Grant]) -> dict[tuple[str, str], tuple[Grant, ...]]:
    """Grants by (policy id, ledger key), each window's oldest first (PolicyBundle.grants)."""
    found: dict[tuple[str, str], list[Grant]] = {}
    for g in sorted(grants, key=lambda g: g.revision):
        found.setdefault((g.policy_id, g.ledger_key), []).append(g)
    return {k: tuple(v) for k, v in found.items()}


@dataclass(frozen=True, slots=True)
class Asked:
    """A grant asked for and checked against the bundle: the budget, its window and ledger key,
    the amount in ledger units and the window's limit before and after."""

    policy: BudgetPolicy
    window: Window
    ledger_key: str
    amount: int
    limit_before: int
    limit_after: int


def budget_of(bundle: PolicyBundle, policy_id: str, scope_id: str | None = None) -> BudgetPolicy:
    """The budget `policy_id` of `bundle`; `scope_id`, when given, must be its scope. Raises
    UnknownBudget or InvalidGrant."""
    policy = next((p for p in bundle.policies if p.id == policy_id), None)
    if policy is None:
        hint = did_you_mean(policy_id, sorted(p.id for p in bundle.policies))
        raise UnknownBudget("policy_id", f"bundle {bundle.git_sha} has no budget {policy_id!r}{hint}")
    if scope_id is not None and scope_id != policy.scope.scope_id:
        raise InvalidGrant("scope_id", f"budget {policy_id!r} has one scope, {policy.scope.scope_id!r}, not {scope_id!r}")
    return policy


def window_of(policy: BudgetPolicy, named: str | None, now: datetime, *, ended: bool = False) -> Window:
    """The window a grant is for: the one containing `now` when `named` is None, else the one
    `named` names — its ledger window key (`<start>/<end>`, as `budgetgate budgets` shows it), or
    an instant or date inside it. A rolling window is refused, and one that has ended unless
    `ended` (listing the grants of a past window)."""
    if policy.window.rolling:
        raise InvalidGrant(
            "window", f"budget {policy.id!r} has a rolling window ({policy.window.rolling_days} days), which has no period of its own to grant to"
        )
    if named is None:
        return window_at(policy.window, now)
    text = named.strip()
    at = _instant(text.partition("/")[0] if "/" in text else text, named)
    try:
        window = window_at(policy.window, at)
    except (ValueError, OverflowError):  # an instant so near the calendar's end that its window has none
        raise InvalidGrant("window", f"{named!r} is beyond the windows budgetgate lays out") from None
    if "/" in text and window.key != text:
        raise InvalidGrant("window", f"{named!r} is not a window of budget {policy.id!r}; the window starting there is {window.key!r}")
    if window.end <= now and not ended:
        raise InvalidGrant("window", f"window {window.key} of budget {policy.id!r} has ended; grants are for the current window or a later one")
    return window


def _instant(text: str, named: str) -> datetime:
    try:
        if len(text) == 10:
            return datetime.combine(date.fromisoformat(text), datetime.min.time(), tzinfo=UTC)
        at = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except (ValueError, OverflowError):
        raise InvalidGrant("window", f"{named!r} is neither a window key (<start>/<end>) nor a date or RFC 3339 instant") from None
    if at.tzinfo is None:
        raise InvalidGrant("window", f"{named!r} has no time zone; write it with Z or an offset")
    return at


def amount_of(unit: Unit, value: Decimal | float | int | str) -> int:
    """A figure in the budget's unit as ledger units; zero, or one that rounds to zero, is refused."""
    try:
        figure = to_decimal(value)
    except ValueError as exc:
        raise InvalidGrant("amount", str(exc)) from None
    if abs(figure) > Decimal(MAX_AMOUNT) / unit.scale:
        raise InvalidGrant("amount", f"{figure} is more than the ledger can hold")
    amount = to_amount(unit, figure)
    if amount == 0:
        raise InvalidGrant("amount", f"a grant of {figure} {unit} changes nothing (the ledger's unit is {smallest(unit)})")
    return amount


def ask(bundle: PolicyBundle, *, policy_id: str, scope_id: str | None, window: str | None, value: Any, reason: str | None, now: datetime) -> Asked:
    """Check a grant against `bundle` (the active bundle, overrides and grants in force): the
    budget and window must exist, the amount be non-zero, a reason given, and the window's limit
    after it not below zero. Raises InvalidGrant (UnknownBudget) naming the field at fault."""
    if reason is None or not reason.strip():
        raise InvalidGrant("reason", "a grant needs a reason, for the admin log (who approved it, a ticket)")
    policy = budget_of(bundle, policy_id, scope_id)
    found = window_of(policy, window, now)
    amount = amount_of(policy.limit.unit, value)
    key = LedgerKey.text_of(policy, found)
    before = bundle.limit_of(policy, key)
    after = policy.limit.amount + sum(g.amount for g in bundle.granted(policy.id, key)) + amount
    unit = policy.limit.unit
    if after < 0:
        raise InvalidGrant(
            "amount",
            f"taking {display(unit, -amount):g} {unit} from budget {policy.id!r} in window {found.key} would leave a limit of "
            f"{display(unit, after):g}; its limit there is {display(unit, before):g}, so at most that can be taken",
        )
    if after > MAX_AMOUNT:
        raise InvalidGrant("amount", f"the window's limit would be {from_amount(unit, after)}, more than the ledger can hold")
    return Asked(policy, found, key, amount, before, after)


def grants_view(bundle: PolicyBundle, policy: BudgetPolicy, ledger_key: str) -> dict[str, Any]:
    """The limit of a budget's window as the reports show it: the policy's, what was granted, and
    each grant."""
    found = bundle.granted(policy.id, ledger_key)
    unit = policy.limit.unit
    return {
        "policy_limit": display(unit, policy.limit.amount),
        "granted": display(unit, sum(g.amount for g in found)),
        "grants": [g.view() for g in found],
    }


def from_row(row: Mapping[str, Any]) -> Grant:
    """A budget_grants row as a Grant."""
    return Grant(
        revision=row["revision"],
        policy_id=row["policy_id"],
        scope_id=row["scope_id"],
        unit=Unit(row["unit"]),
        ledger_key=row["ledger_key"],
        window_start=row["window_start"],
        window_end=row["window_end"],
        amount=row["amount"],
        limit_before=row["limit_before"],
        limit_after=row["limit_after"],
        actor=row["actor"],
        reason=row["reason"],
        granted_at=row["granted_at"],
    )
