"""Settle one run: fold its new facts into its running state (budgetgate.core.run_state, at a
cost independent of the run's history), and apply how its charges moved — to Redis in one
script, then to Postgres, committed together (see transaction.py)."""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

import asyncpg

from budgetgate.core.policy import BudgetPolicy, PolicyBundle
from budgetgate.core.ledger_key import LedgerKey
from budgetgate.core.reconciliation import NOT_STARTED, READMITTED, STARTED, LifecycleFact, Reservation, Rules, RunFacts, Settlement
from budgetgate.core.run_state import given_back, settle_state
from budgetgate.core.windows import Window
from budgetgate.ledger.concurrency_holds import EndedHolds, end_run_holds, rehold_run, renew_run_token
from budgetgate.core.escrow import lease_of
from budgetgate.ledger.queries import owned_by
from budgetgate.ledger.queries import sql as ledger_sql
from budgetgate.ledger.redis_ledger import KeyChange, LedgerKeyMissing, LedgerNotLoaded, RedisLedger, SettlementPending
from budgetgate.ledger.sharded import OneShard, ShardedLedger
from budgetgate.services.reconciler import budget_actions, fairshare, headroom, messages, meter
from budgetgate.policies.policy_store import PolicyStore
from budgetgate.services.reconciler.settings import ReconcilerSettings
from budgetgate.ledger.transaction import LedgerTransaction, ledger_transaction, record_ledger_mark

sql = owned_by("budgetgate.services.reconciler")

log = logging.getLogger(__name__)
T = TypeVar("T")

# What makes a ledger transaction on a run start over (`Settler.retrying`), never a failure of it.
STARTS_OVER = (LedgerNotLoaded, LedgerKeyMissing, SettlementPending)


@dataclass(frozen=True)
class Outcome:
    """What settling a run did, for metrics and tests."""

    run_id: str
    changed: bool
    result: Settlement | None


@dataclass
class Loaded:
    decision: Any
    bundle: PolicyBundle | None
    facts: RunFacts  # without samples: those are folded into `folded`
    held: dict[str, int]  # what the run holds now, per reserved key
    open: bool  # its reservations are still held (not reconciled or released)
    folded: meter.Folded
    settlement: Any


