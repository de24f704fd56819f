"""The admission service (`AdmissionService.build(settings)`): what it holds while it runs, the
background work that keeps it ready (policies and the Redis ledger loaded, the outbox relayed,
policy announcements heard, the budget gauges refreshed) and its readiness checks. The runner
(budgetgate.edge.runner) starts and stops it with the app."""

from __future__ import annotations

import asyncio
from datetime import timedelta
import contextlib
import logging
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

import asyncpg
import redis.asyncio as aioredis

from budgetgate.messaging.publisher import Publisher
from budgetgate.edge.runner import Service
from budgetgate.edge.serving import close_pool, close_within
from budgetgate.runtime import redis_client
from budgetgate.runtime.kafka_access import start_whole
from budgetgate.ledger import partitions
from budgetgate.ledger.sharded import OneShard, ShardedLedger, whole_cluster_stops
from budgetgate.messaging.outbox import OutboxRelay
from budgetgate.runtime.backends import BACKEND_ERRORS
from budgetgate.services.admission.accounting_source import ExternalAccounting
from budgetgate.services.admission.admitter import Admitter
from budgetgate.services.admission.fairshare_cache import DecayedUsage
from budgetgate.services.admission.metrics import BudgetBoard
from budgetgate.policies.policy_store import PolicyStore
from budgetgate.services.admission.pools import TokenPools
from budgetgate.services.admission.settings import AdmissionSettings
from budgetgate.edge.serving import postgres_check
from budgetgate.contracts.topics import Topics

log = logging.getLogger(__name__)


@dataclass
class AdmissionService(Service, OneShard):
    """The service's adapters, built from its settings when it starts."""

    settings: AdmissionSettings
    pool: asyncpg.Pool
    redis: aioredis.Redis
    ledgers: ShardedLedger
    policies: PolicyStore
    admitter: Admitter
    relay: OutboxRelay
    publisher: Publisher
    pools: TokenPools
    topics: Topics
    board: BudgetBoard
    accounting: ExternalAccounting | None = None
    held: int = 0  # reservations held, for the gauge
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    @classmethod
    async def build(cls, settings: AdmissionSettings) -> AdmissionService:
        """Connect to Postgres, Redis and Kafka (lazily), and wire the admitter to them."""
        return await _build(settings)

    @property
    def outbox_relay(self) -> OutboxRelay:  # type: ignore[override]
        return self.relay

    def loops(self) -> dict[str, Coroutine[Any, Any, None]]:
        return {
            "keep-ready": _keep_ready(self),
            "policy-announcements": _policy_announcements(self),
            "budget-gauges": self.board.run(),
            "partitions-ahead": partitions.keep_ahead(self.pool, ahead=self.settings.ledger_partitions_ahead_months),
            "cluster-coverage": _warn_whole_cluster_stops(self),
        }

    async def checks(self) -> dict[str, str]:
        checks = {"postgres": await postgres_check(self.pool)}
        try:
            unloaded = [ledger.shard for ledger in self.ledgers if not await ledger.is_loaded()]
            checks["redis_ledger"] = "ok" if not unloaded else "not loaded" if len(self.ledgers) == 1 else f"shards {unloaded} not loaded"
        except BACKEND_ERRORS as exc:
            checks["redis_ledger"] = f"unreachable: {exc}"
        checks["policy_bundle"] = "none applied" if self.policies.current is None else "ok"
        return checks

    async def close(self) -> None:
        """Close every client within bounded time (see budgetgate.edge.serving.close_within)."""
        await close_within(self.publisher.stop(), what="admission: Kafka producer")
        if self.accounting is not None:
            await close_within(self.accounting.aclose(), what="admission: accounting client")
        await close_within(self.redis.aclose(), what="admission: Redis")
        await close_pool(self.pool)


async def _build(settings: AdmissionSettings) -> AdmissionService:
    # No reset query on release: every use ends its transaction, advisory locks are
    # transaction-scoped and no session state is set, so the reset round trip buys nothing.
    pool = await asyncpg.create_pool(settings.postgres_dsn, min_size=settings.pg_pool_min, max_size=settings.pg_pool_max, command_timeout=10, reset=_no_reset)
    client = redis_client.connect(settings.redis_url, socket_timeout=5, socket_connect_timeout=2)
    ledgers = await ShardedLedger.open(
        pool, client, prefix=settings.redis_prefix, count=settings.ledger_shards, tenant_label=settings.tenant_label, wait=settings.rebuild_wait_seconds
    )
    shared = ledgers.of_root("")  # token pools, which no tenant owns (a sharded ledger has none)
    policies = PolicyStore(pool)
    topics = Topics(settings.topic_prefix)
    publisher = Publisher(settings.kafka_bootstrap, client_id=settings.service_name, access=settings.kafka_access)
    accounting = external_accounting(settings)
    relay = OutboxRelay(pool=pool, publisher=publisher, topics=topics, batch=settings.outbox_batch)
    admitter = Admitter(
        pool=pool, ledgers=ledgers, policies=policies, unmatched=settings.unmatched, tenant_label=settings.tenant_label, accounting=accounting,
        start_deadline=timedelta(seconds=settings.start_deadline_seconds),
        max_batch=settings.batch_max, max_wait=settings.batch_wait_seconds, in_flight=settings.batches_in_flight,
        usage=DecayedUsage(half_life=timedelta(seconds=settings.fair_share_half_life_seconds)),
        committed=RelayNudge(relay, linger=settings.relay_linger_seconds), escrow_chunk_share=settings.escrow_chunk_share,
    )  # fmt: skip
    return AdmissionService(
        settings=settings, pool=pool, redis=client, ledgers=ledgers, policies=policies, admitter=admitter,
        relay=relay, publisher=publisher,
        pools=TokenPools(pool=pool, ledger=shared, sync=ledgers.sync_of(shared), policies=policies), topics=topics, board=BudgetBoard(pool, policies),
        accounting=accounting,
    )  # fmt: skip


