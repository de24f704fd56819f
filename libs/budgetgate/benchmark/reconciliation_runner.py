"""`budgetgate bench reconciliation`: how long the reconciler takes from a run's completion event
to the ledger holding its actuals, under a stated load.

A fresh database gets the spread of team budgets; a real admission service (subprocess) admits
every run; a real reconciler (subprocess) consumes the feed. The feed is open loop: run i's
lifecycle (STARTED, `samples` usage records, COMPLETED) is published at i / rate seconds. Lag of
a run = when Postgres committed its final settlement (clock_timestamp() of that transaction)
minus when its COMPLETED event was handed to the producer, both on this machine's clock.

With `replicas` > 1 that many reconcilers are started in the one consumer group, and the feed
waits until all of them are in it. From the first message fed until every run is settled, the
CPU of each reconciler, their sum, Postgres, Redis and the broker is read (benchmark.cpu), per
message fed.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path

import asyncpg
import httpx
from google.protobuf.timestamp_pb2 import Timestamp

from budgetgate.messaging.publisher import Publisher
from budgetgate.benchmark import databases
from budgetgate.benchmark.consumer_group import taken_by, until_members
from budgetgate.benchmark.cpu import CpuMeter, CpuUse, Part, Started, load_generator, redis_parts, replica_name, unmetered_connection
from budgetgate.benchmark.systems import drop_prefixed_keys
from budgetgate.benchmark.service_processes import Subprocess, free_port, python_module, tansu_command
from budgetgate.core.loader import build_bundle, parse_text
from budgetgate.benchmark.credentials import SERVICE_ENV, bearer, bench_token
from budgetgate.ledger.migrations import migrate_dsn
from budgetgate.policies.repository import apply_bundle
from budgetgate.runtime.settings import CommonSettings
from budgetgate.contracts.topics import Topics
from budgetgate.messaging.topic_admin import ensure_topics
from budgetgate.v1 import lifecycle_pb2, usage_pb2

H = 3_600_000


@dataclass(frozen=True)
class Options:
    runs: int = 600
    rate: float = 20.0  # completed runs per second, each with its whole lifecycle
    samples: int = 4  # usage records per run
    budgets: int = 20
    timeout: float = 300.0
    replicas: int = 1  # reconciler processes in the one consumer group
    pool_quota: int = 0  # with more than 0, the bundle declares POOL with this many tokens


# The token pool of `bench reconciliation --records-per-s R --token-pool`, and its lease length.
POOL = "bench:tokens"
POOL_LEASE_SECONDS = 600


def check_replicas(replicas: int) -> None:
    """ValueError unless 1 <= `replicas` <= the partitions the benchmark's topics are created with."""
    partitions = CommonSettings().topic_partitions
    if not 1 <= replicas <= partitions:
        raise ValueError(
            f"replicas ({replicas}) must be between 1 and the topics' partitions ({partitions}, BUDGETGATE_TOPIC_PARTITIONS): "
            "a consumer group gives each partition to one member, so more would only wait"
        )


@dataclass(frozen=True)
class Spent:
    """What the reconcilers (each, and together), Postgres, Redis and the broker spent over the
    measured load, per `unit` of work fed; with the messages each reconciler took care of."""

    cpu: CpuUse | None
    units: int
    unit: str
    window: str  # what the window spans, for the report
    replicas: int
    taken: list[int] | None  # per reconciler, in the order started (its /metrics)

    def as_json(self) -> dict[str, object]:
        return {
            "replicas": self.replicas,
            "messages_by_replica": None if self.taken is None else {replica_name("reconciler", n): count for n, count in enumerate(self.taken, 1)},
            "cpu": None if self.cpu is None else {**self.cpu.as_json(self.units), "units": self.units, "unit": self.unit},
        }

    def lines(self) -> list[str]:
        lines = []
        if self.replicas > 1:
            each = "" if self.taken is None else ": " + ", ".join(f"{replica_name('reconciler', n)} took {count}" for n, count in enumerate(self.taken, 1))
            lines.append(f"{self.replicas} reconciler processes in one consumer group{each} (messages of every topic it consumes, since it started)")
        if self.cpu is not None:
            lines.append(f"{self.window} ({self.units} {self.unit}s), {self.cpu.line(self.units, self.unit)}")
        return lines