class Settler(OneShard):
    def __init__(
        self,
        *,
        pool: asyncpg.Pool,
        ledgers: ShardedLedger,
        bundles: PolicyStore,
        rules: Rules,
        fair_share_half_life: timedelta = timedelta(days=7),
    ) -> None:
        self.pool = pool
        self.ledgers = ledgers
        self.bundles = bundles
        self.rules = rules
        self.fair_share_half_life = fair_share_half_life
        # Postgres's clock less this process's, as upkeep last measured it. Deadlines are judged on
        # Postgres's clock, the one every recorded time (decided, created, events) was taken on: a
        # reconciler whose own clock ran ahead gave reservations back before their start deadline,
        # and admission gave the room to others (the fault campaign's seed 7, clock skew).
        self.clock_offset = timedelta(0)

    async def ledger_of_run(self, run_id: str) -> RedisLedger:
        """The shard of the Redis ledger holding what run `run_id` holds: its tenant's, by the
        labels of its latest admission (any shard for a run never admitted: it holds nothing)."""
        if len(self.ledgers) == 1:
            return self.ledgers.single
        return self.ledgers.of_root(await self.pool.fetchval(sql("run_root"), run_id, self.ledgers.tenant_label) or "")

    @property
    def pools_ledger(self) -> RedisLedger | None:
        """The shard the token pools are on, on a ledger of several shards (None on one)."""
        return None if len(self.ledgers) == 1 else self.ledgers.of_root("")

    @contextlib.asynccontextmanager
    async def transaction(self, run_id: str) -> AsyncIterator[LedgerTransaction]:
        """A ledger transaction on run `run_id`'s shard, and, on a ledger of several shards, on the
        pools' (its pool token: LedgerTransaction.pools)."""
        async with ledger_transaction(self.pool, await self.ledger_of_run(run_id), pools=self.pools_ledger) as work:
            yield work

    async def ensure_loaded(self) -> None:
        """Rebuild every shard of the Redis ledger that lost its state (LedgerSync.ensure_loaded)."""
        for sync in self.ledgers.syncs:
            await sync.ensure_loaded()

    def now(self) -> datetime:
        """The time on Postgres's clock (this process's, corrected by the last measured offset)."""
        return datetime.now(UTC) + self.clock_offset

    async def measure_clock(self, conn: asyncpg.Connection) -> datetime:
        """Measure the offset of Postgres's clock from this process's; returns Postgres's time now."""
        before = datetime.now(UTC)
        theirs: datetime = await conn.fetchval("SELECT clock_timestamp()")
        after = datetime.now(UTC)
        self.clock_offset = theirs - (before + (after - before) / 2)
        return theirs

    @classmethod
    def configured(cls, settings: ReconcilerSettings, *, pool: asyncpg.Pool, ledgers: ShardedLedger, bundles: PolicyStore) -> Settler:
        """A settler under the reconciler's `settings` (its rules, its fair-share half-life)."""
        half_life = timedelta(seconds=settings.fair_share_half_life_seconds)
        return cls(pool=pool, ledgers=ledgers, bundles=bundles, rules=settings.rules(), fair_share_half_life=half_life)

    async def settle(self, run_id: str, *, now: datetime | None = None) -> Outcome:
        """Bring the run's charges in line with its facts; rebuilds Redis first if it was lost."""

        async def attempt() -> Outcome:
            async with self.transaction(run_id) as work:
                await self.lock(work, run_id)
                return await self.settle_locked(work, run_id, now or self.now())

        return await self.retrying(run_id, attempt)

    async def retrying(self, run_id: str, attempt: Callable[[], Awaitable[T]]) -> T:
        """`attempt` (a ledger transaction changing run `run_id`), tried again after what makes it
        start over: Redis rebuilt when it lost the ledger, the keys loaded that it lacked, a
        parked settlement of the run ended.

        Every key found missing is loaded again before each later try, not only the last try's:
        keys of windows the run's usage lands in first are created in the try's own transaction,
        so a rebuild (after a try that had changed Redis rolled back) drops the ones loaded
        before; loading only the newest would go round them for ever."""
        lacking: dict[str, None] = {}
        for _ in range(5):
            try:
                return await attempt()
            except LedgerNotLoaded:
                await self.ensure_loaded()
                await self._load_keys(lacking)
            except LedgerKeyMissing as missing:
                lacking.update(dict.fromkeys(missing.ledger_keys))
                try:
                    await self._load_keys(lacking)
                except LedgerNotLoaded:
                    # The failed try had changed Redis (a run's holds given back), so its rollback
                    # invalidated the ledger: rebuilt first, then the keys loaded.
                    await self.ensure_loaded()
                    await self._load_keys(lacking)
            except SettlementPending:
                continue  # its predecessor's parked half is ended under the run lock first
        raise RuntimeError(f"run {run_id!r}: the Redis ledger kept changing while settling")

    async def lock(self, work: LedgerTransaction, run_id: str) -> None:
        """Take the run's lock (to the end of the caller's transaction, on the run's shard) and
        end its parked settlement: what the run holds is then as Postgres says, and nobody else
        changes it."""
        await work.conn.execute(sql("lock_run"), run_id)
        await self._end_parked(work.conn, work.ledger, run_id)

    async def settle_locked(self, work: LedgerTransaction, run_id: str, now: datetime) -> Outcome:
        """Settle the run in `work`, under its lock (`lock`)."""
        conn = work.conn
        await conn.execute(sql("unmark_settled"), run_id)
        loaded = await self._load(conn, run_id)
        if loaded is None:
            # Denied, delayed or unknown: nothing is held, and facts wait for an admission.
            await conn.execute(sql("forget_provisional_holds"), run_id)
            return Outcome(run_id, False, None)
        result = settle_state(loaded.facts, loaded.folded.state, bundle=loaded.bundle, rules=self.rules, now=now)
        outcome = await self._apply(work, loaded, result, now)
        await self._keep_token(work, loaded, result, now)
        await self._end_provisional(conn, loaded, result)
        return outcome

    async def release_locked(self, work: LedgerTransaction, run_id: str, now: datetime, *, why: str) -> Outcome:
        """Give back what the run holds, in `work`, under its lock (`lock`), as a release at the
        start deadline does (its reservations end as released, `why` their reason, and its quota
        holds and pool token go back unless it is running), moving no charge and folding none of
        its facts since its last settlement: for an operator, when its settlement keeps failing.
        Its facts to come are settled as any released run's."""
        conn = work.conn
        await conn.execute(sql("unmark_settled"), run_id)
        loaded = await self._load(conn, run_id, fold=False)
        if loaded is None:
            return Outcome(run_id, False, None)
        result = given_back(loaded.facts, loaded.folded.state, loaded.folded.timed, last=loaded.settlement)
        outcome = await self._apply(work, loaded, result, now, end_reason=why)
        await self._end_provisional(conn, loaded, result)
        return outcome

    async def _end_provisional(self, conn: asyncpg.Connection, loaded: Loaded, result: Settlement) -> None:
        """A provisional hold confirmed (a fact showed its object exists), given back, or ended is
        provisional no more: its row goes, in the settlement's transaction, so the rule holds
        across restarts until then and is never applied twice."""
        if loaded.facts.provisional and not result.unconfirmed:
            await conn.execute(sql("end_provisional_hold"), loaded.facts.run_id, loaded.decision["decision_id"])

    async def end_pending(self, *, older_than_ms: int) -> int:
        """End every settlement parked in Redis before `older_than_ms` whose run is not being
        settled right now (its settler died, or could not reach Redis after its commit): applied
        if Postgres committed it, taken back if not. Returns how many were ended."""
        ended = 0
        for ledger in self.ledgers:
            for run_id, (_seq, at_ms) in (await ledger.pending_settlements()).items():
                if at_ms > older_than_ms:
                    continue
                async with self.pool.acquire() as conn, conn.transaction():
                    if await conn.fetchval(sql("try_lock_run"), run_id):
                        ended += await self._end_parked(conn, ledger, run_id)
        return ended

    async def _end_parked(self, conn: asyncpg.Connection, ledger: RedisLedger, run_id: str) -> bool:
        """End the run's parked settlement on its shard `ledger`, if any; the caller holds the
        run's lock, so the transaction that parked it is over and Postgres says whether it committed."""
        seq = await ledger.client.hget(ledger.pending(run_id), "seq")
        if seq is None:
            return False
        revision = await conn.fetchval(sql("run_revision"), run_id)
        committed = revision is not None and revision >= int(seq)
        return await ledger.settle_end(run_id, seq=int(seq), committed=committed)

    async def repair(self, run_id: str, *, now: datetime | None = None) -> Outcome:
        """Recompute the run from its whole history (the repair tool, never the hot path)."""
        async with self.pool.acquire() as conn, conn.transaction():
            await conn.execute(sql("lock_run"), run_id)
            await conn.execute(sql("reset_run_meter"), run_id)
        return await self.settle(run_id, now=now)

    async def _load(self, conn: asyncpg.Connection, run_id: str, *, fold: bool = True) -> Loaded | None:
        decision = await conn.fetchrow(sql("run_decision"), run_id)
        if decision is None:
            return None
        bundle = await self.bundles.at(conn, decision["policy_bundle_sha"])
        policies = {p.id: p for p in bundle.policies} if bundle else {}
        reservations, held, is_open = [], {}, False
        for row in await conn.fetch(sql("run_reservations"), run_id, decision["decision_id"]):
            policy = policies.get(row["policy_id"])
            if policy is None:
                log.error("run %r: policy %r of its decision is not in bundle %s", run_id, row["policy_id"], decision["policy_bundle_sha"])
                continue
            reservations.append(Reservation(policy, row["ledger_key"], row["admitted"]))
            held[row["ledger_key"]] = row["amount"] if row["state"] == "held" else 0
            is_open = is_open or row["state"] == "held"
        settlement = await conn.fetchrow(sql("run_settlement"), run_id)
        facts = RunFacts(
            run_id=run_id,
            admitted_at=decision["decided_at"],
            reservations=tuple(reservations),
            gpus=decision["gpus"] or 0,
            nodes=decision["nodes"] or 1,
            projected_gpu=decision["projected_gpu"],
            flavor=decision["flavor"],
            region=decision["region"],
            events=frozenset(
                LifecycleFact(r["event_id"], r["kind"], r["event_time"], r["gpus"], r["nodes"]) for r in await conn.fetch(sql("run_lifecycle"), run_id)
            ),
            ends_after=decision["decided_at"] if decision["after_refusal"] else None,
            provisional=decision["provisional"],
            metered_through=decision["metered_through"],
            # Given back once is given back for good: a late start is charged, never held again.
            released=bool(settlement and settlement["released"]) or (bool(reservations) and not is_open and not (settlement and settlement["final"])),
        )
        folded = await meter.fold_new_samples(conn, facts, bundle) if fold else await meter.unfolded(conn, run_id)
        return Loaded(decision, bundle, facts, held, is_open, folded, settlement)

    async def _apply(self, work: LedgerTransaction, loaded: Loaded, result: Settlement, now: datetime, *, end_reason: str | None = None) -> Outcome:
        conn = work.conn
        run_id = loaded.facts.run_id
        decision_id = str(loaded.decision["decision_id"])
        bucket_deltas, charges = await _bucket_deltas(conn, run_id, loaded.folded, result)
        held_deltas = {key: result.held.get(key, 0) - amount for key, amount in loaded.held.items()}
        ended = EndedHolds(False, None, False, 0)
        if result.ended_at is not None or (result.released and result.phase != "running"):
            # The run stopped holding GPUs (or never started): its quota counters and pool token
            # go back now, even while its budget reservation waits for metered actuals.
            try:
                ended = await end_run_holds(conn, work.ledger, run_id, pools=work.pools)
                if ended.redis_released:
                    work.changing(work.ledger)
                if ended.tokens_released:
                    work.changing(work.tokens)
            except BaseException:
                work.changing(work.ledger, work.pools)
                raise
        elif result.released:
            await self._hold_again(work, run_id, decision_id)
        closing = loaded.open and (result.final or result.released)
        settlement_moved = _settlement_changed(loaded.settlement, result)
        await meter.save(conn, run_id, loaded.folded, dict(result.consumed))
        if not bucket_deltas and not any(held_deltas.values()) and not closing and not settlement_moved:
            before = (loaded.settlement["phase"], loaded.settlement["wall"], loaded.settlement["review_at"], loaded.settlement["actual_gpu"])
            if before != (result.phase, result.wall, result.review_at, result.actual_gpu):
                await _put_settlement(conn, run_id, decision_id, result)
            await self._count_fair_share(conn, loaded, result, now)
            if ended.ended:
                await self._released(conn, ended, (), cause=f"holds:{run_id}", now=now)
            return Outcome(run_id, False, result)

        windows = self._windows(loaded, result, bucket_deltas)
        await self._ensure_entries(conn, {key for key, _ in bucket_deltas}, windows, loaded.decision["policy_bundle_sha"] or "")
        consumed_deltas = await _consumed_deltas(conn, bucket_deltas, windows, now)
        keys = sorted(set(held_deltas) | set(consumed_deltas))
        changes = [
            KeyChange(key, reserved=held_deltas.get(key, 0), consumed=consumed_deltas.get(key, 0), held=result.held[key] if key in loaded.held else None)
            for key in keys
        ]
        drop_run = (result.final or result.released) and not any(result.held.values())
        seq = (loaded.settlement["revision"] if loaded.settlement else 0) + 1
        if changes or drop_run:
            # Parked before the Redis call: if the call ran but its answer was lost, the parked
            # half is still ended (or Settler.end_pending ends it).
            token = uuid.uuid4().hex
            work.parked.append((run_id, seq, token))
            advanced = await work.ledger.settle_begin(
                run_id=run_id, decision_id=decision_id, seq=seq, token=token, changes=changes, drop_run=drop_run, now_ms=int(now.timestamp() * 1000)
            )
            await record_ledger_mark(conn, work.ledger, advanced)

        await _write_charges(conn, run_id, charges)
        if held_deltas or closing:
            state = ("reconciled" if result.final else "released") if closing else None
            reason = end_reason or ((result.final_state or "").lower() if result.final else (result.release_reason or NOT_STARTED))
            await conn.execute(sql("set_held"), run_id, list(loaded.held), [result.held.get(k, 0) for k in loaded.held], state, reason if state else None)
        revision = await _put_settlement(conn, run_id, decision_id, result)
        if revision != seq:
            raise RuntimeError(f"run {run_id!r}: settlement revision {revision} is not the sequence number {seq} parked in Redis")
        if result.final or closing:
            # Once per run: the message lists every charge, so the run's charges are read whole.
            whole = {(r["ledger_key"], r["bucket"]): r["amount"] for r in await conn.fetch(sql("run_charge_rows"), run_id)}
            result = replace(result, consumed=whole)
            windows = self._windows(loaded, result, whole)
            job = (loaded.decision["job_namespace"], loaded.decision["job_name"]) if loaded.decision["job_name"] else None
            await messages.reconciliation(
                conn,
                run_id=run_id,
                decision_id=decision_id,
                result=result,
                windows=windows,
                bundle_sha=loaded.decision["policy_bundle_sha"] or "",
                job=job,
                revision=revision,
                now=now,
            )
        freed = {key for key in keys if held_deltas.get(key, 0) + consumed_deltas.get(key, 0) < 0}
        if consumed_deltas:
            # Last: the ledger rows stay locked only from here to the commit.
            rows = await conn.fetch(sql("add_consumed"), list(consumed_deltas), list(consumed_deltas.values()))
            await budget_actions.after_consumption(conn, rows, bundles=self.bundles, now=now)
        # Late too: the tenant's row stays locked only from here to the commit.
        await self._count_fair_share(conn, loaded, result, now)
        if ended.ended or freed:
            # After every change of the settlement: the waiting runs are judged on its figures.
            policy_ids = {windows[key][0].id for key in freed if key in windows}
            await self._released(conn, ended, policy_ids, cause=f"settled:{run_id}:{revision}", now=now)
        return Outcome(run_id, True, result)

    async def _hold_again(self, work: LedgerTransaction, run_id: str, decision_id: str) -> None:
        """A run released at its start deadline is running after all: it counts on its tenant's
        quota again until it stops, so that no decision meanwhile admits past the quota on the
        room it was given back (its budget reservation stays given back: what it uses is charged
        as consumed). Its pool token is not taken back: another holder may have it now."""
        try:
            if await rehold_run(work.conn, work.ledger, run_id, decision_id):
                work.changing(work.ledger)
                log.warning("run %r started after its start deadline released it: its quota holds count again, over the quota if it is full", run_id)
        except BaseException:
            work.changing(work.ledger)
            raise

    async def _keep_token(self, work: LedgerTransaction, loaded: Loaded, result: Settlement, now: datetime) -> None:
        """A run that is alive keeps its pool token: its lease is renewed from the run's latest
        start or usage sample, so one that falls silent still loses it a lease after its last
        sign of life. Not after its end (_apply gave the token back), nor under a bundle without
        pools (no run holds a token there). Last in the transaction, so that only its commit can
        fail after Redis renewed the lease (then Redis is invalidated, as for any change)."""
        if result.ended_at is not None or result.released or loaded.bundle is None or not loaded.bundle.pools:
            return
        starts = [event.at for event in loaded.facts.events if event.kind in (STARTED, READMITTED)]
        alive_at = max([*starts, *([loaded.folded.last[0]] if loaded.folded.last else [])], default=None)
        if alive_at is None:
            return
        try:
            renewed = await renew_run_token(
                work.conn, work.ledger, run_id=loaded.facts.run_id, alive_at=min(alive_at, now), now=now,
                pool_leases={pool.namespace: pool.lease_seconds for pool in loaded.bundle.pools}, pools=work.pools,
            )  # fmt: skip
        except BaseException:
            work.changing(work.ledger, work.pools)
            raise
        if renewed:
            work.changing(work.tokens)

    async def _released(self, conn: asyncpg.Connection, ended: EndedHolds, policy_ids: Iterable[str], *, cause: str, now: datetime) -> None:
        """Room came back (the run's holds, or budget room): the runs waiting for it are judged."""
        tenant = ended.tenant if ended.ended else None
        await headroom.after_release(conn, bundles=self.bundles, tenant=tenant, sensitive=ended.sensitive, policy_ids=policy_ids, cause=cause, now=now)

    async def _count_fair_share(self, conn: asyncpg.Connection, loaded: Loaded, result: Settlement, now: datetime) -> None:
        """Add what the run's actual GPU usage moved since its last settlement to its tenant's
        decayed usage, reckoned when it was metered (the run's latest sample; else now)."""
        tenant = loaded.decision["tenant"]
        moved = result.actual_gpu - (loaded.settlement["actual_gpu"] if loaded.settlement else 0)
        if tenant and moved:
            at = min(now, loaded.folded.last[0]) if loaded.folded.last else now
            await fairshare.add_usage(conn, tenant=tenant, amount=moved, at=at, half_life=self.fair_share_half_life)

    def _windows(self, loaded: Loaded, result: Settlement, touched: Any) -> dict[str, tuple[BudgetPolicy, Window]]:
        """The policy and window of every key the run touches or touched, from the fold where it
        knows them and else from the key itself and the run's policy of that scope and unit."""
        windows = {**loaded.folded.windows, **result.windows}
        by_scope_unit = {(r.policy.scope.scope_id, str(r.policy.limit.unit)): r.policy for r in loaded.facts.reservations}
        for text in [r.ledger_key for r in loaded.facts.reservations] + [k for k, _ in touched]:
            if text in windows:
                continue
            key = LedgerKey.parse(text)
            lease = lease_of(text)  # (an escrow lease: its budget's policy)
            policy = by_scope_unit.get((key.scope_id if lease is None else LedgerKey.parse(lease[0]).scope_id, key.unit))
            if policy is not None:
                window = key.window()
                windows[text] = (policy, window or Window(result.ended_at or datetime.now(UTC), result.ended_at or datetime.now(UTC), key.window_key))
        return windows

    async def _ensure_entries(self, conn: asyncpg.Connection, keys: set[str], windows: dict[str, tuple[BudgetPolicy, Window]], decision_sha: str) -> None:
        """Create the ledger entries of windows usage lands in for the first time."""
        leases = {key: lease for key in keys if (lease := lease_of(key)) is not None}
        budgets = {budget: windows[key] for key, (budget, _root) in leases.items()}  # (a lease's budget: its policy and window)
        wanted = sorted(keys | budgets.keys())
        existing = {r["ledger_key"] for r in await conn.fetch(sql("entry_exists"), wanted)}
        for key in [k for k in wanted if k not in existing and k not in leases]:
            policy, window = windows[key] if key in windows else budgets[key]
            current = self.bundles.revision_of(policy)
            rolling = policy.window.rolling
            await conn.execute(
                sql("create_entry"), key, policy.scope.scope_id, str(policy.limit.unit), window.key,
                None if rolling else window.start, None if rolling else window.end, policy.id,
                self.bundles.active.git_sha if self.bundles.active and current is not policy else decision_sha, current.limit.amount,
            )  # fmt: skip
        for key in [k for k in wanted if k not in existing and k in leases]:
            # An escrow lease usage lands in first (a run's usage past its window's end): opened
            # at size 0 beside its budget's entry; the use is taken from what is free.
            budget, root = leases[key]
            await conn.execute(ledger_sql("escrow_open"), budget, root, key, LedgerKey.parse(key).scope_id)

    async def _load_keys(self, ledger_keys: Iterable[str]) -> None:
        for key in ledger_keys:
            await self._load_key(key)

    async def _load_key(self, ledger_key: str) -> None:
        """Load a key into Redis (its shard) from Postgres's committed figures (none: it starts empty)."""
        row = await self.pool.fetchrow(sql("entry_figures"), ledger_key)
        await self.ledgers.of_key(ledger_key).load_key(
            ledger_key, reserved=row["reserved"] if row else 0, consumed=row["consumed"] if row else 0, size=row["size"] if row else None
        )


