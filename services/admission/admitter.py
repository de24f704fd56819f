"""Admission: load → decide → save, a batch of submissions at a time (group commit), with the
reservations made atomically in Redis and the decisions made durable in Postgres before anyone
hears them.

The order of one batch (a ledger_session: no transaction block, three round trips):
1. In one Postgres statement, take the ledger lock (shared) and the lock of every run of the
   batch, at session level, and read each run's latest decision, the ledger sequence Postgres committed and the
   tenant override revision; a submission prepared under an older revision is prepared again,
   so an override takes effect on the very next decision.
2. A resend of a decided run is answered again (`replayed: true`), a changed request gets 409
   (resubmission.resent); the same request twice within the batch follows the first.
3. The others are checked and reserved in Redis in one script, in submission order, all or none
   per decision; the script first proves Redis is current (see reserve.lua). On a ledger of
   several shards, a decision's pool token is taken first on the pools' shard and given back
   before step 4 if the decision holds nothing (_take_tokens, _keep_tokens).
4. Every decision, with its evaluations, reservations, holds and outbox row, is stored in one
   statement, which commits as it ends; only then is anyone answered. The locks are let go
   after that, in the background.
If anything fails after Redis reserved, the Redis ledger is invalidated and rebuilt from
Postgres before the next decision (fail closed; ledger_transaction).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

import asyncpg
import orjson
import redis.exceptions

from budgetgate.runtime.backends import BACKEND_ERRORS
from budgetgate.core.accounting import BudgetSource
from budgetgate.core.decay import Decayed
from budgetgate.core.eligibility import Outlook
from budgetgate.core.escrow import Lease, refill_chunk
from budgetgate.core.evaluation import Plan, Reading, fits
from budgetgate.core.policy import PolicyBundle
from budgetgate.ledger.outlooks import outlooks
from budgetgate.ledger.escrow_leases import Book, BudgetBook, CounterBook, Escrow
from budgetgate.ledger.holds import SENSITIVE, PoolReading
from budgetgate.ledger.queries import owned_by
from budgetgate.ledger.queries import sql as ledger_sql
from budgetgate.ledger.redis_ledger import LedgerNotLoaded, RedisLedger, Reservation, ReserveResult
from budgetgate.ledger.redis_sync import LedgerSync, RebuildWaitExceeded
from budgetgate.ledger.sharded import OneShard, ShardedLedger
from budgetgate.ledger.transaction import LedgerTransaction, ledger_session, record_ledger_mark
from budgetgate.services.admission import records
from budgetgate.services.admission.accounting_source import ExternalAccounting
from budgetgate.services.admission.batching import GroupCommit
from budgetgate.decisions.concurrency import Asks
from budgetgate.services.admission.fairshare_cache import DecayedUsage
from budgetgate.decisions.deciding import Prepared, charges, conclude, holds, prepare, readings, readings_record
from budgetgate.policies.policy_store import PolicyStore
from budgetgate.decisions.rendering import replayed, response_body
from budgetgate.services.admission.resubmission import differences, resent
from budgetgate.services.admission.stages import BatchClock, StageClock
from budgetgate.contracts.admission import AdmissionRequest

sql = owned_by("budgetgate.services.admission")

log = logging.getLogger(__name__)
T = TypeVar("T")
# The most refills one submission gets (Pending.may_refill).
MAX_REFILLS = 3


async def with_ledger(sync: LedgerSync | Sequence[LedgerSync], work: Callable[[], Awaitable[T]]) -> T:
    """Run `work` against the ledger (the shard of `sync`, or of each of several), failing
    closed: a Redis that lost the ledger, or whose call failed on the way (`redis_fault`), is
    rebuilt from Postgres where it needs to be (or, while another process rebuilds it, waited
    for up to `sync.wait`) and the work tried once more; a backend still unreachable then, or a
    rebuild not done in time, becomes Unavailable."""
    try:
        try:
            return await work()
        except RebuildWaitExceeded:
            raise
        except Exception as exc:
            if not isinstance(exc, LedgerNotLoaded) and not redis_fault(exc):
                raise
            for each in (sync,) if isinstance(sync, LedgerSync) else sync:
                await each.ensure_loaded()  # (only a shard that lost its state is rebuilt)
            return await work()
    except (LedgerNotLoaded, *BACKEND_ERRORS) as exc:
        raise as_unavailable(exc) from exc


def redis_fault(exc: BaseException) -> bool:
    """Whether `exc` is Redis failing a call on the way (unreachable, timed out, a cluster
    failing over or resharding): worth one more try once the shards it may have left changed are
    rebuilt. A Redis Cluster client that meets a slot no node serves closes every connection it
    holds, so one shard's failover fails the calls in flight to the others' healthy masters too."""
    return isinstance(exc, redis.exceptions.RedisError) and isinstance(exc, BACKEND_ERRORS)


class Unavailable(RuntimeError):
    """The ledger cannot be used right now; nothing was reserved or recorded as allowed."""


def as_unavailable(exc: BaseException) -> BaseException:
    """What a submission hears of a ledger that cannot be used now (a rebuild not done in time, a
    Redis that lost the ledger, an unreachable backend): Unavailable, a 503 saying which; any
    other error as it is."""
    if isinstance(exc, RebuildWaitExceeded):
        return Unavailable(str(exc))
    if isinstance(exc, LedgerNotLoaded):
        return Unavailable("the Redis ledger is being rebuilt from Postgres; retry shortly")
    if isinstance(exc, BACKEND_ERRORS):
        return Unavailable(f"ledger backend unavailable: {type(exc).__name__}: {exc}")
    return exc


@dataclass(frozen=True, slots=True)
class Lack:
    """An escrow lease of its tenant a refused reservation lacked room on, as its script read it
    (`seen`): a budget's (`charge`, the plan's charge on it) or the sensitive pool's (`counter`,
    the index of the asks' counter on it), and the `amount` the reservation asked of it."""

    book: Book
    root: str
    amount: int
    seen: Lease
    chunk: int
    charge: int | None = None
    counter: int | None = None


