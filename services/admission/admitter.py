"""Admission: load → decide → save, with the reservation made atomically in Redis and the
decision made durable in Postgres before anyone hears it.

The order of one submission:
1. In one Postgres transaction, take the ledger lock (shared) and the run's lock.
2. A decision already stored for the run id is answered again (`replayed: true`).
3. Otherwise plan the charges, check-and-reserve them in Redis (all or none), decide.
4. Store the decision, its evaluations, its reservations and an outbox row; commit; answer.
If anything fails after Redis reserved, the reservation is released once Postgres is known not
to hold it; when that cannot be known, the Redis ledger is invalidated and rebuilt from
Postgres before the next decision (fail closed).
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any, TypeVar

import asyncpg
import redis.exceptions

from budgetgate import topics, wire
from budgetgate.core.evaluation import Charge, Decision, Plan, Reading, Resources, Submission, UnknownFlavor, decide, fits, plan
from budgetgate.ledger.queries import sql
from budgetgate.core.policy import PolicyBundle
from budgetgate.ledger.redis_ledger import ChargeRequest, LedgerNotLoaded, RedisLedger, ReserveResult
from budgetgate.services.admission.concurrency import Asks, NoSuchPool, asks, refused, rejection, standing
from budgetgate.ledger.sync import LedgerSync, undo_unless_committed
from budgetgate.services.admission.policies import PolicyCache
from budgetgate.services.admission.rendering import decision_message, response_body
from budgetgate.services.admission.schemas import AdmissionRequest

log = logging.getLogger(__name__)
T = TypeVar("T")

# Errors that mean a ledger backend is unreachable or failed mid-call: answer 503.
BACKEND_ERRORS: tuple[type[BaseException], ...] = (
    OSError,
    asyncpg.PostgresConnectionError,
    asyncpg.InterfaceError,
    asyncpg.exceptions.CannotConnectNowError,
    asyncpg.InternalClientError,
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
    TimeoutError,
)


async def with_ledger(sync: LedgerSync, work: Callable[[], Awaitable[T]]) -> T:
    """Run `work` against the ledger, failing closed: a Redis that lost the ledger is rebuilt
    from Postgres and the work tried once more; an unreachable backend becomes Unavailable."""
    try:
        try:
            return await work()
        except LedgerNotLoaded:
            await sync.ensure_loaded()
            return await work()
    except LedgerNotLoaded as exc:
        raise Unavailable("the Redis ledger is being rebuilt from Postgres; retry shortly") from exc
    except BACKEND_ERRORS as exc:
        raise Unavailable(f"ledger backend unavailable: {type(exc).__name__}: {exc}") from exc


class Unavailable(RuntimeError):
    """The ledger cannot be used right now; nothing was reserved or recorded as allowed."""


class InvalidSubmission(ValueError):
    """The submission is well-formed JSON but cannot be evaluated; `field` names the culprit."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