async def _consumed_deltas(
    conn: asyncpg.Connection, bucket_deltas: dict[tuple[str, datetime], int], windows: dict[str, tuple[BudgetPolicy, Window]], now: datetime
) -> dict[str, int]:
    """Per ledger key, how much its consumed changes: every bucket of a calendar window, and the
    buckets of a rolling window that have not aged out of it."""
    rolling = sorted({key for key, _ in bucket_deltas if windows[key][0].window.rolling})
    aged: dict[str, datetime] = {}
    if rolling:
        days = [windows[k][0].window.rolling_days or 0 for k in rolling]
        await conn.execute(sql("ensure_rolling_ages"), rolling, days, [budget_actions.age_cutoff(d, now) for d in days])
        aged = {r["ledger_key"]: r["aged_through"] for r in await conn.fetch(sql("rolling_ages_shared"), rolling)}
    totals: dict[str, int] = defaultdict(int)
    for (key, bucket), delta in bucket_deltas.items():
        if key in aged and bucket < aged[key]:
            continue
        totals[key] += delta
    return {key: delta for key, delta in sorted(totals.items()) if delta}


async def _bucket_deltas(
    conn: asyncpg.Connection, run_id: str, folded: meter.Folded, result: Settlement
) -> tuple[dict[tuple[str, datetime], int], dict[tuple[str, datetime], int]]:
    """How the run's charges move per (key, bucket), and what they become on the buckets that move.

    The metered part comes from the fold; the part from time alone (wall time, the provisional
    tail) is whole in `result.consumed` and compared with what was last settled. A run folded
    whole has no past state: its totals are compared with every charge it holds.
    """
    timed = {k: a for k, a in result.consumed.items() if a}
    if folded.whole:
        before = {(r["ledger_key"], r["bucket"]): r["amount"] for r in await conn.fetch(sql("run_charge_rows"), run_id)}
        target: dict[tuple[str, datetime], int] = defaultdict(int, folded.deltas)
        for k, a in timed.items():
            target[k] += a
        deltas = {k: target.get(k, 0) - before.get(k, 0) for k in set(target) | set(before)}
    else:
        moved: dict[tuple[str, datetime], int] = defaultdict(int, folded.deltas)
        for k in set(timed) | set(folded.timed):
            moved[k] += timed.get(k, 0) - folded.timed.get(k, 0)
        deltas = dict(moved)
        keys = sorted(k for k, d in deltas.items() if d)
        rows = await conn.fetch(sql("run_charges_at"), run_id, [k for k, _ in keys], [b for _, b in keys]) if keys else []
        before = {(r["ledger_key"], r["bucket"]): r["amount"] for r in rows}
    deltas = {k: d for k, d in deltas.items() if d}
    return deltas, {k: before.get(k, 0) + d for k, d in deltas.items()}


