"""The CPU time each part of a benchmark spends while it is timed: what one decision or one sample
costs the service, Postgres, Redis, the broker and the load generator, and how busy the machine
was. A ratio against a baseline says which is faster on this machine; this says why, and what a
machine running budgetgate needs per unit of work.

Processes are read with psutil, so only those on this machine: a part on another host (a remote
Postgres, Redis or broker) is reported as unknown (None), never as zero. Postgres is the server
processes of the benchmark's own database (pg_stat_activity), read at the start and the end of the
window; a server process that ended in between is missed, one that started counts from zero.
Redis counts its whole server (INFO cpu), which is shared with anything else using it.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import asyncpg
import psutil
import redis.asyncio as aioredis

T = TypeVar("T")


@dataclass(frozen=True)
class CpuUse:
    """CPU seconds per part over a window of `seconds`; None for a part that could not be read."""

    seconds: float
    parts: dict[str, float | None]
    machine_busy: float  # share of all CPUs busy over the window, 0..1
    cpus: int

    def per_unit_us(self, units: int) -> dict[str, float | None]:
        """Microseconds of CPU per unit of work (a decision, a sample), by part."""
        return {name: (None if used is None or units <= 0 else round(used / units * 1e6, 1)) for name, used in self.parts.items()}

    def bound_per_second(self, units: int) -> float | None:
        """The units of work per second this machine's CPUs, every one of them busy with nothing
        else, would hold at the measured cost of a unit (every part's CPU added up): what no way
        of spreading the work over processes or batches can exceed here without making a unit
        cheaper. None when a part could not be read (its cost would be missing)."""
        known = [used for used in self.parts.values() if used is not None]
        if units <= 0 or len(known) < len(self.parts) or sum(known) <= 0:
            return None
        return self.cpus * units / sum(known)

    def as_json(self, units: int) -> dict[str, object]:
        bound = self.bound_per_second(units)
        return {
            "window_seconds": round(self.seconds, 3),
            "cpu_seconds": {k: None if v is None else round(v, 3) for k, v in self.parts.items()},
            "us_per_unit": self.per_unit_us(units),
            "machine_busy": round(self.machine_busy, 3),
            "cpus": self.cpus,
            "bound_per_second": None if bound is None else round(bound, 1),
        }

    def line(self, units: int, unit: str) -> str:
        """`µs of CPU per <unit>: service 330, postgres 150, ...; machine 61% busy (2 CPUs)`."""
        figures = ", ".join(f"{k} {'-' if v is None else f'{v:.0f}'}" for k, v in self.per_unit_us(units).items())
        return f"CPU µs per {unit}: {figures}; machine {self.machine_busy:.0%} busy ({self.cpus} CPUs)"

    def bound_line(self, units: int, unit: str, *, against: Sequence[tuple[str, float]] = ()) -> str | None:
        """`all 2 CPUs, busy with this alone, would hold at most 3100 decisions/s at these costs:
        3.25x baseline/hot's measured 955/s`, or None without a bound; `against`: measured rates
        (name, per second) to hold the bound against."""
        bound = self.bound_per_second(units)
        if bound is None:
            return None
        line = f"all {self.cpus} CPUs, busy with this alone, would hold at most {bound:.0f} {unit}s/s at these costs"
        compared = [f"{bound / rate:.2f}x {name}'s measured {rate:.0f}/s" for name, rate in against if rate > 0]
        return line + (": " + ", ".join(compared) if compared else "")


@dataclass(frozen=True)
class Part:
    """One part to read: processes of this machine by pid (None: not here, so unknown), the
    Postgres server processes of a database, or a whole Redis server."""

    name: str
    pids: tuple[int, ...] | None = None
    postgres_dsn: str | None = None
    redis_url: str | None = None

    @classmethod
    def process(cls, name: str, pid: int | None) -> Part:
        """A process of this machine, or unknown (`pid` None: not started here)."""
        return cls(name, None if pid is None else (pid,))


_Reading = tuple[dict[int, float] | None, float | None]  # (CPU seconds by pid, or a server-wide total)


@dataclass(frozen=True)
class Started:
    """What the parts had spent when a window began."""

    readings: list[_Reading]
    machine: Any  # psutil.cpu_times()
    at: float


@dataclass
class CpuMeter:
    parts: list[Part]

    async def start(self) -> Started:
        return Started([await _read(part) for part in self.parts], psutil.cpu_times(), time.perf_counter())

    async def stop(self, started: Started) -> CpuUse:
        """The CPU each part spent since `started`."""
        seconds = time.perf_counter() - started.at
        after = [await _read(part) for part in self.parts]
        busy = _busy_share(started.machine, psutil.cpu_times())
        used = {part.name: _spent(b, a) for part, b, a in zip(self.parts, started.readings, after, strict=True)}
        return CpuUse(seconds, used, busy, psutil.cpu_count() or 1)

    async def measure(self, work: Callable[[], Awaitable[T]]) -> tuple[T, CpuUse]:
        """Run `work` and return its result with the CPU each part spent meanwhile."""
        started = await self.start()
        result = await work()
        return result, await self.stop(started)


async def _read(part: Part) -> _Reading:
    if part.redis_url is not None:
        return None, await _redis_cpu(part.redis_url)
    if part.postgres_dsn is not None:
        return _cpu_of(await _backends(part.postgres_dsn)), None
    return _cpu_of(part.pids), None


def _spent(before: _Reading, after: _Reading) -> float | None:
    (pids_before, total_before), (pids_after, total_after) = before, after
    if total_after is not None and total_before is not None:  # a server-wide counter
        return max(total_after - total_before, 0.0)
    if pids_after is None:
        return None
    # A process that started during the window counts from zero.
    return sum(max(t - (pids_before or {}).get(pid, 0.0), 0.0) for pid, t in pids_after.items())


def process_seconds(pid: int) -> float | None:
    """user + system CPU seconds of process `pid` so far; None when it is not readable here."""
    found = _cpu_of((pid,))
    return None if found is None else found[pid]


def _cpu_of(pids: Iterable[int] | None) -> dict[int, float] | None:
    """user + system CPU seconds of each pid still alive; None when there is nothing to read
    (no pid known, or none of them on this machine)."""
    if pids is None:
        return None
    found: dict[int, float] = {}
    for pid in pids:
        try:
            times = psutil.Process(pid).cpu_times()
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        found[pid] = times.user + times.system
    return found or None


async def _backends(dsn: str) -> list[int] | None:
    """The pids of the server processes connected to the database of `dsn`, if the server runs
    here: the process serving this very connection must be a local postgres process started when
    the server says it started (a server in a container, behind a tunnel or on another host has
    pids that are not this machine's, or not those)."""
    conn = await asyncpg.connect(dsn)
    try:
        me = await conn.fetchrow("SELECT pid, extract(epoch FROM backend_start)::float8 AS started FROM pg_stat_activity WHERE pid = pg_backend_pid()")
        if me is None or not _is_local_backend(me["pid"], me["started"]):
            return None
        rows = await conn.fetch("SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()")
    finally:
        await conn.close()
    return [r["pid"] for r in rows]


def _is_local_backend(pid: int, started: float) -> bool:
    try:
        process = psutil.Process(pid)
        return "postgres" in process.name() and abs(process.create_time() - started) < 2.0
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return False


async def _redis_cpu(url: str) -> float | None:
    client = aioredis.from_url(url)
    try:
        info: Mapping[str, object] = await client.info("cpu")
    except Exception:  # noqa: BLE001 - an unreadable part is unknown, not a failed benchmark
        return None
    finally:
        await client.aclose()
    try:
        return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])  # type: ignore[arg-type]
    except (KeyError, TypeError, ValueError):
        return None


def _busy_share(before: Any, after: Any) -> float:
    """The share of all CPUs' time that was not idle between two psutil.cpu_times(), as psutil's
    own cpu_percent counts it (guest time is already in user and nice on Linux)."""

    def total(t: Any) -> float:
        return sum(t) - getattr(t, "guest", 0.0) - getattr(t, "guest_nice", 0.0)

    def idle(t: Any) -> float:
        return getattr(t, "idle", 0.0) + getattr(t, "iowait", 0.0)

    spent = total(after) - total(before)
    if spent <= 0:
        return 0.0
    return min(max(1.0 - (idle(after) - idle(before)) / spent, 0.0), 1.0)
