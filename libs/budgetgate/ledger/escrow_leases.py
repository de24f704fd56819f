"""Escrow leases: the slices of a budget that several roots of the account tree share, grown by
grants and shrunk by returns, each move made in Postgres and Redis together and recorded
(escrow_moves, migration 0041). The arithmetic is budgetgate.core.escrow's.

Postgres holds each lease's size; Redis holds it too, beside what the lease's root reserved and
consumed, and admission tests a reservation on a lease against that size (reserve.lua's lease
charges). Every move runs as one ledger transaction (budgetgate.ledger.transaction: the ledger
lock held shared from before the Redis step until the commit, so a rebuild never falls in
between), with the budget's entry and its leases locked in Postgres:

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
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import datetime, timedelta

import asyncpg

from budgetgate.core import escrow
from budgetgate.core.escrow import Lease
from budgetgate.core.ledger_key import LedgerKey
from budgetgate.ledger.queries import sql
from budgetgate.ledger.redis_ledger import LedgerKeyMissing, LedgerNotLoaded, RedisLedger
from budgetgate.ledger.transaction import LedgerTransaction, committed_seq, ledger_transaction, record_ledger_mark

log = logging.getLogger(__name__)


class UnknownBudget(LookupError):
    """The budget has no ledger entry: nothing to carve leases from."""


class Escrow:
    """Grants and returns of the leases of budgets shared by roots."""

    def __init__(self, pool: asyncpg.Pool, shard_of: Callable[[str], RedisLedger]) -> None:
        self.pool = pool
        self.shard_of = shard_of  # root -> the Redis ledger of its shard

    async def open(self, ledger_key: str, root: str) -> str:
        """Create `root`'s lease of the budget filed under `ledger_key` (size 0) unless it exists;
        its ledger key. Raises UnknownBudget when the budget has no ledger entry."""
        lease = escrow.lease_key(ledger_key, root)
        scope_id = LedgerKey.parse(lease).scope_id
        if await self.pool.fetchval(sql("escrow_open"), ledger_key, root, lease, scope_id) is None:
            raise UnknownBudget(f"budget {ledger_key!r} has no ledger entry to carve leases from")
        return lease

    async def grant(self, ledger_key: str, root: str, want: int, *, reason: str, least: int | None = None) -> int:
        """Grow `root`'s lease by `want`, or by what is free of the budget's limit when that is
        less (by no more than `least` then, when given: core.escrow.grantable); what it grew by
        (0: nothing was free, and nothing was written)."""
        lease_key = await self.open(ledger_key, root)
        ledger = self.shard_of(root)
        async with ledger_transaction(self.pool, ledger) as work:
            limit = await work.conn.fetchval(sql("escrow_lock_budget"), ledger_key)
            leases = await _locked(work.conn, ledger_key)
            given = escrow.grantable(limit, leases.values(), want, least=least)
            if given <= 0:
                return 0
            size = leases[root].size
            moved, _ = await self._move(work, ledger, lease_key, size=size, grow=True, amount=given)
            await work.conn.execute(sql("escrow_move"), ledger_key, root, "grant", size + moved, moved, None, reason)
        log.info("escrow: granted %d to %s's lease of %s (%s)", moved, root, ledger_key, reason)
        return moved

    async def give_back(self, ledger_key: str, root: str, want: int, *, reason: str) -> int:
        """Shrink `root`'s lease by `want`, or by what its root holds neither reserved nor
        consumed when that is less; what it shrank by (0: nothing written)."""
        lease_key = await self.open(ledger_key, root)
        ledger = self.shard_of(root)
        async with ledger_transaction(self.pool, ledger) as work:
            await work.conn.fetchval(sql("escrow_lock_budget"), ledger_key)  # the order every move locks in
            lease = (await _locked(work.conn, ledger_key))[root]
            size = lease.size
            if escrow.returnable(lease, want) <= 0:
                return 0  # what Postgres knows it holds already takes it all; Redis holds no less
            moved, seq = await self._move(work, ledger, lease_key, size=size, grow=False, amount=want)
            if moved <= 0:
                return 0
            await record_ledger_mark(work.conn, ledger, seq)
            await work.conn.execute(sql("escrow_move"), ledger_key, root, "return", size - moved, moved, seq, reason)
        log.info("escrow: %s gave back %d of its lease of %s (%s)", root, moved, ledger_key, reason)
        return moved

    async def refill(self, ledger_key: str, root: str, *, amount: int, seen: Lease, chunk: int) -> int:
        """The synchronous refill decisions get when `root`'s lease, as Redis read it in their
        refusal (`seen`: its size, reserved and consumed), had no room for their reservations of
        `amount` together: a grant of what the lease lacked, in whole `chunk`s
        (core.escrow.refill_wanted) when that much is free, else of what it lacked (the rest left
        free for other roots' refills); when less than that is free, what it still lacks is
        moved into it from the room other roots' leases hold unused (`_reclaim`). Reckoned on the
        lease as the decisions saw it, not as it is now: a refill since, for other decisions, is
        theirs to use. What the lease grew by (0: nothing was free, nor idle in any lease); the
        caller reserves once more, and refuses a decision that does not fit then either."""
        lacking, want = escrow.lacking(seen, amount), escrow.refill_wanted(seen, amount, chunk=chunk)
        if lacking <= 0:
            return 0
        granted = await self.grant(ledger_key, root, want, reason="refill", least=lacking)
        if granted < lacking:
            granted += await self._reclaim(ledger_key, root, lacking - granted)
        return granted

    async def _reclaim(self, ledger_key: str, root: str, need: int) -> int:
        """Too little was free for `root`'s refill: in one ledger transaction, holding every
        shard's lock (in shard order, then the budget's and its leases' rows, as every move), take
        what is free and then the room other roots' leases hold unused (core.escrow's
        reclaim_candidates on the locked figures, passing over a shard that cannot answer; each shrink takes no more than Redis says its root holds unused, so
        a reservation in flight keeps its room), and grow `root`'s lease by all of it at once, so
        no other refill takes it in between. What the lease grew by."""
        lease_key = await self.open(ledger_key, root)
        ledger = self.shard_of(root)
        shrunk: list[RedisLedger] = []
        try:
            async with ledger_transaction(self.pool, ledger) as work:
                await work.conn.execute(sql("lock_every_shard_shared"), ledger.shards.count)
                limit = await work.conn.fetchval(sql("escrow_lock_budget"), ledger_key)
                leases = await _locked(work.conn, ledger_key)
                got = min(max(escrow.free(limit, leases.values()), 0), need)
                for other, unused in escrow.reclaim_candidates(leases, root):
                    take = min(unused, need - got)
                    if take <= 0:
                        break
                    giver, size = self.shard_of(other), leases[other].size
                    try:
                        moved, seq = await self._move(work, giver, escrow.lease_key(ledger_key, other), size=size, grow=False, amount=take)
                    except LedgerNotLoaded as exc:  # that shard is being rebuilt (or was just invalidated): the others may give
                        log.info("escrow: no reclaim from %s's lease of %s for now: %s", other, ledger_key, exc)
                        continue
                    if moved > 0:
                        shrunk.append(giver)
                        await record_ledger_mark(work.conn, giver, seq)
                        await work.conn.execute(sql("escrow_move"), ledger_key, other, "return", size - moved, moved, seq, f"reclaim:{root}")
                        got += moved
                if got <= 0:
                    return 0
                size = leases[root].size
                grown, _ = await self._move(work, ledger, lease_key, size=size, grow=True, amount=got)
                await work.conn.execute(sql("escrow_move"), ledger_key, root, "grant", size + grown, grown, None, "refill")
        except BaseException:
            for giver in shrunk:  # (the receiver's shard is invalidated by ledger_transaction)
                if giver is not ledger:
                    await giver.invalidate("an escrow reclaim failed after shrinking a lease")
            raise
        log.info("escrow: moved %d into %s's lease of %s, from what was free and other leases' idle room", grown, root, ledger_key)
        return grown

    async def refill_forecast(self, ledger_key: str, root: str, *, amount: int, reading: tuple[int, int], chunk: int, limit: int) -> int:
        """What `refill` would grow `root`'s lease by now, from the same figures, writing nothing
        and locking nothing (a quote's forecast; `limit`: the budget's, when it has no entry yet)."""
        rows = await self.pool.fetch(sql("escrow_leases_read"), ledger_key)
        leases = {row["root"]: Lease(row["size"], row["reserved"], row["consumed"]) for row in rows}
        seen = Lease(leases.get(root, Lease(0)).size, *reading)
        want = escrow.refill_wanted(seen, amount, chunk=chunk)
        if want <= 0:
            return 0
        lacking = escrow.lacking(seen, amount)
        granted = escrow.grantable(rows[0]["limit_amount"] if rows else limit, leases.values(), want, least=lacking)
        need = lacking - granted
        return granted + sum(take for _, take in escrow.reclaim_plan(leases, root, need)) if need > 0 else granted

    async def return_idle(self, *, idle: timedelta, chunk_share: float, now: datetime) -> dict[tuple[str, str], int]:
        """Give back, from every lease whose size has not moved for `idle`, what its root holds
        neither reserved nor consumed beyond one chunk (`chunk_share` of the budget's limit,
        core.escrow.chunk_of), so what a root no longer needs is free for the others' refills.
        Postgres chooses the leases; the amount is reckoned on Redis's figures where it has them
        (reservations in flight, which Postgres does not know of yet, keep their headroom), and
        Redis takes no more than its root holds unused when it shrinks (give_back). What each
        moved, by (budget, root); leases that gave nothing are left out."""
        moved: dict[tuple[str, str], int] = {}
        for budget in await self.pool.fetch(sql("escrow_budgets")):
            keep = escrow.chunk_of(budget["limit_amount"], chunk_share)
            for row in await self.pool.fetch(sql("escrow_idle_leases"), budget["ledger_key"], now - idle):
                lease_key = escrow.lease_key(budget["ledger_key"], row["root"])
                live = (await self.shard_of(row["root"]).readings([lease_key])).get(lease_key, (row["reserved"], row["consumed"]))
                want = escrow.idle_return(Lease(row["size"], *live), keep=keep)
                if want > 0 and (given := await self.give_back(budget["ledger_key"], row["root"], want, reason="idle")):
                    moved[budget["ledger_key"], row["root"]] = given
        return moved

    async def _move(self, work: LedgerTransaction, ledger: RedisLedger, lease_key: str, *, size: int, grow: bool, amount: int) -> tuple[int, int]:
        """The Redis step of a move, the lease's key loaded from Postgres first if Redis never had it."""
        committed = await committed_seq(work.conn, ledger)
        work.redis_changed = True
        try:
            return await ledger.move_lease(lease_key, size=size, grow=grow, amount=amount, committed_seq=committed)
        except LedgerKeyMissing:
            row = await work.conn.fetchrow(sql("ledger_figures"), [lease_key])
            await ledger.load_key(lease_key, reserved=row["reserved"], consumed=row["consumed"], size=row["size"])
            return await ledger.move_lease(lease_key, size=size, grow=grow, amount=amount, committed_seq=committed)


async def _locked(conn: asyncpg.Connection, ledger_key: str) -> dict[str, Lease]:
    """Every lease of the budget by root, locked, with what Postgres knows it holds."""
    return {row["root"]: Lease(row["size"], row["reserved"], row["consumed"]) for row in await conn.fetch(sql("escrow_leases_locked"), ledger_key)}
