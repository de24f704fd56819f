"""A run's status: its latest decision as answered and, when that left the run waiting (a DELAY
waits for budget, a quota rejection for quota headroom), what refused it with its figures as
they are now, read from Postgres. GET /v1/admissions/{run_id} and `budgetgate status RUN_ID`."""

from __future__ import annotations

from datetime import datetime
from typing import Any

import asyncpg
import orjson

from budgetgate.core.policy import PolicyBundle
from budgetgate.core.units import Unit, display
from budgetgate.core.waiting import Headroom, Limiting
from budgetgate.core.windows import rfc3339
from budgetgate.ledger.queries import owned_by
from budgetgate.ledger.waiting_runs import headroom, refused_decision
from budgetgate.decisions.rendering import replayed

sql = owned_by("budgetgate.reports")


async def run_status(conn: asyncpg.Connection, bundle: PolicyBundle | None, run_id: str, *, now: datetime) -> tuple[dict[str, Any], str, dict[str, str]] | None:
    """The run's latest answer with `waiting`, and the namespace and labels it was asked for;
    None for a run without a decision. Limits are the active bundle's (`bundle`)."""
    row = await conn.fetchrow(sql("latest_decision"), run_id)
    if row is None:
        return None
    answer = replayed(row)
    run = await refused_decision(conn, str(row["decision_id"])) if bundle is not None else None
    answer["waiting"] = waiting(*await headroom(conn, [run], bundle, now=now), now=now) if run is not None and bundle is not None else None
    labels = orjson.loads(row["labels"]) if isinstance(row["labels"], str) else dict(row["labels"])
    return answer, row["namespace"], labels


def waiting(found: Headroom, *, now: datetime) -> dict[str, Any]:
    """The `waiting` member of a status (schemas.Waiting)."""
    return {
        "state": found.run.state,
        "since": rfc3339(found.run.decided_at),
        "as_of": rfc3339(now),
        "headroom": found.fits,
        "limiting": [_figure(limit) for limit in found.limiting],
        "summary": found.describe(),
    }


def _figure(limit: Limiting) -> dict[str, Any]:
    if limit.kind != "budget":
        shown = lambda amount: amount  # noqa: E731 - GPUs, nodes and allocations are counts
    else:
        unit = Unit(limit.unit)
        shown = lambda amount: display(unit, amount)  # noqa: E731
    return {
        "kind": limit.kind,
        "name": limit.name,
        "scope_id": limit.scope_id,
        "tenant": limit.tenant,
        "unit": limit.unit,
        "limit": shown(limit.limit),
        "used": shown(limit.used),
        "reserved": None if limit.reserved is None else shown(limit.reserved),
        "consumed": None if limit.consumed is None else shown(limit.consumed),
        "requested": shown(limit.requested),
        "remaining": shown(limit.limit - limit.used),
        "fits": limit.fits,
    }