class Admitter:
    def __init__(self, *, pool: asyncpg.Pool, ledger: RedisLedger, sync: LedgerSync, policies: PolicyCache, unmatched: str = "allow", tenant_label: str = "team") -> None:
        self.pool = pool
        self.ledger = ledger
        self.sync = sync
        self.policies = policies
        self.unmatched = unmatched
        self.tenant_label = tenant_label

    async def admit(self, request: AdmissionRequest, *, now: datetime | None = None) -> dict[str, Any]:
        """Decide a submission; raises Unavailable (503) or InvalidSubmission (422)."""
        return await with_ledger(self.sync, lambda: self._admit(request, now or datetime.now(UTC)))

    async def _admit(self, request: AdmissionRequest, now: datetime) -> dict[str, Any]:
        bundle = self.policies.current
        if bundle is None:
            raise Unavailable("no policy bundle has been applied yet; run `budgetgate policy apply`")
        try:
            the_plan = plan(bundle, _submission(request, now))
        except UnknownFlavor as exc:
            raise InvalidSubmission("resources.flavor", str(exc)) from exc
        if not the_plan.charges and not the_plan.violations and self.unmatched == "deny":
            raise InvalidSubmission("namespace", f"no budget policy covers namespace {request.namespace!r} with these labels, and unmatched submissions are denied")
        try:
            the_asks = asks(bundle, request, tenant_label=self.tenant_label, now=now)
        except NoSuchPool as exc:
            raise InvalidSubmission("pool_token.namespace", str(exc)) from exc

        decision_id = str(uuid.uuid4())
        reserved = False
        async with self.pool.acquire() as conn:
            tx = conn.transaction()
            await tx.start()
            finished = False
            try:
                # Ledger lock (shared), the run's lock, and the run's latest decision.
                prior = await conn.fetchrow(sql("begin_decision"), request.run_id)
                if prior is not None and not (prior["outcome"] == "DELAY" and request.attempt > prior["attempt"]):
                    finished = True
                    await tx.rollback()
                    return replay(prior)
                readings, result = await self._reserve(conn, the_plan, the_asks, decision_id, now)
                reserved = result is not None and result.status == "RESERVED"
                releases = await _releases(conn, the_plan, readings) if readings is not None and not reserved else {}
                decision = decide(the_plan, readings, releases=releases)
                if result is not None and result.status == "REJECTED":
                    decision = _refusal(bundle, request, the_asks, result, decision)
                elif reserved and not decision.admitted:
                    raise RuntimeError(f"the ledger reserved for run {request.run_id!r} but the evaluation refuses it")
                view = standing(bundle, request, the_asks, the_plan, readings, result).body()
                body = response_body(plan=the_plan, decision=decision, decision_id=decision_id, decided_at=now, standing=view)
                await _record(conn, request, the_plan, decision, body, reserved=reserved, now=now, the_asks=the_asks)
                finished = True
                await tx.commit()
                return body
            except BaseException:
                if not finished:
                    try:
                        await tx.rollback()
                    except Exception:  # noqa: BLE001
                        # A connection that cannot even roll back must not go back to the pool
                        # (it has no reset query to catch that): drop it.
                        conn.terminate()
                if reserved:
                    await self._undo(request.run_id, decision_id)
                raise

    async def _reserve(self, conn: asyncpg.Connection, the_plan: Plan, the_asks: Asks, decision_id: str, now: datetime) -> tuple[dict[str, Reading] | None, ReserveResult | None]:
        """Check-and-reserve in Redis: the readings each budget had before, and the raw result
        (None when the ledger was not consulted: a label violation, or nothing to hold)."""
        if the_plan.violations or not (the_plan.charges or the_asks.any):
            return None, None
        charges = [ChargeRequest(c.ledger_key, c.amount, c.policy.limit.amount, c.hard) for c in the_plan.charges]
        run_id = the_plan.submission.run_id
        for _ in range(4):
            result = await self.ledger.reserve(run_id=run_id, decision_id=decision_id, charges=charges, now_ms=int(now.timestamp() * 1000), counters=the_asks.counters, pool=the_asks.pool)
            if result.status == "MISSING":
                await self._load_keys(conn, the_plan)
                continue
            if result.status == "DUPLICATE":
                # We hold the run's lock and Postgres has no decision for it: the Redis hold is an
                # orphan of a process that died between reserving and committing.
                log.warning("releasing orphaned reservation of run %r (decision %s)", run_id, result.holder)
                await self.ledger.release(run_id, decision_id=result.holder or "")
                continue
            readings = {
                c.ledger_key: Reading(c.policy.limit.amount, reserved, consumed)
                for c, (reserved, consumed) in zip(the_plan.charges, result.readings, strict=True)
            }
            return readings, result
        raise Unavailable(f"could not reserve for run {run_id!r}: the ledger kept changing")

    async def _load_keys(self, conn: asyncpg.Connection, the_plan: Plan) -> None:
        """Create the ledger entries of a plan in Postgres (if new) and load them into Redis."""
        await _ensure_entries(conn, the_plan)
        keys = [c.ledger_key for c in the_plan.charges]
        for row in await conn.fetch(sql("ledger_figures"), keys):
            await self.ledger.load_key(row["ledger_key"], reserved=row["reserved"], consumed=row["consumed"])

    async def _undo(self, run_id: str, decision_id: str) -> None:
        """Give back a reservation whose decision did not commit, or invalidate Redis if unsure."""
        await undo_unless_committed(
            self.ledger,
            committed=lambda: self.pool.fetchval("SELECT 1 FROM decisions WHERE decision_id = $1", uuid.UUID(decision_id)),
            undo=lambda: self.ledger.release(run_id, decision_id=decision_id),
            what=f"decision {decision_id}",
        )

    async def lookup(self, run_id: str) -> dict[str, Any] | None:
        row = await self.pool.fetchrow(sql("latest_decision"), run_id)
        return replay(row) if row else None


def _refusal(bundle: PolicyBundle, request: AdmissionRequest, the_asks: Asks, result: ReserveResult, decision: Decision) -> Decision:
    """The decision when the atomic step refused: a concurrency limit's reason comes first; else
    a budget must be what refused, or the ledger and the evaluation disagree (a bug)."""
    reason = rejection(bundle, request, the_asks, result)
    if reason is not None:
        return refused(decision, reason)
    if decision.admitted:
        raise RuntimeError(f"the ledger refused run {request.run_id!r} but the evaluation finds room everywhere")
    return decision


def replay(row: Mapping[str, Any]) -> dict[str, Any]:
    body = json.loads(row["response"]) if isinstance(row["response"], str) else dict(row["response"])
    body["replayed"] = True
    return body


