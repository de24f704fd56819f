"""Escrow: a budget whose runs fall under several roots of the account tree, carved into leases.

A decision reserves only on its own root's shard of the Redis ledger (one script, one slot, all
or none). A budget that roots share (all the H100 hours of the company, a cost-center spanning
organisations) is therefore split into leases, one per root: each root reserves on its own
slice, and the slices together never exceed the budget's limit (escrow, O'Neil 1986; Doorman's
capacity leases). A slice grows by a grant taken from what no slice holds, and shrinks by a
return of what its root has not reserved or consumed. This module is the arithmetic, pure; the
moves themselves are budgetgate.ledger.escrow_leases's.

The figures, in the budget's unit (per window, as its ledger key):
- a lease's `size` is what its root may hold; `used` what it holds: reserved plus consumed;
- `free` is what a grant may give: the limit less, for every lease, the larger of its size and
  its use. Use beyond a size comes of settlements whose actual usage exceeded what was reserved
  (admission never reserves past a size): it is taken from what is free, as on a budget of one
  ledger key, where consumption past the limit leaves nothing to reserve.

Promises (tests/property/test_escrow_arithmetic.py):
- a grant never makes the sizes, with use beyond them, exceed the limit;
- a return never shrinks a lease below its use, so nothing reserved is lost;
- with no settlement above its reservation, the use of all leases together never exceeds the limit.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from budgetgate.core.ledger_key import LedgerKey

# Between the budget's scope and the root in a lease's scope id: `<scope id>@<root>`. A scope id
# is made of namespaces, labels and account ids, none of which holds it.
LEASE_SEPARATOR = "@"


def lease_key(ledger_key: str, root: str) -> str:
    """The ledger key of `root`'s lease of the budget filed under `ledger_key`: the same window
    and unit, its scope the budget's with the root after it."""
    if not root or LEASE_SEPARATOR in root:
        raise ValueError(f"not a root a lease can be filed under: {root!r}")
    key = LedgerKey.parse(ledger_key)
    if LEASE_SEPARATOR in key.scope_id:
        raise ValueError(f"{ledger_key!r} is a lease already, not a budget's ledger key")
    return str(LedgerKey(f"{key.scope_id}{LEASE_SEPARATOR}{root}", key.window_key, key.unit))


def lease_of(lease: str) -> tuple[str, str] | None:
    """The budget's ledger key and the root of a lease's ledger key; None for any other key."""
    key = LedgerKey.parse(lease)
    scope_id, separator, root = key.scope_id.rpartition(LEASE_SEPARATOR)
    if not separator or not scope_id or not root:
        return None
    return str(LedgerKey(scope_id, key.window_key, key.unit)), root


@dataclass(frozen=True, slots=True)
class Lease:
    """One root's slice: what it may hold, and what it holds."""

    size: int
    reserved: int = 0
    consumed: int = 0

    def __post_init__(self) -> None:
        if self.size < 0 or self.reserved < 0 or self.consumed < 0:
            raise ValueError(f"a lease's figures are never negative: {self}")

    @property
    def used(self) -> int:
        return self.reserved + self.consumed

    @property
    def unused(self) -> int:
        """What its root may still reserve (0 when settlements took it past its size)."""
        return max(self.size - self.used, 0)

    @property
    def held(self) -> int:
        """What it keeps from every other root: its size, or its use where that is larger."""
        return max(self.size, self.used)

    def fits(self, amount: int) -> bool:
        """Whether a reservation of `amount` fits in it (admission's test, in reserve.lua)."""
        return amount <= self.size - self.used


def free(limit: int, leases: Iterable[Lease]) -> int:
    """What a grant may still give: the limit less what every lease holds (negative when
    settlements took the leases past the limit together)."""
    return limit - sum(lease.held for lease in leases)