@dataclass
class Report:
    options: Options
    runs_settled: int
    messages: int
    send_seconds: float
    lags_ms: list[float] = field(repr=False)
    ledger_ok: bool
    ledger_note: str
    spent: Spent | None = None
    tag: str | None = None  # names its database (bench_<tag>_…), Redis prefix and topics (bench-<tag>…)

    def percentile(self, q: float) -> float:
        ordered = sorted(self.lags_ms)
        return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))] if ordered else float("nan")

    def as_json(self) -> dict[str, object]:
        return {
            "options": asdict(self.options),
            "runs_settled": self.runs_settled,
            "messages": self.messages,
            "offered_messages_per_s": round(self.messages / self.send_seconds, 1) if self.send_seconds else None,
            "lag_ms": {
                "p50": round(self.percentile(0.5), 1),
                "p99": round(self.percentile(0.99), 1),
                "max": round(max(self.lags_ms, default=float("nan")), 1),
                "mean": round(statistics.fmean(self.lags_ms), 1) if self.lags_ms else None,
            },
            "ledger_ok": self.ledger_ok,
            "ledger": self.ledger_note,
            **(self.spent.as_json() if self.spent else {}),
            "run_tag": self.tag,
        }

    def as_text(self) -> str:
        o = self.options
        lines = [
            f"load: {o.runs} runs at {o.rate:g} completions/s, each STARTED + {o.samples} usage records + COMPLETED "
            f"({self.messages} messages, offered at {self.messages / self.send_seconds:.0f} msg/s), {o.budgets} budgets",
            f"settled: {self.runs_settled}/{o.runs} runs",
            f"reconciliation lag (COMPLETED sent -> final settlement committed): p50 {self.percentile(0.5):.1f} ms, "
            f"p99 {self.percentile(0.99):.1f} ms, max {max(self.lags_ms, default=float('nan')):.1f} ms",
            *(self.spent.lines() if self.spent else []),
            f"ledger: {'OK' if self.ledger_ok else 'WRONG'} - {self.ledger_note}",
        ]
        return "\n".join(lines)


def _policies(budgets: int, *, pool_quota: int = 0) -> dict[str, str]:
    docs = {}
    if pool_quota:
        docs["pool.yaml"] = f"""apiVersion: budgetgate/v1
kind: ResourcePool
metadata: {{id: bench-tokens}}
spec: {{namespace: "{POOL}", quota: {pool_quota}, lease_seconds: {POOL_LEASE_SECONDS}}}
"""
    for i in range(budgets):
        docs[f"team-{i}.yaml"] = f"""apiVersion: budgetgate/v1
kind: BudgetPolicy
metadata: {{id: bench/team-{i}}}
spec:
  scope: {{namespace: team-{i}, labels: {{team: t{i}}}}}
  window: {{calendar: month}}
  limit: {{gpu_hours: 100000000}}
"""
    return docs


def _ts(at: datetime) -> Timestamp:
    stamp = Timestamp()
    stamp.FromDatetime(at)
    return stamp


def _lifecycle(run_id: str, kind: str, at: datetime) -> lifecycle_pb2.LifecycleEvent:
    return lifecycle_pb2.LifecycleEvent(event_id=str(uuid.uuid4()), event_time=_ts(at), run_id=run_id, type=lifecycle_pb2.LifecycleType.Value(kind), gpus=8)


def _usage(run_id: str, n: int, at: datetime, gpu: int) -> usage_pb2.UsageRecord:
    return usage_pb2.UsageRecord(
        event_id=str(uuid.uuid4()), event_time=_ts(at), run_id=run_id, sample_id=f"{run_id}/{n}", observed_at=_ts(at),
        gpu_milli_hours_cumulative=gpu, gpu_milli_hours_observed=gpu, node_milli_hours_observed=0,
    )  # fmt: skip


