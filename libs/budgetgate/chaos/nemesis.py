"""The nemesis: carries out the planned faults on the cluster, each recorded with when it began
and ended and what exactly was done."""

from __future__ import annotations

import asyncio
import shutil
import time
from collections.abc import Callable
from typing import Any

from budgetgate.chaos.cluster import Cluster
from budgetgate.chaos.recorder import Recorder
from budgetgate.chaos.schedule import Fault


class Nemesis:
    def __init__(self, cluster: Cluster, recorder: Recorder, clock: Callable[[], float], echo: Callable[[str], None]) -> None:
        self.cluster = cluster
        self.recorder = recorder
        self.clock = clock
        self.echo = echo
        self.done: dict[str, int] = {}
        self.skipped: dict[str, str] = {}

    async def run(self, faults: tuple[Fault, ...], started: float) -> None:
        for fault in faults:
            delay = started + fault.at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            await self.inject(fault)

    async def inject(self, fault: Fault) -> None:
        start = self.clock()
        note = ""
        try:
            note = await self._apply(fault)
            outcome = "done"
            self.done[fault.kind] = self.done.get(fault.kind, 0) + 1
        except SkippedFault as exc:
            outcome, note = "skipped", str(exc)
            self.skipped[fault.kind] = note
        except Exception as exc:  # noqa: BLE001 - a failed fault is recorded, and the campaign goes on
            outcome, note = "failed", f"{type(exc).__name__}: {exc}"
        line: dict[str, Any] = {"type": "fault", "index": fault.index, "kind": fault.kind, "target": fault.target, "params": fault.params}
        line.update(start=round(start, 3), end=round(self.clock(), 3), outcome=outcome, note=note)
        self.recorder.write(line)
        self.echo(f"[{start:7.1f}s] fault {fault.kind} {fault.target} ({fault.duration:.1f}s): {outcome} {note}")

    async def _apply(self, fault: Fault) -> str:
        c = self.cluster
        kind, target, duration = fault.kind, fault.target, fault.duration
        if kind == "kill-service":
            c.kill_service(target)
            await asyncio.sleep(duration)
            await c.restart_service(target, skew=c.services[target].skew)
            return f"kill -9, restarted after {duration:.1f}s"
        if kind == "clock-skew":
            if shutil.which("faketime") is None:
                raise SkippedFault("faketime is not installed (apt-get install faketime): clock skew skipped")
            skew = float(fault.params["skew_seconds"])
            await c.restart_service(target, skew=skew)
            await asyncio.sleep(duration)
            await c.restart_service(target, skew=0.0)
            return f"restarted under faketime {skew:+g}s for {duration:.1f}s"
        if kind in ("proxy-cut", "proxy-delay", "proxy-blackhole"):
            proxies = c.proxies_of(target)
            for proxy in proxies:
                if kind == "proxy-cut":
                    proxy.cut()
                elif kind == "proxy-delay":
                    proxy.slow(float(fault.params["delay_ms"]))
                else:
                    proxy.black_hole()
            await asyncio.sleep(duration)
            for proxy in proxies:
                proxy.heal()
            return f"{len(proxies)} link(s) for {duration:.1f}s"
        if kind == "broker-kill":
            c.kill_broker()
            await asyncio.sleep(duration)
            await c.start_broker()
            return f"kill -9, restarted empty after {duration:.1f}s"
        if kind in ("postgres-kill", "postgres-pause"):
            if c.postgres is None:
                raise SkippedFault("the campaign's database is on a shared server (--postgres shared): Postgres is not killed or paused")
            if kind == "postgres-kill":
                await c.kill_postgres()
                await asyncio.sleep(duration)
                await c.start_postgres()
                return f"kill -9 of the server and its backends, restarted (crash recovery) after {duration:.1f}s"
            c.pause_postgres(True)
            await asyncio.sleep(duration)
            c.pause_postgres(False)
            return f"SIGSTOP of the server and its backends for {duration:.1f}s"
        if kind == "broker-pause":
            c.pause_broker(True)
            await asyncio.sleep(duration)
            c.pause_broker(False)
            return f"SIGSTOP for {duration:.1f}s"
        if kind == "marquez-outage":
            outage = str(fault.params["outage"])
            c.sink.outage = outage
            try:
                await asyncio.sleep(duration)
            finally:
                c.sink.outage = None
            return f"the Marquez stand-in down ({'answers 503' if outage == '503' else 'resets every request'}) for {duration:.1f}s"
        if kind == "redis-kill":
            await c.redis.kill_primary()
            await asyncio.sleep(duration)
            await c.redis.restart_primary()
            return f"primary kill -9, back empty after {duration:.1f}s"
        if kind == "redis-flushall":
            await c.redis.flushall()
            return "FLUSHALL on the primary"
        if kind == "redis-old-snapshot":
            now = self.clock()
            older = [s for s in c.redis.snapshots if s[0] < now - 5.0]
            if not older:
                raise SkippedFault("no snapshot older than 5 s yet")
            at, path = older[-1]
            await c.redis.kill_primary(keep=path)
            await asyncio.sleep(duration)
            await c.redis.restart_primary()
            return f"primary restarted from the snapshot of t={at:.1f}s ({now - at:.1f}s old)"
        if kind == "redis-failover":
            note = await c.redis.fail_over(float(fault.params["replica_lag_seconds"]))
            c.redirect_redis()
            await asyncio.sleep(duration)
            await c.redis.restart_replica()
            return f"lagging replica promoted ({note}); old primary back as its replica"
        raise ValueError(f"unknown fault kind {kind!r}")


class SkippedFault(RuntimeError):
    """A fault that cannot be injected here; the reason is recorded with it."""
