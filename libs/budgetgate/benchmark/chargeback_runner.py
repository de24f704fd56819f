"""`budgetgate bench report`: the chargeback report over a month of metered usage.

A fresh database is filled (generate_series in Postgres, not timed) with `records` usage records
over October 2026: `runs` runs (`records / runs` samples each, seven minutes apart) spread over
50 tenants, 1,000 users, three flavors and two regions, each with its decision, its metered
high-water mark, and reservations on its tenant's budget and one of five cost-center budgets
(the last 5 % of runs still hold theirs). Then the report for the month is timed in a few
groupings, and for its first week, `rounds` times each (the median is the figure), exactly as the command and the API
make it, and the main query's plan is read with EXPLAIN (ANALYZE, BUFFERS). The CPU the timed
reports took (this process, which runs the command's code, and the Postgres server process of
its connection; budgetgate.benchmark.cpu) is given per thousand usage records of the month per
report (a record costs less than a microsecond): the first-week grouping reads about a quarter
of them, so it is the average over the groupings.
There is no reference system: the report is a query and its rendering, with nothing to pit it
against but its own plan."""

from __future__ import annotations

import os
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import asyncpg

from budgetgate.benchmark import databases
from budgetgate.benchmark.cpu import CpuMeter, CpuUse, Part
from budgetgate.benchmark.rounds import spread
from budgetgate.core.loader import load_path
from budgetgate.ledger.migrations import migrate
from budgetgate.reports.chargeback import WORK_MEM, ReportRequest, breakpoints, chargeback, sql

START, END = datetime(2026, 10, 1, tzinfo=UTC), datetime(2026, 11, 1, tzinfo=UTC)
WEEK_END = datetime(2026, 10, 8, tzinfo=UTC)
# (group keys, period, end): the month in four groupings, and its first week alone (a part of the
# table, which the index of migration 0032 reads without the rest).
GROUPINGS: tuple[tuple[tuple[str, ...], str, datetime], ...] = (
    (("tenant",), "none", END),
    (("user",), "month", END),
    (("budget",), "day", END),
    (("flavor", "region"), "week", END),
    (("tenant",), "none", WEEK_END),
)
RATES = """apiVersion: budgetgate/v1
kind: RateCard
metadata: {id: rates/bench}
spec:
  currency: USD
  rates:
    - {flavor: h100, rate_per_gpu_hour: 3.933}
    - {flavor: h100, region: eu, rate_per_gpu_hour: 4.1}
    - {flavor: a100, rate_per_gpu_hour: 1.8}
    - {flavor: a100, rate_per_gpu_hour: 1.6, effective_from: "2026-10-15T00:00:00Z"}
    - {flavor: l4, rate_per_gpu_hour: 0.7}
"""

# One month of runs and their samples, made by Postgres itself. $1 runs, $2 samples per run.
_FILL = """
INSERT INTO ledger_entries (ledger_key, scope_id, unit, window_key, window_start, window_end, policy_id, policy_git_sha, limit_amount)
SELECT p || '|2026-10', p, 'gpu_hours', '2026-10', '2026-10-01Z', '2026-11-01Z', p, 'bench', 1000000::bigint * 3600000
FROM (SELECT 'gpu/t' || t AS p FROM generate_series(0, 49) t UNION ALL SELECT 'cost/cc' || c FROM generate_series(0, 4) c) AS policies;

INSERT INTO decisions (decision_id, run_id, attempt, outcome, reason, namespace, labels, projected_gpu, request, response, decided_at,
                       gpus, nodes, flavor, region)
SELECT md5('run' || i)::uuid, 'run-' || i, 1, 'ALLOW', 'fits', 'ns-' || (i % 50),
       jsonb_build_object('team', 't' || (i % 50), 'user', 'u' || (i % 1000)),
       (1 + i % 8)::bigint * $2 * 420000 * 11 / 10, '{}', '{}',
       timestamptz '2026-10-01Z' + (interval '30 days') * i / $1, 1 + i % 8, 1,
       (ARRAY['h100', 'a100', 'l4'])[1 + i % 3], (ARRAY['us', 'eu'])[1 + i % 2]
FROM generate_series(0, $1 - 1) AS i;

INSERT INTO reservations (run_id, ledger_key, decision_id, amount, state, expected_end, created_at)
SELECT d.run_id, k.key, d.decision_id, d.projected_gpu, CASE WHEN i >= $1 * 95 / 100 THEN 'held' ELSE 'reconciled' END,
       d.decided_at + interval '1 day', d.decided_at
FROM generate_series(0, $1 - 1) AS i JOIN decisions d ON d.run_id = 'run-' || i
CROSS JOIN LATERAL (VALUES ('gpu/t' || (i % 50) || '|2026-10'), ('cost/cc' || (i % 5) || '|2026-10')) AS k (key);

INSERT INTO usage_records (run_id, sample_id, observed_at, gpu_milli_hours, node_milli_hours, gpu_milli_hours_cumulative,
                           node_milli_hours_cumulative, gpu_milli_hours_delta, node_milli_hours_delta, late, exporter, source, event_id)
SELECT 'run-' || i, 's' || s, timestamptz '2026-10-01Z' + (interval '30 days') * i / $1 + interval '7 minutes' * (s + 1),
       (1 + i % 8)::bigint * 420000 * (s + 1), 420000::bigint * (s + 1), (1 + i % 8)::bigint * 420000 * (s + 1), 420000::bigint * (s + 1),
       (1 + i % 8)::bigint * 420000, 420000, false, 'bench', 'http', 'run-' || i || '/' || s
FROM generate_series(0, $1 - 1) AS i CROSS JOIN generate_series(0, $2 - 1) AS s;

INSERT INTO usage_runs (run_id, gpu_milli_hours_cumulative, node_milli_hours_cumulative, samples, latest_observed_at)
SELECT run_id, max(gpu_milli_hours_cumulative), max(node_milli_hours_cumulative), count(*), max(observed_at)
FROM usage_records GROUP BY run_id;
"""