def _submission(request: AdmissionRequest, now: datetime) -> Submission:
    res = request.resources
    return Submission(
        run_id=request.run_id,
        attempt=request.attempt,
        namespace=request.namespace,
        labels=dict(request.labels),
        resources=Resources(gpus=res.gpus, nodes=res.nodes, flavor=res.flavor, region=res.region),
        runtime_hours=Decimal(repr(request.projected_runtime_hours)),
        at=now,
    )


async def _ensure_entries(conn: asyncpg.Connection, the_plan: Plan) -> None:
    await conn.execute(sql("ensure_ledger_entries"), *_entry_columns(the_plan, the_plan.charges), the_plan.bundle_sha)


async def _releases(conn: asyncpg.Connection, the_plan: Plan, readings: Mapping[str, Reading]) -> dict[str, list[tuple[datetime, int]]]:
    """When running reservations on each blocked, delaying key are expected to end, so a DELAY
    can name the earliest moment room appears. Denying budgets need no such time."""
    result = {}
    for charge in the_plan.charges:
        if charge.hard and charge.policy.on_exhausted.delays and not fits(charge.amount, readings[charge.ledger_key]):
            rows = await conn.fetch(sql("expected_releases"), charge.ledger_key)
            result[charge.ledger_key] = [(r["expected_end"], r["amount"]) for r in rows]
    return result


async def _record(conn: asyncpg.Connection, request: AdmissionRequest, the_plan: Plan, decision: Decision, body: dict[str, Any], *, reserved: bool, now: datetime, the_asks: Asks) -> None:
    """Decision, evaluations, ledger entries, reservations and outbox row in one statement."""
    decision_id = uuid.UUID(body["decision_id"])
    job = (request.job.namespace, request.job.name) if request.job else None
    evaluations = decision.evaluations
    charges = the_plan.charges if reserved else ()
    standing_view = {k: body[k] for k in ("tenant", "priority_penalty", "preemptible")}
    message = decision_message(plan=the_plan, decision=decision, decision_id=body["decision_id"], decided_at=now, job=job, standing=standing_view)
    holds = reserved and bool(the_asks.counters)
    pool = the_asks.pool if reserved else None
    record = wire.encode(message, key=request.run_id)
    await conn.execute(
        sql("record_decision"),
        decision_id,
        request.run_id,
        request.attempt,
        decision.outcome,
        decision.reason,
        request.namespace,
        json.dumps(request.labels),
        job[0] if job else None,
        job[1] if job else None,
        the_plan.bundle_sha,
        the_plan.projected_gpu,
        the_plan.showback_micros,
        the_plan.currency,
        request.model_dump_json(),
        json.dumps(body),
        now,
        [e.policy_id for e in evaluations],
        [e.policy_git_sha for e in evaluations],
        [e.scope_id for e in evaluations],
        [e.ledger_key for e in evaluations],
        [e.window_start for e in evaluations],
        [e.window_end for e in evaluations],
        [str(e.unit) for e in evaluations],
        [str(e.enforcement) for e in evaluations],
        [e.outcome for e in evaluations],
        [e.limit for e in evaluations],
        [e.projected for e in evaluations],
        [e.remaining for e in evaluations],
        [e.admitted for e in evaluations],
        [e.deficit for e in evaluations],
        [e.next_eligible_time for e in evaluations],
        *_entry_columns(the_plan, charges),
        [c.amount for c in charges],
        now + timedelta(hours=float(the_plan.submission.runtime_hours)),
        topics.DECISIONS,
        record.value,
        json.dumps([[k, v.decode("latin-1")] for k, v in record.headers]),
        holds,
        the_asks.tenant,
        request.resources.gpus,
        request.resources.nodes,
        the_asks.sensitive,
        pool.levels[0].namespace if pool else None,
        [level.namespace for level in pool.levels] if pool else None,
        pool.project if pool else "",
        pool.sub_namespace if pool else "",
        datetime.fromtimestamp(pool.expiry_ms / 1000, UTC) if pool else None,
    )


def _entry_columns(the_plan: Plan, charges: Sequence[Charge]) -> tuple[list[Any], ...]:
    """Column arrays of the ledger entries of `charges` (keys, scopes, units, windows, policies, limits)."""
    return (
        [c.ledger_key for c in charges],
        [c.policy.scope.scope_id for c in charges],
        [str(c.policy.limit.unit) for c in charges],
        [c.window.key for c in charges],
        [None if c.policy.window.rolling else c.window.start for c in charges],
        [None if c.policy.window.rolling else c.window.end for c in charges],
        [c.policy.id for c in charges],
        [c.policy.limit.amount for c in charges],
    )
