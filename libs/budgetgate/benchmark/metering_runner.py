"""One `budgetgate bench metering` run: the load published to Kafka first, then the real
metering-ingest service started and timed, on the database's clock, from the start of its first
transaction until it has consumed all of it; then the rows it wrote are copied with COPY into a
second, identical database and that is timed too.

With `replicas` > 1 that many metering-ingest processes are started together in one consumer
group and share the topic's partitions; the timing from the first transaction includes their
joining the group (a rebalance for each that joins), so the CPU figures and the steady rate are
taken over a window that opens at the first commit after all of them are in the group.

Everything started is stopped, and the databases dropped, also on Ctrl-C, SIGTERM or an error.
"""

from __future__ import annotations

import asyncio
import logging
import contextlib
import os
import time
import uuid
from collections import defaultdict
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import asyncpg
import httpx
from aiokafka import TopicPartition
from aiokafka.admin import AIOKafkaAdminClient

from budgetgate.messaging.publisher import Publisher
from budgetgate.benchmark.session import session
from budgetgate.benchmark.consumer_group import taken_by, until_members
from budgetgate.benchmark.cpu import CpuMeter, CpuUse, Part, Started
from budgetgate.benchmark import databases, metering_workload, pauses, sql_blocks
from budgetgate.benchmark.service_processes import StartError, Subprocess, free_port, python_module, tansu_command
from budgetgate.core.metering import FOLD, Counters, MemoryUsage, fold_start, usage_event_id
from budgetgate.ledger.migrations import migrate_dsn
from budgetgate.runtime.settings import CommonSettings
from budgetgate.contracts.topics import Topics
from budgetgate.messaging.topic_admin import ensure_topics

log = logging.getLogger(__name__)

INBOX = "metering-ingest"  # the name the service records its polls' offsets under (its default inbox name)
_PUBLISH_CHUNK = 500


@dataclass(frozen=True)
class Options:
    samples: int = 10_000
    runs: int = 100
    resend_every: int = 10
    partitions: int = 3
    rounds: int = 1  # the whole run (its own broker, databases, topics and service) this many times
    replicas: int = 1  # metering-ingest processes in the one consumer group
    ready_timeout: float = 60.0
    # Long enough for the slowest machine this runs on; the run fails rather than hang.
    consume_timeout: float = 1800.0

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"replicas must be at least 1, not {self.replicas}")
        if self.replicas > self.partitions:
            raise ValueError(
                f"replicas ({self.replicas}) must be at most partitions ({self.partitions}): "
                "a consumer group gives each partition to one member, so the others would only wait"
            )


@dataclass
class Result:
    """What one run measured, and whether the service's usage came out right."""

    tag: str
    messages: int
    distinct: int
    runs: int
    ingest_seconds: float
    rows: int
    copy_seconds: float
    published: int
    unpublished_at_end: int
    problems: list[str] = field(default_factory=list)
    cpu: CpuUse | None = None  # from the service's first commit (with every replica in the group) until it had consumed every sample
    cpu_samples: int = 0  # the samples consumed in that window, which its figures are per
    collections: pauses.Collections | None = None  # the service's garbage collection (its replicas' added up), once it had consumed every sample
    replicas: int = 1
    consumed_by_replica: list[int] | None = None  # the messages each replica took care of (its /metrics), in the order started
    copy_cpu: CpuUse | None = None  # the fastest COPY's: its client (this process) and its Postgres server process, per row
    copied: int = 0  # the rows COPY loads: one per distinct sample of the load

    @property
    def correct(self) -> bool:
        return not self.problems


