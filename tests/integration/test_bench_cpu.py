"""The benchmarks' CPU meter against real processes, a real Postgres and a real Redis: what a part
spent is read over the window only, a part that cannot be read is unknown (None) rather than
zero, and a server process that starts during the window counts from zero. Only lower bounds
on CPU time are asserted (other work on the machine only adds to them)."""

from __future__ import annotations

import os
from collections import namedtuple
import subprocess
import sys
import time

import asyncpg
import psutil
import pytest

from budgetgate.benchmark import cpu
from budgetgate.benchmark.cpu import CpuMeter, CpuUse, Part
from budgetgate.runtime import redis_client


def _burn(seconds: float) -> None:
    """Spend about `seconds` of this process's CPU."""
    end = time.process_time() + seconds
    while time.process_time() < end:
        sum(range(1000))


async def test_a_process_is_read_over_the_window_only() -> None:
    _burn(0.3)  # before the window: not counted
    meter = CpuMeter([Part("me", (os.getpid(),))])

    async def work() -> str:
        _burn(0.2)
        return "done"

    result, used = await meter.measure(work)

    assert result == "done"
    spent = used.parts["me"]
    assert spent is not None and 0.15 <= spent < 0.45
    assert used.seconds >= 0.15 and used.cpus >= 1 and 0.0 <= used.machine_busy <= 1.0


async def test_parts_that_cannot_be_read_are_unknown_not_zero() -> None:
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    meter = CpuMeter([Part("elsewhere", None), Part("ended", (ended.pid,)), Part("no redis", redis_url="redis://127.0.0.1:9/0")])

    _, used = await meter.measure(_nothing)

    assert used.parts == {"elsewhere": None, "ended": None, "no redis": None}
    assert used.per_unit_us(10) == {"elsewhere": None, "ended": None, "no redis": None}
    assert "elsewhere -, ended -, no redis -" in used.line(10, "decision")


async def test_postgres_counts_the_server_processes_of_its_database_including_new_ones(pg_dsn: str) -> None:
    if await cpu._backends(pg_dsn) is None:  # noqa: SLF001
        pytest.skip("the test Postgres is not a server of this machine (a container): its processes cannot be read")
    meter = CpuMeter([Part("postgres", postgres_dsn=pg_dsn)])
    started = await meter.start()
    conn = await asyncpg.connect(pg_dsn)  # its server process starts inside the window
    try:
        await conn.fetchval("SELECT count(*) FROM generate_series(1, 3000000)")
        used = await meter.stop(started)
    finally:
        await conn.close()

    spent = used.parts["postgres"]
    assert spent is not None and spent > 0.05


async def test_the_benchmarks_own_connections_are_not_its_postgres(pg_dsn: str) -> None:
    """A connection the benchmark opens to watch the database while the load runs is not the
    system's: its server process is left out of "postgres"; any other connection is in it."""
    if await cpu._backends(pg_dsn) is None:  # noqa: SLF001
        pytest.skip("the test Postgres is not a server of this machine (a container): its processes cannot be read")
    watching = await cpu.unmetered_connection(pg_dsn)
    working = await asyncpg.connect(pg_dsn)
    try:
        read = await cpu._backends(pg_dsn)  # noqa: SLF001
        assert read is not None
        assert await working.fetchval("SELECT pg_backend_pid()") in read
        assert await watching.fetchval("SELECT pg_backend_pid()") not in read
    finally:
        await watching.close()
        await working.close()