@dataclass
class Measured:
    records: int
    runs: int
    load_seconds: float
    seconds: dict[str, dict[str, Any] | None] = field(default_factory=dict)
    rows: dict[str, int] = field(default_factory=dict)
    plan: list[str] = field(default_factory=list)
    # The month's metered GPU milli-hours as the report totals them, in every grouping alike
    # (None when the groupings disagreed, which the command reports as a failure).
    gpu_milli_hours: int | None = None
    cpu: CpuUse | None = None  # over every timed report: this process and the database's server process
    reports: int = 0  # the reports the CPU was spent on

    @property
    def units(self) -> int:
        """Thousands of usage records of the month, once per report made: what the CPU figure is per."""
        return self.records * self.reports // 1000

    def as_json(self) -> dict[str, Any]:
        return {
            "records": self.records,
            "runs": self.runs,
            "load_seconds": round(self.load_seconds, 1),
            "seconds": self.seconds,
            "rows": self.rows,
            "gpu_milli_hours": self.gpu_milli_hours,
            "plan": self.plan,
            "reports": self.reports,
            "cpu": self.cpu.as_json(self.units) if self.cpu else None,
        }

    def as_text(self) -> str:
        lines = [f"report over {self.records:,} usage records of {self.runs:,} runs in one month (loaded in {self.load_seconds:.1f} s, not timed)"]
        for name, figure in self.seconds.items():
            if figure:
                around = f"low {figure['low']:.3f}, high {figure['high']:.3f}"
                lines.append(f"  {name:<28} {figure['median']:.3f} s median of {figure['rounds']} ({around}); {self.rows[name]} rows")
        if self.cpu is not None:
            lines.append(f"  over its {self.reports} reports, {self.cpu.line(self.units, '1,000 usage records per report')}")
        lines += ["", "EXPLAIN (ANALYZE, BUFFERS) of chargeback_metered, grouped by tenant:", *self.plan]
        return "\n".join(lines)


async def run(server_dsn: str, *, records: int, runs: int, rounds: int, echo: Any = print) -> Measured:
    if records < runs:
        raise ValueError(f"--records ({records}) must be at least --runs ({runs}): every run has a sample")
    name = f"bench_report_{uuid.uuid4().hex[:8]}"
    dsn = await databases.create(server_dsn, name)
    folder = Path(tempfile.mkdtemp())
    (folder / "rates.yaml").write_text(RATES)
    bundle = load_path(folder, git_sha="bench").bundle
    try:
        conn = await asyncpg.connect(dsn)
        try:
            await migrate(conn)
            echo(f"loading {records:,} usage records of {runs:,} runs over October 2026 (not timed)")
            started = time.perf_counter()
            for statement in _FILL.split(";\n\n"):
                await conn.execute(statement.replace("$1", str(runs)).replace("$2", str(records // runs)))
            await conn.execute("VACUUM ANALYZE")
            load = time.perf_counter() - started
            measured = Measured(records=(records // runs) * runs, runs=runs, load_seconds=load)
            timings: dict[str, list[float]] = {}
            totals: set[int] = set()
            meter = CpuMeter([Part.process("budgetgate", os.getpid()), Part("postgres", postgres_dsn=dsn)])
            metered = await meter.start()
            for n in range(rounds):
                for keys, period, end in GROUPINGS:
                    label = (f"{','.join(keys)} by {period}" if period != "none" else ",".join(keys)) + (", first week" if end != END else "")
                    request = ReportRequest(START, end, keys, period)
                    echo(f"round {n + 1}/{rounds}: {label}")
                    started = time.perf_counter()
                    report = await chargeback(conn, bundle, request, tenant_label="team", user_label="user")
                    timings.setdefault(label, []).append(time.perf_counter() - started)
                    measured.rows[label] = len(report["rows"])
                    if end == END:
                        totals.add(report["total"]["gpu_milli_hours"])
            measured.cpu, measured.reports = await meter.stop(metered), rounds * len(GROUPINGS)
            measured.seconds = {label: spread(values) for label, values in timings.items()}
            measured.gpu_milli_hours = totals.pop() if len(totals) == 1 else None
            args = (START, END, breakpoints(bundle, START, END), "team", "user", False)  # by tenant: no labels in the grain
            async with conn.transaction(readonly=True):
                # As the report runs it (budgetgate.reports.chargeback).
                await conn.execute(f"SET LOCAL work_mem = '{WORK_MEM}'; SET LOCAL jit = off")
                measured.plan = [r[0] for r in await conn.fetch("EXPLAIN (ANALYZE, BUFFERS) " + sql("chargeback_metered"), *args)]
            return measured
        finally:
            await conn.close()
    finally:
        await databases.drop(server_dsn, name)