class Run:
    def __init__(self, options: Options, *, echo: Callable[[str], None]) -> None:
        self.options = options
        self.echo = echo
        self.tag = uuid.uuid4().hex[:8]
        self.settings = CommonSettings()
        self.topics = Topics(f"bench-{self.tag}-")
        self.children: list[Subprocess] = []
        self.broker_pid: int | None = None

    async def execute(self) -> Result:
        async with session(self.children) as (stack, log_dir):
            return await self._measure(stack, log_dir)

    async def _measure(self, stack: contextlib.AsyncExitStack, log_dir: Path) -> Result:
        bootstrap = await self._kafka(stack, log_dir)
        ingest_dsn = await self._database(stack, "ingest")
        copy_dsn = await self._database(stack, "copy")
        work = metering_workload.build(samples=self.options.samples, runs=self.options.runs, resend_every=self.options.resend_every, tag=self.tag)
        await _execute(ingest_dsn, sql_blocks.sql("metering.sql", "decide_runs"), work.runs)
        await ensure_topics(bootstrap, prefix=self.topics.prefix, partitions=self.options.partitions)
        self.echo(f"publishing {len(work.messages)} samples ({work.resends} resends) of {len(work.runs)} runs to {self.topics.metering}")
        ends = await _publish(bootstrap, self.topics.metering, work.messages)

        services = self._start_services(stack, log_dir, ingest_dsn, bootstrap)
        pids = [child.pid for child, _ in services]
        meter = CpuMeter([*Part.replicas("service", pids), Part("postgres", postgres_dsn=ingest_dsn), Part.process("broker", self.broker_pid)])
        # Watched from the start: the service may consume everything before it answers ready.
        # Its CPU is read from its first commit on (with every replica in the group), so its start
        # (imports, connections, joining the group) is left out.
        metering = asyncio.create_task(_from_first_commit(meter, ingest_dsn, self._joined(bootstrap, services)))
        consumed = asyncio.create_task(self._wait_consumed(services, ingest_dsn, bootstrap, ends, len(work.messages)))
        try:
            await asyncio.gather(*(self._wait_ready(service) for service in services))
            self.echo(f"metering-ingest ready{_times(len(services))}; timed from its first transaction until it has consumed every sample")
            ingest_seconds = await consumed
            cpu = await _cpu_window(meter, metering, len(work.messages))
            urls = [(f"http://127.0.0.1:{port}", child.pid) for child, port in services]
            collections = await pauses.observed_all(urls)
            by_replica = await taken_by([url for url, _ in urls]) if len(services) > 1 else None
        finally:
            consumed.cancel()
            metering.cancel()
            if metering.done() and not metering.cancelled():
                metering.exception()  # retrieved: a failure of the figure is not the run's
        pending, published = await _outbox(ingest_dsn)
        await _wait_relayed(services, ingest_dsn)
        await asyncio.gather(*(child.stop() for child, _ in services))  # nothing in flight while the rows are read

        rows = await _fetch(ingest_dsn, sql_blocks.sql("metering.sql", "usage_rows"))
        problems = await check_usage(ingest_dsn, work, rows)
        copied = _clean_rows(work, rows[0]["recorded_at"] if rows else datetime.now(UTC))
        self.echo(f"copying a usage row per distinct sample ({len(copied)}) with COPY")
        copy_seconds, copy_cpu = await _copy(copy_dsn, copied)
        used, in_window = cpu or (None, 0)
        return Result(
            self.tag, len(work.messages), work.distinct, len(work.runs), ingest_seconds, len(rows), copy_seconds, published, pending, problems, used, in_window,
            collections, len(services), by_replica, copy_cpu, len(copied),
        )  # fmt: skip

    def _joined(self, bootstrap: str, services: list[tuple[Subprocess, int]]) -> Callable[[], Awaitable[None]]:
        """What returns once every replica is a member of the group (at once with one: its first
        commit is after it joined)."""

        async def joined() -> None:
            if len(services) > 1:
                await until_members(bootstrap, self._group, len(services), timeout=self.options.ready_timeout, alive=lambda: _check_alive(services))
                self.echo(f"all {len(services)} replicas in the consumer group")

        return joined

    async def _kafka(self, stack: contextlib.AsyncExitStack, log_dir: Path) -> str:
        given = os.environ.get("BUDGETGATE_KAFKA_BOOTSTRAP")
        if given:
            stack.push_async_callback(_delete_topics, given, self.topics)
            return given
        port = free_port()
        self.echo(f"starting a Tansu broker on 127.0.0.1:{port} (BUDGETGATE_KAFKA_BOOTSTRAP is unset)")
        broker = self._child("kafka", tansu_command(port), log_dir=log_dir)
        stack.push_async_callback(broker.stop)
        await broker.wait_port(port, timeout=self.options.ready_timeout)
        self.broker_pid = broker.pid
        return f"127.0.0.1:{port}"

    async def _database(self, stack: contextlib.AsyncExitStack, role: str) -> str:
        name = f"bench_{self.tag}_metering_{role}"
        dsn = await databases.create(self.settings.postgres_dsn, name)
        stack.push_async_callback(databases.drop, self.settings.postgres_dsn, name)
        await migrate_dsn(dsn)
        return dsn

    def _start_services(self, stack: contextlib.AsyncExitStack, log_dir: Path, dsn: str, bootstrap: str) -> list[tuple[Subprocess, int]]:
        """`options.replicas` metering-ingest processes in one consumer group, each with its port."""
        env = {
            "BUDGETGATE_POSTGRES_DSN": dsn,
            "BUDGETGATE_KAFKA_BOOTSTRAP": bootstrap,
            "BUDGETGATE_TOPIC_PREFIX": self.topics.prefix,
            "BUDGETGATE_CONSUMER_GROUP": "metering-ingest",  # the service joins it under the topic prefix (self._group)
        }
        services = []
        count = self.options.replicas
        for number in range(1, count + 1):
            port = free_port()
            name = "metering-ingest" if count == 1 else f"metering-ingest-{number}"
            command = python_module("budgetgate.services.metering_ingest", "--host", "127.0.0.1", "--port", str(port))
            child = self._child(name, command, log_dir=log_dir, env=env)
            stack.push_async_callback(child.stop)
            services.append((child, port))
        return services

    @property
    def _group(self) -> str:
        return f"{self.topics.prefix}metering-ingest"

    def _child(self, name: str, command: list[str], *, log_dir: Path, env: dict[str, str] | None = None) -> Subprocess:
        child = Subprocess(name, command, log_dir=log_dir, env=env, cwd=log_dir)
        self.children.append(child)
        return child

    async def _wait_ready(self, service: tuple[Subprocess, int]) -> None:
        child, port = service
        await child.wait_port(port, timeout=self.options.ready_timeout)
        deadline = time.monotonic() + self.options.ready_timeout
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=5) as client:
            while (response := await client.get("/readyz")).status_code != 200:
                child.check_alive()
                if time.monotonic() > deadline:
                    raise StartError(f"metering-ingest not ready after {self.options.ready_timeout:.0f}s: {response.text}\n{child.log_tail()}")
                await asyncio.sleep(0.05)

    async def _wait_consumed(self, services: list[tuple[Subprocess, int]], dsn: str, bootstrap: str, ends: dict[TopicPartition, int], expected: int) -> float:
        """Seconds from the service's first transaction until every sample is consumed (the
        service may start consuming before it answers ready: its start is not timed).

        Watched on the broker, where the service commits its offsets after its transactions
        commit: polling the database every few milliseconds would take CPU from the service
        being measured. The offsets its polls recorded are read once at the end, for
        the count and the time on the database's clock."""
        deadline = time.monotonic() + self.options.consume_timeout
        admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, client_id="budgetgate-bench")
        await admin.start()
        try:
            while True:
                committed = await admin.list_consumer_group_offsets(self._group, partitions=list(ends))
                if all(tp in committed and committed[tp].offset >= end for tp, end in ends.items()):
                    break
                _check_alive(services)
                if time.monotonic() > deadline:
                    done = {f"{tp.partition}": (committed[tp].offset if tp in committed else None) for tp in ends}
                    raise StartError(f"metering-ingest committed offsets {done} of {ends} in {self.options.consume_timeout:.0f}s\n{_log_tails(services)}")
                await asyncio.sleep(0.02)
        finally:
            await admin.close()
        [found] = await _fetch(dsn, sql_blocks.sql("metering.sql", "consumed"), INBOX)
        # More than `expected` when a rebalance delivered a poll again (its samples were found
        # duplicates of themselves); fewer would be samples never applied.
        if found["done"] < expected:
            raise StartError(f"metering-ingest committed every offset but its polls applied {found['done']} of {expected} samples\n{_log_tails(services)}")
        return float(found["seconds"])