async def test_postgres_writes_are_its_wal_and_the_growth_of_the_database_over_the_window(pg_dsn: str) -> None:
    """10,000 rows of 200 bytes written inside the window: at least their bytes in the WAL and on
    disk (other work on the server only adds to both); nothing after the window counts."""
    conn = await asyncpg.connect(pg_dsn)
    table = f"bench_writes_{os.getpid()}"
    await conn.execute(f"DROP TABLE IF EXISTS {table}; CREATE TABLE {table} (id bigint, pad text)")
    meter = CpuMeter([Part("postgres", postgres_dsn=pg_dsn)])
    try:
        started = await meter.start()
        await conn.execute(f"INSERT INTO {table} SELECT g, repeat('x', 200) FROM generate_series(1, 10000) AS g")
        # The inbox (and the outbox) are pruned after their windows: on disk for a while, not kept.
        await conn.execute("INSERT INTO inbox (consumer, event_id, topic) SELECT 'bench', repeat('e', 200) || g, 't' FROM generate_series(1, 5000) AS g")
        used = await meter.stop(started)
        await conn.execute(f"INSERT INTO {table} SELECT g, repeat('x', 200) FROM generate_series(1, 100000) AS g")  # after: not counted
    finally:
        await conn.execute(f"DROP TABLE {table}")
        await conn.close()

    written = used.postgres_writes
    assert written is not None and written.wal_bytes is not None and written.stored_bytes is not None
    assert written.wal_bytes >= 15_000 * 200 and written.stored_bytes >= 10_000 * 200
    assert written.transient_bytes is not None and written.transient_bytes >= 5_000 * 200
    if await _server_is_quiet(pg_dsn):  # with other tests writing beside it, only the lower bounds hold
        assert written.stored_bytes < 5_000 * 200 + 100_000 * 200
    per_row = used.as_json(10_000)["postgres_bytes_per_unit"]
    assert isinstance(per_row, dict) and per_row["wal"] >= 200 and per_row["stored"] >= 200
    wal, stored, transient = (f"{per_row[k]:,.0f}" for k in ("wal", "stored", "transient"))
    assert f"; Postgres bytes per row: WAL {wal}, stored {stored} (+ {transient} in the outbox and inbox until pruned)" in used.line(10_000, "row")
    # A meter without a Postgres part reads none of it.
    _, none = await CpuMeter([Part.process("me", os.getpid())]).measure(_nothing)
    assert none.postgres_writes is None and "postgres_bytes" not in none.as_json(1) and "bytes per" not in none.line(1, "row")


async def _server_is_quiet(dsn: str) -> bool:
    conn = await asyncpg.connect(dsn)
    try:
        return await conn.fetchval("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()") == 0
    finally:
        await conn.close()


async def test_redis_counts_its_server(redis_server_url: str) -> None:
    client = redis_client.connect(redis_server_url)
    meter = CpuMeter([Part("redis", redis_url=redis_server_url)])

    async def work() -> None:  # about 0.2 s of the server's CPU in one script
        await client.eval("local n = 0 for i = 1, 20000000 do n = n + i end return 0", 0)

    try:
        _, used = await meter.measure(work)
    finally:
        await client.aclose()

    spent = used.parts["redis"]
    assert spent is not None and spent > 0.05


def test_redis_is_one_part_and_a_cluster_one_part_per_node_or_unknown_when_unreachable(redis_server_url: str) -> None:
    # (A reachable cluster, node by node: tests/integration/test_bench_smoke.py.)
    assert cpu.redis_parts(redis_server_url) == [Part("redis", redis_url=redis_server_url)]
    assert cpu.redis_parts("redis+cluster://127.0.0.1:9") == [Part("redis", None)]


def test_figures_per_unit_and_the_report_line() -> None:
    used = CpuUse(seconds=2.0, parts={"service": 0.6, "postgres": 0.3, "broker": None}, machine_busy=0.5, cpus=2)

    assert used.per_unit_us(2000) == {"service": 300.0, "postgres": 150.0, "broker": None}
    assert used.per_unit_us(0) == {"service": None, "postgres": None, "broker": None}
    assert used.line(2000, "decision") == (
        "CPU µs per decision: all parts - (service 300, postgres 150, broker -); machine 50% busy (2 CPUs): bound by waiting, not by CPU"
    )
    assert used.as_json(2000) == {
        "window_seconds": 2.0,
        "cpu_seconds": {"service": 0.6, "postgres": 0.3, "broker": None},
        "us_per_unit": {"service": 300.0, "postgres": 150.0, "broker": None},
        "groups": {},  # one process per service: no replicas to add up
        "group_us_per_unit": {},
        "all_parts_us_per_unit": None,  # the broker's part is unknown, so what a unit costs is too
        "not_in_all_parts": [],
        "machine_busy": 0.5,
        "bound_by_waiting": True,
        "cpus": 2,
        "bound_per_second": None,
    }
    assert used.bound_per_second(2000) is None and used.bound_line(2000, "decision") is None


