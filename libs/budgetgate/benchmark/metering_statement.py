"""`budgetgate bench metering-statement`: metering_place_batch alone, called as metering-ingest's
Kafka polls call it, with no broker and no service: what Postgres spends on a sample in the
statement that judges and records a poll, apart from everything else `bench metering` measures.

The load is `bench metering`'s (budgetgate.benchmark.metering_workload): runs with a decision
each, their samples in order, every n-th resent under a new event id. It is validated as the
service validates it, then placed a poll at a time (`poll` samples, in the order Kafka would give
them on one partition), each poll in a transaction of its own, on a fresh database, calling the
function with the arguments the Kafka route gives it. The CPU is Postgres's (the database's
server processes) over the polls only; the benchmark's own (encoding the arrays, reading the
answers) is shown apart, as a load generator's: metering-ingest sends the same arguments with
its texts joined (services/metering_ingest/store.py place_batch), which its own figures hold.

With `explain`, the load's last poll runs under auto_explain (ANALYZE, timing, nested
statements) after the measured ones, and the plan of each statement of metering_place_batch
comes back: where the statement's time goes, node by node (a superuser connection is needed to
LOAD auto_explain).

The usage recorded is checked as `bench metering` checks it (metering_runner.check_usage): each
distinct sample applied once, and every run's cumulative, the sum of its rows' deltas and its
usage up to every quarter hour the clean stream's.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg

from budgetgate.v1.metering_pb2 import MeteringSample

from budgetgate.benchmark import databases, metering_workload, rounds, sql_blocks
from budgetgate.benchmark.metering_runner import check_usage
from budgetgate.benchmark.cpu import CpuMeter, CpuUse, Part, load_generator
from budgetgate.core.metering import DEFAULT_USAGE_TOLERANCE, FOLD, RawSample, Sample, Tolerance, usage_event_id, validate
from budgetgate.ledger.migrations import migrate_dsn

# The function itself (the ledger's schema): metering-ingest's query passes the same arguments,
# its texts joined into one text each (services/metering_ingest/store.py place_batch), which only
# the caller's encoding of them changes.
_PLACE = """
SELECT idx, outcome FROM metering_place_batch($1::text[], $2::text[], $3::timestamptz[], $4::bigint[], $5::bigint[], $6::text[], $7::text[],
                                              $8::text[], $9::bigint, $10::bigint, $11::interval, $12::boolean)