def _times(count: int) -> str:
    return "" if count == 1 else f" ({count} replicas)"


def _check_alive(services: list[tuple[Subprocess, int]]) -> None:
    for child, _ in services:
        child.check_alive()


def _log_tails(services: list[tuple[Subprocess, int]]) -> str:
    return "\n".join(f"{child.name}:\n{child.log_tail()}" for child, _ in services)


async def _from_first_commit(meter: CpuMeter, dsn: str, joined: Callable[[], Awaitable[None]]) -> tuple[Started, int]:
    """Start `meter` as soon as every replica is in the group (`joined`) and the service's first
    transaction is visible (a sum of its polls' offsets, none until then, every 10 ms, and nothing
    after); with the samples consumed by then."""
    await joined()
    conn = await asyncpg.connect(dsn)
    try:
        while not (done := (await conn.fetchrow(sql_blocks.sql("metering.sql", "consumed"), INBOX))["done"]):
            await asyncio.sleep(0.01)
    finally:
        await conn.close()
    return await meter.start(), int(done)


async def _cpu_window(meter: CpuMeter, metering: asyncio.Task[tuple[Started, int]], messages: int) -> tuple[CpuUse, int] | None:
    """What the parts spent from the first commit on, with the samples consumed meanwhile; None
    when that cannot be read (the figures are an addition to the run, never its failure) or
    when the service had consumed everything before the window opened."""
    try:
        started, before = await metering
        used = await meter.stop(started)
    except Exception as exc:  # noqa: BLE001 - see the docstring
        log.warning("CPU figures left out: %s", exc)
        return None
    return (used, messages - before) if messages > before else None