@dataclass(frozen=True, slots=True)
class Token:
    """A submission's pool token as the pools' shard answered it, taken apart from its decision
    on a ledger of several shards (Admitter._take_tokens): `granted` (and then the sequence the
    grant advanced that shard to) or refused, with the readings of its levels."""

    granted: bool
    readings: tuple[PoolReading, ...]
    seq: int = 0


@dataclass(eq=False)
class Pending:
    """A submission waiting in a batch: its pure part done, its answer to come."""

    request: AdmissionRequest
    bundle: PolicyBundle
    plan: Plan
    asks: Asks
    decided_at: datetime
    answer: asyncio.Future[dict[str, Any]]
    decision_id: str = field(default_factory=lambda: str(uuid.uuid4()))
    result: ReserveResult | None = None
    accounting: BudgetSource | None = None
    provisional: bool = False
    clock: StageClock | None = None  # a submission timed stage by stage (stages.py)
    # Its caller's count on its rate limit, sent before it was planned and awaited by its batch
    # before anything is reserved (fastpath.py): raises RateLimited past the limit.
    counted: asyncio.Future[None] | None = None
    shard: int = 0  # of the Redis ledger: its tenant's (budgetgate.core.shards)
    pool_shard: int | None = None  # the pools' shard, when its pool token is taken apart there (Asks.pool_apart)
    token: Token | None = None  # that token, taken in its batch
    shard_failed: bool = False  # its shard failed once in a batch other shards' decisions committed in
    # Escrow leases of its tenant that lacked room (each as the script read it): refilled after
    # its batch, then decided again.
    refill: list[Lack] | None = None
    refills: int = 0  # refills it had; another only while each granted room (`may_refill`)
    refill_granted: bool = True  # whether its last refill grew every lease it asked of

    @property
    def may_refill(self) -> bool:
        """Whether a refusal by its tenant's leases alone gets it a refill: the first always; up
        to MAX_REFILLS while each one granted room (which a submission of its tenant decided in a
        batch in flight meanwhile may have taken), never once a refill found nothing to grant."""
        return self.refills == 0 or (self.refill_granted and self.refills < MAX_REFILLS)

    @property
    def run_id(self) -> str:
        return self.request.run_id

    @cached_property
    def shards(self) -> frozenset[int]:
        """The shards its decision touches: its tenant's, and the pools' when its token is taken
        there (both set when it is prepared, before any batch reads this)."""
        return frozenset((self.shard,) if self.pool_shard is None else (self.shard, self.pool_shard))

    @cached_property
    def prepared(self) -> Prepared:
        return Prepared(self.request, self.bundle, self.plan, self.asks, self.decided_at, self.accounting)

    @property
    def needs_ledger(self) -> bool:
        return self.prepared.needs_ledger


