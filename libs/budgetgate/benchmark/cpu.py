"""The CPU time each part of a benchmark spends while it is timed: what one decision or one sample
costs the service, Postgres, Redis, the broker and the load generator, and how busy the machine
was. A ratio against a baseline says which is faster on this machine; this says why, and what a
machine running budgetgate needs per unit of work.

Processes are read with psutil, so only those on this machine: a part on another host (a remote
Postgres, Redis or broker) is reported as unknown (None), never as zero. Postgres is the server
processes of the benchmark's own database (pg_stat_activity), read at the start and the end of the
window; a server process that ended in between is missed, one that started counts from zero; the
benchmark's own connections that watch the database meanwhile (application_name `UNMETERED`) are
left out, as the load generator is.
Redis counts its whole server (INFO cpu), which is shared with anything else using it; a Redis
Cluster (a `redis+cluster://` URL) is one part per node, masters and replicas, each read on its
own (`redis_parts`), named `redis-<port>`, which the capacity model adds up as Redis.

Beside the CPU, the meter reads what Postgres wrote over the window (`PostgresWrites`): the WAL
the server wrote (pg_current_wal_lsn, so every database of the server, checkpoints' full-page
images included) and how much the benchmark's database grew on disk (pg_database_size: tables,
indexes and TOAST, in whole pages), split into what is kept (until its month is archived) and
what is transient: the outbox and the inbox (`TRANSIENT`), whose rows are deleted after their
replay and dedup windows and whose space Postgres then reuses. Per unit of work, they are the
write rate and the storage a platform's Postgres needs.

"All parts" is what the system measured spends: every part but those read only to be shown
beside it (`Part.counted` False: the load generator, which a real deployment does not run).
Replicas of one service are parts of their own ("service 1", "service 2") and, added up, a group
("service"): each replica's share is shown, and their sum, but each is counted once. A
window in which the machine was less than `WAITING_BELOW` busy was bound by waiting (on a round
trip, a timer, a lock, an fsync), not by CPU: more work could have been done in it, so its rate
says less about the design than its CPU per unit does.
"""

from __future__ import annotations

import os
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import asyncpg
import psutil
import redis.asyncio as aioredis
import redis.exceptions

from budgetgate.runtime.redis_client import cluster_node_url, connect_sync

T = TypeVar("T")

# Below this share of all CPUs busy, a window is reported as bound by waiting, not by CPU.
WAITING_BELOW = 0.9
# The application_name of a benchmark's own connections to the database it meters (polling for
# progress while the load runs): their server processes are not the system's, so not in "postgres".
UNMETERED = "budgetgate-bench"