async def _execute(dsn: str, query: str, *args: object) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(query, *args)
    finally:
        await conn.close()


async def _fetch(dsn: str, query: str, *args: object) -> list[asyncpg.Record]:
    conn = await asyncpg.connect(dsn)
    try:
        return await conn.fetch(query, *args)
    finally:
        await conn.close()


async def _publish(bootstrap: str, topic: str, messages: list) -> dict[TopicPartition, int]:  # type: ignore[type-arg]
    """Publish the load; returns, per partition, the offset past its last record (what a
    consumer that took all of it has committed)."""
    ends: dict[TopicPartition, int] = {}
    async with Publisher(bootstrap, client_id="budgetgate-bench") as publisher:
        for start in range(0, len(messages), _PUBLISH_CHUNK):
            chunk = messages[start : start + _PUBLISH_CHUNK]
            # One producer sends a chunk in order per partition; acknowledged together.
            for acked in await asyncio.gather(*(publisher.send(topic, m, key=m.run_id) for m in chunk)):
                tp = TopicPartition(acked.topic, acked.partition)
                ends[tp] = max(ends.get(tp, 0), acked.offset + 1)
    return ends


async def _outbox(dsn: str) -> tuple[int, int]:
    [row] = await _fetch(dsn, sql_blocks.sql("audit.sql", "outbox_state"))
    return row["pending"], row["total"]