class Admitter(OneShard):
    def __init__(
        self,
        *,
        pool: asyncpg.Pool,
        ledgers: ShardedLedger,
        policies: PolicyStore,
        unmatched: str = "allow",
        tenant_label: str = "team",
        accounting: ExternalAccounting | None = None,
        start_deadline: timedelta = timedelta(hours=1),
        max_batch: int = 64,
        max_wait: float = 0.001,
        in_flight: int = 2,
        usage: DecayedUsage | None = None,
        committed: Callable[[], None] | None = None,
        escrow_chunk_share: float = 0.02,
    ) -> None:
        self.start_deadline = start_deadline
        self.committed = committed  # told after each batch that committed decisions (the relay's nudge)
        self.pool = pool
        self.ledgers = ledgers
        self.policies = policies
        self.unmatched = unmatched
        self.tenant_label = tenant_label
        self.accounting = accounting
        self.usage = usage
        # A ledger of several shards charges the budgets tenants share through their escrow leases.
        self.escrow = Escrow(pool, ledgers.of_root)
        self.escrow_chunk_share = escrow_chunk_share
        self.batches = GroupCommit(self._commit, max_batch=max_batch, max_wait=max_wait, in_flight=in_flight)
        self._scoped: dict[str, PolicyBundle] = {}  # namespace -> the active bundle's policies covering it

    def ledger_of(self, request: AdmissionRequest) -> RedisLedger:
        """The shard of the Redis ledger a submission's keys are on: its tenant's."""
        return self.ledgers.of_labels(request.labels)

    async def admit(
        self,
        request: AdmissionRequest,
        *,
        now: datetime | None = None,
        provisional: bool = False,
        clock: StageClock | None = None,
        counted: asyncio.Future[None] | None = None,
    ) -> dict[str, Any]:
        """Decide a submission; raises Unavailable (503), InvalidSubmission (422) or Conflict (409).

        `provisional`: the submission's object may still be refused after this answer (the
        Kubernetes validating webhook answers before the API server stores it), so what an ALLOW
        holds is given back unless the object is confirmed (see the reconciler's provisional hold).
        `clock`: for a submission timed stage by stage, its clock, which this fills in.
        `counted`: its caller's count on its rate limit, not awaited yet: awaited in its batch
        before anything is reserved; what it raises (RateLimited) is the answer."""
        pending = self._prepare(request, now or datetime.now(UTC))
        pending.provisional = provisional
        pending.counted = counted
        if self.accounting is not None:
            pending.accounting = await self.accounting.source(pending.bundle, pending.plan, pending.asks.tenant, label=self.tenant_label)
        if clock is not None:
            clock.planned = time.perf_counter()
            pending.clock = clock
        self.batches.submit(pending)
        return await pending.answer

    def prepare(self, request: AdmissionRequest, now: datetime) -> Prepared:
        """The pure part of deciding `request` under the active bundle (a quote stops here
        before asking the ledger); raises Unavailable or InvalidSubmission."""
        bundle = self.policies.current
        if bundle is None:
            raise Unavailable("no policy bundle has been applied yet; run `budgetgate policy apply`")
        covering = self._covering(bundle, request.namespace)
        return prepare(bundle, request, now, unmatched=self.unmatched, tenant_label=self.tenant_label, covering=covering, leased=len(self.ledgers) > 1)

    def _prepare(self, request: AdmissionRequest, now: datetime) -> Pending:
        """The pure part, done before joining a batch: the plan and the concurrency asked for."""
        p = self.prepare(request, now)
        pending = Pending(request, p.bundle, p.plan, p.asks, now, asyncio.get_running_loop().create_future())
        pending.shard = self.ledger_of(request).shard
        if p.asks.pool_apart:
            pending.pool_shard = self.pools_ledger.shard
        return pending

    @property
    def pools_ledger(self) -> RedisLedger:
        """The shard the token pools are on: the empty root's."""
        return self.ledgers.of_root("")

    def _covering(self, bundle: PolicyBundle, namespace: str) -> PolicyBundle:
        """`bundle` with only the policies whose scope covers `namespace` (any others cannot
        apply): planning then looks at a handful of policies, not every team's."""
        found = self._scoped.get(namespace)
        if found is None or (found.git_sha, found.override_revision) != (bundle.git_sha, bundle.override_revision):
            if len(self._scoped) > 10_000:
                self._scoped.clear()
            found = self._scoped[namespace] = replace(bundle, policies=tuple(p for p in bundle.policies if p.scope.covers_namespace(namespace)))
        return found

    async def _commit(self, batch: list[Pending]) -> None:
        """Decide and commit `batch`, then answer each of its submissions."""
        answers: dict[Pending, dict[str, Any] | BaseException] = {}
        clock = BatchClock()
        ledgers = [self.ledgers.parts[shard] for shard in sorted({shard for p in batch for shard in p.shards})]
        failed: dict[int, BaseException] = {}  # shards that failed while others' decisions committed
        try:
            answers = await with_ledger([self.ledgers.sync_of(ledger) for ledger in ledgers], lambda: self._decide(ledgers, batch, clock, failed))
        except asyncio.CancelledError:
            for p in batch:
                p.answer.cancel()
            raise
        except Exception as exc:  # noqa: BLE001 - every waiting submission hears of it
            failure = exc
            answers = {p: failure for p in batch}
        deferred = [p for p in batch if p not in answers]
        clock.ended = time.perf_counter()
        for p, answer in answers.items():
            if p.clock is not None:
                p.clock.batch = clock
            if p.answer.done():
                continue  # the client went away
            if isinstance(answer, BaseException):
                p.answer.set_exception(answer)
            else:
                p.answer.set_result(answer)
        if failed:
            deferred = await self._after_shard_failures(deferred, failed)
        if any(p.refill for p in deferred):
            deferred = await self._refill(deferred)
        if deferred:
            self.batches.resubmit(deferred)

    async def _refill(self, deferred: list[Pending]) -> list[Pending]:
        """The synchronous refill of each submission whose tenant's escrow lease lacked room,
        after its batch committed the others' decisions; then it is decided again, refused if it
        still does not fit and may not be refilled again (`Pending.may_refill`). The submissions
        of a batch that lacked room on one lease are refilled together, for what they lack
        together (each would otherwise ask only for what it lacks alone, and all but one find the
        lease full again), by Escrow.refill; the leases are refilled at once. A refill that fails
        answers its submissions 503. Returns those to try again."""
        again: list[Pending] = []
        asking: list[tuple[Pending, list[tuple[Book, str]]]] = []
        wanted: dict[tuple[Book, str], Lack] = {}  # lease -> what its submissions lack together, on the fullest reading
        for p in deferred:
            if not p.refill:
                again.append(p)
                continue
            lacking, p.refill = p.refill, None
            p.refills += 1
            leases = []
            for lack in lacking:
                lease = (lack.book, lack.root)
                leases.append(lease)
                if (first := wanted.get(lease)) is not None:
                    lack = replace(first, amount=first.amount + lack.amount, seen=max(first.seen, lack.seen, key=lambda seen: seen.used))
                wanted[lease] = lack
            asking.append((p, leases))
        outcomes = await _at_once([
            self.escrow.refill(book, root, amount=lack.amount, seen=lack.seen, chunk=lack.chunk) for (book, root), lack in wanted.items()
        ])  # fmt: skip
        by_lease = dict(zip(wanted, outcomes, strict=True))
        for p, leases in asking:
            failure = next((found for lease in leases if isinstance(found := by_lease[lease], Exception)), None)
            if failure is None:
                p.refill_granted = all(by_lease[lease] for lease in leases)
                again.append(p)
            elif not p.answer.done():
                p.answer.set_exception(as_unavailable(failure))
        return again

    def lacking(self, p: Prepared | Pending, result: ReserveResult) -> list[Lack]:
        """The escrow leases of its tenant a refused reservation lacked room on, each as read
        (`lacking_leases`), with the chunk a refill of it grants in (BUDGETGATE_ESCROW_CHUNK_SHARE
        of the limit, or a few of its reservations when that is less: core.escrow.refill_chunk),
        as admission refills and a quote forecasts."""
        return lacking_leases(p.bundle, p.plan, p.asks, result, chunk_share=self.escrow_chunk_share)

    async def _after_shard_failures(self, deferred: list[Pending], failed: dict[int, BaseException]) -> list[Pending]:
        """The submissions of shards that failed in a batch whose other shards' decisions
        committed (a master failing over, a shard that lost its state): as `with_ledger` does for
        a whole batch, a shard that lost its state is rebuilt (or waited for) and its submissions
        tried once more, and so is one whose call failed on the way (invalidated in `_reserve`, so
        rebuilt first: `redis_fault`); those whose shard is still unreachable, or failed again,
        are answered 503. One shard's fault never fails the decisions of another's. Returns those
        to try again."""
        reasons: dict[int, BaseException | None] = {}
        for shard, exc in failed.items():
            mine = [p for p in deferred if shard in p.shards]
            reason: BaseException | None = as_unavailable(exc)
            if not any(p.shard_failed for p in mine):  # (a shard's failure is its Redis's, or a lost state)
                try:
                    await self.ledgers.syncs[shard].ensure_loaded()
                    reason = None  # rebuilt: its submissions are tried once more
                except Exception as error:  # noqa: BLE001 - its submissions hear of it
                    reason = as_unavailable(error)
            reasons[shard] = reason
        again = []
        for p in deferred:
            found = [reasons[shard] for shard in p.shards if shard in reasons]
            reason = next((r for r in found if r is not None), None)
            if not found:
                again.append(p)
            elif reason is None:
                p.shard_failed = True
                again.append(p)
            elif not p.answer.done():
                p.answer.set_exception(reason)
        return again

    async def _decide(
        self, ledgers: list[RedisLedger], batch: list[Pending], clock: BatchClock, failed: dict[int, BaseException]
    ) -> dict[Pending, dict[str, Any] | BaseException]:
        """The answers of `batch`, committed; its submissions are on the shards `ledgers` (each
        on its tenant's); submissions left out wait for the next batch. `clock` gets the seconds
        of each step on Postgres and Redis. A shard whose script fails while another's succeeds
        goes into `failed` and its submissions are left out; when every shard fails, this raises."""
        run_ids = sorted({p.run_id for p in batch})
        since = time.perf_counter()
        wait = self.ledgers.sync_of(ledgers[0]).wait
        async with ledger_session(self.pool, ledgers[0]) as work:  # (each shard its scripts change is marked: LedgerTransaction.changing)
            try:  # takes the shards' ledger locks first: behind a rebuild, waits as long as for one
                rows = await work.conn.fetch(sql("begin_batch"), run_ids, [ledger.shard for ledger in ledgers], len(self.ledgers), timeout=wait)
            except TimeoutError as exc:
                raise RebuildWaitExceeded(
                    f"the ledger stayed locked for more than {wait:g} s (Redis being rebuilt from Postgres, or Postgres slow); retry shortly"
                ) from exc
            clock.postgres_read += time.perf_counter() - since
            limited = await _over_limits(batch)  # (sent before planning: what is left of a round trip is waited for here)
            heads = rows[: len(ledgers)]  # a row per shard: its committed sequence
            committed = {row["shard"]: row["committed_seq"] for row in heads}
            latest = {row["run_id"]: row for row in rows[len(ledgers) :]}
            answers, fresh, followers = _sort_out([p for p in batch if p not in limited] if limited else batch, latest, tenant_label=self.tenant_label)
            answers.update(limited)
            fresh = await self._current(work.conn, fresh, heads[0]["override_revision"], answers)
            since = time.perf_counter()
            failed.clear()  # (a try again after a rebuild starts afresh)
            asked = [p for p in fresh if p.needs_ledger]
            failed.update(await self._reserve(work, asked, committed))
            # Left out: a failed shard's, and those decided again after a refill of their leases.
            fresh = [p for p in fresh if p.shards.isdisjoint(failed) and not p.refill]
            await self._keep_tokens(work, asked, fresh, failed)
            clock.redis += time.perf_counter() - since
            decided = await self._decisions(work.conn, fresh)
            since = time.perf_counter()
            if decided:
                try:
                    await records.record(work.conn, decided)
                except asyncpg.UniqueViolationError as exc:
                    if exc.constraint_name != "decisions_ledger_seq":
                        raise
                    # Another batch committed the sequence number Redis gave this one: Redis lost
                    # a write it had acknowledged (see migration 0021). Rolled back, Redis rebuilt
                    # from Postgres (with_ledger), and the batch decided again.
                    raise LedgerNotLoaded(f"Redis handed out ledger sequence numbers again: {exc}") from exc
            clock.postgres_write += time.perf_counter() - since
        if decided and self.committed is not None:
            self.committed()
        for r, p in zip(decided, fresh, strict=True):
            answers[p] = r.body
        for follower, leader in followers:
            if leader not in answers:
                continue  # its shard failed: both wait for the next batch
            led = answers[leader]
            answers[follower] = led if isinstance(led, BaseException) else {**led, "replayed": True}
        return answers

    async def _current(self, conn: asyncpg.Connection, fresh: list[Pending], revision: int, answers: dict[Pending, Any]) -> list[Pending]:
        """`fresh`, each prepared under override `revision` or a newer one: those prepared under
        an older revision are prepared again (one that now fails is answered with the error)."""
        if all(p.bundle.override_revision >= revision for p in fresh):
            return fresh
        if self.policies.overrides.revision < revision:
            await self.policies.refresh(conn)
        current = []
        for p in fresh:
            if p.bundle.override_revision < revision:
                try:
                    again = self.prepare(p.request, p.decided_at)
                except Exception as exc:  # noqa: BLE001 - this submission's answer
                    answers[p] = exc
                    continue
                p.bundle, p.plan, p.asks = again.bundle, again.plan, again.asks
                p.__dict__.pop("prepared", None)  # the cached Prepared of the old plan
            current.append(p)
        return current

    async def _reserve(self, work: LedgerTransaction, pending: list[Pending], committed: dict[int, int]) -> dict[int, BaseException]:
        """Check-and-reserve every submission of `pending` in Redis, in order on each shard (one
        script per shard, the shards' at once; `committed`: each shard's committed sequence);
        each gets its `result`. Keys Redis never saw are loaded and orphaned holds released, then
        tried again. A shard whose script fails (lost its state, unreachable, failing over) is
        returned with its error, its submissions without a result, while the others' stand; a
        script that may have run is covered by invalidating its shard (what it held is an orphan
        of a decision never committed). When every shard touched fails, the first error is raised."""
        now_ms = int(datetime.now(UTC).timestamp() * 1000)
        failed: dict[int, BaseException] = {}
        for p in pending:
            p.result = p.refill = p.token = None
        if apart := [p for p in pending if p.pool_shard is not None]:
            shard = self.pools_ledger.shard
            try:
                await self._take_tokens(work, apart, committed[shard], now_ms)
            except (LedgerNotLoaded, *BACKEND_ERRORS) as exc:
                if len(committed) == 1:
                    raise  # every shard touched failed
                failed[shard] = exc
                if not isinstance(exc, LedgerNotLoaded):  # a grant's reply may have been lost
                    await self.pools_ledger.invalidate(f"a pool token's grant failed in a batch other shards committed: {exc}")
        for _ in range(4):
            pending = [p for p in pending if p.shards.isdisjoint(failed)]
            if not pending:
                return failed
            by_shard: dict[int, list[Pending]] = {}
            for p in pending:
                by_shard.setdefault(p.shard, []).append(p)
            asked = {shard: [_reservation(p) for p in mine] for shard, mine in by_shard.items()}
            work.changing(*(self.ledgers.parts[shard] for shard in asked))
            replies = await _at_once(
                [self.ledgers.parts[shard].reserve_batch(reservations, now_ms=now_ms, committed_seq=committed[shard]) for shard, reservations in asked.items()]
            )
            errors = [(shard, reply) for shard, reply in zip(by_shard, replies, strict=True) if isinstance(reply, BaseException)]
            for shard, error in errors:
                if not isinstance(error, (LedgerNotLoaded, *BACKEND_ERRORS)) or len(failed) + len(errors) == len(committed):
                    raise error  # a fault of no shard's state, or every shard's: the whole batch fails
            for shard, error in errors:
                failed[shard] = error
                if not isinstance(error, LedgerNotLoaded):  # the script may have run before its reply was lost
                    await self.ledgers.parts[shard].invalidate(f"its script failed in a batch other shards committed: {error}")
            again = []
            for (shard, mine), results in zip(by_shard.items(), replies, strict=True):
                if shard in failed:
                    continue
                ledger = self.ledgers.parts[shard]
                for p, result in zip(mine, results, strict=True):
                    if result.status == "MISSING":
                        again.append(p)
                    elif result.status == "DUPLICATE":
                        # We hold the run's lock and Postgres has no decision for it: the Redis hold
                        # is an orphan of a process that died between reserving and committing.
                        log.warning("releasing orphaned reservation of run %r (decision %s)", p.run_id, result.holder)
                        await ledger.release(p.run_id, decision_id=result.holder or "")
                        again.append(p)
                    else:
                        p.result = result if p.token is None else replace(result, pools=p.token.readings)
                        if result.status == "REJECTED" and p.may_refill:
                            p.refill = self.lacking(p, result) or None
                missing = [p.plan for p in again if p.shard == shard and p.plan.charges]
                if missing:
                    await self._load_keys(work.conn, ledger, missing)
            pending = again
        pending = [p for p in pending if p.shards.isdisjoint(failed)]
        if pending:  # the fourth round may have reserved them all
            raise Unavailable(f"could not reserve for runs {[p.run_id for p in pending]!r}: the ledger kept changing")
        return failed

    async def _take_tokens(self, work: LedgerTransaction, apart: list[Pending], committed_seq: int, now_ms: int) -> None:
        """Take the pool token of each of `apart`, in submission order, on the pools' shard (a
        ledger of several shards), before its decision is reserved on its tenant's: each gets its
        `token`, granted or refused with the readings of its levels, and its reservation is then
        refused if the token was (`Reservation.refused`). A token Postgres holds already for an
        earlier attempt of the run, on a level asked, is refused as taken, as on one shard; one
        Redis alone holds (an orphan of a batch that never committed) is taken over. A grant is
        a pending hold, as TigerBeetle's pending transfers: given back after the tenant's script
        when the decision holds nothing (`_keep_tokens`), and by invalidating the shard should
        the batch fail."""
        ledger = self.pools_ledger
        rows = await work.conn.fetch(sql("held_run_tokens"), [p.asks.pool.token for p in apart if p.asks.pool is not None])
        held: dict[str, set[str]] = {}
        for row in rows:
            held.setdefault(row["token"], set()).update(row["levels"])
        work.changing(ledger)
        for p in apart:
            pool = p.asks.pool
            assert pool is not None
            if held.get(pool.token, set()) & {level.namespace for level in pool.levels}:
                checked = await ledger.check(Reservation(p.run_id, p.decision_id, (), (), pool), now_ms=now_ms, committed_seq=committed_seq)
                p.token = Token(False, tuple(replace(r, check="TAKEN") for r in checked.pools))
                continue
            status, readings, seq = await ledger.allocate(pool, now_ms=now_ms, committed_seq=committed_seq)
            p.token = Token(status in ("GRANTED", "RENEWED"), readings, seq)

    async def _keep_tokens(self, work: LedgerTransaction, asked: list[Pending], deciding: list[Pending], failed: Mapping[int, BaseException]) -> None:
        """The pool tokens taken apart in this batch (`_take_tokens`, for `asked`: a submission
        of an earlier batch keeps the token it had there, given back then): kept by the decisions of
        `deciding` that hold, their grants' sequence recorded (a mark of the pools' shard, so a
        Redis that lost them is rebuilt before it decides); given back, before the decisions
        commit, by every other (refused, left for a refill, its tenant's shard failed)."""
        granted = [p for p in asked if p.token is not None and p.token.granted]
        if not granted or self.pools_ledger.shard in failed:
            return
        kept = {p for p in deciding if holds(p.result)}
        for p in granted:
            if p not in kept and p.asks.pool is not None:
                await self.pools_ledger.deallocate([level.namespace for level in p.asks.pool.levels], p.asks.pool.token)
        await record_ledger_mark(work.conn, self.pools_ledger, max((p.token.seq for p in granted if p in kept and p.token), default=0))

    async def _load_keys(self, conn: asyncpg.Connection, ledger: RedisLedger, plans: list[Plan]) -> None:
        """Create the ledger entries of `plans` in Postgres (if new) and load them into Redis (the
        shard `ledger` of their submissions' tenant). An escrow lease is opened (size 0, its
        budget's entry created too): its first decision asks for a refill."""
        charges = {c.ledger_key: (c, p.bundle_sha) for p in plans for c in p.charges}
        budgets = {c.budget_key: (replace(c, root=None), sha) for c, sha in charges.values() if c.root is not None}
        entries = [records.entry(c) | {"policy_git_sha": sha} for c, sha in [*charges.values(), *budgets.values()]]
        await conn.execute(sql("ensure_ledger_entries"), orjson.dumps(entries).decode())
        for c, _sha in charges.values():
            if c.root is not None:
                await conn.execute(ledger_sql("escrow_open"), c.budget_key, c.root, c.ledger_key, records.entry(c)["scope_id"])
        for row in await conn.fetch(sql("ledger_figures"), list(charges)):
            await ledger.load_key(row["ledger_key"], reserved=row["reserved"], consumed=row["consumed"], size=row["size"])

    async def _decisions(self, conn: asyncpg.Connection, fresh: list[Pending]) -> list[records.DecisionRecord]:
        """The decision of every fresh submission, from what Redis read and reserved."""
        found = {p: readings(p.plan, p.result) for p in fresh}
        ahead = await releases(conn, [(p.plan, r) for p, r in found.items() if r is not None and not holds(p.result)], self.start_deadline)
        decided = []
        for p in fresh:
            reserved = holds(p.result)
            usage = self.decayed(p.prepared)
            decision, view = conclude(p.prepared, p.result, ahead, usage)
            body = response_body(plan=p.plan, decision=decision, decision_id=p.decision_id, decided_at=p.decided_at, standing=view)
            seq = p.result.seq if p.result is not None and reserved else None
            recorded = readings_record(p.prepared, p.result, ahead, tenant_label=self.tenant_label, usage=usage)
            decided.append(records.DecisionRecord(p.request, p.plan, decision, body, p.asks, p.decided_at, reserved, seq, recorded, p.provisional))
        return decided

    def decayed(self, p: Prepared) -> Decayed | None:
        """The decayed usage of the submission's tenant, for its fair share (none kept: None)."""
        return self.usage.of(p.bundle, p.asks.tenant, p.at) if self.usage is not None else None


