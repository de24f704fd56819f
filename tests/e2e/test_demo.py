"""`budgetgate demo`: on a stack of its own, the same output on every run, and never the bundle of
a stack it did not start."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import asyncpg

from budgetgate.cli.demo import MIX, _relative_times
from budgetgate.ledger.queries import sql
from tests.support.admission import apply_policies, budget_yaml


def demo(cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "BUDGETGATE_HOME"}
    return subprocess.run([sys.executable, "-m", "budgetgate.cli.main", "demo"], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


async def active_sha(dsn: str) -> str:
    conn = await asyncpg.connect(dsn)
    try:
        return (await conn.fetchrow(sql("active_bundle")))["git_sha"]
    finally:
        await conn.close()


def test_workloads_have_distinct_names() -> None:
    assert len({w.what for w in MIX}) == len(MIX)


async def test_demo_runs_on_its_own_stack_and_prints_the_same_every_time(tmp_path: Path, pg_dsn: str) -> None:
    # Someone's stack is recorded here: the demo must leave its bundle alone.
    await apply_policies(pg_dsn, {"mine.yaml": budget_yaml("mine")}, sha="m" * 40)
    (tmp_path / ".budgetgate").mkdir()
    (tmp_path / ".budgetgate" / "dev.json").write_text(json.dumps({"settings": {"postgres_dsn": pg_dsn}, "processes": [], "complete": True}))
    first = demo(tmp_path)
    assert first.returncode == 0, first.stderr
    second = demo(tmp_path)
    assert second.returncode == 0, second.stderr
    assert first.stdout == second.stdout
    assert "research experiment 2, resubmitted smaller" in first.stdout
    # The runs' samples are charged (metering-ingest's usage bound covers the demo's compressed
    # hours), so every reservation became actuals and the chargeback holds them.
    assert "reservations are still held" not in first.stdout
    assert "limit 120 -> 160 GPU-hours this window" in first.stdout and "research experiment 3, after the grant (4xh100 12h): ALLOW" in first.stdout
    [total] = [line.split() for line in first.stdout.splitlines() if line.startswith("total (each run once)")]
    assert float(total[4]) > 0 and float(total[-1]) == 0, total  # metered GPU-hours, nothing left reserved
    assert await active_sha(pg_dsn) == "m" * 40


def test_reasons_print_run_relative_instants_as_distances_and_window_starts_as_they_are() -> None:
    reason = "room at 2026-11-29T07:00:12Z; window resets 2026-11-30T00:00:00Z, in Berlin 2026-11-29T23:00:00Z"
    bounds = ["2026-11-29T00:00:00Z", "2026-11-30T00:00:00Z", "2026-11-29T23:00:00Z"]  # the decision's windows'
    # A window's start stays an instant: as a distance it would change with the minute the demo runs in.
    tail = "; window resets 2026-11-30T00:00:00Z, in Berlin 2026-11-29T23:00:00Z"
    assert _relative_times(reason, "2026-11-29T06:46:30Z", bounds) == "room at decision time + 0h14m" + tail
    assert _relative_times(reason, "2026-11-29T06:47:10Z", bounds) == "room at decision time + 0h13m" + tail
    # An hour after a decision in the last second of 09:59, rounded up to a whole second, is on the
    # hour: a distance all the same (CI printed it as an instant once, and the two runs differed).
    late = "Resubmit at or after 2026-11-30T11:00:00Z."
    assert _relative_times(late, "2026-11-30T09:59:59.613Z", bounds) == "Resubmit at or after decision time + 1h00m."
