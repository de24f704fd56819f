"""HEADROOM: a run refused for now (a DELAY, a quota rejection) hears when room returns for it,
on budget.actions.v1, so its platform resubmits it without polling.

- **Registered** from budget.decisions.v1, in the inbox's transaction: a waiting decision enters
  waiting_runs and is judged at once (room may have returned while it was on its way); a later
  decision of the run, or the platform reporting the run ended, forgets it.
- **A release** (a settlement giving back a tenant's holds, or room on a budget: a reservation
  released or replaced by a smaller actual) judges the waiting runs it concerns, in the
  settlement's own transaction, after its changes.
- **A new policy bundle or override revision** (a limit may have risen): upkeep judges every
  waiting run not yet judged under the active bundle with the latest tenant overrides.
- **A new calendar window** (a month, a week begins): upkeep judges the runs refused by a budget
  in an earlier window of it, in the new one.

A run judged to fit gets one HEADROOM per cause (the release, the bundle), written to the
outbox in the judging transaction (headroom_notices keeps each cause once). Judgments take
transaction advisory locks per tenant and per budget, all at once and in one order, before
reading anything: two releases that only together make room, or a release and a registration
crossing each other, are judged one after the other, the second seeing the first.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Mapping, Sequence, Set
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import orjson

from budgetgate.messaging.inbox import BatchRoute, Delivery
from budgetgate.core.policy import PolicyBundle
from budgetgate.core.waiting import QUOTA, WaitingRun, budget_needs, waiting_for
from budgetgate.core.windows import window_at
from budgetgate.ledger.queries import owned_by
from budgetgate.ledger.waiting_runs import headroom, registered
from budgetgate.services.reconciler import messages
from budgetgate.policies.policy_store import PolicyStore, judged_under
from budgetgate.v1 import common_pb2, decisions_pb2

sql = owned_by("budgetgate.services.reconciler")

_PAGE = 200


def lock_names(*, tenant: str | None = None, sensitive: bool = False, policy_ids: Iterable[str] = ()) -> set[str]:
    """The judgment locks of a tenant's holds, the sensitive pool and budgets."""
    return ({f"t:{tenant}"} if tenant else set()) | ({"s"} if sensitive else set()) | {f"p:{p}" for p in policy_ids}


def _names(run: WaitingRun, bundle: PolicyBundle) -> set[str]:
    """The judgment locks of what refused `run`: a run refused by a quota may need budgets too."""
    budgets = lock_names(policy_ids=(n.policy_id for n in run.needs))
    if run.waiting_for == QUOTA:
        return budgets | lock_names(tenant=run.tenant, sensitive=run.sensitive(bundle))
    return budgets


def decisions_route(*, bundles: PolicyStore) -> BatchRoute:
    """The inbox route of budget.decisions.v1: waiting runs registered and forgotten."""

    async def decisions(conn: asyncpg.Connection, batch: Sequence[Delivery]) -> Mapping[Delivery, str]:
        latest: dict[str, decisions_pb2.Decision] = {}
        for delivery in batch:
            message = delivery.message
            if message.run_id not in latest or message.attempt >= latest[message.run_id].attempt:
                latest[message.run_id] = message
        await conn.execute(sql("forget_waiting"), list(latest), [m.attempt for m in latest.values()])
        runs = [run for m in latest.values() if (run := _waiting_run(m)) is not None]
        if runs:
            await register(conn, runs, bundle=bundles.current, now=datetime.now(UTC))
        return {}

    return BatchRoute(decisions_pb2.Decision, decisions)


def _waiting_run(message: decisions_pb2.Decision) -> WaitingRun | None:
    kind = waiting_for(common_pb2.Outcome.Name(message.outcome), message.reason)
    if kind is None:
        return None
    evaluations = ((e.policy_id, e.unit, e.enforcement, common_pb2.Outcome.Name(e.outcome), e.projected_amount) for e in message.evaluations)
    return WaitingRun(
        run_id=message.run_id, attempt=message.attempt, decision_id=message.decision_id, waiting_for=kind, tenant=message.tenant or None,
        labels=dict(message.labels), gpus=message.resources.gpus, nodes=message.resources.nodes, needs=budget_needs(evaluations),
        decided_at=message.event_time.ToDatetime(tzinfo=UTC),
    )  # fmt: skip


async def register(conn: asyncpg.Connection, runs: Sequence[WaitingRun], *, bundle: PolicyBundle | None, now: datetime) -> int:
    """Register waiting runs and judge them at once; returns the HEADROOM actions sent."""
    rows = [
        {"run_id": r.run_id, "attempt": r.attempt, "decision_id": r.decision_id, "waiting_for": r.waiting_for, "tenant": r.tenant,
         "labels": dict(r.labels), "sensitive": bundle is not None and r.sensitive(bundle), "gpus": r.gpus, "nodes": r.nodes,
         "needs": [[n.policy_id, n.unit, n.amount] for n in r.needs], "checked_sha": judged_under(bundle) if bundle else None,
         "decided_at": r.decided_at.isoformat()}
        for r in runs
    ]  # fmt: skip
    fresh = {row["run_id"] for row in await conn.fetch(sql("register_waiting"), orjson.dumps(rows).decode())}
    if bundle is None:
        return 0
    return await _judge(conn, [r for r in runs if r.run_id in fresh], bundle, cause="registered", now=now)


