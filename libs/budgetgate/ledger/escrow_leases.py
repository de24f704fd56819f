"""Escrow leases: the slices of a budget that several roots of the account tree share, grown by
grants and shrunk by returns, each move made in Postgres and Redis together and recorded
(escrow_moves, migration 0041). The arithmetic is budgetgate.core.escrow's.

Postgres holds each lease's size; Redis holds it too, beside what the lease's root reserved and
consumed, and admission tests a reservation on a lease against that size (reserve.lua's lease
charges). Every move runs as one ledger transaction (budgetgate.ledger.transaction: the ledger
lock held shared from before the Redis step until the commit, so a rebuild never falls in
between), with the budget's entry locked in Postgres (every move takes that lock first):

- a grant takes from what no lease holds (`core.escrow.grantable`, from Postgres's figures),
  grows Redis's lease, then commits the new size;
- a return shrinks Redis's lease first, by at most what its root holds neither reserved nor
  consumed (lease.lua decides, atomically with admission's reservations), then commits the new
  size with the ledger sequence the shrinking advanced Redis to (ledger_marks).

So Redis's size is never above Postgres's for long enough to admit on: a Redis step whose commit
failed, or may have, invalidates the Redis ledger (it is rebuilt from Postgres, sizes included);
a Redis that loses a return (a replica promoted before it had it) is behind the sequence Postgres
committed, and is rebuilt before it decides; one that loses a grant holds a smaller lease than
Postgres granted, which refuses more, never less, and is rebuilt at its lease's next move (the
sizes differ: lease.lua answers STALE).

A decision its root's lease refuses gets a synchronous refill (`refill`) before it is refused:
what is free, and when that is too little, what it still lacks reclaimed from the room other
roots' leases hold unused (returns recorded as `reclaim:<root>`), so a decision is refused only
when the budget lacks room, not for room idle in other leases. The reconciler gives back, at
every orphan sweep, what idle leases do not use beyond a chunk (`return_idle`), so it is free
for other roots' refills.

The roots' shards: every lease lives on its root's shard of the Redis ledger (`shard_of`); until
the ledger is sharded by root (docs/scale-out.md), every root's shard is the one Redis ledger.

What is carved: a budget (`BudgetBook`, its limit its ledger entry's, a lease's use its
reservations and consumption), or a counter tenants share (`CounterBook`: the sensitive-workload
pool, its limit the bundle's size, a lease's use what its tenant's sensitive runs hold at once,
in run_holds and on the lease's counter in Redis; migration 0045). The moves are the same; a
counter's lease is sized in the pool's unit when it is granted (migration 0047), and the first
grant after the pool is counted in another unit empties every lease sized in the former one
(`void_other_units`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Literal

import asyncpg

from budgetgate.core import escrow
from budgetgate.core.escrow import Lease
from budgetgate.core.ledger_key import LedgerKey
from budgetgate.ledger.holds import sensitive_lease
from budgetgate.ledger.queries import sql
from budgetgate.ledger.redis_ledger import LedgerKeyMissing, LedgerNotLoaded, RedisLedger
from budgetgate.ledger.transaction import LedgerTransaction, committed_seq, ledger_transaction, record_ledger_mark

log = logging.getLogger(__name__)


class UnknownBudget(LookupError):
    """The budget has no ledger entry: nothing to carve leases from."""


@dataclass(frozen=True, slots=True)
class BudgetBook:
    """The leases of a budget tenants share: each a ledger key of its own (core.escrow.lease_key)."""

    ledger_key: str
    counted_in = None  # (a lease's use is its ledger key's reserved + consumed)

    @property
    def moves_key(self) -> str:
        return self.ledger_key

    def lease(self, root: str) -> str:
        return escrow.lease_key(self.ledger_key, root)

    async def open(self, conn: asyncpg.Connection | asyncpg.Pool, root: str) -> str:
        lease = self.lease(root)
        if await conn.fetchval(sql("escrow_open"), self.ledger_key, root, lease, LedgerKey.parse(lease).scope_id) is None:
            raise UnknownBudget(f"budget {self.ledger_key!r} has no ledger entry to carve leases from")
        return lease

    async def lock(self, conn: asyncpg.Connection) -> int:
        """Lock the budget's entry, which every move of its leases takes first, so they are made
        one at a time; its limit."""
        return int(await conn.fetchval(sql("escrow_lock_budget"), self.ledger_key))

    async def leases(self, conn: asyncpg.Connection | asyncpg.Pool) -> dict[str, Lease]:
        """Every lease by root, with what Postgres knows it holds (a move reads them under `lock`)."""
        return (await self.figures(conn))[1]

    async def figures(self, conn: asyncpg.Connection | asyncpg.Pool) -> tuple[int | None, dict[str, Lease]]:
        """The budget's limit (None before it has a lease) and its leases, read in one statement."""
        rows = await conn.fetch(sql("escrow_leases_read"), self.ledger_key)
        return (rows[0]["limit_amount"] if rows else None), {row["root"]: Lease(row["size"], row["reserved"], row["consumed"]) for row in rows}

    async def record(self, conn: asyncpg.Connection, root: str, kind: str, size_after: int, amount: int, seq: int | None, reason: str) -> None:
        await conn.execute(sql("escrow_move"), self.ledger_key, root, kind, size_after, amount, seq, reason)

    async def load(self, conn: asyncpg.Connection, ledger: RedisLedger, lease: str) -> None:
        """Load a lease's key Redis never had, from Postgres."""
        row = await conn.fetchrow(sql("ledger_figures"), [lease])
        await ledger.load_key(lease, reserved=row["reserved"], consumed=row["consumed"], size=row["size"])

    async def live(self, ledger: RedisLedger, root: str) -> tuple[int, int] | None:
        """What the lease holds in Redis (reserved, consumed); None when Redis has no key for it."""
        lease = self.lease(root)
        return (await ledger.readings([lease])).get(lease)


