"""One benchmark run: for each scenario and system, a fresh database and service, a warm-up,
the measured load, a retry probe and the correctness check; everything started is stopped and
dropped again, also on Ctrl-C, SIGTERM or an error.

With `rounds` > 1 all of that is done again, round after round, the systems taking turns to go
first, so that budgetgate and the baseline of one round are measured minutes apart at most and
a machine whose speed drifts (a shared one's did by 1.7x within a quarter of an hour) does not
decide the ratio: the report pairs each round's figures and gives the median of the rounds. The
open loop, when asked for, is part of every round too, for every scenario.

Every measured load is also metered for CPU (benchmark.cpu: the service, Postgres, Redis, the
broker, and apart from them the load generator), and budgetgate's stage histogram is read
before and after it (benchmark.breakdown): where a submission's time went.

With `replicas` > 1 every system (and the ceiling) runs as that many processes on the same
database, Redis prefix and topics, driven as one service (benchmark.load: client k on replica
k mod N, the open loop round robin); the CPU meter reads each replica and their sum, the stage
histograms and garbage collection figures are added up over them, the retry probe sends each
run id to another replica than the one that answered it first, and the audit is the same: it
reads the one ledger every replica wrote to."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import asyncpg
import httpx
import redis.exceptions
from aiokafka.errors import KafkaError

from budgetgate.benchmark.session import session
from budgetgate.benchmark import breakdown, databases, load, pauses, wakeups, workload
from budgetgate.benchmark.correctness import Audit, check
from budgetgate.benchmark.cpu import CpuMeter, CpuUse, Part, load_generator
from budgetgate.benchmark.service_processes import StartError, Subprocess, free_port, python_module, tansu_command
from budgetgate.benchmark.systems import Backends, Baseline, Budgetgate, System
from budgetgate.runtime.settings import CommonSettings

SYSTEMS = ("baseline", "budgetgate")
# Failures of the machinery around the measurement: reported as a message, not a traceback.
BENCH_ERRORS: tuple[type[BaseException], ...] = (StartError, OSError, asyncpg.PostgresError, redis.exceptions.RedisError, KafkaError, httpx.HTTPError)


# The load generator runs in the benchmark's own process: its CPU is read with the rest, and
# shown apart from the system's (a deployment does not run it).
LOAD_GENERATOR = load_generator()
# The ceiling is measured this many times; the fastest pass is the one reported.
CEILING_TRIES = 3


@dataclass(frozen=True)
class Options:
    requests: int = 2000
    concurrency: int = 32
    warmup: int = 100
    budgets: int = 100
    allow_fraction: float = 0.8
    scenarios: tuple[str, ...] = workload.DEFAULT_SCENARIOS
    systems: tuple[str, ...] = SYSTEMS
    probe: int = 20  # measured run ids submitted again after the run
    ready_timeout: float = 60.0
    ceiling: bool = True  # also measure a FastAPI endpoint that validates the body, answers a constant
    open_loop_rate: float = 0.0  # > 0: also offer this many submissions/s (open loop) to each system
    open_loop_seconds: float = 30.0
    rounds: int = 1  # every scenario × system (and the ceiling) measured this many times, interleaved
    replicas: int = 1  # processes of each system (and of the ceiling), driven as one service
    ledger_shards: int = 1  # of budgetgate's Redis ledger (BUDGETGATE_LEDGER_SHARDS)

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"replicas must be at least 1, not {self.replicas}")
        if self.concurrency < self.replicas:
            raise ValueError(
                f"concurrency ({self.concurrency}) must be at least replicas ({self.replicas}): "
                "client k drives replica k mod N, so a replica without a client would idle"
            )


@dataclass(frozen=True)
class Replica:
    """One process of a system under test, and the port it serves on."""

    process: Subprocess
    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@dataclass
class RunResult:
    system: str
    scenario: str
    workload: workload.Workload
    outcome: load.Outcome
    audit: Audit
    notes: dict[str, int]
    cpu: CpuUse | None = None  # what each part spent while the measured load ran
    round: int = 1
    collections: pauses.Collections | None = None  # the service's garbage collection, after the measured load
    stages: list[breakdown.Stage] | None = None  # where the measured submissions' time went (budgetgate only)
    replicas: int = 1  # processes of the system, driven as one


@dataclass
class Measurements:
    """Everything one `bench admission` measured; `tag` names its databases (bench_<tag>_…),
    Redis prefixes and topic prefixes (bench-<tag>-…)."""

    tag: str
    results: list[RunResult]
    # Per round, the ceiling's best pass and what it spent.
    ceilings: dict[int, tuple[load.Outcome, CpuUse]] = field(default_factory=dict)
    open_loop: list[RunResult] = field(default_factory=list)
    # With an open loop: what waking an idle Redis and Postgres costs here (wakeups.py).
    wake_ups: wakeups.WakeUps | None = None

    @property
    def ceiling(self) -> load.Outcome | None:
        """The highest ceiling of every round (the one that flatters budgetgate least)."""
        best = self._best_ceiling()
        return best[0] if best else None

    @property
    def ceiling_cpu(self) -> CpuUse | None:
        best = self._best_ceiling()
        return best[1] if best else None

    def _best_ceiling(self) -> tuple[load.Outcome, CpuUse] | None:
        passes = [c for c in self.ceilings.values() if c[0].elapsed]
        return max(passes, key=lambda c: c[0].answered / c[0].elapsed, default=None)

    @property
    def correct(self) -> bool:
        return all(r.audit.ok for r in [*self.results, *self.open_loop])


class Run:
    def __init__(self, options: Options, *, echo: Callable[[str], None]) -> None:
        self.options = options
        self.echo = echo
        self.tag = uuid.uuid4().hex[:8]
        self.settings = CommonSettings()
        self.children: list[Subprocess] = []

    async def execute(self) -> Measurements:
        """Every scenario × system, in that order, then with an open loop rate the open loop of
        every scenario × system, once per round (the systems in the opposite order every other
        round)."""
        options = self.options
        async with session(self.children) as (stack, log_dir):
            backends = await self._backends(stack, log_dir)
            measured = Measurements(self.tag, [])
            works = {scenario: self._workload(scenario, options.requests, "run") for scenario in options.scenarios}
            offered = round(options.open_loop_rate * options.open_loop_seconds)
            opens = {scenario: self._workload(scenario, offered, "open") for scenario in options.scenarios} if options.open_loop_rate > 0 else {}
            if opens:
                measured.wake_ups = await wakeups.measure(backends.redis_url, self.settings.postgres_dsn)
            for number in range(1, options.rounds + 1):
                systems = options.systems if number % 2 else tuple(reversed(options.systems))
                for scenario, work in works.items():
                    if options.ceiling and number not in measured.ceilings:
                        measured.ceilings[number] = await self._ceiling(work, log_dir, number)
                    for name in systems:
                        measured.results.append(await self._measure(self._system(name, backends, f"{scenario}-r{number}"), work, log_dir, number=number))
                for scenario, work in opens.items():
                    for name in systems:
                        system = self._system(name, backends, f"open-{scenario}-r{number}")
                        measured.open_loop.append(await self._measure(system, work, log_dir, rate=options.open_loop_rate, number=number))
            return measured

    def _workload(self, scenario: str, requests: int, kind: str) -> workload.Workload:
        o = self.options
        return workload.build(scenario, requests=requests, warmup=o.warmup, budgets=o.budgets, allow_fraction=o.allow_fraction, tag=f"{self.tag}/{kind}")

    def _system(self, name: str, backends: Backends, label: str) -> System:
        return Budgetgate(backends, tag=f"{self.tag}-{label}", ledger_shards=self.options.ledger_shards) if name == "budgetgate" else Baseline()

    async def _ceiling(self, work: workload.Workload, log_dir: Path, number: int = 1) -> tuple[load.Outcome, CpuUse]:
        """The same load against a FastAPI endpoint that only validates the body: the best of
        CEILING_TRIES passes (one pass varied by 60 % between runs on a shared machine; the
        fastest is the ceiling, so a slow moment never flatters budgetgate's ratio)."""
        async with contextlib.AsyncExitStack() as stack:
            replicas = await self._start_replicas(
                stack, "ceiling", lambda port: (python_module("budgetgate.benchmark.ceiling", "--port", str(port)), {}), log_dir=log_dir, ready_path="/readyz"
            )
            run = self.options
            ports = [replica.port for replica in replicas]
            await load.drive(host="127.0.0.1", ports=ports, bodies=work.warmup, concurrency=run.concurrency)
            meter = CpuMeter([*Part.replicas("service", [replica.process.pid for replica in replicas]), LOAD_GENERATOR])
            best: tuple[load.Outcome, CpuUse] | None = None
            named = "fastapi-ceiling" if run.rounds == 1 else f"fastapi-ceiling round {number}"
            for attempt in range(1, CEILING_TRIES + 1):
                self.echo(f"[{named}] measuring ({attempt}/{CEILING_TRIES}): {len(work.measured)} submissions, {run.concurrency} clients{self._spread}")
                with _collector_quiet():
                    outcome, cpu = await meter.measure(lambda: load.drive(host="127.0.0.1", ports=ports, bodies=work.measured, concurrency=run.concurrency))
                self.echo(f"[{named}] {outcome.answered / outcome.elapsed:.0f} requests/s, {outcome.error_count} errors")
                if best is None or outcome.answered / outcome.elapsed > best[0].answered / best[0].elapsed:
                    best = outcome, cpu
            assert best is not None
            return best

    @property
    def _spread(self) -> str:
        return f" over {self.options.replicas} replicas" if self.options.replicas > 1 else ""

    async def _start_replicas(
        self,
        stack: contextlib.AsyncExitStack,
        name: str,
        command: Callable[[int], tuple[list[str], dict[str, str]]],
        *,
        log_dir: Path,
        ready_path: str,
    ) -> list[Replica]:
        """`options.replicas` processes of `command` (given its port), each on a port of its own,
        started together and stopped by `stack`; returned once every one of them is ready."""
        count = self.options.replicas
        replicas = []
        for number in range(1, count + 1):
            port = free_port()
            argv, env = command(port)
            process = self._start(name if count == 1 else f"{name}-{number}", argv, log_dir=log_dir, env=env)
            stack.push_async_callback(process.stop)
            replicas.append(Replica(process, port))
        await asyncio.gather(*(self._wait_ready(replica.process, replica.port, ready_path) for replica in replicas))
        return replicas

    async def _backends(self, stack: contextlib.AsyncExitStack, log_dir: Path) -> Backends:
        given = os.environ.get("BUDGETGATE_KAFKA_BOOTSTRAP")
        if given:
            return Backends(redis_url=self.settings.redis_url, kafka_bootstrap=given, kafka_is_ours=False)
        port = free_port()
        self.echo(f"starting a Tansu broker on 127.0.0.1:{port} (BUDGETGATE_KAFKA_BOOTSTRAP is unset)")
        broker = self._start("kafka", tansu_command(port), log_dir=log_dir)
        stack.push_async_callback(broker.stop)
        await broker.wait_port(port, timeout=self.options.ready_timeout)
        return Backends(redis_url=self.settings.redis_url, kafka_bootstrap=f"127.0.0.1:{port}", kafka_is_ours=True, broker_pid=broker.pid)

    def _start(self, name: str, command: list[str], *, log_dir: Path, env: dict[str, str] | None = None) -> Subprocess:
        child = Subprocess(name, command, log_dir=log_dir, env=env, cwd=log_dir)
        self.children.append(child)
        return child

    async def _measure(self, system: System, work: workload.Workload, log_dir: Path, *, rate: float = 0.0, number: int = 1) -> RunResult:
        """Closed loop, or with `rate` an open loop offering that many submissions/s; `number`:
        the round it belongs to."""
        label = f"{system.name}/{work.scenario}" + (f" open loop {rate:g}/s" if rate else "") + (f" round {number}" if self.options.rounds > 1 else "")
        server_dsn = self.settings.postgres_dsn
        kind = "open" if rate else "closed"
        database = f"bench_{self.tag}_{system.name}_{work.scenario}_{kind}_r{number}"  # a round's own, as its Redis prefix and service
        async with contextlib.AsyncExitStack() as stack:
            dsn = await databases.create(server_dsn, database)
            stack.push_async_callback(databases.drop, server_dsn, database)
            stack.push_async_callback(system.cleanup)
            await system.prepare(dsn, work)
            name = f"{system.name}-{work.scenario}-r{number}"
            replicas = await self._start_replicas(stack, name, lambda port: system.command(dsn=dsn, port=port), log_dir=log_dir, ready_path=system.ready_path)
            ports = [replica.port for replica in replicas]

            run = self.options
            self.echo(f"[{label}] warm-up: {len(work.warmup)} submissions")
            warm = await load.drive(host="127.0.0.1", ports=ports, bodies=work.warmup, concurrency=run.concurrency, token=system.token)
            meter = CpuMeter([*system.cpu_parts(service_pids=[replica.process.pid for replica in replicas], dsn=dsn), LOAD_GENERATOR])
            urls = [replica.url for replica in replicas]
            timed_before = await breakdown.read_all(urls) if system.reports_stages else None
            with _collector_quiet():
                measured, cpu = await meter.measure(lambda: self._load(system, work, ports, rate=rate, label=label))
            self.echo(f"[{label}] {measured.answered / measured.elapsed:.0f} decisions/s, {measured.error_count} errors")
            timed_after = await breakdown.read_all(urls) if timed_before is not None else None
            timed = breakdown.between(timed_before, timed_after) if timed_before is not None and timed_after is not None else None
            collections = await pauses.observed_all([(replica.url, replica.process.pid) for replica in replicas]) if system.reports_collections else None
            notes = await system.notes(dsn)
            mismatches, probe_errors = await self._probe(system, work, measured, ports)
            await asyncio.gather(*(replica.process.stop() for replica in replicas))  # nothing in flight while the ledger is read
            totals, problems = await system.totals(dsn)
            audit = check(
                totals,
                told_allows=warm.count("ALLOW") + measured.count("ALLOW"),
                expected_allows=work.expected_allows,
                errors=warm.error_count + measured.error_count + probe_errors,
                probe_mismatches=mismatches,
                problems=problems,
            )
            return RunResult(system.name, work.scenario, work, measured, audit, notes, cpu, number, collections, timed, len(replicas))

    async def _probe(self, system: System, work: workload.Workload, measured: load.Outcome, ports: list[int]) -> tuple[int, int]:
        """The first `probe` measured run ids submitted again, each to the replica after the one
        that answered it first (with one replica, the same one): how many got another decision
        than their first, and how many got no answer."""
        again_on: dict[int, list[int]] = {}
        for i in range(min(self.options.probe, len(work.measured))):
            first = measured.served_by[i]
            again_on.setdefault(((first if first is not None else -1) + 1) % len(ports), []).append(i)
        mismatches = errors = 0
        for replica, indices in again_on.items():
            bodies = [work.measured[i] for i in indices]
            probe = await load.drive(host="127.0.0.1", ports=[ports[replica]], bodies=bodies, concurrency=min(self.options.concurrency, 8), token=system.token)
            mismatches += sum(again != measured.decisions[i] for again, i in zip(probe.decisions, indices, strict=True) if measured.decisions[i] is not None)
            errors += probe.error_count
        return mismatches, errors

    async def _load(self, system: System, work: workload.Workload, ports: list[int], *, rate: float, label: str) -> load.Outcome:
        if rate:
            self.echo(f"[{label}] offering {len(work.measured)} submissions at {rate:g}/s{self._spread}, {len(work.budgets)} budget(s)")
            return await load.offer(host="127.0.0.1", ports=ports, bodies=work.measured, rate=rate, token=system.token)
        self.echo(f"[{label}] measuring: {len(work.measured)} submissions, {self.options.concurrency} clients{self._spread}, {len(work.budgets)} budget(s)")
        return await load.drive(host="127.0.0.1", ports=ports, bodies=work.measured, concurrency=self.options.concurrency, token=system.token)

    async def _wait_ready(self, service: Subprocess, port: int, path: str) -> None:
        await service.wait_port(port, timeout=self.options.ready_timeout)
        deadline = time.monotonic() + self.options.ready_timeout
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=5) as client:
            while True:
                service.check_alive()
                response = await client.get(path)
                if response.status_code == 200:
                    return
                if time.monotonic() > deadline:
                    raise StartError(f"{service.name} not ready after {self.options.ready_timeout:.0f}s: {response.text}\n{service.log_tail()}")
                await asyncio.sleep(0.1)


@contextlib.contextmanager
def _collector_quiet() -> Iterator[None]:
    """No garbage collection in the load generator while a load is measured (collected before
    and after): its workloads and results are hundreds of thousands of objects, a full pass
    paused it for 100 ms mid-run, and every submission due meanwhile counted the pause as
    latency of the system measured. What a run leaves for the collector is freed afterwards."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
        gc.collect()


async def run(options: Options, *, echo: Callable[[str], None]) -> Measurements:
    """Run the benchmark described by `options`; progress goes to `echo`."""
    return await Run(options, echo=echo).execute()
