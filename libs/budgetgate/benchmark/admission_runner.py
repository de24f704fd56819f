"""One benchmark run: for each scenario and system, a fresh database and service, a warm-up,
the measured load, a retry probe and the correctness check; everything started is stopped and
dropped again, also on Ctrl-C, SIGTERM or an error.

With `rounds` > 1 all of that is done again, round after round, the systems taking turns to go
first, so that budgetgate and the baseline of one round are measured minutes apart at most and
a machine whose speed drifts (a shared one's did by 1.7x within a quarter of an hour) does not
decide the ratio: the report pairs each round's figures and gives the median of the rounds."""

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
from budgetgate.benchmark import databases, load, pauses, workload
from budgetgate.benchmark.correctness import Audit, check
from budgetgate.benchmark.cpu import CpuMeter, CpuUse, Part
from budgetgate.benchmark.service_processes import StartError, Subprocess, free_port, python_module, tansu_command
from budgetgate.benchmark.systems import Backends, Baseline, Budgetgate, System
from budgetgate.runtime.settings import CommonSettings

SYSTEMS = ("baseline", "budgetgate")
# Failures of the machinery around the measurement: reported as a message, not a traceback.
BENCH_ERRORS: tuple[type[BaseException], ...] = (StartError, OSError, asyncpg.PostgresError, redis.exceptions.RedisError, KafkaError, httpx.HTTPError)


# The load generator runs in the benchmark's own process: its CPU is read with the rest.
LOAD_GENERATOR = Part.process("load generator", os.getpid())
# The ceiling is measured this many times; the fastest pass is the one reported.
CEILING_TRIES = 3


@dataclass(frozen=True)
class Options:
    requests: int = 2000
    concurrency: int = 32
    warmup: int = 100
    budgets: int = 100
    allow_fraction: float = 0.8
    scenarios: tuple[str, ...] = workload.SCENARIOS
    systems: tuple[str, ...] = SYSTEMS
    probe: int = 20  # measured run ids submitted again after the run
    ready_timeout: float = 60.0
    ceiling: bool = True  # also measure a FastAPI endpoint that validates the body, answers a constant
    open_loop_rate: float = 0.0  # > 0: also offer this many submissions/s (open loop) to each system
    open_loop_seconds: float = 30.0
    rounds: int = 1  # every scenario × system (and the ceiling) measured this many times, interleaved


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