@dataclass(frozen=True, slots=True)
class CounterBook:
    """The leases of a counter tenants share: the sensitive-workload pool of `limit` GPUs or
    nodes (`counted_in`), the bundle's. Each tenant's lease is a counter on its shard
    (holds.sensitive_lease) that its sensitive runs count on, its size what they may hold."""

    counter: str
    counted_in: str  # gpus | nodes
    limit: int

    @property
    def moves_key(self) -> str:
        return f"counter:{self.counter}"

    def lease(self, root: str) -> str:
        return sensitive_lease(root)

    async def open(self, conn: asyncpg.Connection | asyncpg.Pool, root: str) -> str:
        await conn.execute(sql("counter_escrow_open"), self.counter, root)
        return self.lease(root)

    async def lock(self, conn: asyncpg.Connection) -> int:
        """Lock the counter's row (the order every move locks in); the pool's size."""
        await conn.fetchval(sql("counter_escrow_lock"), self.counter)
        return self.limit

    async def leases(self, conn: asyncpg.Connection | asyncpg.Pool) -> dict[str, Lease]:
        """Every lease by tenant (and what tenants without one hold), with what Postgres knows its
        runs hold (a move reads them under `lock`)."""
        rows = await conn.fetch(sql("counter_leases_figures"), self.counter, self.counted_in)
        return {row["root"]: Lease(row["size"], row["reserved"], row["consumed"]) for row in rows}

    async def figures(self, conn: asyncpg.Connection | asyncpg.Pool) -> tuple[int | None, dict[str, Lease]]:
        """The pool's size and its leases."""
        return self.limit, await self.leases(conn)

    async def record(self, conn: asyncpg.Connection, root: str, kind: str, size_after: int, amount: int, seq: int | None, reason: str) -> None:
        """(The lease is sized in the pool's unit from now on: a move is made in it.)"""
        await conn.execute(sql("counter_escrow_move"), self.counter, root, kind, size_after, amount, seq, reason, self.counted_in)

    async def sized_otherwise(self, conn: asyncpg.Connection | asyncpg.Pool) -> dict[str, int]:
        """The leases sized in another unit than the pool's (or in none recorded, from before
        units were), by tenant: their size, in that unit."""
        return {row["root"]: row["size"] for row in await conn.fetch(sql("counter_leases_otherwise"), self.counter, self.counted_in)}

    async def load(self, conn: asyncpg.Connection, ledger: RedisLedger, lease: str) -> None:
        raise AssertionError("a counter's lease is never missing: lease.lua reads an absent counter as empty")

    async def live(self, ledger: RedisLedger, root: str) -> tuple[int, int] | None:
        """What the tenant's sensitive runs hold in Redis (as reserved, nothing consumed)."""
        held = await ledger.client.hget(ledger.keys.counter(self.lease(root)), self.counted_in)
        return None if held is None else (int(held), 0)


Book = BudgetBook | CounterBook


def _book(what: str | Book) -> Book:
    """A budget's ledger key stands for its book."""
    return BudgetBook(what) if isinstance(what, str) else what


