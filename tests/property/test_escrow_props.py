"""Escrow's arithmetic (budgetgate.core.escrow): however grants, returns, reservations and
settlements of several roots interleave, the leases never let the roots together admit more than
the budget's limit."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from budgetgate.core import escrow
from budgetgate.core.escrow import Lease

ROOTS = ("org-a", "org-b", "org-c")
amounts = st.integers(min_value=0, max_value=400)


class Leases(RuleBasedStateMachine):
    """Three roots sharing a budget. Each reservation is admitted only within its root's lease
    (reserve.lua's test); a refused one asks for a refill once and tries again, as admission
    does. Settlements end reservations with their actual usage, at most what was reserved
    unless `overage` (then a run used more than it asked for)."""

    def __init__(self) -> None:
        super().__init__()
        self.limit = 1_000
        self.leases = {root: Lease(0) for root in ROOTS}
        self.holds: list[tuple[str, int]] = []  # (root, amount) reserved and not yet settled
        self.overage = 0  # usage settled beyond what was reserved, over the whole run

    @rule(root=st.sampled_from(ROOTS), want=amounts)
    def grant(self, root: str, want: int) -> None:
        before = self._held()
        given = escrow.grantable(self.limit, self.leases.values(), want)
        assert 0 <= given <= want
        lease = self.leases[root]
        self.leases[root] = replace(lease, size=lease.size + given)
        # A grant never takes the leases past the limit: their sizes, with use beyond a size
        # (a settlement's overage) counted as held, as it is on a budget of one ledger key.
        assert self._held() <= max(self.limit, before)
        if given < want:
            assert given == max(self.limit - before, 0)  # it gave less only for lack of room: all there was

    def _held(self) -> int:
        return sum(max(lease.size, lease.reserved + lease.consumed) for lease in self.leases.values())

    @rule(root=st.sampled_from(ROOTS), want=amounts)
    def give_back(self, root: str, want: int) -> None:
        lease = self.leases[root]
        taken = escrow.returnable(lease, want)
        assert 0 <= taken <= want
        self.leases[root] = replace(lease, size=lease.size - taken)
        assert self.leases[root].size >= self.leases[root].used or taken == 0

    @rule(root=st.sampled_from(ROOTS), amount=st.integers(min_value=1, max_value=300), chunk=st.integers(min_value=1, max_value=200))
    def reserve(self, root: str, amount: int, chunk: int) -> None:
        lease = self.leases[root]
        room = self.limit - sum(lease.used for lease in self.leases.values())  # the budget's, all leases together
        if not lease.fits(amount):
            # The refill (Escrow.refill): what it lacks in whole chunks when that is free, else
            # what it lacks of what is; when too little is, the rest reclaimed from the others'
            # unused room.
            lacking, before = escrow.lacking(lease, amount), self._held()
            given = escrow.grantable(self.limit, self.leases.values(), escrow.refill_wanted(lease, amount, chunk=chunk), least=lacking)
            assert given <= max(self.limit - before, 0) and (given >= lacking or given == max(self.limit - before, 0))
            self.leases[root] = replace(lease, size=lease.size + given)
            need = lacking - given
            if need > 0:
                for other, take in escrow.reclaim_plan(self.leases, root, need):
                    assert other != root and 0 < take <= self.leases[other].unused
                    self.give_back(other, take)
                self.grant(root, need)
            lease = self.leases[root]
        if lease.fits(amount):
            self.leases[root] = replace(lease, reserved=lease.reserved + amount)
            self.holds.append((root, amount))
        elif self.overage == 0:
            # Refused only for want of room in the budget, never for room idle in other leases.
            assert room < amount

    @precondition(lambda self: self.holds)
    @rule(data=st.data(), overage=st.booleans())
    def settle(self, data: st.DataObject, overage: bool) -> None:
        root, amount = self.holds.pop(data.draw(st.integers(min_value=0, max_value=len(self.holds) - 1)))
        actual = data.draw(st.integers(min_value=0, max_value=amount + (200 if overage else 0)))
        self.overage += max(actual - amount, 0)
        lease = self.leases[root]
        self.leases[root] = replace(lease, reserved=lease.reserved - amount, consumed=lease.consumed + actual)

    @invariant()
    def never_over_the_limit(self) -> None:
        used = sum(lease.used for lease in self.leases.values())
        assert used <= self.limit + self.overage
        if self.overage == 0:
            assert sum(lease.size for lease in self.leases.values()) <= self.limit
            assert escrow.free(self.limit, self.leases.values()) >= 0

    @invariant()
    def no_lease_holds_more_than_its_size_but_by_overage(self) -> None:
        for lease in self.leases.values():
            assert lease.used <= lease.size + self.overage


TestLeases = Leases.TestCase
TestLeases.settings = settings(max_examples=300, stateful_step_count=60, deadline=None)


@given(
    size=st.integers(0, 10_000), reserved=st.integers(0, 10_000), consumed=st.integers(0, 10_000), amount=st.integers(1, 10_000), chunk=st.integers(1, 5_000)
)
def test_a_refill_asks_for_what_the_lease_lacks_in_whole_chunks(size: int, reserved: int, consumed: int, amount: int, chunk: int) -> None:
    lease = Lease(size, reserved, consumed)
    wanted = escrow.refill_wanted(lease, amount, chunk=chunk)
    if lease.fits(amount):
        assert wanted == 0
    else:
        assert wanted % chunk == 0
        assert replace(lease, size=size + wanted).fits(amount)  # enough, granted in full
        assert not replace(lease, size=size + wanted - chunk).fits(amount)  # and not a chunk more


@given(size=st.integers(0, 10_000), reserved=st.integers(0, 10_000), consumed=st.integers(0, 10_000), want=st.integers(0, 10_000))
def test_a_return_never_takes_what_the_root_holds(size: int, reserved: int, consumed: int, want: int) -> None:
    lease = Lease(size, reserved, consumed)
    taken = escrow.returnable(lease, want)
    assert 0 <= taken <= want
    assert size - taken >= min(size, reserved + consumed)


@given(size=st.integers(0, 10_000), reserved=st.integers(0, 10_000), consumed=st.integers(0, 10_000), keep=st.integers(0, 5_000))
def test_an_idle_lease_keeps_what_its_root_holds_and_a_chunk(size: int, reserved: int, consumed: int, keep: int) -> None:
    lease = Lease(size, reserved, consumed)
    given_back = escrow.idle_return(lease, keep=keep)
    assert given_back == escrow.returnable(lease, given_back)  # a return takes all of it
    after = replace(lease, size=size - given_back)
    assert after.unused == min(lease.unused, keep)


@given(limit=st.integers(0, 10**15), share=st.floats(min_value=1e-6, max_value=1.0))
def test_a_chunk_is_the_share_of_the_limit_rounded_up(limit: int, share: float) -> None:
    chunk = escrow.chunk_of(limit, share)
    assert chunk >= 1 and chunk >= limit * share and chunk - 1 < max(limit * share, 1)


def test_a_chunk_is_a_share_of_the_limit() -> None:
    for share in (0.0, -0.1, 1.5):
        with pytest.raises(ValueError, match="share of the limit"):
            escrow.chunk_of(1_000, share)


@given(root=st.from_regex(r"[a-z0-9][a-z0-9-]{0,20}", fullmatch=True))
def test_a_lease_key_names_its_budget_and_root(root: str) -> None:
    budget = "ns=vision-prod;team=vision|2026-11-01T00:00:00Z/2026-12-01T00:00:00Z|gpu_hours"
    lease = escrow.lease_key(budget, root)
    assert lease.endswith("|2026-11-01T00:00:00Z/2026-12-01T00:00:00Z|gpu_hours")
    assert escrow.lease_of(lease) == (budget, root)
    assert escrow.lease_of(budget) is None


def test_a_lease_of_a_lease_or_a_root_holding_the_separator_is_refused() -> None:
    budget = "cost-center=ml|rolling-30d|gpu_hours"
    with pytest.raises(ValueError, match="is a lease already"):
        escrow.lease_key(escrow.lease_key(budget, "org-a"), "org-b")
    with pytest.raises(ValueError, match="not a root"):
        escrow.lease_key(budget, "org@a")
    with pytest.raises(ValueError, match="not a root"):
        escrow.lease_key(budget, "")


@given(
    leases=st.dictionaries(st.sampled_from("abcdefghij"), st.tuples(st.integers(0, 500), st.integers(0, 300)), max_size=10),
    root=st.sampled_from(("a", "b")),
    need=st.integers(-5, 2_000),
    most=st.integers(1, 10),
)
def test_a_reclaim_asks_the_other_leases_for_their_unused_room_most_first_and_no_more_than_needed(
    leases: dict[str, tuple[int, int]], root: str, need: int, most: int
) -> None:
    figures = {r: Lease(size, min(used, size)) for r, (size, used) in leases.items()}
    asks = escrow.reclaim_plan(figures, root, need, most=most)
    assert len(asks) <= most and all(other != root for other, _ in asks)
    assert all(0 < take <= figures[other].unused for other, take in asks)
    assert sum(take for _, take in asks) <= max(need, 0)
    assert [figures[o].unused for o, _ in asks] == sorted((figures[o].unused for o, _ in asks), reverse=True)
    others = sorted((lease.unused for r, lease in figures.items() if r != root and lease.unused > 0), reverse=True)
    assert sum(take for _, take in asks) == min(max(need, 0), sum(others[:most]))  # all it needs, or all the most unused hold


@given(limit=st.integers(1, 10**12), share=st.floats(0.0001, 1.0), amount=st.integers(1, 10**10))
def test_a_refills_chunk_is_the_budgets_or_a_few_reservations_whichever_is_less(limit: int, share: float, amount: int) -> None:
    chunk = escrow.refill_chunk(limit, share, amount)
    assert 1 <= chunk <= escrow.chunk_of(limit, share)
    assert chunk == escrow.chunk_of(limit, share) or chunk == escrow.REFILL_DECISIONS * amount