def lacking_leases(bundle: PolicyBundle, the_plan: Plan, asks: Asks, result: ReserveResult, *, chunk_share: float) -> list[Lack]:
    """The escrow leases a refused reservation lacked room on, each as read (its size the
    reading's limit): budgets' leases and the sensitive pool's, only when every limit that lacked
    room is a lease (a refill cannot help a tenant's own budget or quota, nor a token pool)."""
    found = readings(the_plan, result) or {}
    lacking: list[Lack] = []
    for i, c in enumerate(the_plan.charges):
        if c.hard and not fits(c.amount, (reading := found[c.ledger_key])):
            if c.root is None:
                return []
            seen = Lease(reading.limit, reading.reserved, reading.consumed)
            chunk = refill_chunk(c.policy.limit.amount, chunk_share, c.amount)
            lacking.append(Lack(BudgetBook(c.budget_key), c.root, c.amount, seen, chunk, charge=i))
    sizes = result.counter_sizes or (None,) * len(asks.counters)
    for i, (c, held, size) in enumerate(zip(asks.counters, result.counters, sizes, strict=True)):
        asked = (c.gpus, c.nodes, c.allocations)
        limits = [size if c.lease and limit is not None else limit for limit in c.limits]
        short = [f for f in range(3) if limits[f] is not None and held[f] + asked[f] > limits[f]]  # type: ignore[operator]
        if not short:
            continue
        if not c.lease or bundle.sensitive is None or asks.tenant is None or size is None:
            return []
        unit = 0 if bundle.sensitive.unit == "gpus" else 1
        seen = Lease(size, held[unit])
        chunk = refill_chunk(bundle.sensitive.size, chunk_share, asked[unit])
        lacking.append(Lack(CounterBook(SENSITIVE, bundle.sensitive.unit, bundle.sensitive.size), asks.tenant, asked[unit], seen, chunk, counter=i))
    if any(reading.check in ("EXHAUSTED", "CAP", "TAKEN") for reading in result.pools):
        return []
    return lacking