"""
_MICROSECOND = timedelta(microseconds=1)

# As metering-ingest's defaults: its clock skew allowance (which the usage bound's slack is) and
# the most records a poll takes.
MAX_SKEW = timedelta(minutes=5)
DEFAULT_POLL = 15_000


@dataclass(frozen=True)
class Options:
    samples: int = 200_000
    runs: int = 2_000
    resend_every: int = 10
    poll: int = DEFAULT_POLL
    rounds: int = 1
    explain: bool = False

    def __post_init__(self) -> None:
        if min(self.samples, self.runs, self.poll, self.rounds) < 1 or self.resend_every < 0:
            raise ValueError("samples, runs, poll and rounds must be at least 1, resend_every at least 0")


@dataclass
class Result:
    """One round: the load placed poll by poll, what it cost and whether the usage came out right."""

    samples: int  # placed in the measured polls, resends included
    polls: int  # measured
    seconds: float  # the measured polls' wall time, as the caller saw it
    cpu: CpuUse
    usage_rows: int
    left_to_core: int  # samples the statement left to the core (none in a clean load)
    problems: list[str]  # what is wrong with the usage recorded (bench metering's check)
    plans: list[str]  # with `explain`: the plans of one poll's statements

    @property
    def correct(self) -> bool:
        return not self.problems and self.left_to_core == 0

    def cpu_us(self, part: str) -> float | None:
        return self.cpu.per_unit_us(self.samples).get(part)

    def as_json(self) -> dict[str, Any]:
        return {
            "samples": self.samples, "polls": self.polls, "seconds": round(self.seconds, 3),
            "samples_per_s": round(self.samples / self.seconds, 1) if self.seconds else None,
            "cpu": self.cpu.as_json(self.samples), "usage_rows": self.usage_rows, "left_to_core": self.left_to_core,
            "problems": self.problems[:20], "correct": self.correct, "plans": self.plans,
        }  # fmt: skip


async def run(options: Options, *, server_dsn: str, echo: Callable[[str], None]) -> list[Result]:
    """Every round on a fresh database of the server of `server_dsn`, dropped after it."""
    results = []
    tag = uuid.uuid4().hex[:8]
    for number in range(1, options.rounds + 1):
        name = f"bench_{tag}_statement_{number}"
        dsn = await databases.create(server_dsn, name)
        try:
            results.append(await _round(options, dsn, echo=lambda message, n=number: echo(f"[round {n}/{options.rounds}] {message}")))
        finally:
            await databases.drop(server_dsn, name)
    return results


async def _round(options: Options, dsn: str, *, echo: Callable[[str], None]) -> Result:
    await migrate_dsn(dsn)
    work = metering_workload.build(samples=options.samples, runs=options.runs, resend_every=options.resend_every, tag=uuid.uuid4().hex[:8])
    now = datetime.now(UTC)
    samples = [_valid(message, now) for message in work.messages]
    event_ids = [usage_event_id(s.run_id, s.sample_id) for s in samples]
    polls = [(samples[i : i + options.poll], event_ids[i : i + options.poll]) for i in range(0, len(samples), options.poll)]
    tolerance = Tolerance.of(DEFAULT_USAGE_TOLERANCE, slack=MAX_SKEW)
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(sql_blocks.sql("metering.sql", "decide_runs"), work.runs)
        echo(f"placing {len(samples)} samples ({work.resends} resends) of {len(work.runs)} runs in {len(polls)} polls of up to {options.poll}")
        # With `explain`, the last poll is placed under auto_explain after the measured window,
        # so what the explaining costs is in no figure.
        if options.explain and len(polls) < 2:
            raise RuntimeError(f"--explain needs a load of two polls or more (this one is {len(samples)} samples, polls of {options.poll})")
        measured = polls[:-1] if options.explain else polls
        left = 0

        async def place() -> float:
            nonlocal left
            started = time.perf_counter()
            for poll, ids in measured:
                left += await _place(conn, poll, ids, tolerance)
            return time.perf_counter() - started

        meter = CpuMeter([Part("postgres", postgres_dsn=dsn), load_generator()])
        seconds, cpu = await meter.measure(place)
        plans = await _explained(conn, *polls[-1], tolerance) if options.explain else []
        rows = await conn.fetch(sql_blocks.sql("metering.sql", "usage_rows"))
    finally:
        await conn.close()
    problems = await check_usage(dsn, work, rows)
    return Result(sum(len(poll) for poll, _ in measured), len(measured), seconds, cpu, len(rows), left, problems, plans)


async def _place(conn: asyncpg.Connection, poll: Sequence[Sample], event_ids: Sequence[str], tolerance: Tolerance) -> int:
    """One poll in its transaction, with the arguments the Kafka route gives it (each sample's
    source kafka, the fold, no row for a folded sample); how many samples it left to the core."""
    async with conn.transaction():
        rows = await conn.fetch(
            _PLACE,
            [s.run_id for s in poll], [s.sample_id for s in poll], [s.observed_at for s in poll], [s.counters.gpu for s in poll],
            [s.counters.node for s in poll], [s.exporter for s in poll], ["kafka"] * len(poll), list(event_ids),
            tolerance.ppm, tolerance.slack // _MICROSECOND, FOLD, False,
        )  # fmt: skip
    return sum(1 for row in rows if row["outcome"] == "python")


def _valid(message: MeteringSample, now: datetime) -> Sample:
    """A sample of the load, validated as metering-ingest validates it."""
    at = message.observed_at.ToDatetime(tzinfo=UTC)
    return validate(RawSample(message.run_id, message.sample_id, at, message.gpu_seconds, message.node_seconds, message.exporter), now=now, max_skew=MAX_SKEW)


async def _explained(conn: asyncpg.Connection, poll: Sequence[Sample], event_ids: Sequence[str], tolerance: Tolerance) -> list[str]:
    """`_place` under auto_explain; the plans of its statements (the nested ones included)."""
    plans: list[str] = []

    def heard(_: object, message: asyncpg.PostgresLogMessage) -> None:
        plans.append(str(message.message))

    try:
        await conn.execute("LOAD 'auto_explain'")
    except asyncpg.InsufficientPrivilegeError as exc:
        raise RuntimeError(f"--explain needs a superuser connection to LOAD auto_explain: {exc}") from exc
    settings = {"log_min_duration": "0", "log_analyze": "on", "log_nested_statements": "on", "log_level": "notice"}
    conn.add_log_listener(heard)
    try:
        for name, value in settings.items():
            await conn.execute(f"SET auto_explain.{name} = '{value}'")
        left = await _place(conn, poll, event_ids, tolerance)
    finally:
        await conn.execute("RESET auto_explain.log_min_duration")
        conn.remove_log_listener(heard)
    if left:
        raise RuntimeError(f"the explained poll left {left} samples to the core")
    return plans


def as_text(results: Sequence[Result]) -> str:
    lines = []
    for number, result in enumerate(results, 1):
        per_s = result.samples / result.seconds if result.seconds else float("nan")
        lines.append(
            f"round {number}: {result.samples} samples in {result.polls} polls, {result.seconds:.2f} s ({per_s:.0f} samples/s); "
            f"{result.cpu.line(result.samples, 'sample')}; {result.usage_rows} usage rows"
        )
        lines.append(
            f"  correctness: {'OK' if result.correct else 'WRONG'} - "
            + (
                "every distinct sample applied once; every run's cumulative, the sum of its rows' deltas and its usage up to every quarter "
                "hour equal the clean stream's; nothing left to the core"
                if result.correct
                else "; ".join([*result.problems[:5], f"{result.left_to_core} samples left to the core"])
            )
        )
    if len(results) > 1:
        summary = {part: rounds.spread(r.cpu_us(part) for r in results) for part in ("postgres", "load generator")}
        lines.append(
            f"median of {len(results)} rounds: samples/s {rounds.spread_text(_rates(results))}; CPU µs per sample: "
            f"postgres {rounds.spread_text(summary['postgres'], digits=1)}, load generator {rounds.spread_text(summary['load generator'], digits=1)}"
        )
    for result in results:
        if result.plans:
            lines += ["", "plans of the last poll's statements (auto_explain ANALYZE; that poll is in no figure above):"]
            lines += [plan + "\n" for plan in result.plans]
            break
    return "\n".join(lines)


def as_json(options: Options, results: Sequence[Result]) -> dict[str, Any]:
    return {
        "options": {"samples": options.samples, "runs": options.runs, "resend_every": options.resend_every, "poll": options.poll, "rounds": options.rounds},
        "rounds": [r.as_json() for r in results],
        "median_cpu_us_per_sample": {part: rounds.spread(r.cpu_us(part) for r in results) for part in ("postgres", "load generator")},
        "samples_per_s": _rates(results),
        "correct": all(r.correct for r in results),
    }


def _rates(results: Sequence[Result]) -> dict[str, Any] | None:
    return rounds.spread((r.samples / r.seconds for r in results if r.seconds), digits=0)
