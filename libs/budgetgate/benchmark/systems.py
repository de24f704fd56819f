"""The two systems under test, each able to prepare a fresh database, start as a subprocess,
report its budgets' totals afterwards, and clean up what it left outside its database."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Protocol

import asyncpg
from budgetgate.runtime import redis_client

from budgetgate.benchmark import baseline, sql_blocks
from budgetgate.benchmark.correctness import MILLI_PER_HOUR, BudgetTotal
from budgetgate.benchmark.cpu import Part, redis_parts
from budgetgate.benchmark.credentials import SERVICE_ENV, bench_token
from budgetgate.benchmark.service_processes import python_module
from budgetgate.benchmark.workload import SHARED_ID, Workload, policy_yaml
from budgetgate.core.escrow import lease_of
from budgetgate.core.ledger_key import LedgerKey
from budgetgate.core.loader import build_bundle, parse_text
from budgetgate.core.shards import Shards
from budgetgate.ledger.migrations import migrate_dsn
from budgetgate.ledger.redis_ledger import RedisLedger
from budgetgate.policies.repository import apply_bundle
from budgetgate.contracts.topics import Topics
from budgetgate.messaging.topic_admin import ensure_topics


@dataclass(frozen=True)
class Backends:
    redis_url: str
    kafka_bootstrap: str
    kafka_is_ours: bool  # started for this run, so its topics vanish with it
    broker_pid: int | None = None  # the broker started for this run (its CPU is read)


class System(Protocol):
    name: str
    ready_path: str
    reports_collections: bool  # whether its /metrics has budgetgate_gc_* (benchmark.pauses)
    reports_stages: bool  # whether its /metrics has budgetgate_admission_stage_seconds (benchmark.breakdown)
    token: str | None  # what the load generator sends as a bearer token

    async def prepare(self, dsn: str, workload: Workload) -> None: ...
    def command(self, *, dsn: str, port: int) -> tuple[list[str], dict[str, str]]: ...
    def cpu_parts(self, *, service_pids: Sequence[int], dsn: str) -> list[Part]: ...
    async def totals(self, dsn: str) -> tuple[list[BudgetTotal], list[str]]: ...
    async def notes(self, dsn: str) -> dict[str, int]: ...
    async def cleanup(self) -> None: ...


class Budgetgate:
    """budgetgate's admission service, on its own Redis prefix and Kafka topic prefix."""

    name = "budgetgate"
    ready_path = "/readyz"
    reports_collections = True  # its /metrics has the garbage collector's figures (budgetgate.runtime.garbage)
    reports_stages = True  # and the stages of a submission (services/admission/stages.py)

    def __init__(self, backends: Backends, *, tag: str, ledger_shards: int = 1) -> None:
        self.token: str | None = None
        self.backends = backends
        self.ledger_shards = ledger_shards
        self.redis_prefix = f"bench-{tag}"
        self.topics = Topics(f"bench-{tag}-")
        self.shared_scope: str | None = None  # the scope id of the budget every submission falls under (`shared`)

    async def prepare(self, dsn: str, workload: Workload) -> None:
        await migrate_dsn(dsn)
        documents = parse_text(policy_yaml(workload.budgets, workload.shared_gpu_hours), "bench/policies.yaml")
        bundle = build_bundle(documents, git_sha=uuid.uuid4().hex + "00000000")
        self.shared_scope = next((p.scope.scope_id for p in bundle.policies if p.id == SHARED_ID), None)
        conn = await asyncpg.connect(dsn)
        try:
            await apply_bundle(conn, bundle=bundle, documents=documents, source="budgetgate bench", applied_by="budgetgate bench")
        finally:
            await conn.close()
        self.token = await bench_token(dsn)
        await ensure_topics(self.backends.kafka_bootstrap, prefix=self.topics.prefix, partitions=1)

    def command(self, *, dsn: str, port: int) -> tuple[list[str], dict[str, str]]:
        env = {
            "BUDGETGATE_POSTGRES_DSN": dsn,
            "BUDGETGATE_REDIS_URL": self.backends.redis_url,
            "BUDGETGATE_REDIS_PREFIX": self.redis_prefix,
            "BUDGETGATE_KAFKA_BOOTSTRAP": self.backends.kafka_bootstrap,
            "BUDGETGATE_TOPIC_PREFIX": self.topics.prefix,
            "BUDGETGATE_LEDGER_SHARDS": str(self.ledger_shards),
            **SERVICE_ENV,
        }
        return python_module("budgetgate.services.admission", "--host", "127.0.0.1", "--port", str(port)), env

    def cpu_parts(self, *, service_pids: Sequence[int], dsn: str) -> list[Part]:
        """The service (each of its replicas), its database's server processes, Redis and the
        broker (unknown when the broker was given rather than started here)."""
        return [
            *Part.replicas("service", service_pids),
            Part("postgres", postgres_dsn=dsn),
            *redis_parts(self.backends.redis_url),
            Part.process("broker", self.backends.broker_pid),
        ]

    async def totals(self, dsn: str) -> tuple[list[BudgetTotal], list[str]]:
        conn = await asyncpg.connect(dsn)
        try:
            rows = await conn.fetch(sql_blocks.sql("audit.sql", "ledger_totals"))
            allow_decisions = await conn.fetchval(sql_blocks.sql("audit.sql", "allow_decisions"))
        finally:
            await conn.close()
        problems = []
        in_redis = await self._redis_reserved([r["budget"] for r in rows])
        for r in rows:
            found = in_redis.get(r["budget"])
            if found is None and not r["admitted"] and lease_of(r["budget"]) is None:
                found = 0  # a budget carved into escrow leases holds nothing itself, and is never loaded
            if found != r["admitted"]:
                problems.append(f"Redis holds {found} on {r['budget']}, Postgres {r['admitted']}")
        # A budget carved into escrow leases (the shared scenario on several shards) is judged
        # whole: its leases' figures added up under its own key, against its limit.
        by_budget: dict[str, BudgetTotal] = {}
        for r in rows:
            lease = lease_of(r["budget"])
            key = lease[0] if lease else r["budget"]
            t = by_budget.get(key) or BudgetTotal(key, 0, 0, 0, 0, shared=LedgerKey.parse(key).scope_id == self.shared_scope)
            limit = t.limit if lease else r["limit_amount"]
            by_budget[key] = replace(t, limit=limit, consumed=t.consumed + r["consumed"], admitted=t.admitted + r["admitted"], allows=t.allows + r["allows"])
        totals = list(by_budget.values())
        if allow_decisions != sum(t.allows for t in totals if not t.shared):
            problems.append(f"{allow_decisions} ALLOW decisions but {sum(t.allows for t in totals if not t.shared)} held reservations on the team budgets")
        return totals, problems

    async def _redis_reserved(self, ledger_keys: list[str]) -> dict[str, int]:
        client = redis_client.connect(self.backends.redis_url)
        try:
            shards = [RedisLedger(client, prefix=self.redis_prefix, shard=i, shards=self.ledger_shards) for i in range(self.ledger_shards)]
            readings = {}
            for ledger in shards:  # each key on its tenant's shard
                readings |= await ledger.readings([key for key in ledger_keys if ledger.owns_key(key)])
        finally:
            await client.aclose()
        return {key: reserved for key, (reserved, _consumed) in readings.items()}

    async def notes(self, dsn: str) -> dict[str, int]:
        conn = await asyncpg.connect(dsn)
        try:
            row = await conn.fetchrow(sql_blocks.sql("audit.sql", "outbox_state"))
        finally:
            await conn.close()
        return {"outbox_records": row["total"], "outbox_unpublished": row["pending"]}

    async def cleanup(self) -> None:
        await drop_prefixed_keys(self.backends.redis_url, self.redis_prefix, shards=self.ledger_shards)
        if not self.backends.kafka_is_ours:
            from aiokafka.admin import AIOKafkaAdminClient

            admin = AIOKafkaAdminClient(bootstrap_servers=self.backends.kafka_bootstrap)
            with contextlib.suppress(Exception):
                await admin.start()
                await admin.delete_topics(self.topics.all())
            with contextlib.suppress(Exception):
                await admin.close()