def test_all_parts_leave_out_what_is_only_shown_beside_them_and_a_busy_machine_is_not_waiting() -> None:
    used = CpuUse(seconds=2.0, parts={"service": 0.6, "postgres": 0.3, "load generator": 0.5}, machine_busy=0.95, cpus=2, apart=frozenset({"load generator"}))

    assert used.all_parts == pytest.approx(0.9) and used.all_parts_us(2000) == 450.0
    assert not used.bound_by_waiting
    assert used.line(2000, "decision") == "CPU µs per decision: all parts 450 (service 300, postgres 150); load generator 250; machine 95% busy (2 CPUs)"
    assert used.bound_per_second(2000) == pytest.approx(2 * 2000 / 0.9)  # the load generator is no part of a unit's cost
    unknown_beside = CpuUse(seconds=1.0, parts={"service": 0.2, "load generator": None}, machine_busy=0.89, cpus=2, apart=frozenset({"load generator"}))
    assert unknown_beside.all_parts_us(1000) == 200.0 and unknown_beside.bound_by_waiting


async def test_the_meter_keeps_a_part_not_counted_apart() -> None:
    meter = CpuMeter([Part.process("me", os.getpid()), Part.process("beside", os.getpid(), counted=False)])

    _, used = await meter.measure(_nothing)

    assert used.apart == frozenset({"beside"})


def test_the_bound_is_what_all_cpus_hold_at_the_measured_cost_of_a_unit() -> None:
    # 2000 decisions cost 0.6 + 0.3 + 0.1 = 1.0 CPU second: 500 µs each, so 2 CPUs hold 4000/s.
    used = CpuUse(seconds=2.0, parts={"service": 0.6, "postgres": 0.3, "redis": 0.1}, machine_busy=0.5, cpus=2)

    assert used.bound_per_second(2000) == pytest.approx(4000.0)
    assert used.as_json(2000)["bound_per_second"] == 4000.0
    assert used.bound_per_second(0) is None
    assert used.bound_line(2000, "decision", against=[("baseline/hot", 1000.0), ("nothing", 0.0), ("the ceiling", 8000.0)]) == (
        "all 2 CPUs, busy with this alone, would hold at most 4000 decisions/s at these costs: "
        "4.00x baseline/hot's measured 1000/s, 0.50x the ceiling's measured 8000/s"
    )
    assert used.bound_line(2000, "decision") == "all 2 CPUs, busy with this alone, would hold at most 4000 decisions/s at these costs"
    idle = CpuUse(seconds=1.0, parts={"service": 0.0}, machine_busy=0.0, cpus=2)
    assert idle.bound_per_second(10) is None  # nothing spent: no bound, not an infinite one


async def _nothing() -> None:
    return None


def test_a_process_that_is_not_the_server_is_not_taken_for_it() -> None:
    me = psutil.Process()
    assert not cpu._is_local_backend(me.pid, me.create_time())  # noqa: SLF001 - not a postgres process
    assert not cpu._is_local_backend(2**22 + 7, 0.0)  # noqa: SLF001 - no such process


def test_busy_share_counts_guest_time_once_as_psutil_does() -> None:
    times = namedtuple("times", "user nice system idle iowait irq softirq steal guest guest_nice")
    before = times(0, 0, 0, 0, 0, 0, 0, 0, 0, 0)
    # 3 s busy (1 of it a guest's, already inside user), 1 s idle: 75 % busy, not 80 %.
    after = times(3, 0, 0, 1, 0, 0, 0, 0, 1, 0)
    assert cpu._busy_share(before, after) == 0.75  # noqa: SLF001
    assert cpu._busy_share(after, after) == 0.0  # noqa: SLF001
