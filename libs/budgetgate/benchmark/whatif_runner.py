"""`budgetgate bench what-if`: `policy what-if` over a large recorded history, end to end.

A fresh database is filled (COPY, not timed) with N recorded decisions over the last 29 days,
spread over `teams` teams with one monthly GPU-hour budget each, decided by a running tally as
admission would, with their ledger readings and, for half the admitted runs, a recorded end at
80 % of the projection (each answer with its budget's evaluation, which what-if reads to tell
what decided it). Then the candidate folder (every limit at 70 %) is replayed against it
exactly as the command does it (read the history, simulate), and timed, with the CPU it took:
this process (which runs the command's code) and the Postgres server processes of the database
(budgetgate.benchmark.cpu), per decision replayed. There is no reference system: nothing else
replays a history against candidate policies."""

from __future__ import annotations

import json
import os
import tempfile
import time
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import asyncpg

from budgetgate.benchmark import databases
from budgetgate.benchmark.cpu import CpuMeter, CpuUse, Part
from budgetgate.core.evaluation import Resources, Submission, plan
from budgetgate.core.loader import load_path
from budgetgate.core.units import projected_hours_amount
from budgetgate.ledger.migrations import migrate
from budgetgate.reports.whatif_report import what_if


@dataclass(frozen=True)
class Measured:
    decisions: int
    seconds: float
    flips: int
    recorded_allows: int
    not_simulated: int = 0
    cpu: CpuUse | None = None  # over the timed replay: this process and the database's server processes

    def as_json(self) -> dict[str, Any]:
        return {
            "decisions": self.decisions,
            "seconds": round(self.seconds, 3),
            "decisions_per_s": round(self.decisions / self.seconds),
            "flips": self.flips,
            "recorded_allows": self.recorded_allows,
            "not_simulated": self.not_simulated,
            "cpu": self.cpu.as_json(self.decisions) if self.cpu else None,
        }

    def as_text(self) -> str:
        line = (
            f"what-if: {self.decisions} recorded decisions replayed in {self.seconds:.1f} s "
            f"({self.decisions / self.seconds:,.0f} decisions/s); {self.flips} flips of {self.recorded_allows} recorded ALLOWs"
        )
        return line if self.cpu is None else f"{line}\n{self.cpu.line(self.decisions, 'decision replayed')}"


def _policies(folder: Path, teams: int, limit_hours: int) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    docs = [
        f"apiVersion: budgetgate/v1\nkind: BudgetPolicy\nmetadata: {{id: gpu/t{i}}}\nspec:\n  scope: {{namespace: ns-{i}, labels: {{team: t{i}}}}}\n"
        f"  window: {{calendar: month}}\n  limit: {{gpu_hours: {limit_hours}}}\n  enforcement: hard\n  on_exhausted: deny\n"
        for i in range(teams)
    ]
    (folder / "teams.yaml").write_text("---\n".join(docs))
    return folder


def _history(decisions: int, teams: int, limit_hours: int, now: datetime) -> tuple[list[tuple], list[tuple], int]:
    bundle = load_path(_policies(Path(tempfile.mkdtemp()) / "recorded", teams, limit_hours), git_sha="r" * 40).bundle
    used: dict[str, int] = {}
    rows, ends, allows = [], [], 0
    span = timedelta(days=29) / decisions
    start = now - timedelta(days=29)
    for n in range(decisions):
        team, gpus, hours = n % teams, 1 + (n * 7) % 8, 1 + (n * 13) % 12
        at = start + span * n
        sub = Submission(
            run_id=f"bench/{n}", namespace=f"ns-{team}", labels={"team": f"t{team}"}, resources=Resources(gpus=gpus), runtime_hours=Decimal(hours), at=at
        )
        [charge] = plan(bundle, sub).charges
        amount = projected_hours_amount(gpus, Decimal(hours))
        held = used.get(charge.ledger_key, 0)
        outcome = "ALLOW" if held + amount <= charge.policy.limit.amount else "DENY"
        reading = {"ledger_key": charge.ledger_key, "limit": charge.policy.limit.amount, "reserved": held, "consumed": 0}
        request = {
            "run_id": sub.run_id,
            "attempt": 1,
            "namespace": sub.namespace,
            "labels": dict(sub.labels),
            "resources": {"gpus": gpus, "nodes": 1},
            "projected_runtime_hours": float(hours),
        }
        decision_id = uuid.uuid4()
        rows.append(
            (
                decision_id,
                sub.run_id,
                1,
                outcome,
                "bench",
                sub.namespace,
                json.dumps(sub.labels),
                "r" * 40,
                amount,
                json.dumps(request),
                # The answer as far as what-if reads it: what its budget decided.
                json.dumps({"decision": outcome, "evaluations": [{"policy_id": charge.policy.id, "enforcement": "hard", "decision": outcome}]}),
                at,
                json.dumps({"version": 1, "status": "RESERVED", "ledger": [reading]}),
            )
        )
        if outcome == "ALLOW":
            allows += 1
            used[charge.ledger_key] = held + amount
            if n % 2 == 0:
                ends.append((sub.run_id, decision_id, "ended", True, at + timedelta(hours=hours), amount, amount * 4 // 5))
    return rows, ends, allows


async def run(server_dsn: str, *, decisions: int, teams: int, limit_hours: int = 2000, echo: Any = print) -> Measured:
    name = f"bench_whatif_{uuid.uuid4().hex[:8]}"
    dsn = await databases.create(server_dsn, name)
    try:
        conn = await asyncpg.connect(dsn)
        try:
            await migrate(conn)
            now = datetime.now(UTC)
            echo(f"recording {decisions} decisions over {teams} budgets (not timed)")
            rows, ends, allows = _history(decisions, teams, limit_hours, now)
            await conn.copy_records_to_table(
                "decisions",
                records=rows,
                columns=[
                    "decision_id",
                    "run_id",
                    "attempt",
                    "outcome",
                    "reason",
                    "namespace",
                    "labels",
                    "policy_bundle_sha",
                    "projected_gpu",
                    "request",
                    "response",
                    "decided_at",
                    "readings",
                ],
            )
            await conn.copy_records_to_table(
                "run_settlements", records=ends, columns=["run_id", "decision_id", "phase", "final", "ended_at", "projected_gpu", "actual_gpu"]
            )
            await conn.execute("ANALYZE")
        finally:
            await conn.close()
        candidate = load_path(_policies(Path(tempfile.mkdtemp()) / "candidate", teams, limit_hours * 7 // 10), git_sha="what-if").bundle
        echo("replaying against the candidate (every limit at 70 %)")
        meter = CpuMeter([Part.process("budgetgate", os.getpid()), Part("postgres", postgres_dsn=dsn)])
        # Connected first: the meter reads the server process serving it at both ends (one
        # that starts or ends in between is not read).
        conn = await asyncpg.connect(dsn)
        try:
            metered = await meter.start()
            started = time.perf_counter()
            report = await what_if(conn, candidate, now - timedelta(days=30))
            seconds = time.perf_counter() - started
            cpu = await meter.stop(metered)
        finally:
            await conn.close()
        return Measured(report["decisions"], seconds, len(report["flips"]), allows, len(report["not_simulated"]), cpu)
    finally:
        await databases.drop(server_dsn, name)