class Escrow:
    """Grants and returns of the leases of budgets (and counters) shared by roots."""

    def __init__(self, pool: asyncpg.Pool, shard_of: Callable[[str], RedisLedger]) -> None:
        self.pool = pool
        self.shard_of = shard_of  # root -> the Redis ledger of its shard

    async def open(self, what: str | Book, root: str) -> str:
        """Create `root`'s lease of the budget filed under `what` (a ledger key, or a book)
        (size 0) unless it exists; its name. Raises UnknownBudget when the budget has no ledger entry."""
        return await _book(what).open(self.pool, root)

    async def grant(self, what: str | Book, root: str, want: int, *, reason: str, least: int | None = None) -> int:
        """Grow `root`'s lease by `want`, or by what is free of the budget's limit when that is
        less (by no more than `least` then, when given: core.escrow.grantable); what it grew by
        (0: nothing was free, and nothing was written)."""
        book = _book(what)
        lease_key = await book.open(self.pool, root)
        if isinstance(book, CounterBook):
            await self.void_other_units(book)
        ledger = self.shard_of(root)
        async with ledger_transaction(self.pool, ledger) as work:
            limit = await book.lock(work.conn)
            leases = await book.leases(work.conn)
            given = escrow.grantable(limit, leases.values(), want, least=least)
            if given <= 0:
                return 0
            size = leases[root].size
            moved, _ = await self._move(work, book, ledger, lease_key, size=size, how="grow", amount=given)
            await book.record(work.conn, root, "grant", size + moved, moved, None, reason)
        log.info("escrow: granted %d to %s's lease of %s (%s)", moved, root, book.moves_key, reason)
        return moved

    async def give_back(self, what: str | Book, root: str, want: int, *, reason: str) -> int:
        """Shrink `root`'s lease by `want`, or by what its root holds neither reserved nor
        consumed when that is less; what it shrank by (0: nothing written)."""
        book = _book(what)
        lease_key = await book.open(self.pool, root)
        ledger = self.shard_of(root)
        async with ledger_transaction(self.pool, ledger) as work:
            await book.lock(work.conn)  # the order every move locks in
            lease = (await book.leases(work.conn))[root]
            size = lease.size
            if escrow.returnable(lease, want) <= 0:
                return 0  # what Postgres knows it holds already takes it all; Redis holds no less
            moved, seq = await self._move(work, book, ledger, lease_key, size=size, how="shrink", amount=want)
            if moved <= 0:
                return 0
            await record_ledger_mark(work.conn, ledger, seq)
            await book.record(work.conn, root, "return", size - moved, moved, seq, reason)
        log.info("escrow: %s gave back %d of its lease of %s (%s)", root, moved, book.moves_key, reason)
        return moved

    async def refill(self, what: str | Book, root: str, *, amount: int, seen: Lease, chunk: int) -> int:
        """The synchronous refill decisions get when `root`'s lease, as Redis read it in their
        refusal (`seen`: its size, reserved and consumed), had no room for their reservations of
        `amount` together: a grant of what the lease lacked, in whole `chunk`s
        (core.escrow.refill_wanted) when that much is free, else of what it lacked (the rest left
        free for other roots' refills); when less than that is free, what it still lacks is
        moved into it from the room other roots' leases hold unused (`_reclaim`). Reckoned on the
        lease as the decisions saw it, not as it is now: a refill since, for other decisions, is
        theirs to use. What the lease grew by (0: nothing was free, nor idle in any lease); the
        caller reserves once more, and refuses a decision that does not fit then either."""
        book = _book(what)
        lacking, want = escrow.lacking(seen, amount), escrow.refill_wanted(seen, amount, chunk=chunk)
        if lacking <= 0:
            return 0
        granted = await self.grant(book, root, want, reason="refill", least=lacking)
        if granted < lacking:
            granted += await self._reclaim(book, root, lacking - granted)
        return granted

    @contextlib.asynccontextmanager
    async def _every_shard(self, book: Book, ledger: RedisLedger) -> AsyncIterator[tuple[LedgerTransaction, int]]:
        """A ledger transaction on `ledger`'s shard holding every shard's lock (in shard order),
        then `book`'s row, as every move takes them: yields it and the book's limit. Each move
        marks the shard it changes (`_move`), so should the transaction fail, every shard it
        changed is invalidated, its lock still held (ledger_transaction)."""
        async with ledger_transaction(self.pool, ledger) as work:
            await work.conn.execute(sql("lock_every_shard_shared"), ledger.shards.count)
            limit = await book.lock(work.conn)
            yield work, limit

    async def _reclaim(self, book: Book, root: str, need: int) -> int:
        """Too little was free for `root`'s refill: in one ledger transaction, holding every
        shard's lock (in shard order, then the budget's entry, as every move), take
        what is free and then the room other roots' leases hold unused (core.escrow's
        reclaim_candidates on the locked figures, passing over a shard that cannot answer; each shrink takes no more than Redis says its root holds unused, so
        a reservation in flight keeps its room), and grow `root`'s lease by all of it at once, so
        no other refill takes it in between. What the lease grew by."""
        lease_key = await book.open(self.pool, root)
        ledger = self.shard_of(root)
        async with self._every_shard(book, ledger) as (work, limit):
            leases = await book.leases(work.conn)
            got = min(max(escrow.free(limit, leases.values()), 0), need)
            for other, unused in escrow.reclaim_candidates(leases, root):
                take = min(unused, need - got)
                if take <= 0:
                    break
                giver, size = self.shard_of(other), leases[other].size
                try:
                    moved, seq = await self._move(work, book, giver, book.lease(other), size=size, how="shrink", amount=take)
                except LedgerNotLoaded as exc:  # that shard is being rebuilt (or was just invalidated): the others may give
                    log.info("escrow: no reclaim from %s's lease of %s for now: %s", other, book.moves_key, exc)
                    continue
                if moved > 0:
                    await record_ledger_mark(work.conn, giver, seq)
                    await book.record(work.conn, other, "return", size - moved, moved, seq, f"reclaim:{root}")
                    got += moved
            if got <= 0:
                return 0
            size = leases[root].size
            grown, _ = await self._move(work, book, ledger, lease_key, size=size, how="grow", amount=got)
            await book.record(work.conn, root, "grant", size + grown, grown, None, "refill")
        log.info("escrow: moved %d into %s's lease of %s, from what was free and other leases' idle room", grown, root, book.moves_key)
        return grown

    async def void_other_units(self, book: CounterBook) -> int:
        """Empty every lease of `book`'s pool sized in another unit than the pool is counted in
        now (the bundle changed its sensitive_unit), before any lease is granted in this one: in
        one ledger transaction holding every shard's lock (in shard order, then the pool's row, as
        every move), each on its shard (lease.lua's void, which advances that shard's sequence,
        recorded with the move as a return's) and in Postgres, sized in the pool's unit from then
        on. So no size is read in a unit it was not granted in, nor comes back should the unit
        change back while runs admitted in the other unit hold what it would have covered. A
        shard that cannot answer fails it (and the grant that asked): none is left behind. How
        many leases it emptied."""
        if not await book.sized_otherwise(self.pool):
            return 0
        async with self._every_shard(book, self.shard_of("")) as (work, _):
            stale = await book.sized_otherwise(work.conn)
            for root, size in stale.items():
                holder = self.shard_of(root)
                moved, seq = await self._move(work, book, holder, book.lease(root), size=size, how="void", amount=size)
                if seq:
                    await record_ledger_mark(work.conn, holder, seq)
                await book.record(work.conn, root, "return", 0, moved, seq or None, f"unit:{book.counted_in}")
        log.info("escrow: the pool of %s is counted in %s: emptied the %d lease(s) sized otherwise", book.counter, book.counted_in, len(stale))
        return len(stale)

    async def refill_forecast(self, what: str | Book, root: str, *, amount: int, reading: tuple[int, int], chunk: int, limit: int) -> int:
        """What `refill` would grow `root`'s lease by now, from the same figures, writing nothing
        and locking nothing (a quote's forecast; `limit`: the budget's, when it has no entry yet)."""
        found, leases = await _book(what).figures(self.pool)
        limit = limit if found is None else found
        seen = Lease(leases.get(root, Lease(0)).size, *reading)
        want = escrow.refill_wanted(seen, amount, chunk=chunk)
        if want <= 0:
            return 0
        lacking = escrow.lacking(seen, amount)
        granted = escrow.grantable(limit, leases.values(), want, least=lacking)
        need = lacking - granted
        return granted + sum(take for _, take in escrow.reclaim_plan(leases, root, need)) if need > 0 else granted

    async def return_idle(self, *, idle: timedelta, chunk_share: float, now: datetime, counters: Sequence[CounterBook] = ()) -> dict[tuple[str, str], int]:
        """Give back, from every lease whose size has not moved for `idle`, what its root holds
        neither reserved nor consumed beyond one chunk (`chunk_share` of the budget's limit,
        core.escrow.chunk_of), so what a root no longer needs is free for the others' refills.
        Postgres chooses the leases; the amount is reckoned on Redis's figures where it has them
        (reservations in flight, which Postgres does not know of yet, keep their headroom), and
        Redis takes no more than its root holds unused when it shrinks (give_back). The leases of
        each counter of `counters` (the sensitive pool, at the bundle's size) too; and where a
        counter's leases hold more than its size (the bundle made the pool smaller), each gives
        back what its tenant does not hold, idle or not, until they fit. What each moved, by
        (budget or 'counter:<name>', root); leases that gave nothing are left out."""
        moved: dict[tuple[str, str], int] = {}
        idle_leases: list[tuple[Book, int, list[str]]] = []
        for budget in await self.pool.fetch(sql("escrow_budgets")):
            book = BudgetBook(budget["ledger_key"])
            roots = [row["root"] for row in await self.pool.fetch(sql("escrow_idle_leases"), budget["ledger_key"], now - idle)]
            idle_leases.append((book, escrow.chunk_of(budget["limit_amount"], chunk_share), roots))
        for counter in counters:
            await self.void_other_units(counter)
            leases = await counter.leases(self.pool)
            over = -escrow.free(counter.limit, leases.values())
            for root, unused in escrow.reclaim_candidates(leases, "", most=len(leases)) if over > 0 else ():
                if over <= 0:
                    break
                if given := await self.give_back(counter, root, min(unused, over), reason="pool made smaller"):
                    moved[counter.moves_key, root] = given
                    over -= given
            roots = [row["root"] for row in await self.pool.fetch(sql("counter_idle_roots"), counter.counter, now - idle)]
            idle_leases.append((counter, escrow.chunk_of(max(counter.limit, 1), chunk_share), roots))
        for book, keep, roots in idle_leases:
            leases = await book.leases(self.pool)
            for root in roots:
                lease = leases.get(root)
                if lease is None:
                    continue
                live = await book.live(self.shard_of(root), root) or (lease.reserved, lease.consumed)
                want = escrow.idle_return(Lease(lease.size, *live), keep=keep)
                if want > 0 and (given := await self.give_back(book, root, want, reason="idle")):
                    moved[book.moves_key, root] = moved.get((book.moves_key, root), 0) + given
        return moved

    async def _move(
        self, work: LedgerTransaction, book: Book, ledger: RedisLedger, lease_key: str, *, size: int, how: Literal["grow", "shrink", "void"], amount: int
    ) -> tuple[int, int]:
        """The Redis step of a move, the lease's key loaded from Postgres first if Redis never had it."""
        committed = await committed_seq(work.conn, ledger)
        work.changing(ledger)
        try:
            return await ledger.move_lease(lease_key, size=size, how=how, amount=amount, committed_seq=committed, counted_in=book.counted_in)
        except LedgerKeyMissing:
            await book.load(work.conn, ledger, lease_key)
            return await ledger.move_lease(lease_key, size=size, how=how, amount=amount, committed_seq=committed, counted_in=book.counted_in)


