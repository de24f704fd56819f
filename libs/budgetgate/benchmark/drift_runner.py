"""`budgetgate bench drift`: admission latency with the reconciler's drift check running
back to back, and without it (A/B), on a ledger holding many reservations.

A fresh database gets `budgets` team budgets and a real admission service (subprocess) admits
`held` runs that stay held. Then for `duration` seconds per phase, submissions go out open loop
at `rate` per second (each admitted and held too), first with the drift check (repairing, as the
reconciler runs it) looping back to back in this process, then without. Reported: admission
latency p50/p99/max per phase and the p99 ratio, and each phase's CPU per submission
(budgetgate.benchmark.cpu): the admission service, Postgres, Redis and the broker, and, shown
apart, this process, which generates the load and, in the 'on' phase, runs the drift check, so
the phases' difference in it, in Postgres and in Redis is what the check costs; the ledger audit
checks that Redis equals Postgres at the end (exit 1 when it does not).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import asyncpg
import httpx
import redis.asyncio as aioredis

from budgetgate.benchmark import databases
from budgetgate.benchmark.cpu import CpuMeter, CpuUse, Part, redis_parts
from budgetgate.benchmark.service_processes import free_port, python_module
from budgetgate.benchmark.reconciliation_runner import Bench, Options
from budgetgate.benchmark.credentials import SERVICE_ENV, bearer, bench_token
from budgetgate.ledger.migrations import migrate_dsn
from budgetgate.ledger.redis_ledger import RedisLedger
from budgetgate.ledger.redis_sync import LedgerSync
from budgetgate.messaging.topic_admin import ensure_topics


CHECK_GRACE_S = 60.0  # how long the check in progress when a phase's load ends may take to finish


@dataclass(frozen=True)
class DriftOptions:
    held: int = 3000
    rate: float = 40.0
    duration: float = 20.0
    budgets: int = 50


@dataclass
class DriftReport:
    options: DriftOptions
    latencies_ms: dict[str, list[float]] = field(repr=False)
    checks: int
    ledger_ok: bool
    ledger_note: str
    cpu: dict[str, CpuUse | None] = field(default_factory=dict)  # per phase, over its load

    def percentile(self, phase: str, q: float) -> float:
        ordered = sorted(self.latencies_ms[phase])
        return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))] if ordered else float("nan")

    def as_json(self) -> dict[str, object]:
        phases = {
            p: {
                "requests": len(v),
                "p50_ms": round(self.percentile(p, 0.5), 1),
                "p99_ms": round(self.percentile(p, 0.99), 1),
                "max_ms": round(max(v, default=float("nan")), 1),
            }
            for p, v in self.latencies_ms.items()
        }
        return {
            "options": asdict(self.options),
            "admission_latency": phases,
            "p99_ratio_on_to_off": round(self.percentile("on", 0.99) / self.percentile("off", 0.99), 2),
            "drift_checks": self.checks,
            "ledger_ok": self.ledger_ok,
            "ledger": self.ledger_note,
            "cpu": {p: (used.as_json(len(self.latencies_ms[p])) if used else None) for p, used in self.cpu.items()},
        }

    def as_text(self) -> str:
        o = self.options
        lines = [f"load: {o.rate:g} submissions/s for {o.duration:g} s per phase, {o.held} reservations held beforehand, {o.budgets} budgets"]
        for phase in ("on", "off"):
            v = self.latencies_ms[phase]
            lines.append(
                f"drift check {phase:>3}: {len(v)} submissions, latency p50 {self.percentile(phase, 0.5):.1f} ms, p99 "
                f"{self.percentile(phase, 0.99):.1f} ms, max {max(v, default=float('nan')):.1f} ms"
            )
            used = self.cpu.get(phase)
            if used is not None:
                lines.append(f"  {used.line(len(v), 'submission')}")
        ratio = self.percentile("on", 0.99) / self.percentile("off", 0.99)
        lines.append(f"p99 ratio on/off: {ratio:.2f}; drift checks completed in 'on' (with the one its load's end found running): {self.checks}")
        lines.append(f"ledger: {'OK' if self.ledger_ok else 'WRONG'} - {self.ledger_note}")
        return "\n".join(lines)


class DriftBench(Bench):
    def __init__(self, options: DriftOptions, *, echo: Callable[[str], None]) -> None:
        self.token = ""  # the benchmark's API token, made in its database
        super().__init__(Options(budgets=options.budgets), echo=echo)
        self.drift = options
        self.count = 0
        self._checks = 0
        self._stop_checking = asyncio.Event()

    async def run_ab(self) -> DriftReport:
        log_dir = Path(tempfile.mkdtemp(prefix=f"budgetgate-bench-{self.tag}-"))
        database = f"bench_{self.tag}_drift"
        dsn = await databases.create(self.settings.postgres_dsn, database)
        prefix, topic_prefix = f"bench-{self.tag}", f"bench-{self.tag}-"
        redis = aioredis.from_url(self.settings.redis_url)
        pool = await asyncpg.create_pool(dsn, min_size=1, max_size=2)
        try:
            bootstrap = await self._kafka(log_dir)
            await migrate_dsn(dsn)
            await self._apply(dsn)
            self.token = await bench_token(dsn)
            await ensure_topics(bootstrap, prefix=topic_prefix)
            env = {
                "BUDGETGATE_POSTGRES_DSN": dsn,
                "BUDGETGATE_REDIS_URL": self.settings.redis_url,
                "BUDGETGATE_REDIS_PREFIX": prefix,
                "BUDGETGATE_KAFKA_BOOTSTRAP": bootstrap,
                "BUDGETGATE_TOPIC_PREFIX": topic_prefix,
                **SERVICE_ENV,
            }
            port = free_port()
            admission = self._start("admission", python_module("budgetgate.services.admission", "--port", str(port)), log_dir, env)
            await admission.wait_port(port, timeout=60)
            sync = LedgerSync(pool, RedisLedger(redis, prefix=prefix))
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30, headers=bearer(self.token)) as client:
                await self._ready(client)
                self.echo(f"admitting {self.drift.held} runs that stay held …")
                gate = asyncio.Semaphore(16)

                async def held() -> None:
                    async with gate:
                        await self._submit(client)

                await asyncio.gather(*(held() for _ in range(self.drift.held)))
                latencies, checks, cpu = {}, 0, {}
                meter = CpuMeter(
                    [
                        Part.process("service", admission.pid),
                        Part("postgres", postgres_dsn=dsn),
                        *redis_parts(self.settings.redis_url),
                        Part.process("broker", self.broker_pid),
                        Part.process("load generator and drift check", os.getpid(), counted=False),
                    ]
                )
                for phase in ("on", "off"):
                    self.echo(f"measuring admission with the drift check {phase} …")
                    metered = await meter.start()
                    checker = asyncio.create_task(self._check_forever(sync)) if phase == "on" else None
                    latencies[phase] = await self._load(client)
                    if checker is not None:
                        self._stop_checking.set()
                        await finish_checking(checker, done=lambda: self._checks)
                        checks = self._checks
                    cpu[phase] = await meter.stop(metered)
            drift = await sync.check_drift(repair=False)
            ok = drift is not None and drift.clean
            return DriftReport(self.drift, latencies, checks, ok, "Redis equals Postgres" if ok else f"Redis differs from Postgres: {drift}", cpu)
        finally:
            for child in reversed(self.children):
                await child.stop()
            await pool.close()
            with contextlib.suppress(Exception):
                await databases.drop(self.settings.postgres_dsn, database)
            with contextlib.suppress(Exception):
                keys = [k async for k in redis.scan_iter(match=f"{{{prefix}}}:*", count=1000)]
                for start in range(0, len(keys), 500):
                    await redis.delete(*keys[start : start + 500])
            await redis.aclose()
            shutil.rmtree(log_dir, ignore_errors=True)

    async def _ready(self, client: httpx.AsyncClient) -> None:
        deadline = time.monotonic() + 60
        while (await client.get("/readyz")).status_code != 200:
            if time.monotonic() > deadline:
                raise RuntimeError("admission did not become ready")
            await asyncio.sleep(0.2)

    async def _submit(self, client: httpx.AsyncClient) -> float:
        self.count += 1
        team = self.count % self.drift.budgets
        body = {
            "run_id": f"bench/{self.tag}/{self.count}",
            "namespace": f"team-{team}",
            "labels": {"team": f"t{team}"},
            "resources": {"gpus": 1},
            "projected_runtime_hours": 1.0,
        }
        began = time.monotonic()
        answer = await client.post("/v1/admissions", json=body)
        if answer.status_code != 200 or answer.json()["decision"] != "ALLOW":
            raise RuntimeError(f"submission refused: {answer.status_code} {answer.text[:200]}")
        return (time.monotonic() - began) * 1000

    async def _load(self, client: httpx.AsyncClient) -> list[float]:
        total = int(self.drift.rate * self.drift.duration)
        began = time.monotonic()

        async def one(i: int) -> float:
            await asyncio.sleep(max(0.0, began + i / self.drift.rate - time.monotonic()))
            return await self._submit(client)

        return list(await asyncio.gather(*(one(i) for i in range(total))))

    async def _check_forever(self, sync: LedgerSync) -> None:
        self._checks = 0
        while not self._stop_checking.is_set():
            await sync.check_drift(repair=True)
            self._checks += 1


async def finish_checking(checker: asyncio.Task[None], *, done: Callable[[], int], grace: float = CHECK_GRACE_S) -> None:
    """End the drift check loop `checker`, already told to stop: the check in progress is let
    finish (within `grace` s), so a phase shorter than one check still counts the one it ran, and
    a check that raised fails the benchmark instead of reading as none done (a CI run once
    reported 0 checks in a 2 s phase; which of the two it was, its output did not say). Cancelled
    after `grace`: under Python 3.11 a cancellation can be lost inside the clients' own timeouts
    (asyncio.wait_for, which asyncpg uses, loses one that comes as the awaited call completes),
    and the loop ends on the stop either way. `done()`: the checks completed, for the message."""
    await asyncio.wait({checker}, timeout=grace)
    checker.cancel()
    [ended] = await asyncio.gather(checker, return_exceptions=True)
    if isinstance(ended, Exception):  # (a cancellation is not one)
        raise RuntimeError(f"the drift check failed after {done()} check(s): {ended!r}") from ended


async def run(options: DriftOptions, *, echo: Callable[[str], None]) -> DriftReport:
    return await DriftBench(options, echo=echo).run_ab()