async def _wait_relayed(services: list[tuple[Subprocess, int]], dsn: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while (await _outbox(dsn))[0] > 0 and time.monotonic() < deadline:
        _check_alive(services)
        await asyncio.sleep(0.1)


async def check_usage(dsn: str, work: metering_workload.MeteringWorkload, rows: list[asyncpg.Record]) -> list[str]:
    """What is wrong with the usage recorded in `dsn` (`rows`: its usage rows, by run and
    observed_at), compared with the clean stream applied sample after sample: each run's cumulative; each distinct sample applied once (a run's count
    of applied samples, whether each became a row or its quarter hour's one point); the rows'
    deltas adding up to the cumulative; and the usage up to every quarter hour, where windows,
    hour buckets and rates change (budgetgate.core.metering.FOLD), the clean stream's."""
    problems = []
    if len(rows) > work.distinct:
        problems.append(f"{len(rows)} usage rows for {work.distinct} distinct samples")
    totals = {r["run_id"]: r for r in await _fetch(dsn, sql_blocks.sql("metering.sql", "run_totals"))}
    by_run: dict[str, list[asyncpg.Record]] = defaultdict(list)
    for row in rows:  # by run and observed_at
        by_run[row["run_id"]].append(row)
    for run_id, expected in work.expected.items():
        total = totals.get(run_id)
        found = Counters(total["gpu"], total["node"]) if total else None
        if found != expected:
            problems.append(f"run {run_id}: cumulative {found}, expected {expected}")
        applied, distinct = (total["samples"] if total else 0), len(work.clean.recorded(run_id))
        if applied != distinct:
            problems.append(f"run {run_id}: {applied} samples applied, {distinct} distinct")
        mine = by_run.get(run_id, [])
        added = Counters(sum(r["gpu_milli_hours_delta"] for r in mine), sum(r["node_milli_hours_delta"] for r in mine))
        if added != expected:
            problems.append(f"run {run_id}: its rows' deltas add up to {added}, its cumulative is {expected}")
        if (wrong := first_wrong_quarter(run_id, mine, work.clean)) is not None:
            problems.append(f"run {run_id}: usage up to {wrong[0].isoformat()} is {wrong[1]}, the clean stream's {wrong[2]}")
    return problems


def first_wrong_quarter(run_id: str, rows: Sequence[Mapping[str, Any]], clean: MemoryUsage) -> tuple[datetime, Counters, Counters] | None:
    """The first quarter hour from the run's first sample to past its last up to which its
    recorded usage (its latest row before it; `rows`: its usage rows by observed_at) differs
    from the clean stream's, if one does: (the quarter hour, the rows' usage, the clean's). A
    point on a quarter hour starts the next: the reconciler charges an increment to the window,
    bucket and rate of its end."""
    samples = clean.recorded(run_id)
    if not samples:
        return None
    at = fold_start(samples[0].observed_at)
    index, usage = 0, Counters()
    while at <= samples[-1].observed_at + FOLD:
        while index < len(rows) and rows[index]["observed_at"] < at:
            usage = Counters(rows[index]["gpu_milli_hours"], rows[index]["node_milli_hours"])
            index += 1
        if usage != (expected := clean.usage_through(run_id, at - timedelta(microseconds=1))):
            return at, usage, expected
        at += FOLD
    return None


def _clean_rows(work: metering_workload.MeteringWorkload, recorded_at: datetime) -> list[tuple[object, ...]]:
    """A usage row per distinct sample, as the clean stream applied sample after sample gives
    them: what COPY loads, the reference for ingesting every sample of the load."""
    return [
        (
            a.sample.run_id, a.sample.sample_id, a.sample.observed_at, a.sample.counters.gpu, a.sample.counters.node, a.cumulative.gpu, a.cumulative.node,
            a.delta.gpu, a.delta.node, a.late, a.sample.exporter, "kafka", usage_event_id(a.sample.run_id, a.sample.sample_id), recorded_at,
        )
        for a in work.accepted
    ]  # fmt: skip


COPY_TRIES = 3
_COPY_COLUMNS = (
    "run_id", "sample_id", "observed_at", "gpu_milli_hours", "node_milli_hours", "gpu_milli_hours_cumulative", "node_milli_hours_cumulative",
    "gpu_milli_hours_delta", "node_milli_hours_delta", "late", "exporter", "source", "event_id", "recorded_at",
)  # fmt: skip


async def _copy(dsn: str, records: list[tuple[object, ...]]) -> tuple[float, CpuUse]:
    """Seconds to COPY `rows` into the usage table of `dsn` (one transaction, as a bulk load
    does), and the CPU it spent: the best of COPY_TRIES, the table emptied before each. The
    fastest COPY is the baseline, so a slow moment of the machine never flatters the ratio.

    The CPU is the fastest try's, all of it counted: the client that encodes the rows (this
    process, which does nothing else meanwhile) and the server process that writes them. It is
    the reference for the service's CPU per sample, as COPY's rate is for its rate."""
    columns = list(_COPY_COLUMNS)
    conn = await asyncpg.connect(dsn)
    meter = CpuMeter([Part.process("client", os.getpid()), Part("postgres", postgres_dsn=dsn)])
    try:
        best: tuple[float, CpuUse] | None = None
        for _ in range(COPY_TRIES):
            await conn.execute("TRUNCATE usage_records")
            started = await meter.start()
            began = time.perf_counter()
            async with conn.transaction():
                await conn.copy_records_to_table("usage_records", records=records, columns=columns)
            seconds = time.perf_counter() - began
            used = await meter.stop(started)
            if best is None or seconds < best[0]:
                best = seconds, used
        assert best is not None  # COPY_TRIES > 0
        return best
    finally:
        await conn.close()


async def _delete_topics(bootstrap: str, topics: Topics) -> None:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    with contextlib.suppress(Exception):
        await admin.start()
        await admin.delete_topics(topics.all())
    with contextlib.suppress(Exception):
        await admin.close()


async def run(options: Options, *, echo: Callable[[str], None]) -> list[Result]:
    """Run the metering benchmark described by `options`, round after round (each paired with its
    own COPY); progress goes to `echo`."""
    results = []
    for number in range(1, options.rounds + 1):
        prefix = f"[round {number}/{options.rounds}] " if options.rounds > 1 else ""
        results.append(await Run(options, echo=lambda message, prefix=prefix: echo(prefix + message)).execute())
    return results
