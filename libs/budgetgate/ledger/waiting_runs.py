"""Waiting runs in Postgres: a refused decision read as a waiting run, the reconciler's register
of waiting runs (waiting_runs) read back, and the figures now of what refused them, judged by
core/waiting.py. Admission's status of a run and the reconciler's HEADROOM both judge here."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import asyncpg
import orjson

from budgetgate.core.evaluation import Reading
from budgetgate.core.policy import PolicyBundle
from budgetgate.core.quotas import Holdings
from budgetgate.core.waiting import BudgetNeed, Headroom, WaitingRun, budget_needs, current_keys, judge, waiting_for
from budgetgate.ledger.queries import sql


def _json(value: Any) -> Any:
    return orjson.loads(value) if isinstance(value, str | bytes) else value


async def refused_decision(conn: asyncpg.Connection, decision_id: str) -> WaitingRun | None:
    """The decision as a waiting run, if it left its run waiting (a DELAY, a quota rejection)."""
    row = await conn.fetchrow(sql("waiting_decision"), decision_id)
    kind = waiting_for(row["outcome"], row["reason"]) if row is not None else None
    if row is None or kind is None:
        return None
    return WaitingRun(
        run_id=row["run_id"], attempt=row["attempt"], decision_id=str(row["decision_id"]), waiting_for=kind, tenant=row["tenant"],
        labels=_json(row["labels"]), gpus=row["gpus"] or 0, nodes=row["nodes"], needs=budget_needs(tuple(e) for e in _json(row["evaluations"])),
        decided_at=row["decided_at"],
    )  # fmt: skip


def registered(row: Mapping[str, Any]) -> WaitingRun:
    """A waiting_runs row as the run it registers."""
    return WaitingRun(
        run_id=row["run_id"], attempt=row["attempt"], decision_id=str(row["decision_id"]), waiting_for=row["waiting_for"], tenant=row["tenant"],
        labels=_json(row["labels"]), gpus=row["gpus"], nodes=row["nodes"], needs=tuple(BudgetNeed(*n) for n in _json(row["needs"])),
        decided_at=row["decided_at"],
    )  # fmt: skip


async def headroom(conn: asyncpg.Connection, runs: Sequence[WaitingRun], bundle: PolicyBundle, *, now: datetime) -> list[Headroom]:
    """Each of `runs` judged against the limits of `bundle` and what Postgres holds now: the
    refusing budgets in their current windows, the tenants' and the sensitive pool's holds."""
    keys = sorted({key for run in runs for key in current_keys(run, bundle, now).values()})
    ledger = {r["ledger_key"]: Reading(r["limit_amount"], r["reserved"], r["consumed"]) for r in await conn.fetch(sql("ledger_figures"), keys)} if keys else {}
    tenants = sorted({run.tenant for run in runs if run.tenant and run.waiting_for == "quota"})
    held = {r["tenant"]: Holdings(r["gpus"], r["nodes"], r["allocations"]) for r in await conn.fetch(sql("held_by_tenants"), tenants)} if tenants else {}
    sensitive = Holdings()
    if any(run.sensitive(bundle) for run in runs):
        row = await conn.fetchrow(sql("held_sensitive"))
        sensitive = Holdings(row["gpus"], row["nodes"], row["allocations"])
    return [judge(run, bundle, now=now, ledger=ledger, tenant_held=held.get(run.tenant or "", Holdings()), sensitive_held=sensitive) for run in runs]