async def _warn_whole_cluster_stops(service: AdmissionService) -> None:
    """Once at start: warn when one master's failover would stop every shard of the ledger."""
    try:
        warning = await whole_cluster_stops(service.redis, len(service.ledgers))
    except BACKEND_ERRORS as exc:
        log.info("could not read the Redis Cluster's %s: %s", "cluster-require-full-coverage", exc)
        return
    if warning is not None:
        log.warning("%s", warning)


class RelayNudge:
    """Wakes the outbox relay `linger` seconds after a batch of decisions was committed, once for
    every batch committed meanwhile: each relay pass claims, publishes and marks its rows in a
    transaction of its own, and a pass per batch cost a lone decision at 200 submissions/s a
    quarter of its CPU (service, Postgres and broker). A decision reaches Kafka `linger` later
    at most; its answer does not wait for it (the outbox row is committed before)."""

    def __init__(self, relay: OutboxRelay, *, linger: float) -> None:
        self.relay = relay
        self.linger = linger
        self._due: asyncio.TimerHandle | None = None

    def __call__(self) -> None:
        if self.linger <= 0:
            self.relay.wakeup.set()
        elif self._due is None:
            self._due = asyncio.get_running_loop().call_later(self.linger, self._wake)

    def _wake(self) -> None:
        self._due = None
        self.relay.wakeup.set()


def external_accounting(settings: AdmissionSettings) -> ExternalAccounting | None:
    if not settings.accounting_url:
        return None
    return ExternalAccounting(
        settings.accounting_url,
        token=settings.accounting_token.get_secret_value() if settings.accounting_token else None,
        timeout=settings.accounting_timeout_seconds,
        cache_seconds=settings.accounting_cache_seconds,
        failure_threshold=settings.accounting_failure_threshold,
        reset_seconds=settings.accounting_reset_seconds,
    )


async def _no_reset(_conn: asyncpg.Connection) -> None:
    return None


async def _keep_ready(rt: AdmissionService) -> None:
    """Load policies and the Redis ledger, and keep them current, outliving any outage."""
    # Orphaned Redis holds (a process died between reserving and committing) are swept by the
    # reconciler, which owns leak protection; a retry of the same run releases its orphan here.
    while True:
        try:
            await rt.policies.refresh()
            # Before the ledger: a service ready to decide answers decayed shares from the start.
            await rt.admitter.usage.refresh(rt.pool)  # type: ignore[union-attr]
            for sync in rt.ledgers.syncs:
                await sync.ensure_loaded()
            rt.held = await rt.pool.fetchval("SELECT count(*) FROM reservations WHERE state = 'held'")
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - retried on the next tick
            log.warning("readiness upkeep failed: %s", exc)
        await asyncio.sleep(rt.settings.policy_refresh_seconds if rt.policies.current else 0.5)


async def _policy_announcements(rt: AdmissionService) -> None:
    """Switch bundles as soon as budget.policies.v1 announces one (polling is the safety net)."""
    from aiokafka import AIOKafkaConsumer

    while True:
        consumer = AIOKafkaConsumer(
            rt.topics.policies,
            bootstrap_servers=rt.settings.kafka_bootstrap,
            group_id=None,
            auto_offset_reset="latest",
            enable_auto_commit=False,
            metadata_max_age_ms=rt.settings.kafka_metadata_max_age_ms,
            **rt.settings.kafka_access.aiokafka(),
        )
        try:
            await start_whole(consumer.start())
            async for _record in consumer:
                await rt.policies.refresh()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001
            log.warning("policy announcements unavailable (%s); relying on polling", exc)
            await asyncio.sleep(5)
        finally:
            # Bounded: a consumer whose broker went away can wait on it for ever while stopping.
            with contextlib.suppress(Exception):
                await asyncio.wait_for(consumer.stop(), timeout=5)
