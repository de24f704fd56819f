"""The ledger key a budget's charges in one window are filed under: `<scope>|<window>|<unit>`.

Built and parsed only here, so the services exchange this value, never a string format that each
of them re-parses. The window part is `<start>/<end>` (UTC, seconds) for a calendar window and
`rolling-<n>d` for a rolling one.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime

from budgetgate.core.policy import BudgetPolicy
from budgetgate.core.windows import Window

# The largest amount the ledger holds in one figure (Postgres bigint and Redis HINCRBY are int64;
# below 2**53 a figure is also exact as a Lua number and in JSON). A million GPUs for ten years is
# about 3.2e17 GPU-milliseconds, so no real budget gets near it.
MAX_AMOUNT = 2**53 - 1

_SEPARATOR = "|"
_STAMP = "%Y-%m-%dT%H:%M:%SZ"


class AmountOutOfRange(ValueError):
    """An amount the ledger's integers cannot hold."""


def checked(amount: int, what: str) -> int:
    """`amount` if the ledger can hold it (and its negation), else AmountOutOfRange."""
    if not -MAX_AMOUNT <= amount <= MAX_AMOUNT:
        raise AmountOutOfRange(f"{what} of {amount} is beyond the ledger's range (±{MAX_AMOUNT})")
    return amount


@dataclass(frozen=True, slots=True, order=True)
class LedgerKey:
    scope_id: str
    window_key: str
    unit: str

    @classmethod
    def of(cls, policy: BudgetPolicy, window: Window) -> LedgerKey:
        """The key of `policy`'s charges in `window`."""
        return cls(policy.scope.scope_id, window.key, str(policy.limit.unit))

    @staticmethod
    def text_of(policy: BudgetPolicy, window: Window) -> str:
        """`str(LedgerKey.of(policy, window))`, without the object (once per charge per decision)."""
        return _SEPARATOR.join((policy.scope.scope_id, window.key, policy.limit.unit.value))

    @classmethod
    def parse(cls, text: str) -> LedgerKey:
        """The key written as `str(key)`; the scope may itself contain the separator."""
        scope_id, sep, rest = text.rpartition(_SEPARATOR)
        scope_id, sep2, window_key = scope_id.rpartition(_SEPARATOR)
        if not (sep and sep2 and scope_id and window_key and rest):
            raise ValueError(f"not a ledger key: {text!r}")
        return cls(scope_id, window_key, rest)

    def __str__(self) -> str:
        return _SEPARATOR.join((self.scope_id, self.window_key, self.unit))

    @property
    def rolling(self) -> bool:
        return self.window_key.startswith("rolling-")

    def window(self) -> Window | None:
        """The calendar window the key names; None for a rolling window (it has no fixed bounds)."""
        if self.rolling:
            return None
        start, _, end = self.window_key.partition("/")
        return Window(_instant(start), _instant(end), self.window_key)


def _instant(text: str) -> datetime:
    return datetime.strptime(text, _STAMP).replace(tzinfo=UTC)