def _reservation(p: Pending) -> Reservation:
    """What `p`'s decision reserves on its tenant's shard: all it asks, but its pool token when
    taken apart (then refused when the token was)."""
    if p.token is None:
        return Reservation(p.run_id, p.decision_id, charges(p.plan), p.asks.counters, p.asks.pool)
    return Reservation(p.run_id, p.decision_id, charges(p.plan), p.asks.counters, refused=not p.token.granted)


async def _at_once(calls: list[Awaitable[T]]) -> list[T | Exception]:
    """Each call's result or error, the calls run at once; one call (every batch of a ledger of
    one shard) is awaited as it is, without the task `asyncio.gather` wraps each call in."""
    if len(calls) == 1:
        try:
            return [await calls[0]]
        except Exception as exc:  # noqa: BLE001 - returned, as gather's return_exceptions does
            return [exc]
    return list(await asyncio.gather(*calls, return_exceptions=True))  # type: ignore[arg-type]


async def _over_limits(batch: list[Pending]) -> dict[Pending, BaseException]:
    """The submissions of `batch` whose caller's count on its rate limit refused them (waited for
    here, before the batch reserves anything), each with what it raised (RateLimited); one whose
    count was cancelled (the service stopping) is answered Unavailable, not the whole batch."""
    counts = [p.counted for p in batch if p.counted is not None]
    if not all(count.done() for count in counts):
        await asyncio.wait(counts)
    refused: dict[Pending, BaseException] = {}
    for p in batch:
        count = p.counted
        if count is None:
            continue
        if count.cancelled():
            refused[p] = Unavailable("its rate limit could not be checked (the service is stopping); retry shortly")
        elif (exc := count.exception()) is not None:
            refused[p] = exc
    return refused


