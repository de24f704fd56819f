"""The reconciler: Reconciler.start() wires Postgres, Redis and Kafka to four loops — consume
facts, settle marked runs, time-driven upkeep, relay the outbox — and stop() ends them. The
runner (budgetgate.edge.runner) starts one when its app starts serving (app.py); tests make one
directly (Reconciler.create(settings)). Its readiness: Postgres and Redis answer and its Kafka
subscriber has started."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
from opentelemetry.metrics import Observation

from budgetgate.messaging.publisher import Publisher
from budgetgate.runtime import redis_client
from budgetgate.runtime.backends import BACKEND_ERRORS
from budgetgate.messaging.inbox import Inbox, prune_forever
from budgetgate.runtime.kafka_access import start_whole
from budgetgate.messaging.lag import ConsumerProgress
from budgetgate.ledger import partitions
from budgetgate.ledger.queries import owned_by
from budgetgate.ledger.escrow_leases import CounterBook, Escrow
from budgetgate.ledger.holds import SENSITIVE
from budgetgate.ledger.sharded import OneShard, ShardedLedger
from budgetgate.messaging.outbox import OutboxRelay
from budgetgate.edge.runner import Service
from budgetgate.edge.serving import close_pool, close_within, postgres_check, redis_check
from budgetgate.services.reconciler import budget_actions, consumers, dead_letters, headroom
from budgetgate.policies.policy_store import PolicyStore
from budgetgate.services.reconciler.settings import ReconcilerSettings
from budgetgate.services.reconciler.dead_letters import REFUSALS
from budgetgate.services.reconciler.settler import Settler
from budgetgate.messaging.subscriber import inbox_broker
from budgetgate.runtime.telemetry import Telemetry, setup_telemetry
from budgetgate.contracts.topics import Topics
from budgetgate.messaging.topic_admin import ensure_topics

sql = owned_by("budgetgate.services.reconciler")


log = logging.getLogger(__name__)

# A settlement parked in Redis longer than this is ended by upkeep (its settler died or lost Redis).
PARKED_GRACE_MS = 2000


@dataclass
class Stats:
    settled: int = 0
    changed: int = 0
    drifted_keys: int = 0
    drift_checks: int = 0
    repairs: int = 0
    errors: int = 0
    dead_letters: int = 0
    dead_lettered: int = 0  # settlements dead-lettered now (whoever set them aside), as upkeep last read
    ended_parked: int = 0
    upkeep_ticks: int = 0  # time-driven passes done (deadlines judged, holds lifted, alerts sent)
    failing: dict[str, int] = field(default_factory=dict)  # run id → failed tries so far
    fresh: set[str] = field(default_factory=set)


class Reconciler(Service, OneShard):
    """One reconciler instance; several may run side by side (runs are locked one at a time).

    Its outbox relay is not the runner's to serve (`outbox_relay` stays None): it shares the
    producer of the consumer's dead letters, and runs in the consume loop once that is started."""

    def __init__(self, settings: ReconcilerSettings, *, telemetry: Telemetry | None = None) -> None:
        self.settings = settings
        self.telemetry = telemetry or setup_telemetry(service_name=settings.service_name, otlp_endpoint=settings.otlp_endpoint)
        self.topics = Topics(settings.topic_prefix)
        self.stats = Stats()
        self.wakeup = asyncio.Event()
        meter = self.telemetry.meter("budgetgate.reconciler")
        self._settlements = meter.create_counter("budgetgate_reconciler_settlements", description="runs settled, by whether the ledger changed")
        self._lag = meter.create_histogram(
            "budgetgate_reconciliation_lag", unit="s", description="from a run's end (event time) to its reservation replaced by actuals"
        )
        meter.create_observable_gauge(
            "budgetgate_ledger_drift_keys",
            callbacks=[lambda _o: [Observation(self.stats.drifted_keys)]],
            description="ledger keys, runs, quota counters and pools on which Redis differed from Postgres at the last drift check",
        )
        meter.create_observable_counter(
            "budgetgate_ledger_drift_repairs", callbacks=[lambda _o: [Observation(self.stats.repairs)]], description="Redis rebuilds after a confirmed drift"
        )
        self._dead_letters = meter.create_counter(
            "budgetgate_reconciler_dead_letters",
            description="runs whose settlement kept failing for a reason other than an outage, set aside in settlement_failures",
        )
        meter.create_observable_gauge(
            "budgetgate_reconciler_dead_lettered",
            callbacks=[lambda _o: [Observation(self.stats.dead_lettered)]],
            description="settlements dead-lettered now, their runs' holds still held until an operator resolves them (`budgetgate settlements`)",
        )
        self.progress = ConsumerProgress(self.telemetry.meter("budgetgate.messaging.inbox"), name="reconciler")
        self.pool: asyncpg.Pool | None = None
        self.consuming = False  # its Kafka subscriber started (and not stopped since): part of readiness
        self.tasks: list[asyncio.Task[None]] = []
        self._repaired = False
        self._windows_seen: datetime | None = None  # when upkeep last looked for new calendar windows

    @classmethod
    def create(cls, settings: ReconcilerSettings, *, telemetry: Telemetry | None = None) -> Reconciler:
        """The reconciler for `settings`; connections open on start()."""
        return cls(settings, telemetry=telemetry)

    async def start(self) -> None:
        """Connect to Postgres and Redis (Kafka in the consume loop), then start the loops."""
        s = self.settings
        self.pool = await asyncpg.create_pool(s.postgres_dsn, min_size=s.pg_pool_min, max_size=s.pg_pool_max, command_timeout=30)
        self.redis = redis_client.connect(s.redis_url, socket_timeout=5, socket_connect_timeout=2)
        self.ledgers = await ShardedLedger.open(self.pool, self.redis, prefix=s.redis_prefix, count=s.ledger_shards, tenant_label=s.tenant_label)
        self.escrow = Escrow(self.pool, self.ledgers.of_root)
        self.bundles = PolicyStore()
        self.settler = Settler.configured(s, pool=self.pool, ledgers=self.ledgers, bundles=self.bundles)
        async with self.pool.acquire() as conn:  # before the first settlement: deadlines on Postgres's clock
            await self.settler.measure_clock(conn)
        self.publisher = Publisher(s.kafka_bootstrap, client_id=s.service_name, access=s.kafka_access)
        self.relay = OutboxRelay(pool=self.pool, publisher=self.publisher, topics=self.topics, batch=s.outbox_batch)
        consumption = consumers.subscription(s, self.topics)
        self.inbox = Inbox(name="reconciler", pool=self.pool, publisher=self.publisher, routes=consumption.inbox_routes(self))
        self.broker = inbox_broker(s, consumption.router(lambda: self))
        await super().start()

    def loops(self) -> dict[str, Coroutine[Any, Any, None]]:
        return {
            "reconciler-consume": self._guarded("consume", self._consume),
            "reconciler-settle": self._guarded("settle", self._settle_marked),
            "reconciler-upkeep": self._guarded("upkeep", self._upkeep),
            "partitions-ahead": partitions.keep_ahead(self.pool, ahead=self.settings.ledger_partitions_ahead_months),
            "inbox-prune": prune_forever(self.inbox, keep=self.settings.consumer_retention),
        }

    async def checks(self) -> dict[str, str]:
        assert self.pool is not None
        checks = {"postgres": await postgres_check(self.pool), "redis": await redis_check(self.redis)}
        checks["kafka_consumer"] = "ok" if self.consuming else "not consuming yet"
        return checks

    async def close(self) -> None:
        """Within bounded time: a client stuck on a server that went away (a consumer leaving its
        group, a pool waiting for a connection) is abandoned, not waited on."""
        await close_within(self.broker.stop(), what="reconciler: Kafka consumer")
        await close_within(self.publisher.stop(), what="reconciler: Kafka producer")
        await close_within(self.redis.aclose(), what="reconciler: Redis")
        if self.pool is not None:
            await close_pool(self.pool)

    async def _guarded(self, name: str, loop) -> None:  # type: ignore[no-untyped-def]
        """Run a loop for ever, outliving any outage of Postgres, Redis or Kafka."""
        delay = 0.5
        while True:
            try:
                await loop()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - retried with backoff
                self.stats.errors += 1
                log.warning("reconciler %s loop failed, retrying in %.1fs: %s: %s", name, delay, type(exc).__name__, exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 10.0)

    async def _consume(self) -> None:
        """Start the subscriber (and the producer its dead letters and the relay need), waiting
        for Kafka as long as it takes; once started, FastStream reconnects by itself."""
        with contextlib.suppress(Exception):
            await ensure_topics(self.settings.kafka_bootstrap, prefix=self.settings.topic_prefix, access=self.settings.kafka_access)
        await self.publisher.start()
        relay = asyncio.create_task(self.relay.run(), name="reconciler-relay")
        try:
            await start_whole(self.broker.start())
            self.consuming = True
            await asyncio.Event().wait()
        finally:
            self.consuming = False
            relay.cancel()
            await asyncio.gather(relay, return_exceptions=True)
            with contextlib.suppress(Exception):
                await self.broker.stop()
            await self.publisher.stop()

    async def _settle_marked(self) -> None:
        assert self.pool is not None
        if not self._repaired:
            # A reconciler killed between the two halves of a settlement left one parked in
            # Redis; the runs' own settlements end theirs first anyway, this ends the others now.
            await self.settler.end_pending(older_than_ms=int(time.time() * 1000))
            self._repaired = True
        while True:
            # Cleared before the marks are read: a fact marked during this pass wakes the next.
            self.wakeup.clear()
            rows = await self.pool.fetch(sql("runs_waiting"), 200)
            await self._settle_all([r["run_id"] for r in rows])
            if len(rows) < 200:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.wakeup.wait(), timeout=self.settings.tick_seconds)

    async def _settle_all(self, run_ids: list[str]) -> None:
        gate = asyncio.Semaphore(self.settings.settle_concurrency)
        settled: list[str] = []

        async def one(run_id: str) -> None:
            async with gate:
                try:
                    outcome = await self.settler.settle(run_id)
                except BACKEND_ERRORS:
                    # An outage (some are ResponseErrors too: a read-only replica after a
                    # failover, a Redis out of memory): the pass fails and is tried again with
                    # backoff; it is never a try against the run.
                    raise
                except REFUSALS as exc:
                    await self._failed(run_id, exc)
                    return
            self.stats.failing.pop(run_id, None)
            settled.append(run_id)
            self.stats.settled += 1
            self.stats.changed += outcome.changed
            self._settlements.add(1, {"changed": str(outcome.changed).lower()})
            result = outcome.result
            if outcome.changed and result is not None and result.final and result.ended_at is not None:
                self._lag.record(max(0.0, (datetime.now(UTC) - result.ended_at).total_seconds()))
            if outcome.changed:
                self.relay.wakeup.set()

        await asyncio.gather(*(one(r) for r in run_ids))
        if settled:
            # The earlier failed tries of runs settled now are forgotten, whichever process (or an
            # earlier life of this one) made them: one statement for the pass. Kept when the pass
            # failed or Postgres went away: a stale count only dead-letters a failing run sooner.
            with contextlib.suppress(*BACKEND_ERRORS):
                await self.pool.execute(sql("clear_settlement_failures"), settled)  # type: ignore[union-attr]

    async def _failed(self, run_id: str, exc: BaseException) -> None:
        """A settlement refused for a reason other than an outage: tried again a bounded number of
        times (the run stays marked), then dead-lettered with the reason, and never looped on."""
        assert self.pool is not None
        reason = dead_letters.failure_reason(exc)
        row = await self.pool.fetchrow(sql("record_settlement_failure"), run_id, reason, self.settings.settle_tries)
        self.stats.failing[run_id] = row["attempts"]
        if row["dead"]:
            self.stats.dead_letters += 1
            self._dead_letters.add(1)
            log.error("run %r dead-lettered after %d failed settlements: %s", run_id, row["attempts"], reason)
        else:
            log.warning("settling run %r failed (try %d of %d): %s", run_id, row["attempts"], self.settings.settle_tries, reason)

    def _shared_counters(self) -> list[CounterBook]:
        """The counters tenants share carved into leases on a ledger of several shards: the
        sensitive-workload pool, at the size of the bundle in force (size 0 when it declares none,
        so every lease gives back what its tenant does not hold)."""
        if self.ledgers.shards.count == 1:
            return []
        bundle = self.bundles.current
        sensitive = bundle.sensitive if bundle is not None else None
        return [CounterBook(SENSITIVE, sensitive.unit if sensitive else "gpus", sensitive.size if sensitive else 0)]

    async def _upkeep(self) -> None:
        assert self.pool is not None
        s = self.settings
        next_sweep = next_drift = next_prune = 0.0
        # The walk through admitted_objects: where its next pass goes on (None: from the oldest),
        # and what it deleted so far.
        prune_after: tuple[datetime, str] | None = None
        pruned = 0
        while True:
            async with self.pool.acquire() as conn:
                # Every deadline below is judged on Postgres's clock (Settler.measure_clock).
                now = await self.settler.measure_clock(conn)
                await self.bundles.refresh(conn)
                # Read anew each tick: an operator resolves them from another process.
                self.stats.dead_lettered = await dead_letters.count(conn)
            due = [r["run_id"] for r in await self.pool.fetch(sql("runs_due"), now, 500)]
            unseen = [r["run_id"] for r in await self.pool.fetch(sql("unseen_holds"), now - timedelta(seconds=s.start_deadline_seconds), 500)]
            # Provisional holds of the Kubernetes webhook never confirmed: given back ("the object was never stored").
            unconfirmed = [r["run_id"] for r in await self.pool.fetch(sql("unconfirmed_holds"), now - timedelta(seconds=s.provisional_hold_seconds), 500)]
            await self._settle_all(sorted(set(due) | set(unseen) | set(unconfirmed)))
            # Settlements parked by a reconciler that died (or lost Redis) after its commit:
            # Redis converges on Postgres within a tick or two, without a restart or a rebuild.
            self.stats.ended_parked += await self.settler.end_pending(older_than_ms=int(time.time() * 1000) - PARKED_GRACE_MS)
            await budget_actions.age_rolling(self.pool, self.ledgers, now=now, bundles=self.bundles)
            if await budget_actions.lift_holds(self.pool, bundles=self.bundles, now=now):
                self.relay.wakeup.set()
            if await budget_actions.committed_alerts(self.pool, now=now):
                self.relay.wakeup.set()
            # A new bundle may have raised a limit a waiting run is refused by; a new calendar
            # window (since the last tick; at start, any) may have room for runs refused in the last.
            if await headroom.recheck(self.pool, self.bundles, now=now):
                self.relay.wakeup.set()
            if await headroom.rollover(self.pool, self.bundles, since=self._windows_seen, now=now):
                self.relay.wakeup.set()
            self._windows_seen = now
            self.stats.upkeep_ticks += 1
            await headroom.forget_stale(self.pool, older_than=timedelta(seconds=s.waiting_seconds), now=now)
            if time.monotonic() >= next_sweep:
                # Leak protection for Redis holds whose decision never committed (a process died
                # between reserving and committing).
                for sync in self.ledgers.syncs:
                    await sync.sweep_orphans(grace=timedelta(seconds=s.orphan_grace_seconds), now=now)
                # Only the highest ledger mark of each shard counts (migrations 0025, 0043).
                await self.pool.execute(sql("prune_ledger_marks"))
                # What idle escrow leases do not use goes back, free for other roots' refills.
                await self.escrow.return_idle(
                    idle=timedelta(seconds=s.escrow_idle_seconds), chunk_share=s.escrow_chunk_share, now=now, counters=self._shared_counters()
                )
                next_sweep = time.monotonic() + s.orphan_grace_seconds / 2
            if time.monotonic() >= next_prune:
                # The Kubernetes objects of runs that ended longer ago than the retention: a
                # batch a tick (short locks), walking the rows in admission order, so the rows of
                # runs still going are passed over once a walk, not read again every tick; a new
                # walk a tenth of the retention after the last.
                retention = timedelta(seconds=s.admitted_objects_retention_seconds)
                page = await self.pool.fetchrow(sql("prune_admitted_objects"), now - retention, *(prune_after or (None, None)), 1000)
                pruned += page["pruned"]
                if page["looked"] == 1000:
                    prune_after = (page["last_at"], page["last_uid"])
                else:  # the walk reached the objects admitted within the retention: done for a while
                    if pruned:
                        log.info("forgot %d admitted Kubernetes objects of runs that ended more than %s ago", pruned, retention)
                    prune_after, pruned = None, 0
                    next_prune = time.monotonic() + max(retention.total_seconds() / 10, s.tick_seconds)
            if s.drift_check_seconds > 0 and time.monotonic() >= next_drift:
                await self.check_drift()
                next_drift = time.monotonic() + s.drift_check_seconds
            await asyncio.sleep(s.tick_seconds)

    async def check_drift(self) -> None:
        """Compare every shard of Redis with Postgres, repairing what differs (a shard not loaded
        is left to its rebuild); the figures are the pass's, all shards added."""
        found = [drift for sync in self.ledgers.syncs if (drift := await sync.check_drift(repair=True)) is not None]
        if not found:
            return
        self.stats.drift_checks += 1
        self.stats.drifted_keys = sum(len(d.keys) + len(d.runs) + len(d.counters) + len(d.pools) + len(d.sizes) for d in found)
        self.stats.repairs += sum(d.repaired for d in found)