class Bench:
    def __init__(self, options: Options, *, echo: Callable[[str], None]) -> None:
        self.token = ""  # the benchmark's API token, made in its database
        self.options = options
        self.echo = echo
        self.tag = uuid.uuid4().hex[:8]
        self.settings = CommonSettings()
        self.children: list[Subprocess] = []
        self.broker_pid: int | None = None  # the broker started for the run (its CPU is read)
        check_replicas(options.replicas)

    async def run(self) -> Report:
        log_dir = Path(tempfile.mkdtemp(prefix=f"budgetgate-bench-{self.tag}-"))
        database = f"bench_{self.tag}_reconciliation"
        dsn = await databases.create(self.settings.postgres_dsn, database)
        prefix, topic_prefix = f"bench-{self.tag}", f"bench-{self.tag}-"
        try:
            bootstrap = await self._kafka(log_dir)
            await migrate_dsn(dsn)
            await self._apply(dsn)
            self.token = await bench_token(dsn)
            await ensure_topics(bootstrap, prefix=topic_prefix)
            env = {
                "BUDGETGATE_POSTGRES_DSN": dsn, "BUDGETGATE_REDIS_URL": self.settings.redis_url, "BUDGETGATE_REDIS_PREFIX": prefix,
                "BUDGETGATE_KAFKA_BOOTSTRAP": bootstrap, "BUDGETGATE_TOPIC_PREFIX": topic_prefix, **SERVICE_ENV,
            }  # fmt: skip
            port = free_port()
            admission = self._start("admission", python_module("budgetgate.services.admission", "--port", str(port)), log_dir, env)
            await admission.wait_port(port, timeout=60)
            run_ids = await self._admit(f"http://127.0.0.1:{port}")
            reconcilers = await self._start_reconcilers(log_dir, env, bootstrap, topic_prefix)
            async with Publisher(bootstrap, client_id="bench") as publisher:
                topics = Topics(topic_prefix)
                await self._warm_up(publisher, topics, dsn, run_ids.pop())
                meter = self._meter(dsn, reconcilers)
                started = await meter.start()
                sent_at, messages, seconds = await self._feed(publisher, topics, run_ids)
            lags = await self._lags(dsn, sent_at)
            spent = await self._spent(meter, started, reconcilers, messages, "message", "from the first message fed until every run was settled")
            ok, note = await self._audit(dsn, len(sent_at))
            return Report(self.options, len(lags), messages, seconds, lags, ok, note, spent, self.tag)
        finally:
            await self._clean_up(database, prefix, log_dir)

    async def _start_reconcilers(self, log_dir: Path, env: dict[str, str], bootstrap: str, topic_prefix: str) -> list[tuple[Subprocess, int]]:
        """`options.replicas` reconcilers in one consumer group, each with its port; with more
        than one, returned once every one of them is in the group."""
        count = self.options.replicas
        reconcilers = []
        for number in range(1, count + 1):
            port = free_port()
            command = python_module("budgetgate.services.reconciler", "--port", str(port))
            name = "reconciler" if count == 1 else f"reconciler-{number}"
            # The group is joined under the topic prefix: <topic prefix>reconciler.
            reconcilers.append((self._start(name, command, log_dir, {**env, "BUDGETGATE_TICK_SECONDS": "1", "BUDGETGATE_CONSUMER_GROUP": "reconciler"}), port))
        if count > 1:
            self.echo(f"waiting for the {count} reconcilers to join their consumer group …")
            group = f"{topic_prefix}reconciler"

            def alive() -> None:
                for child, _ in reconcilers:
                    child.check_alive()

            await until_members(bootstrap, group, count, timeout=120, alive=alive)
        return reconcilers

    def _meter(self, dsn: str, reconcilers: list[tuple[Subprocess, int]]) -> CpuMeter:
        """Each reconciler, the run's database, Redis and the broker; the benchmark beside them."""
        return CpuMeter(
            [
                *Part.replicas("reconciler", [child.pid for child, _ in reconcilers]),
                Part("postgres", postgres_dsn=dsn),
                *redis_parts(self.settings.redis_url),
                Part.process("broker", self.broker_pid),
                load_generator(),
            ]
        )

    async def _spent(self, meter: CpuMeter, started: Started, reconcilers: list[tuple[Subprocess, int]], units: int, unit: str, window: str) -> Spent:
        cpu = await meter.stop(started)
        taken = await taken_by([f"http://127.0.0.1:{port}" for _, port in reconcilers]) if len(reconcilers) > 1 else None
        return Spent(cpu, units, unit, window, len(reconcilers), taken)

    async def _clean_up(self, database: str, prefix: str, log_dir: Path) -> None:
        """Stop the services, drop the run's database and Redis keys, remove its logs."""
        for child in reversed(self.children):
            await child.stop()
        with contextlib.suppress(Exception):
            await databases.drop(self.settings.postgres_dsn, database)
        with contextlib.suppress(Exception):
            await drop_prefixed_keys(self.settings.redis_url, prefix)
        shutil.rmtree(log_dir, ignore_errors=True)

    def _start(self, name: str, command: list[str], log_dir: Path, env: dict[str, str] | None = None) -> Subprocess:
        child = Subprocess(name, command, log_dir=log_dir, env=env, cwd=log_dir)
        self.children.append(child)
        return child

    async def _kafka(self, log_dir: Path) -> str:
        import os

        if given := os.environ.get("BUDGETGATE_KAFKA_BOOTSTRAP"):
            return given
        port = free_port()
        broker = self._start("kafka", tansu_command(port), log_dir)
        await broker.wait_port(port, timeout=30)
        self.broker_pid = broker.pid
        return f"127.0.0.1:{port}"

    async def _apply(self, dsn: str) -> None:
        documents = [doc for name, text in _policies(self.options.budgets, pool_quota=self.options.pool_quota).items() for doc in parse_text(text, name)]
        conn = await asyncpg.connect(dsn)
        try:
            await apply_bundle(conn, bundle=build_bundle(documents, git_sha=f"bench-{self.tag}"), documents=documents, source="bench", applied_by="bench")
        finally:
            await conn.close()

    async def _admit(self, url: str) -> list[str]:
        self.echo(f"admitting {self.options.runs + 1} runs …")
        async with httpx.AsyncClient(base_url=url, timeout=30, headers=bearer(self.token)) as client:
            deadline = time.monotonic() + 60
            while (await client.get("/readyz")).status_code != 200:
                if time.monotonic() > deadline:
                    raise RuntimeError("admission did not become ready")
                await asyncio.sleep(0.2)
            gate = asyncio.Semaphore(16)

            async def admit(i: int) -> str:
                team = i % self.options.budgets
                body = {
                    "run_id": f"bench/{self.tag}/{i}",
                    "namespace": f"team-{team}",
                    "labels": {"team": f"t{team}"},
                    "resources": {"gpus": 8},
                    "projected_runtime_hours": 2.0,
                }
                async with gate:
                    answer = (await client.post("/v1/admissions", json=body)).json()
                if answer["decision"] != "ALLOW":
                    raise RuntimeError(f"run {body['run_id']} was not admitted: {answer['reason']}")
                return body["run_id"]

            return list(await asyncio.gather(*(admit(i) for i in range(self.options.runs + 1))))

    def _lifecycle_of(self, run_id: str, now: datetime) -> tuple[list[object], object]:
        start = now - timedelta(hours=1)
        step = timedelta(hours=1) / self.options.samples
        before = [_lifecycle(run_id, "STARTED", start)]
        before += [_usage(run_id, n, start + step * (n + 1), 2 * H * (n + 1)) for n in range(self.options.samples)]
        return before, _lifecycle(run_id, "COMPLETED", start + step * self.options.samples)

    async def _warm_up(self, publisher: Publisher, topics: Topics, dsn: str, run_id: str) -> None:
        """One run through the whole path first, so the consumer group has joined."""
        self.echo("waiting for the reconciler to join its consumer group …")
        before, completed = self._lifecycle_of(run_id, datetime.now(UTC))
        for message in [*before, completed]:
            await self._send(publisher, topics, message)
        conn = await asyncpg.connect(dsn)
        try:
            deadline = time.monotonic() + 120
            while not await conn.fetchval("SELECT final FROM run_settlements WHERE run_id = $1", run_id):
                if time.monotonic() > deadline:
                    raise RuntimeError("the reconciler did not settle the warm-up run within 120 s")
                await asyncio.sleep(0.2)
        finally:
            await conn.close()

    async def _send(self, publisher: Publisher, topics: Topics, message: object) -> None:
        topic = topics.lifecycle if isinstance(message, lifecycle_pb2.LifecycleEvent) else topics.usage
        await publisher.send(topic, message, key=message.run_id)  # type: ignore[arg-type, attr-defined]

    async def _feed(self, publisher: Publisher, topics: Topics, run_ids: list[str]) -> tuple[dict[str, float], int, float]:
        self.echo(f"feeding {len(run_ids)} runs at {self.options.rate:g}/s …")
        sent_at: dict[str, float] = {}
        began = time.monotonic()
        wall_began = time.time()
        count = 0

        async def one(i: int, run_id: str) -> None:
            nonlocal count
            await asyncio.sleep(max(0.0, began + i / self.options.rate - time.monotonic()))
            before, completed = self._lifecycle_of(run_id, datetime.now(UTC))
            for message in before:
                await self._send(publisher, topics, message)
            sent_at[run_id] = wall_began + (time.monotonic() - began)
            await self._send(publisher, topics, completed)
            count += len(before) + 1

        await asyncio.gather(*(one(i, r) for i, r in enumerate(run_ids)))
        return sent_at, count, time.monotonic() - began

    async def _lags(self, dsn: str, sent_at: dict[str, float]) -> list[float]:
        conn = await unmetered_connection(dsn)
        try:
            deadline = time.monotonic() + self.options.timeout
            while True:
                rows = await conn.fetch("SELECT run_id, settled_at FROM run_settlements WHERE final AND run_id = ANY($1::text[])", list(sent_at))
                if len(rows) == len(sent_at) or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.5)
        finally:
            await conn.close()
        return [max(0.0, (r["settled_at"].timestamp() - sent_at[r["run_id"]]) * 1000) for r in rows]

    async def _audit(self, dsn: str, runs: int) -> tuple[bool, str]:
        conn = await asyncpg.connect(dsn)
        try:
            reserved = await conn.fetchval("SELECT COALESCE(sum(amount), 0) FROM reservations WHERE state = 'held'")
            consumed = await conn.fetchval("SELECT COALESCE(sum(consumed), 0) FROM ledger_entries")
        finally:
            await conn.close()
        expected = (runs + 1) * 2 * H * self.options.samples
        ok = reserved == 0 and consumed == expected
        return ok, f"reserved {reserved / H:g} GPU-h held (expected 0), consumed {consumed / H:g} GPU-h (expected {expected / H:g})"


async def run(options: Options, *, echo: Callable[[str], None]) -> Report:
    return await Bench(options, echo=echo).run()
