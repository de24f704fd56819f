"""`budgetgate bench reconciliation --records-per-s R`: reconciliation lag at a steady load of usage
records, on short runs and on runs with a long history, in the same invocation.

Half the records go to `long_runs` runs whose history of `long_length` samples is preloaded by
COPY (and folded by the reconciler before the clock starts); the other half to short runs of
`short_length` samples each, `short_slots` at a time, each completing after its last sample and
making room for the next. Lag of a record = when the ledger (the run's charges in Postgres) first
shows its cumulative counter, minus when it was handed to the producer; the ledger is polled
every `poll` seconds, which bounds the resolution. Ends with the ledger audit.

With `replicas` > 1 that many reconcilers share the consumer group (as in `bench reconciliation`);
from the first record fed until the ledger showed the last one, the CPU of each reconciler, their
sum, Postgres, Redis and the broker is read, per usage record fed.

With `token_pool`, every run takes a token of a pool with its admission, which the reconciler
renews at each settlement of a run alive later than its grant (the long runs': the short runs'
samples are older than their grants) and gives back at its end; the audit fails on a token still
held then, or a run without one.
"""

from __future__ import annotations

import asyncio
import math
import tempfile
import time
import uuid
from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path

import asyncpg
from aiokafka import AIOKafkaProducer

from budgetgate.messaging.publisher import Publisher
from budgetgate.contracts import wire
from budgetgate.benchmark import databases
from budgetgate.benchmark.service_processes import free_port, python_module
from budgetgate.benchmark.cpu import unmetered_connection
from budgetgate.benchmark.reconciliation_runner import POOL, Bench, Options, Spent, _lifecycle, _usage
from budgetgate.benchmark.credentials import SERVICE_ENV, bearer, bench_token
from budgetgate.ledger.migrations import migrate_dsn
from budgetgate.contracts.topics import Topics
from budgetgate.messaging.topic_admin import ensure_topics

STEP_MS = 1000 * 8  # each sample adds 1 s of 8 GPUs, in GPU-milliseconds (milli-hours)


@dataclass(frozen=True)
class SteadyOptions:
    records_per_s: float = 2000.0
    short_length: int = 100
    long_length: int = 10_000
    long_runs: int = 10
    short_slots: int = 10
    duration: float = 30.0
    budgets: int = 5
    poll: float = 0.1
    timeout: float = 300.0
    replicas: int = 1  # reconciler processes in the one consumer group
    # Every run takes a token of a pool (reconciliation_runner.POOL) with its admission: each
    # settlement of a run alive later than its grant renews the token's lease, in Postgres and
    # Redis, and the run's end gives it back.
    token_pool: bool = False


@dataclass
class Tokens:
    """What the runs' pool tokens went through (`token_pool`): granted with their admissions, held
    at the end (none, every run having ended), and renewed: leases that ended later than granted."""

    granted: int
    held: int
    renewed: int


@dataclass
class SteadyReport:
    options: SteadyOptions
    records: int
    send_seconds: float
    lags_ms: dict[str, list[float]] = field(repr=False)
    unseen: int
    ledger_ok: bool
    ledger_note: str
    spent: Spent | None = None
    tag: str | None = None  # names its database (bench_<tag>_…), Redis prefix and topics (bench-<tag>…)
    tokens: Tokens | None = None

    def percentile(self, group: str, q: float) -> float:
        ordered = sorted(self.lags_ms[group])
        return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))] if ordered else float("nan")

    @property
    def ratio(self) -> float:
        short = self.percentile("short", 0.99)
        return self.percentile("long", 0.99) / short if short else float("nan")

    def as_json(self) -> dict[str, object]:
        groups = {
            g: {
                "records": len(v),
                "p50_ms": round(self.percentile(g, 0.5), 1),
                "p99_ms": round(self.percentile(g, 0.99), 1),
                "max_ms": round(max(v, default=float("nan")), 1),
            }
            for g, v in self.lags_ms.items()
        }
        return {
            "options": asdict(self.options), "records": self.records, "offered_records_per_s": round(self.records / self.send_seconds, 1),
            "lag": groups, "p99_ratio_long_to_short": round(self.ratio, 2), "unseen": self.unseen, "ledger_ok": self.ledger_ok, "ledger": self.ledger_note,
            **(self.spent.as_json() if self.spent else {}), "run_tag": self.tag, "tokens": asdict(self.tokens) if self.tokens else None,
        }  # fmt: skip

    def as_text(self) -> str:
        o = self.options
        lines = [f"load: {self.records} usage records offered at {self.records / self.send_seconds:.0f}/s for {o.duration:g} s ({o.budgets} budgets)"]
        if self.tokens:
            lines.append(
                f"pool tokens ({POOL}): {self.tokens.granted} granted with the admissions, {self.tokens.renewed} renewed by the reconciler, "
                f"{self.tokens.held} still held after every run ended"
            )
        for group, length, runs in (("short", o.short_length, f"{o.short_slots} at a time"), ("long", o.long_length, f"{o.long_runs} runs")):
            lines.append(
                f"runs of {length} samples ({runs}): {len(self.lags_ms[group])} records, lag p50 {self.percentile(group, 0.5):.1f} ms, "
                f"p99 {self.percentile(group, 0.99):.1f} ms, max {max(self.lags_ms[group], default=float('nan')):.1f} ms"
            )
        lines.append(f"p99 ratio long/short: {self.ratio:.2f}; records never seen in the ledger: {self.unseen}")
        lines += self.spent.lines() if self.spent else []
        lines.append(f"ledger: {'OK' if self.ledger_ok else 'WRONG'} - {self.ledger_note}")
        return "\n".join(lines)