def grantable(limit: int, leases: Iterable[Lease], want: int, *, least: int | None = None) -> int:
    """How much of `want` a grant gives now: all of it, what is free, or nothing. With `least`
    (a refill: what its decisions lack, `want` being that in whole chunks), when not all of
    `want` is free it gives only `least` of what is, so the rest stays free for other roots'
    refills rather than sit unused in this lease."""
    if want < 0:
        raise ValueError(f"a grant asks for a positive amount, not {want}")
    room = free(limit, leases)
    if least is not None and room < want:
        want = min(want, max(least, 0))
    return max(min(want, room), 0)


def returnable(lease: Lease, want: int) -> int:
    """How much of `want` a return takes from `lease`: never what its root holds."""
    if want < 0:
        raise ValueError(f"a return gives back a positive amount, not {want}")
    return min(want, lease.unused)


def chunk_of(limit: int, share: float) -> int:
    """The chunk of a budget's leases: `share` of its limit, rounded up, at least 1. Refills ask
    for whole chunks, and an idle lease keeps one unused (so its root's next decisions do not
    each ask for a refill)."""
    if not 0 < share <= 1:
        raise ValueError(f"a chunk is a share of the limit in (0, 1], not {share}")
    return max(math.ceil(limit * share), 1)


# A refill's chunk is at most this many times the reservation that asked for it.
REFILL_DECISIONS = 16


def refill_chunk(limit: int, share: float, amount: int) -> int:
    """The chunk a refill for a reservation of `amount` asks in: the budget's chunk (`chunk_of`),
    or REFILL_DECISIONS such reservations when that is less. A lease thus grows with what its
    root asks for, a few decisions ahead, and many roots together do not carve a budget into
    chunks none of them uses (with 2 % chunks, fifty roots would hold the whole limit)."""
    return max(min(chunk_of(limit, share), REFILL_DECISIONS * amount), 1)


def idle_return(lease: Lease, *, keep: int) -> int:
    """What an idle lease gives back: what its root holds neither reserved nor consumed, beyond
    `keep` (a chunk of headroom)."""
    return max(lease.unused - max(keep, 0), 0)


def refill_wanted(lease: Lease, amount: int, *, chunk: int) -> int:
    """What a root whose lease cannot hold a reservation of `amount` asks for: what it lacks,
    rounded up to whole `chunk`s, so that the next reservations do not each ask again."""
    if chunk < 1:
        raise ValueError(f"a refill's chunk is at least 1, not {chunk}")
    short = lacking(lease, amount)
    return -(-short // chunk) * chunk


# The most other leases one refill reclaims from (all in its one ledger transaction).
RECLAIM_FROM_AT_MOST = 8


def lacking(lease: Lease, amount: int) -> int:
    """What `lease` lacks for a reservation of `amount` (0: it fits)."""
    return max(amount - (lease.size - lease.used), 0)


def reclaim_candidates(leases: Mapping[str, Lease], root: str, *, most: int = RECLAIM_FROM_AT_MOST) -> list[tuple[str, int]]:
    """The other roots' leases a refill of `root`'s that found too little free asks to give back,
    with the room each holds unused: the most unused first, at most `most` of them. Each return
    still takes no more than its root holds unused when it is made (`returnable`, and lease.lua
    on Redis's figures), so a reservation in flight keeps its room."""
    found = sorted(((other, lease.unused) for other, lease in leases.items() if other != root and lease.unused > 0), key=lambda c: (-c[1], c[0]))
    return found[:most]


def reclaim_plan(leases: Mapping[str, Lease], root: str, need: int, *, most: int = RECLAIM_FROM_AT_MOST) -> list[tuple[str, int]]:
    """What such a refill asks of each candidate (`reclaim_candidates`) to meet `need`, were every
    one to give what it holds unused."""
    asks: list[tuple[str, int]] = []
    for other, unused in reclaim_candidates(leases, root, most=most):
        if need <= 0:
            break
        asks.append((other, min(unused, need)))
        need -= asks[-1][1]
    return asks