async def after_release(
    conn: asyncpg.Connection, *, bundles: PolicyStore, tenant: str | None, sensitive: bool, policy_ids: Iterable[str], cause: str, now: datetime
) -> int:
    """A settlement gave back what `tenant` (and the sensitive pool) held, or room on budgets
    `policy_ids`: judge the runs waiting on them; returns the HEADROOM actions sent."""
    policies = sorted(set(policy_ids))
    names = lock_names(tenant=tenant, sensitive=sensitive, policy_ids=policies)
    bundle = bundles.current
    if not names or bundle is None:
        return 0
    # Taken even when nobody waits: a registration crossing this release waits for its commit.
    await conn.execute(sql("lock_headroom"), sorted(names))
    rows = await conn.fetch(sql("waiting_on_release"), tenant, sensitive, policies)
    return await _judge(conn, [registered(r) for r in rows], bundle, cause=cause, now=now, locked=names)


async def recheck(pool: asyncpg.Pool, bundles: PolicyStore, *, now: datetime) -> int:
    """Judge the waiting runs not yet judged under the active bundle (its limits may have
    risen); returns the HEADROOM actions sent."""
    bundle, sent = bundles.current, 0
    while bundle is not None:
        async with pool.acquire() as conn, conn.transaction():
            rows = await conn.fetch(sql("waiting_unchecked"), judged_under(bundle), _PAGE)
            runs = [registered(r) for r in rows]
            sent += await _judge(conn, runs, bundle, cause=f"policies:{judged_under(bundle)}", now=now)
            await conn.execute(sql("mark_waiting_checked"), [uuid.UUID(r.decision_id) for r in runs], judged_under(bundle))
        if len(rows) < _PAGE:
            break
    return sent


async def rollover(pool: asyncpg.Pool, bundles: PolicyStore, *, since: datetime | None, now: datetime) -> int:
    """Judge the runs waiting on a calendar-window budget whose window began after they were
    refused (a DELAY until the month resets, say): in the new window the budget may have room.
    Only windows that began after `since` are looked at (None, as at start: every current one);
    returns the HEADROOM actions sent, once per run and new window."""
    bundle = bundles.current
    if bundle is None:
        return 0
    began = {p.id: window_at(p.window, now) for p in bundle.policies if not p.window.rolling}
    if since is not None:
        began = {policy_id: window for policy_id, window in began.items() if window.start > since}
    if not began:
        return 0

    def by_cause(rows: Iterable[Any]) -> dict[str, list[WaitingRun]]:
        found: dict[str, list[WaitingRun]] = {}
        for run in map(registered, rows):
            new = sorted(f"{n.policy_id}@{began[n.policy_id].key}" for n in run.needs if n.policy_id in began and run.decided_at < began[n.policy_id].start)
            if new:
                found.setdefault("window:" + ",".join(new), []).append(run)
        return found

    async with pool.acquire() as conn, conn.transaction():
        # Locked are only the budgets somebody waits on (a bundle may have thousands), then read again.
        waiting = by_cause(await conn.fetch(sql("waiting_on_release"), None, False, sorted(began)))
        policy_ids = sorted({n.policy_id for runs in waiting.values() for run in runs for n in run.needs if n.policy_id in began})
        if not policy_ids:
            return 0
        names = lock_names(policy_ids=policy_ids)
        await conn.execute(sql("lock_headroom"), sorted(names))
        waiting = by_cause(await conn.fetch(sql("waiting_on_release"), None, False, policy_ids))
        return sum([await _judge(conn, runs, bundle, cause=cause, now=now, locked=names) for cause, runs in sorted(waiting.items())])


async def forget_stale(pool: asyncpg.Pool, *, older_than: timedelta, now: datetime) -> None:
    """Runs refused longer ago than `older_than` get no more HEADROOM (their platforms gave up)."""
    await pool.execute(sql("forget_stale_waiting"), now - older_than)


async def _judge(
    conn: asyncpg.Connection, runs: Sequence[WaitingRun], bundle: PolicyBundle, *, cause: str, now: datetime, locked: Set[str] = frozenset()
) -> int:
    """Judge `runs` now and send HEADROOM to each that fits, once per cause. Without `locked`,
    the locks of every run judged are taken first; with it (a release holds its own), no more
    are taken: taking more after some would risk a deadlock, so a run also waiting on a budget
    another release frees at the same instant is judged on that budget as last committed."""
    if not runs:
        return 0
    if not locked:
        await conn.execute(sql("lock_headroom"), sorted(set().union(*(_names(run, bundle) for run in runs))))
    fitting = [found for found in await headroom(conn, runs, bundle, now=now) if found.fits]
    if not fitting:
        return 0
    fresh = {str(r["decision_id"]) for r in await conn.fetch(sql("insert_headroom_notices"), [uuid.UUID(f.run.decision_id) for f in fitting], cause)}
    for found in fitting:
        if found.run.decision_id in fresh:
            await messages.headroom(conn, found, cause=cause, now=now)
    return len(fresh)