@dataclass
class _Run:
    run_id: str
    group: str
    sent: int = 0  # samples so far, preloaded included
    pending: deque[tuple[int, float]] = field(default_factory=deque)  # (cumulative, sent at)


class SteadyBench(Bench):
    def __init__(self, options: SteadyOptions, *, echo: Callable[[str], None]) -> None:
        self.token = ""  # the benchmark's API token, made in its database
        o = options
        shorts = math.ceil(o.records_per_s / 2 * o.duration / o.short_length) + o.short_slots
        tokens = o.long_runs + shorts + 1 if o.token_pool else 0  # a token for every run, the warm-up's too
        super().__init__(Options(budgets=options.budgets, replicas=options.replicas, pool_quota=tokens), echo=echo)
        self.steady = options
        self.runs = [_Run(f"bench/{self.tag}/long/{i}", "long") for i in range(o.long_runs)] + [
            _Run(f"bench/{self.tag}/short/{i}", "short") for i in range(shorts)
        ]
        self.warm = f"bench/{self.tag}/warm-up"
        self.lags: dict[str, list[float]] = defaultdict(list)
        self.start = datetime.now(UTC) - timedelta(seconds=o.long_length + 60)

    async def run_steady(self) -> SteadyReport:
        log_dir = Path(tempfile.mkdtemp(prefix=f"budgetgate-bench-{self.tag}-"))
        database = f"bench_{self.tag}_steady"
        dsn = await databases.create(self.settings.postgres_dsn, database)
        prefix, topic_prefix = f"bench-{self.tag}", f"bench-{self.tag}-"
        try:
            bootstrap = self.bootstrap = await self._kafka(log_dir)
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
            await self._admit_all(f"http://127.0.0.1:{port}")
            await self._preload(dsn)
            reconcilers = await self._start_reconcilers(log_dir, env, bootstrap, topic_prefix)
            await self._until_settled(dsn, "the reconciler to fold the preloaded history")
            async with Publisher(bootstrap, client_id="bench") as publisher:
                topics = Topics(topic_prefix)
                await self._warm_up(publisher, topics, dsn, self.warm)
                meter = self._meter(dsn, reconcilers)
                started = await meter.start()
                records, seconds = await self._feed_steady(publisher, topics, dsn)
                spent = await self._spent(meter, started, reconcilers, records, "usage record", "from the first record fed until the ledger showed the last")
                await self._finish(publisher, topics, dsn)
            ok, note, tokens = await self._audit_steady(dsn)
            unseen = sum(len(r.pending) for r in self.runs)
            return SteadyReport(self.steady, records, seconds, dict(self.lags), unseen, ok, note, spent, self.tag, tokens)
        finally:
            await self._clean_up(database, prefix, log_dir)

    async def _admit_all(self, url: str) -> None:
        import httpx

        self.echo(f"admitting {len(self.runs)} runs …")
        async with httpx.AsyncClient(base_url=url, timeout=30, headers=bearer(self.token)) as client:
            deadline = time.monotonic() + 60
            while (await client.get("/readyz")).status_code != 200:
                if time.monotonic() > deadline:
                    raise RuntimeError("admission did not become ready")
                await asyncio.sleep(0.2)
            gate = asyncio.Semaphore(16)

            async def admit(i: int, run: _Run) -> None:
                team = i % self.steady.budgets
                body = {
                    "run_id": run.run_id,
                    "namespace": f"team-{team}",
                    "labels": {"team": f"t{team}"},
                    "resources": {"gpus": 8},
                    "projected_runtime_hours": 2.0,
                    **({"pool_token": {"namespace": POOL}} if self.steady.token_pool else {}),
                }
                async with gate:
                    answer = (await client.post("/v1/admissions", json=body)).json()
                if answer["decision"] != "ALLOW":
                    raise RuntimeError(f"run {run.run_id} was not admitted: {answer['reason']}")

            await asyncio.gather(*(admit(i, r) for i, r in enumerate([*self.runs, _Run(self.warm, "warm")])))

    async def _preload(self, dsn: str) -> None:
        """The long runs' history, by COPY, marked to be settled as if it had just arrived."""
        length = self.steady.long_length
        self.echo(f"preloading {self.steady.long_runs} runs × {length} samples by COPY …")
        conn = await asyncpg.connect(dsn)
        try:
            longs = [r for r in self.runs if r.group == "long"]
            await conn.copy_records_to_table(
                "lifecycle_events", columns=["event_id", "run_id", "kind", "event_time", "gpus", "nodes"],
                records=[(str(uuid.uuid4()), r.run_id, "STARTED", self.start, 8, 1) for r in longs],
            )  # fmt: skip
            for run in longs:
                rows = [(run.run_id, f"{run.run_id}/{n}", self._at(n), STEP_MS * (n + 1), 0) for n in range(length)]
                await conn.copy_records_to_table("run_samples", columns=["run_id", "sample_id", "observed_at", "gpu", "node"], records=rows)
                run.sent = length
            await conn.executemany("INSERT INTO runs_to_settle (run_id) VALUES ($1)", [(r.run_id,) for r in longs])
        finally:
            await conn.close()

    def _at(self, n: int) -> datetime:
        return self.start + timedelta(seconds=n + 1)

    async def _until_settled(self, dsn: str, what: str) -> None:
        self.echo(f"waiting for {what} …")
        conn = await asyncpg.connect(dsn)
        try:
            deadline = time.monotonic() + self.steady.timeout
            while await conn.fetchval("SELECT count(*) FROM runs_to_settle"):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"timed out waiting for {what}")
                await asyncio.sleep(0.5)
        finally:
            await conn.close()

    async def _feed_steady(self, publisher: Publisher, topics: Topics, dsn: str) -> tuple[int, float]:
        o = self.steady
        self.echo(f"feeding {o.records_per_s:g} usage records/s for {o.duration:g} s …")
        longs = [r for r in self.runs if r.group == "long"]
        shorts = deque(r for r in self.runs if r.group == "short")
        slots = [shorts.popleft() for _ in range(o.short_slots)]
        total = int(o.records_per_s * o.duration)
        poller = asyncio.create_task(self._poll(dsn))
        # Its own producer, batching more than the services' one (Publisher waits for each
        # send): at thousands of records per second the feed must not be what limits the load.
        producer = AIOKafkaProducer(bootstrap_servers=self.bootstrap, acks="all", enable_idempotence=False, max_batch_size=512 * 1024, linger_ms=5)
        await producer.start()
        in_flight: deque[asyncio.Future[object]] = deque()
        began, sent = time.monotonic(), 0
        try:
            while sent < total:
                due = min(total, int((time.monotonic() - began) * o.records_per_s) + 1)
                batch: list[tuple[str, object]] = []
                for j in range(sent, due):
                    if j % 2 == 0:
                        run = longs[(j // 2) % len(longs)]
                    else:
                        slot = (j // 2) % len(slots)
                        run = slots[slot]
                        if run.sent == 0:
                            batch.append((topics.lifecycle, _lifecycle(run.run_id, "STARTED", self._at(0))))
                    cumulative = STEP_MS * (run.sent + 1)
                    batch.append((topics.usage, _usage(run.run_id, run.sent, self._at(run.sent), cumulative)))
                    run.pending.append((cumulative, time.time()))
                    run.sent += 1
                    if run.group == "short" and run.sent == o.short_length:
                        batch.append((topics.lifecycle, _lifecycle(run.run_id, "COMPLETED", self._at(run.sent - 1))))
                        slots[slot] = shorts.popleft()
                records = [(topic, wire.encode(m, key=m.run_id)) for topic, m in batch]  # type: ignore[attr-defined, arg-type]
                acks = [await producer.send(topic, value=r.value, key=r.key, headers=r.headers) for topic, r in records]
                in_flight.extend(acks)
                while len(in_flight) > 20_000:
                    await in_flight.popleft()
                sent = due
                await asyncio.sleep(0.02)
            await asyncio.gather(*in_flight)
            seconds = time.monotonic() - began
            deadline = time.monotonic() + o.timeout
            while any(r.pending for r in self.runs) and time.monotonic() < deadline:
                if poller.done():
                    poller.result()  # the poller failed: its error, not a silent wait until the timeout
                    raise RuntimeError("the ledger poller stopped")
                await asyncio.sleep(o.poll)
        finally:
            poller.cancel()
            await asyncio.gather(poller, return_exceptions=True)
            await producer.stop()
        self.unused = list(shorts)
        return total, seconds

    async def _poll(self, dsn: str) -> None:
        conn = await unmetered_connection(dsn)
        try:
            by_id = {r.run_id: r for r in self.runs}
            while True:
                rows = await conn.fetch("SELECT run_id, sum(amount)::bigint AS amount FROM run_charges WHERE ledger_key LIKE '%|gpu_hours' GROUP BY run_id")
                seen = time.time()
                for row in rows:
                    run = by_id.get(row["run_id"])
                    while run is not None and run.pending and run.pending[0][0] <= row["amount"]:
                        _, at = run.pending.popleft()
                        self.lags[run.group].append(max(0.0, (seen - at) * 1000))
                await asyncio.sleep(self.steady.poll)
        finally:
            await conn.close()

    async def _finish(self, publisher: Publisher, topics: Topics, dsn: str) -> None:
        """Every run ends: used ones complete, unused ones are cancelled before they start."""
        now = datetime.now(UTC)
        for run in self.runs:
            if run.sent and not (run.group == "short" and run.sent == self.steady.short_length):
                await publisher.send(topics.lifecycle, _lifecycle(run.run_id, "COMPLETED", self._at(run.sent - 1)), key=run.run_id)
            elif not run.sent:
                await publisher.send(topics.lifecycle, _lifecycle(run.run_id, "CANCELLED", now), key=run.run_id)
        conn = await asyncpg.connect(dsn)
        try:
            deadline = time.monotonic() + self.steady.timeout
            while await conn.fetchval("SELECT count(*) FROM run_settlements WHERE final") < len(self.runs) + 1:
                if time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.5)
        finally:
            await conn.close()

    async def _audit_steady(self, dsn: str) -> tuple[bool, str, Tokens | None]:
        """Whether the ledger adds up once every run ended, what it found, and (with a token pool)
        what the runs' tokens went through: every run took one, and none is held any more."""
        conn = await asyncpg.connect(dsn)
        try:
            reserved = int(await conn.fetchval("SELECT COALESCE(sum(amount), 0) FROM reservations WHERE state = 'held'"))
            consumed = int(await conn.fetchval("SELECT COALESCE(sum(consumed), 0) FROM ledger_entries"))
            final = await conn.fetchval("SELECT count(*) FROM run_settlements WHERE final")
            tokens = await self._tokens(conn) if self.steady.token_pool else None
        finally:
            await conn.close()
        runs = len(self.runs) + 1  # the warm-up run too
        warm = 2 * 3_600_000 * self.options.samples  # the warm-up run's last reading (Bench._lifecycle_of)
        expected = sum(STEP_MS * r.sent for r in self.runs) + warm
        ok = reserved == 0 and consumed == expected and final == runs
        h = 3_600_000
        note = f"reserved {reserved / h:g} GPU-h held (expected 0), consumed {consumed / h:g} GPU-h (expected {expected / h:g}), {final}/{runs} runs final"
        if tokens is not None:
            ok = ok and tokens.granted == runs and tokens.held == 0
            note += f", pool tokens {tokens.granted} granted for {runs} runs and {tokens.held} still held (expected 0)"
        return ok, note, tokens

    @staticmethod
    async def _tokens(conn: asyncpg.Connection) -> Tokens:
        row = await conn.fetchrow(
            """SELECT count(*) AS granted, count(*) FILTER (WHERE state = 'held') AS held,
                      count(*) FILTER (WHERE lease_expires_at > granted_at + make_interval(secs => lease_seconds + 1)) AS renewed
               FROM pool_allocations WHERE namespace = $1 AND token LIKE 'run:%'""",
            POOL,
        )
        return Tokens(granted=row["granted"], held=row["held"], renewed=row["renewed"])


async def run(options: SteadyOptions, *, echo: Callable[[str], None]) -> SteadyReport:
    return await SteadyBench(options, echo=echo).run_steady()