@dataclass
class Measurements:
    """Everything one `bench admission` measured; `tag` names its databases (bench_<tag>_…),
    Redis prefixes and topic prefixes (bench-<tag>-…)."""

    tag: str
    results: list[RunResult]
    # Per round, the ceiling's best pass and what it spent.
    ceilings: dict[int, tuple[load.Outcome, CpuUse]] = field(default_factory=dict)
    open_loop: list[RunResult] = field(default_factory=list)

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
        """Every scenario × system, in that order, once per round (the systems in the opposite
        order every other round); then the open loop, once."""
        options = self.options
        async with session(self.children) as (stack, log_dir):
            backends = await self._backends(stack, log_dir)
            measured = Measurements(self.tag, [])
            works = {scenario: self._workload(scenario, options.requests, "run") for scenario in options.scenarios}
            for number in range(1, options.rounds + 1):
                systems = options.systems if number % 2 else tuple(reversed(options.systems))
                for scenario, work in works.items():
                    if options.ceiling and number not in measured.ceilings:
                        measured.ceilings[number] = await self._ceiling(work, log_dir, number)
                    for name in systems:
                        measured.results.append(await self._measure(self._system(name, backends, f"{scenario}-r{number}"), work, log_dir, number=number))
            if options.open_loop_rate > 0:
                work = self._workload("spread", round(options.open_loop_rate * options.open_loop_seconds), "open")
                for name in options.systems:
                    system = self._system(name, backends, "open")
                    measured.open_loop.append(await self._measure(system, work, log_dir, rate=options.open_loop_rate))
            return measured

    def _workload(self, scenario: str, requests: int, kind: str) -> workload.Workload:
        o = self.options
        return workload.build(scenario, requests=requests, warmup=o.warmup, budgets=o.budgets, allow_fraction=o.allow_fraction, tag=f"{self.tag}/{kind}")

    def _system(self, name: str, backends: Backends, label: str) -> System:
        return Budgetgate(backends, tag=f"{self.tag}-{label}") if name == "budgetgate" else Baseline()

    async def _ceiling(self, work: workload.Workload, log_dir: Path, number: int = 1) -> tuple[load.Outcome, CpuUse]:
        """The same load against a FastAPI endpoint that only validates the body: the best of
        CEILING_TRIES passes (one pass varied by 60 % between runs on a shared machine; the
        fastest is the ceiling, so a slow moment never flatters budgetgate's ratio)."""
        port = free_port()
        service = self._start("ceiling", python_module("budgetgate.benchmark.ceiling", "--port", str(port)), log_dir=log_dir)
        try:
            await self._wait_ready(service, port, "/readyz")
            run = self.options
            await load.drive(host="127.0.0.1", port=port, bodies=work.warmup, concurrency=run.concurrency)
            meter = CpuMeter([Part.process("service", service.pid), LOAD_GENERATOR])
            best: tuple[load.Outcome, CpuUse] | None = None
            named = "fastapi-ceiling" if run.rounds == 1 else f"fastapi-ceiling round {number}"
            for attempt in range(1, CEILING_TRIES + 1):
                self.echo(f"[{named}] measuring ({attempt}/{CEILING_TRIES}): {len(work.measured)} submissions, {run.concurrency} clients")
                with _collector_quiet():
                    outcome, cpu = await meter.measure(lambda: load.drive(host="127.0.0.1", port=port, bodies=work.measured, concurrency=run.concurrency))
                self.echo(f"[{named}] {outcome.answered / outcome.elapsed:.0f} requests/s, {outcome.error_count} errors")
                if best is None or outcome.answered / outcome.elapsed > best[0].answered / best[0].elapsed:
                    best = outcome, cpu
            assert best is not None
            return best
        finally:
            await service.stop()

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
        label = f"{system.name}/{work.scenario}" + (f" open loop {rate:g}/s" if rate else f" round {number}" if self.options.rounds > 1 else "")
        server_dsn = self.settings.postgres_dsn
        database = f"bench_{self.tag}_{system.name}_{work.scenario}_r{number}"  # a round's own, as its Redis prefix and service
        async with contextlib.AsyncExitStack() as stack:
            dsn = await databases.create(server_dsn, database)
            stack.push_async_callback(databases.drop, server_dsn, database)
            stack.push_async_callback(system.cleanup)
            await system.prepare(dsn, work)
            port = free_port()
            command, env = system.command(dsn=dsn, port=port)
            service = self._start(f"{system.name}-{work.scenario}-r{number}", command, log_dir=log_dir, env=env)
            stack.push_async_callback(service.stop)
            await self._wait_ready(service, port, system.ready_path)

            run = self.options
            self.echo(f"[{label}] warm-up: {len(work.warmup)} submissions")
            warm = await load.drive(host="127.0.0.1", port=port, bodies=work.warmup, concurrency=run.concurrency, token=system.token)
            meter = CpuMeter([*system.cpu_parts(service_pid=service.pid, dsn=dsn), LOAD_GENERATOR])
            with _collector_quiet():
                measured, cpu = await meter.measure(lambda: self._load(system, work, port, rate=rate, label=label))
            self.echo(f"[{label}] {measured.answered / measured.elapsed:.0f} decisions/s, {measured.error_count} errors")
            collections = await pauses.observed(f"http://127.0.0.1:{port}", service.pid) if system.reports_collections else None
            notes = await system.notes(dsn)
            probe_bodies = work.measured[: run.probe]
            probe = await load.drive(host="127.0.0.1", port=port, bodies=probe_bodies, concurrency=min(run.concurrency, 8), token=system.token)
            mismatches = sum(again != first for again, first in zip(probe.decisions, measured.decisions, strict=False) if first is not None)
            await service.stop()  # nothing in flight while the ledger is read
            totals, problems = await system.totals(dsn)
            audit = check(
                totals,
                told_allows=warm.count("ALLOW") + measured.count("ALLOW"),
                expected_allows=work.expected_allows,
                errors=warm.error_count + measured.error_count + probe.error_count,
                probe_mismatches=mismatches,
                problems=problems,
            )
            return RunResult(system.name, work.scenario, work, measured, audit, notes, cpu, number, collections)

    async def _load(self, system: System, work: workload.Workload, port: int, *, rate: float, label: str) -> load.Outcome:
        if rate:
            self.echo(f"[{label}] offering {len(work.measured)} submissions at {rate:g}/s, {len(work.budgets)} budget(s)")
            return await load.offer(host="127.0.0.1", port=port, bodies=work.measured, rate=rate, token=system.token)
        self.echo(f"[{label}] measuring: {len(work.measured)} submissions, {self.options.concurrency} clients, {len(work.budgets)} budget(s)")
        return await load.drive(host="127.0.0.1", port=port, bodies=work.measured, concurrency=self.options.concurrency, token=system.token)

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