@dataclass(frozen=True)
class CpuUse:
    """CPU seconds per part over a window of `seconds`; None for a part that could not be read."""

    seconds: float
    parts: dict[str, float | None]
    machine_busy: float  # share of all CPUs busy over the window, 0..1
    cpus: int
    apart: frozenset[str] = frozenset()  # parts shown but not counted in all parts (Part.counted)
    groups: dict[str, tuple[str, ...]] = field(default_factory=dict)  # a group's name: its parts (Part.group), the replicas of a service
    postgres_writes: PostgresWrites | None = None  # what the Postgres part wrote (None: no Postgres part)

    def per_unit_us(self, units: int) -> dict[str, float | None]:
        """Microseconds of CPU per unit of work (a decision, a sample), by part."""
        return {name: _per_unit_us(used, units) for name, used in self.parts.items()}

    def group_seconds(self) -> dict[str, float | None]:
        """CPU seconds of each group, its parts added up; None when one of them could not be read."""
        return {name: _sum([self.parts[member] for member in members]) for name, members in self.groups.items()}

    def group_us(self, units: int) -> dict[str, float | None]:
        """Microseconds of CPU per unit of work of each group (the replicas of a service, together)."""
        return {name: _per_unit_us(used, units) for name, used in self.group_seconds().items()}

    @property
    def all_parts(self) -> float | None:
        """CPU seconds of every counted part added up; None when one of them could not be read
        (its share would be missing)."""
        return _sum([used for name, used in self.parts.items() if name not in self.apart])

    def all_parts_us(self, units: int) -> float | None:
        """Microseconds of CPU per unit of work, every counted part added up."""
        spent = self.all_parts
        return None if spent is None or units <= 0 else round(spent / units * 1e6, 1)

    @property
    def bound_by_waiting(self) -> bool:
        """Whether the machine was less than WAITING_BELOW busy over the window."""
        return self.machine_busy < WAITING_BELOW

    def bound_per_second(self, units: int) -> float | None:
        """The units of work per second this machine's CPUs, every one of them busy with nothing
        else, would hold at the measured cost of a unit (all parts): what no way of spreading
        the work over processes or batches can exceed here without making a unit cheaper. None
        when a part could not be read (its cost would be missing)."""
        spent = self.all_parts
        if units <= 0 or spent is None or spent <= 0:
            return None
        return self.cpus * units / spent

    def as_json(self, units: int) -> dict[str, object]:
        bound = self.bound_per_second(units)
        return {
            "window_seconds": round(self.seconds, 3),
            "cpu_seconds": {k: None if v is None else round(v, 3) for k, v in self.parts.items()},
            "us_per_unit": self.per_unit_us(units),
            "groups": {name: list(members) for name, members in self.groups.items()},
            "group_us_per_unit": self.group_us(units),
            "all_parts_us_per_unit": self.all_parts_us(units),
            "not_in_all_parts": sorted(self.apart),
            "machine_busy": round(self.machine_busy, 3),
            "bound_by_waiting": self.bound_by_waiting,
            "cpus": self.cpus,
            "bound_per_second": None if bound is None else round(bound, 1),
            **({} if self.postgres_writes is None else self.postgres_writes.as_json(units)),
        }

    def line(self, units: int, unit: str) -> str:
        """`CPU µs per <unit>: all parts 520 (service 330, postgres 150, redis 40); load generator
        80; machine 61% busy (2 CPUs): bound by waiting, not by CPU`; replicas as `service 330 =
        service 1 160 + service 2 170`."""
        each = self.per_unit_us(units)
        counted = parts_text(each, self.groups, self.group_us(units), apart=self.apart)
        shown = "".join(f"; {k} {_us(v)}" for k, v in each.items() if k in self.apart)
        machine = f"machine {self.machine_busy:.0%} busy ({self.cpus} CPUs)" + (": bound by waiting, not by CPU" if self.bound_by_waiting else "")
        written = "" if self.postgres_writes is None else f"; Postgres {self.postgres_writes.text(units, unit)}"
        return f"CPU µs per {unit}: all parts {_us(self.all_parts_us(units))} ({counted}){shown}; {machine}{written}"

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
class PostgresWrites:
    """What the Postgres server wrote over a window: `wal_bytes` of WAL (the server's, every
    database), and how much the benchmark's database grew on disk: `stored_bytes` in the tables
    it keeps, `transient_bytes` in the outbox and the inbox (pruned after their windows); None
    for a figure that could not be read (WAL on a standby)."""

    wal_bytes: int | None
    stored_bytes: int | None
    transient_bytes: int | None = None

    def _figures(self) -> dict[str, int | None]:
        return {"wal": self.wal_bytes, "stored": self.stored_bytes, "transient": self.transient_bytes}

    def per_unit(self, units: int) -> dict[str, float | None]:
        """Bytes per unit of work: `wal` written, `stored` more on disk to keep, `transient` more
        on disk until pruned."""
        return {name: None if spent is None or units <= 0 else round(spent / units, 1) for name, spent in self._figures().items()}

    def as_json(self, units: int) -> dict[str, object]:
        return {"postgres_bytes": self._figures(), "postgres_bytes_per_unit": self.per_unit(units)}

    def text(self, units: int, unit: str) -> str:
        """`bytes per decision: WAL 7,300, stored 4,100 (+ 2,200 in the outbox and inbox until pruned)`."""
        wal, stored, transient = self.per_unit(units).values()
        return f"bytes per {unit}: WAL {_bytes(wal)}, stored {_bytes(stored)} (+ {_bytes(transient)} in the outbox and inbox until pruned)"