def _sort_out(batch: list[Pending], latest: Mapping[str, Any], *, tenant_label: str) -> tuple[dict[Pending, Any], list[Pending], list[tuple[Pending, Pending]]]:
    """Split a batch, in submission order, into answers known already (replays, conflicts), the
    submissions to decide, and followers answered as their leader (the same request again within
    the batch). A second submission of a run with another attempt or another request is left for
    the next batch, to be judged against what the first committed (resubmission.resent)."""
    answers: dict[Pending, Any] = {}
    fresh: list[Pending] = []
    followers: list[tuple[Pending, Pending]] = []
    leaders: dict[str, Pending] = {}
    for p in batch:
        req = p.request
        leader = leaders.get(p.run_id)
        if leader is not None:
            if leader.request.attempt == req.attempt and not differences(leader.request.model_dump(mode="json"), req):
                followers.append((p, leader))
            continue  # else deferred
        leaders[p.run_id] = p
        prior = latest.get(p.run_id)
        verdict = resent(prior, req, tenant_label=tenant_label)
        if verdict == "decide":
            fresh.append(p)
        elif verdict == "replay" and prior is not None:
            answers[p] = replayed(prior)
        else:
            answers[p] = verdict
    return answers, fresh, followers


async def releases(conn: asyncpg.Connection, refused_plans: list[tuple[Plan, Mapping[str, Reading]]], start_deadline: timedelta) -> dict[str, Outlook]:
    """How the usage of each key that lacks room on a delaying budget changes with time alone
    (one query for the batch), so a DELAY can name the earliest instant room appears; a denying
    budget's time is only informative (the next window, read without a query)."""
    short = {
        c.ledger_key: c
        for the_plan, readings in refused_plans
        for c in the_plan.charges
        if c.policy.on_exhausted.delays and not fits(c.amount, readings[c.ledger_key])
    }  # fmt: skip
    return await outlooks(conn, list(short.values()), start_deadline=start_deadline)
