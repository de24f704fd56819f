"""A run's folded state in Postgres (run_meters, and the high-water marks on its sample line),
brought up to date with the samples recorded since its last settlement.

Only new samples are read: one appended at the end of the line is folded with no query at all;
a late one reads its predecessor and the few rows after it whose increments it changes. A run
with no stored state (settled before this existed, or reset for repair) is folded whole, once.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import asyncpg

from budgetgate.core.policy import BudgetPolicy, PolicyBundle
from budgetgate.core.reconciliation import RunFacts, UsageFact
from budgetgate.core.run_state import Highs, MeterRow, Reflow, RunState, SampleLine, fold, insert_sample, reflow
from budgetgate.core.windows import Window
from budgetgate.ledger.queries import owned_by

sql = owned_by("budgetgate.services.reconciler")

Bucket = tuple[str, datetime]
_PAGE = 64


@dataclass
class Folded:
    """The run's state after folding its new samples, and how its metered charges moved."""

    state: RunState
    last: tuple[datetime, str] | None  # the last sample on the line
    timed: dict[Bucket, int]  # charges from time alone as last settled
    deltas: dict[Bucket, int] = field(default_factory=lambda: defaultdict(int))
    windows: dict[str, tuple[BudgetPolicy, Window]] = field(default_factory=dict)
    whole: bool = False  # no stored state: the whole run was folded, `deltas` are its totals
    unread: bool = False  # no stored state and nothing folded (a release, see `unfolded`)

    def take(self, moved: Any) -> None:
        for key, delta in moved.deltas.items():
            self.deltas[key] += delta
        self.windows.update(moved.windows)


async def _stored(conn: asyncpg.Connection, run_id: str) -> Folded | None:
    """The run's folded state as last settled, with nothing folded since (None: it has none)."""
    row = await conn.fetchrow(sql("run_meter"), run_id)
    if row is None:
        return None
    used = json.loads(row["used"]) if isinstance(row["used"], str) else dict(row["used"])
    timed_rows = json.loads(row["timed"]) if isinstance(row["timed"], str) else list(row["timed"])
    return Folded(
        state=RunState(row["gpu"], row["node"], row["covered"], used),
        last=(row["last_at"], row["last_id"]) if row["last_at"] is not None else None,
        timed={(k, datetime.fromisoformat(b)): a for k, b, a in timed_rows},
    )


async def fold_new_samples(conn: asyncpg.Connection, run: RunFacts, bundle: PolicyBundle | None) -> Folded:
    """Fold the samples recorded since the run was last settled (its whole line if never)."""
    folded = await _stored(conn, run.run_id)
    if folded is None:
        return await _fold_whole(conn, run, bundle)
    line = _Line(conn, run.run_id)
    for sample in [UsageFact(r["sample_id"], r["observed_at"], r["gpu"], r["node"]) for r in await conn.fetch(sql("unfolded_samples"), run.run_id)]:
        key = (sample.observed_at, sample.sample_id)
        if folded.last is None or key > folded.last:
            step = insert_sample(sample, before=(folded.state.gpu, folded.state.node), after=())
            folded.last = key
        else:
            step = await line.place(sample)
        line.keep(step.rows)
        folded.state, moved = fold(folded.state, sample, step, run=run, bundle=bundle)
        folded.take(moved)
    await line.flush()
    return folded


async def unfolded(conn: asyncpg.Connection, run_id: str) -> Folded:
    """The run as last settled, none of its new samples folded: for a release, which moves no
    charge (a sample it cannot fold is what it is released in spite of)."""
    return await _stored(conn, run_id) or Folded(state=RunState(), last=None, timed={}, unread=True)


async def save(conn: asyncpg.Connection, run_id: str, folded: Folded, timed: dict[Bucket, int]) -> None:
    if folded.unread:
        return  # nothing was stored, nothing folded: its first fold reads the whole line
    s = folded.state
    last_at, last_id = folded.last if folded.last else (None, None)
    timed_rows = [[k, b.isoformat(), a] for (k, b), a in sorted(timed.items()) if a]
    await conn.execute(sql("put_run_meter"), run_id, s.gpu, s.node, s.covered, last_at, last_id, json.dumps(dict(s.used)), json.dumps(timed_rows))


async def _fold_whole(conn: asyncpg.Connection, run: RunFacts, bundle: PolicyBundle | None) -> Folded:
    """The repair path: the run's whole line folded in memory, its marks written in one go."""
    line = SampleLine()
    folded = Folded(state=RunState(), last=None, timed={}, whole=True)
    samples = [UsageFact(r["sample_id"], r["observed_at"], r["gpu"], r["node"]) for r in await conn.fetch(sql("run_sample_rows"), run.run_id)]
    for sample in sorted(samples, key=lambda s: (s.observed_at, s.sample_id)):
        folded.state, moved = fold(folded.state, sample, line.add(sample), run=run, bundle=bundle)
        folded.take(moved)
    if line.rows:
        folded.last = line.rows[-1].key
        await _put_highs(conn, run.run_id, line.rows)
    return folded


class _Line:
    """The run's folded sample line in Postgres, for samples that arrive out of order."""

    def __init__(self, conn: asyncpg.Connection, run_id: str) -> None:
        self.conn, self.run_id = conn, run_id
        self.pending: dict[str, MeterRow] = {}

    def keep(self, rows: Sequence[MeterRow]) -> None:
        for row in rows:
            self.pending[row.sample_id] = row

    async def flush(self) -> None:
        if self.pending:
            await _put_highs(self.conn, self.run_id, list(self.pending.values()))
            self.pending.clear()

    async def place(self, sample: UsageFact) -> Reflow:
        await self.flush()  # the queries below must see the marks written so far
        before_row = await self.conn.fetchrow(sql("sample_before"), self.run_id, sample.observed_at, sample.sample_id)
        before: Highs = (before_row["gpu_high"], before_row["node_high"]) if before_row else (0, 0)
        after = await self._after((sample.observed_at, sample.sample_id))
        step = insert_sample(sample, before=before, after=after)
        rows, changes = list(step.rows), list(step.changes)
        while step.carry is not None and after:
            after = await self._after(after[-1].key)
            step = reflow(step.carry, after)
            rows += step.rows
            changes += step.changes
        return Reflow(tuple(rows), tuple(changes))

    async def _after(self, key: tuple[datetime, str]) -> list[MeterRow]:
        found = await self.conn.fetch(sql("samples_after"), self.run_id, key[0], key[1], _PAGE)
        return [MeterRow(r["observed_at"], r["sample_id"], r["gpu"], r["node"], r["gpu_high"], r["node_high"]) for r in found]


async def _put_highs(conn: asyncpg.Connection, run_id: str, rows: Sequence[MeterRow]) -> None:
    await conn.execute(sql("put_sample_highs"), run_id, [r.sample_id for r in rows], [r.gpu_high for r in rows], [r.node_high for r in rows])