def parts_text(each: Mapping[str, float | None], groups: Mapping[str, Sequence[str]], sums: Mapping[str, float | None], *, apart: Iterable[str] = ()) -> str:
    """`service 330 = service 1 160 + service 2 170, postgres 150, redis 40`: the parts not
    `apart` in order, the members of a group as one figure, its sum (`sums`) and theirs."""
    group_of = {member: name for name, members in groups.items() for member in members}
    left_out = set(apart)
    figures = []
    for name, used in each.items():
        group = group_of.get(name)
        if name in left_out:
            continue
        if group is None:
            figures.append(f"{name} {_us(used)}")
        elif name == groups[group][0]:
            figures.append(f"{group} {_us(sums.get(group))} = " + " + ".join(f"{member} {_us(each.get(member))}" for member in groups[group]))
    return ", ".join(figures)


def _bytes(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


def _us(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def _per_unit_us(used: float | None, units: int) -> float | None:
    return None if used is None or units <= 0 else round(used / units * 1e6, 1)


def _sum(values: Sequence[float | None]) -> float | None:
    """The sum, or None when there is nothing to add or one of them is unknown."""
    if not values or any(v is None for v in values):
        return None
    return sum(v for v in values if v is not None)


@dataclass(frozen=True)
class Part:
    """One part to read: processes of this machine by pid (None: not here, so unknown), the
    Postgres server processes of a database, or a whole Redis server. `counted`: whether it is
    part of the system measured (all parts), or only shown beside it (the load generator).
    `group`: the name its figure is also added up under with the other parts of that group (the
    replicas of one service)."""

    name: str
    pids: tuple[int, ...] | None = None
    postgres_dsn: str | None = None
    redis_url: str | None = None
    counted: bool = True
    group: str | None = None

    @classmethod
    def process(cls, name: str, pid: int | None, *, counted: bool = True, group: str | None = None) -> Part:
        """A process of this machine, or unknown (`pid` None: not started here)."""
        return cls(name, None if pid is None else (pid,), counted=counted, group=group)

    @classmethod
    def replicas(cls, name: str, pids: Sequence[int]) -> list[Part]:
        """The processes of one service: one is the part `name`; several are `name 1` … `name N`,
        in group `name`."""
        if len(pids) == 1:
            return [cls.process(name, pids[0])]
        return [cls.process(replica_name(name, number), pid, group=name) for number, pid in enumerate(pids, 1)]


def redis_parts(url: str) -> list[Part]:
    """The Redis part of a benchmark: the server of `url`, or, for a Redis Cluster URL, each of
    its nodes (found from the one the URL names; a node that cannot be asked is left out, and
    the cluster that cannot be reached at all is one unknown part)."""
    node = cluster_node_url(url)
    if node is None:
        return [Part("redis", redis_url=url)]
    try:
        client = connect_sync(url)
        try:
            nodes = sorted((n.host, n.port) for n in client.get_nodes())  # type: ignore[attr-defined]
        finally:
            client.close()
    except (redis.exceptions.RedisError, redis.exceptions.RedisClusterException):
        return [Part("redis", None)]
    scheme = node.partition("://")[0]
    return [Part(f"redis-{port}", redis_url=f"{scheme}://{host}:{port}") for host, port in nodes]


def load_generator() -> Part:
    """The benchmark's own process (it generates the load): shown beside the system, not counted."""
    return Part.process("load generator", os.getpid(), counted=False)


async def unmetered_connection(dsn: str) -> asyncpg.Connection:
    """A connection of the benchmark's own to the database it meters, left out of its "postgres"."""
    return await asyncpg.connect(dsn, server_settings={"application_name": UNMETERED})


def replica_name(name: str, number: int) -> str:
    """What replica `number` (from 1) of service `name` is called in the figures."""
    return f"{name} {number}"


_Reading = tuple[dict[int, float] | None, float | None]  # (CPU seconds by pid, or a server-wide total)


@dataclass(frozen=True)
class Started:
    """What the parts had spent when a window began."""

    readings: list[_Reading]
    machine: Any  # psutil.cpu_times()
    at: float
    postgres: tuple[int | None, int | None, int | None] | None = None  # (WAL position, database size, transient tables' size) of the Postgres part


@dataclass
class CpuMeter:
    parts: list[Part]

    @property
    def _postgres_dsn(self) -> str | None:
        return next((part.postgres_dsn for part in self.parts if part.postgres_dsn is not None), None)

    async def start(self) -> Started:
        dsn = self._postgres_dsn
        postgres = None if dsn is None else await _postgres_position(dsn)
        return Started([await _read(part) for part in self.parts], psutil.cpu_times(), time.perf_counter(), postgres)

    async def stop(self, started: Started) -> CpuUse:
        """The CPU each part spent since `started`."""
        seconds = time.perf_counter() - started.at
        after = [await _read(part) for part in self.parts]
        busy = _busy_share(started.machine, psutil.cpu_times())
        dsn = self._postgres_dsn
        writes = None
        if dsn is not None and started.postgres is not None:
            (wal_before, size_before, transient_before), (wal_after, size_after, transient_after) = started.postgres, await _postgres_position(dsn)
            transient = _grown(transient_before, transient_after)
            grown = _grown(size_before, size_after)
            writes = PostgresWrites(_grown(wal_before, wal_after), None if grown is None or transient is None else max(grown - transient, 0), transient)
        used = {part.name: _spent(b, a) for part, b, a in zip(self.parts, started.readings, after, strict=True)}
        apart = frozenset(part.name for part in self.parts if not part.counted)
        groups: dict[str, tuple[str, ...]] = {}
        for part in self.parts:
            if part.group is not None:
                groups[part.group] = (*groups.get(part.group, ()), part.name)
        return CpuUse(seconds, used, busy, psutil.cpu_count() or 1, apart, groups, writes)

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


def _grown(before: int | None, after: int | None) -> int | None:
    return None if before is None or after is None else max(after - before, 0)


async def _postgres_position(dsn: str) -> tuple[int | None, int | None, int | None]:
    """(the server's WAL position in bytes, the database's size in bytes, the size of its
    transient tables); None for what cannot be read (a standby has no current WAL position).
    Read on a connection left out of the CPU."""
    conn = await unmetered_connection(dsn)
    try:
        size, transient = await conn.fetchrow(_SIZES, list(TRANSIENT))
        try:
            wal = await conn.fetchval("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::bigint")
        except asyncpg.PostgresError:
            wal = None
    finally:
        await conn.close()
    return wal, size, transient


# Tables whose rows are deleted after a window (the outbox's replay window, the inbox's dedup
# window), with their partitions: what they hold is on disk for a while, not kept.
TRANSIENT = ("outbox", "inbox")
_SIZES = """
SELECT pg_database_size(current_database()),
       coalesce(sum(pg_total_relation_size(c.oid)), 0)::bigint
FROM pg_class c
WHERE c.relnamespace = 'public'::regnamespace AND c.relkind = 'r'
  AND (c.relname = ANY($1::text[])
       OR EXISTS (SELECT 1 FROM pg_inherits i JOIN pg_class p ON p.oid = i.inhparent WHERE i.inhrelid = c.oid AND p.relname = ANY($1::text[])))
"""


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
        rows = await conn.fetch(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid() AND application_name IS DISTINCT FROM $1",
            UNMETERED,
        )
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