class Baseline:
    """The FastAPI + asyncpg service with SELECT … FOR UPDATE (budgetgate.benchmark.baseline)."""

    name = "baseline"
    ready_path = "/readyz"
    reports_collections = False
    reports_stages = False
    token: str | None = None  # the baseline has no authentication

    def __init__(self) -> None:
        self.shared = False  # every submission falls under the budget SHARED_ID too (`shared`)

    async def prepare(self, dsn: str, workload: Workload) -> None:
        self.shared = workload.shared_gpu_hours is not None
        conn = await asyncpg.connect(dsn)
        try:
            rows = [(b.team, b.namespace, round(b.limit_gpu_hours * MILLI_PER_HOUR)) for b in workload.budgets]
            if workload.shared_gpu_hours is not None:
                rows.append((SHARED_ID, "-", workload.shared_gpu_hours * MILLI_PER_HOUR))  # (no namespace of its own)
            await baseline.prepare(conn, rows)
        finally:
            await conn.close()

    def command(self, *, dsn: str, port: int) -> tuple[list[str], dict[str, str]]:
        shared = ["--shared-budget"] if self.shared else []
        return python_module("budgetgate.benchmark.baseline", "--dsn", dsn, "--host", "127.0.0.1", "--port", str(port), *shared), {}

    def cpu_parts(self, *, service_pids: Sequence[int], dsn: str) -> list[Part]:
        return [*Part.replicas("service", service_pids), Part("postgres", postgres_dsn=dsn)]

    async def totals(self, dsn: str) -> tuple[list[BudgetTotal], list[str]]:
        conn = await asyncpg.connect(dsn)
        try:
            rows = await conn.fetch(baseline.sql("totals"), SHARED_ID)
        finally:
            await conn.close()
        totals = [BudgetTotal(r["budget_id"], r["limit_amount"], r["consumed"], r["admitted"], r["allows"], shared=r["budget_id"] == SHARED_ID) for r in rows]
        problems = [
            f"budget {r['budget_id']}: reserved {r['reserved']} but ALLOW decisions add up to {r['admitted']}" for r in rows if r["reserved"] != r["admitted"]
        ]
        return totals, problems

    async def notes(self, dsn: str) -> dict[str, int]:
        return {}

    async def cleanup(self) -> None:
        return None


async def drop_prefixed_keys(url: str, prefix: str, *, shards: int = 1) -> None:
    """Delete the keys of a benchmark's Redis prefix, tag by tag (one hash tag each, so one slot
    of a Redis Cluster), on a server or a cluster: the ledger's shards (`{prefix}:*`, or
    `{prefix:i}:*` for shard i of several) and, with several shards, the keys the services keep
    under the prefix's own tag (the rate limit's windows, `{prefix}:ratelimit…`)."""
    tags = {Shards(prefix, 1).tag(0)} | {Shards(prefix, shards).tag(shard) for shard in range(shards)}
    client = redis_client.connect(url)
    try:
        for tag in sorted(tags):
            keys = [key async for key in client.scan_iter(match=f"{tag}:*", count=1000)]
            for start in range(0, len(keys), 500):
                await client.delete(*keys[start : start + 500])
    finally:
        await client.aclose()
