"""The sender: delivers stored events in order, marks each delivered as soon as it is acknowledged,
and waits with capped exponential backoff while the receiver is down, slow or failing.

Only the event in flight can be sent twice (acknowledged, then the process dies before the mark).
A refused event (400, 413, 422: transport.REFUSING_STATUS) is dead-lettered with the receiver's
answer and never retried. So is an event the receiver keeps failing on while it takes others: a
5xx answered to it `server_error_limit` times, each time after the receiver had accepted another
event since its previous try (a receiver down or failing on everything never proves that, so an
outage dead-letters nothing). Such an event held back its run's later events for ever (a run's
events go in order); `budgetgate evidence resend` puts dead-lettered events back once the
receiver is fixed. One sender runs at a time across instances (a Postgres advisory lock), so a
run's events stay in order.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import asyncpg

from budgetgate.ledger.queries import owned_by
from budgetgate.evidence import event_store, events
from budgetgate.services.evidence_emitter import handlers
from budgetgate.services.evidence_emitter.transport import NotDelivered, Refused

sql = owned_by("budgetgate.services.evidence_emitter")

log = logging.getLogger(__name__)

Send = Callable[[object], None]  # blocking; raises Refused or NotDelivered


def backoff(failures: int, *, initial: float, cap: float) -> float:
    """Seconds to wait after `failures` consecutive failures: initial, doubled each time, capped."""
    if failures <= 0:
        return 0.0
    return min(cap, initial * 2 ** min(failures - 1, 62))


@dataclass
class SenderStats:
    delivered: int = 0
    dead_lettered: int = 0
    failures: int = 0
    consecutive_failures: int = 0
    last_error: str | None = None
    backlog: event_store.Backlog = field(default_factory=lambda: event_store.Backlog(0, 0.0))


class Sender:
    def __init__(
        self,
        *,
        pool: asyncpg.Pool,
        send: Send,
        batch: int = 100,
        initial_backoff: float = 0.5,
        max_backoff: float = 60.0,
        idle_seconds: float = 0.5,
        decision_wait: float = 600.0,
        server_error_limit: int = 10,
    ) -> None:
        self.pool = pool
        self.send = send
        self.batch = batch
        self.initial_backoff = initial_backoff
        self.max_backoff = max_backoff
        self.idle_seconds = idle_seconds
        self.decision_wait = decision_wait
        self.server_error_limit = server_error_limit
        self.wakeup = asyncio.Event()
        self.stats = SenderStats()
        # Per event failing with a 5xx: (strikes, deliveries counted at its previous failure).
        # Kept in memory: a restart only makes a poison event take longer to be set aside.
        self._strikes: dict[int, tuple[int, int]] = {}

    async def run(self) -> None:
        """Deliver until cancelled, outliving Postgres and receiver outages."""
        while True:
            try:
                async with self._leadership() as lead:
                    while not lead.is_closed():
                        await self.release_decided()
                        await event_store.release_stale(self.pool, self.decision_wait)
                        await self.refresh_backlog()
                        if await self.deliver_once() == 0:
                            await self._idle()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - Postgres went away: try again shortly
                log.warning("evidence sender: %s; retrying", exc)
                await asyncio.sleep(self.idle_seconds * 4)

    async def release_decided(self) -> int:
        """Release waiting reconciliations whose decision is stored by now (see
        handlers.release_decided); returns how many."""
        released = 0
        for run_id in await event_store.waiting_decided(self.pool):
            async with self.pool.acquire() as conn, conn.transaction():
                released += await handlers.release_decided(conn, run_id)
        return released

    async def deliver_once(self) -> int:
        """Send one batch of due events; returns how many were taken care of (delivered or dead).

        A failure with no answer (the receiver down, slow) stops the batch, and the backoff is
        waited out before returning. A 5xx is the receiver's answer about that one event, maybe:
        the next event is tried, and only a second failure in a row stops the batch. (Stopping
        at every failure let one event the receiver kept failing on, due again each time the
        sender woke, hold back every other event for ever.)
        """
        done, failed_in_a_row = 0, 0
        for pending in await event_store.next_batch(self.pool, self.batch):
            event = events.from_json(pending.payload)
            try:
                await asyncio.to_thread(self.send, event)
            except Refused as exc:
                log.error("evidence event %d refused (HTTP %s), dead-lettered: %s", pending.seq, exc.status, exc.body[:500])
                await event_store.mark_dead(self.pool, pending.seq, status=exc.status, body=exc.body, error=str(exc))
                self.stats.dead_lettered += 1
                done += 1
                continue
            except NotDelivered as exc:
                if self._poison(pending, exc):
                    reason = f"the receiver answered HTTP {exc.status} to this event {self.server_error_limit} times while it accepted others: {exc}"
                    log.error("evidence event %d dead-lettered: %s; body: %s", pending.seq, reason, exc.body[:500])
                    await event_store.mark_dead(self.pool, pending.seq, status=exc.status, body=exc.body, error=reason)
                    self.stats.dead_lettered += 1
                    done += 1
                    continue
                failed_in_a_row += 1
                wait = await self._failed(pending, exc)
                if not exc.server_error or failed_in_a_row > 1:
                    await asyncio.sleep(wait)
                    return done
                continue
            await event_store.mark_delivered(self.pool, pending.seq)
            self._strikes.pop(pending.seq, None)
            self.stats.delivered += 1
            self.stats.consecutive_failures = 0
            failed_in_a_row = 0
            done += 1
        return done

    def _poison(self, pending: event_store.Pending, exc: NotDelivered) -> bool:
        """Whether `exc` is the last strike against the event (see the module doc)."""
        if not exc.server_error:
            return False
        strikes, delivered_then = self._strikes.get(pending.seq, (-1, self.stats.delivered))
        # The first 5xx is no strike (nothing shows the receiver up since); a later one is when
        # the receiver took another event after the event's previous try.
        strikes = 0 if strikes < 0 else strikes + (self.stats.delivered > delivered_then)
        if strikes >= self.server_error_limit:
            self._strikes.pop(pending.seq, None)
            return True
        if len(self._strikes) >= 10_000:
            self._strikes.clear()
        self._strikes[pending.seq] = (strikes, self.stats.delivered)
        return False

    async def _failed(self, pending: event_store.Pending, exc: NotDelivered) -> float:
        """Count the failure and put the event off; returns the sender's wait before its next try."""
        self.stats.failures += 1
        self.stats.consecutive_failures += 1
        self.stats.last_error = str(exc)
        wait = backoff(self.stats.consecutive_failures, initial=self.initial_backoff, cap=self.max_backoff)
        # The event's own delay grows with its attempts, so one event the receiver keeps failing
        # on (a 5xx for its content) does not hold back other runs' events for ever.
        own = backoff(pending.attempts + 1, initial=self.initial_backoff, cap=self.max_backoff)
        log.warning("evidence event %d not delivered (%s); retrying in %.1fs", pending.seq, exc, wait)
        await event_store.mark_retry(self.pool, pending.seq, error=str(exc), after_seconds=own)
        return wait

    async def refresh_backlog(self) -> event_store.Backlog:
        self.stats.backlog = await event_store.backlog(self.pool)
        return self.stats.backlog

    async def _idle(self) -> None:
        self.wakeup.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.wakeup.wait(), timeout=self.idle_seconds)

    @contextlib.asynccontextmanager
    async def _leadership(self) -> AsyncIterator[asyncpg.Connection]:
        conn: asyncpg.Connection = await self.pool.acquire()
        try:
            while not await conn.fetchval(sql("evidence_try_lead")):
                await self.refresh_backlog()
                await asyncio.sleep(self.idle_seconds * 4)
            try:
                yield conn
            finally:
                with contextlib.suppress(Exception):
                    await conn.fetchval(sql("evidence_unlead"))
        finally:
            await self.pool.release(conn)