async def _write_charges(conn: asyncpg.Connection, run_id: str, charges: dict[tuple[str, datetime], int]) -> None:
    put = [(k, b, a) for (k, b), a in charges.items() if a > 0]
    gone = [(k, b) for (k, b), a in charges.items() if a <= 0]
    if put:
        await conn.execute(sql("put_run_charges"), run_id, [p[0] for p in put], [p[1] for p in put], [p[2] for p in put])
    if gone:
        await conn.execute(sql("drop_run_charges"), run_id, [g[0] for g in gone], [g[1] for g in gone])


async def _put_settlement(conn: asyncpg.Connection, run_id: str, decision_id: str, r: Settlement) -> int:
    return await conn.fetchval(
        sql("put_settlement"), run_id, _uuid(decision_id), r.phase, r.final, r.provisional, r.released, r.over_running,
        r.final_state, r.ended_at, r.wall, r.projected_gpu, r.actual_gpu, r.error_gpu, r.review_at,
    )  # fmt: skip


def _settlement_changed(row: Any, r: Settlement) -> bool:
    if row is None:
        return True
    return (row["final"], row["provisional"], row["released"]) != (r.final, r.provisional, r.released)


def _uuid(text: str):  # type: ignore[no-untyped-def]
    import uuid

    return uuid.UUID(text)
