"""Recorded history for `policy what-if`: the period's submissions in the order decided, the
ledger as the period's first decisions read it, the runs' recorded ends, and the reservations
held when the period began — read from Postgres, then simulated purely (core.whatif)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import orjson

from budgetgate.core.escrow import lease_of
from budgetgate.core.whatif import Ended, Recorded, Start, budgets_outcome
from budgetgate.ledger.queries import owned_by
from budgetgate.decisions.deciding import submission
from budgetgate.contracts.admission import AdmissionRequest

sql = owned_by("budgetgate.reports")


@dataclass
class History:
    decisions: list[Recorded] = field(default_factory=list)
    start: dict[str, Start] = field(default_factory=dict)
    ends: list[Ended] = field(default_factory=list)
    holds: dict[str, tuple[dict[str, int], int]] = field(default_factory=dict)


def _json(value: Any) -> Any:
    return orjson.loads(value) if isinstance(value, str | bytes) else value


def _budgets_outcome(verdicts: list[str] | None) -> str | None:
    """What a decision's budgets alone decided, from its evaluations' "enforcement outcome"
    pairs; None when its answer recorded no evaluations, or evaluations without either part."""
    if verdicts is None:
        return None
    pairs = [(enforcement, outcome) for enforcement, _, outcome in (v.partition(" ") for v in verdicts)]
    if any("?" in pair for pair in pairs):
        return None
    return budgets_outcome(pairs)


async def recorded_history(conn: Any, since: datetime, *, progress: Callable[[int], None] | None = None) -> History:
    """Everything a what-if over the period from `since` needs, in four queries."""
    history = History()
    async with conn.transaction():
        n = 0
        async for row in conn.cursor(sql("whatif_decisions"), since, prefetch=2000):
            request = (
                AdmissionRequest.model_validate_json(row["request"]) if isinstance(row["request"], str) else AdmissionRequest.model_validate(row["request"])
            )
            budgets = _budgets_outcome(row["verdicts"])
            history.decisions.append(Recorded(submission(request, row["decided_at"]), row["outcome"], reason=row["reason"], budgets_outcome=budgets))
            for reading in _json(row["ledger"]) or ():
                if reading["ledger_key"] not in history.start:
                    history.start[reading["ledger_key"]] = Start(reading["reserved"], reading["consumed"], row["decided_at"])
            n += 1
            if progress is not None and n % 5000 == 0:
                progress(5000)
    history.ends = [Ended(r["run_id"], r["ended_at"], r["actual_gpu"], r["released"]) for r in await conn.fetch(sql("whatif_ends"), since)]
    history.holds = {r["run_id"]: (_json(r["amounts"]), r["projected_gpu"]) for r in await conn.fetch(sql("whatif_holds"), since)}
    # A budget tenants share on a ledger of several shards is held by its tenants' escrow leases,
    # which the simulation reads as one (core.whatif.Simulation.figures): a lease no decision of
    # the period read starts from its figures now, which every end before now is in already.
    held = {key for amounts, _ in history.holds.values() for key in amounts}
    shared = sorted({lease[0] for key in (*history.start, *held) if (lease := lease_of(key)) is not None})
    if shared:
        for row in await conn.fetch(sql("whatif_lease_figures"), shared):
            if row["lease_key"] not in history.start:
                history.start[row["lease_key"]] = Start(row["reserved"], row["consumed"], row["read_at"])
    return history