async def escrow_report(conn: asyncpg.Connection, *, sensitive: CounterBook | None, since: datetime) -> list[dict[str, object]]:
    """What every budget carved into leases, and the sensitive pool (`sensitive`, at the bundle's
    size; None when the bundle declares none), hold now as Postgres knows it (Redis may hold
    reservations in flight on top): the limit, what no lease holds (`free`), each lease's size,
    use and unused room, and the moves made since `since` by kind and reason. For an operator
    (`budgetgate ledger leases`)."""
    moves: dict[str, list[dict[str, object]]] = {}
    for row in await conn.fetch(sql("escrow_moves_since"), since):
        moves.setdefault(row["ledger_key"], []).append({"kind": row["kind"], "reason": row["reason"], "moves": row["moves"], "amount": row["amount"]})
    books: list[tuple[Book, int]] = [(BudgetBook(row["ledger_key"]), row["limit_amount"]) for row in await conn.fetch(sql("escrow_budgets"))]
    if sensitive is not None and any(row["counter"] == sensitive.counter for row in await conn.fetch(sql("counter_lease_sizes"))):
        books.append((sensitive, sensitive.limit))  # (carved only on a ledger of several shards)
    report = []
    for book, limit in books:
        leases = await book.leases(conn)
        if not leases:
            continue
        report.append({
            "carved": book.moves_key,
            "unit": book.counted_in or LedgerKey.parse(book.moves_key).unit,
            "limit": limit,
            "free": escrow.free(limit, leases.values()),
            "leases": [{"root": root, "size": lease.size, "used": lease.used, "unused": lease.unused} for root, lease in sorted(leases.items())],
            "moves": moves.get(book.moves_key, []),
        })  # fmt: skip
    return report
