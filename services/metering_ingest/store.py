"""The usage tables in Postgres (usage_runs, usage_records, metering_pending), and the owners of
runs (their decisions' namespace and tenant).

Every function runs in the caller's transaction; whoever changes a run's usage holds the run's
lock (`lock_run`) first, so the Kafka consumer, HTTP ingest and the pending re-check, in any
number of processes, see and change one run's usage one at a time.
"""

from __future__ import annotations

import base64
import json
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Literal

import asyncpg

from budgetgate.contracts.timestamps import EPOCH
from budgetgate.messaging import outbox
from budgetgate.core.metering import Accepted, Capacity, Counters, Known, RunView, Sample, Tolerance, UsageBound, usage_event_id
from budgetgate.ledger.queries import owned_by
from budgetgate.core.principals import Principal

sql = owned_by("budgetgate.services.metering_ingest")

Source = Literal["kafka", "http"]
_MICROSECOND = timedelta(microseconds=1)
_SEPARATOR = "\x1f"  # (metering_place_batch's query splits on chr(31))


@dataclass(frozen=True)
class RunState:
    """A known run's high-water mark, the observed_at of its latest sample, and its capacity as
    kept on its row (None: unknown, no bound)."""

    cumulative: Counters
    latest: datetime | None
    capacity: Capacity | None = None

    def bound(self, tolerance: Tolerance) -> UsageBound | None:
        """The most the run can have used by a time, with `tolerance` (None: no bound known)."""
        return None if self.capacity is None else UsageBound(self.capacity, tolerance)


@dataclass(frozen=True)
class Begun:
    """A sample's run, locked: the view to judge the sample by, or None while metering does not
    know the run (then whether it has a decision by now)."""

    view: RunView | None
    has_decision: bool


@dataclass(frozen=True)
class PendingSample:
    """A valid sample of a run without a decision, kept as it arrived; `sender` is the principal
    that posted it when that one is limited to namespaces or tenants (its name and limits)."""

    run_id: str
    sample_id: str
    observed_at: datetime
    source: Source
    topic: str
    payload: bytes
    headers: tuple[tuple[str, bytes], ...]
    partition: int | None = None
    offset: int | None = None
    sender: Principal | None = None


@dataclass(frozen=True)
class Owner:
    """Whose a run is: the namespace and tenant (None: of no tenant) its decision names."""

    namespace: str
    tenant: str | None


async def run_owners(conn: asyncpg.Connection, run_ids: Sequence[str], *, tenant_label: str) -> dict[str, Owner]:
    """The owner of each of `run_ids` that has a decision (`tenant_label`: the label naming the
    tenant), in one round trip whatever their number."""
    rows = await conn.fetch(sql("run_owners"), sorted(set(run_ids)), tenant_label)
    return {row["run_id"]: Owner(row["namespace"], row["tenant"]) for row in rows}


async def lock_run(conn: asyncpg.Connection, run_id: str) -> None:
    await conn.execute(sql("lock_usage_run"), run_id)


async def run_state(conn: asyncpg.Connection, run_id: str) -> RunState | None:
    """The run's usage so far, or None while it is not known to metering."""
    row = await conn.fetchrow(sql("usage_run"), run_id)
    if row is None:
        return None
    return RunState(Counters(row["gpu_milli_hours_cumulative"], row["node_milli_hours_cumulative"]), row["latest_observed_at"], _capacity(row))


def _capacity(row: asyncpg.Record) -> Capacity | None:
    since = row["first_decided_at"]
    return None if since is None else Capacity(row["max_gpus"], row["max_nodes"], since)


async def refresh_capacity(conn: asyncpg.Connection, run_ids: Sequence[str]) -> dict[str, Capacity | None]:
    """The capacity of each of `run_ids` (known runs, their locks held) as their decisions say
    now, kept on their rows: a later decision may ask for more than the run was introduced with."""
    rows = await conn.fetch(sql("refresh_capacity"), sorted(set(run_ids)))
    return {row["run_id"]: _capacity(row) for row in rows}


async def has_decision(conn: asyncpg.Connection, run_id: str) -> bool:
    return bool(await conn.fetchval(sql("run_has_decision"), run_id))


async def create_run(conn: asyncpg.Connection, run_id: str) -> None:
    await conn.execute(sql("insert_usage_run"), run_id)


async def begin(conn: asyncpg.Connection, sample: Sample, tolerance: Tolerance) -> Begun:
    """Take the run's lock and read what judging `sample` needs, in one round trip (the view's
    bound with `tolerance`)."""
    rows = await conn.fetch(sql("begin_sample"), sample.run_id, sample.sample_id, sample.observed_at, usage_event_id(sample.run_id, sample.sample_id))
    found = {row["role"]: row for row in rows}
    run = found.get("run")
    if run is None:
        return Begun(view=None, has_decision="decision" in found)
    return Begun(view=_view(_run_row(run), rows, tolerance), has_decision=True)


def _run_row(row: asyncpg.Record) -> RunState:
    """The state of a run from the 'run' row of metering_begin_sample or metering_begin_batch."""
    return RunState(Counters(row["gpu_milli_hours"], row["node_milli_hours"]), row["observed_at"], _capacity(row))


async def view(conn: asyncpg.Connection, sample: Sample, state: RunState, tolerance: Tolerance) -> RunView:
    """What the core needs to assess `sample` against a run whose lock is held."""
    event_id = usage_event_id(sample.run_id, sample.sample_id)
    return _view(state, await conn.fetch(sql("usage_neighbours"), sample.run_id, sample.sample_id, sample.observed_at, event_id), tolerance)


def _view(state: RunState, rows: list[asyncpg.Record], tolerance: Tolerance) -> RunView:
    found = {
        row["role"]: Known(row["sample_id"], row["observed_at"], Counters(row["gpu_milli_hours"], row["node_milli_hours"]))
        for row in rows
        if row["role"] != "run"
    }
    return RunView(
        cumulative=state.cumulative,
        latest=state.latest,
        same_id=found.get("same_id"),
        same_time=found.get("same_time"),
        before=found.get("before"),
        after=found.get("after"),
        bound=state.bound(tolerance),
    )


async def record(conn: asyncpg.Connection, accepted: Accepted, *, source: Source, announce: tuple[str, str | None, bytes, str]) -> None:
    """Store an accepted sample, raise its run's high-water mark and write the outbox row of its
    usage record (`announce`: the outbox columns), in one statement."""
    sample = accepted.sample
    await conn.execute(
        sql("record_usage"),
        sample.run_id,
        sample.sample_id,
        sample.observed_at,
        sample.counters.gpu,
        sample.counters.node,
        accepted.cumulative.gpu,
        accepted.cumulative.node,
        accepted.delta.gpu,
        accepted.delta.node,
        accepted.late,
        sample.exporter,
        source,
        usage_event_id(sample.run_id, sample.sample_id),
        *announce,
    )


@dataclass(frozen=True)
class BatchBegun:
    """A batch's runs, locked: the state of each run metering knows, the unknown runs that have
    a decision, and the recorded neighbours of each sample (by its index in the batch)."""

    runs: dict[str, RunState]
    decided: frozenset[str]
    neighbours: dict[int, list[asyncpg.Record]]

    def view(self, index: int, state: RunState, tolerance: Tolerance) -> RunView:
        return _view(state, self.neighbours.get(index, []), tolerance)


async def begin_batch(conn: asyncpg.Connection, samples: Sequence[Sample], event_ids: Sequence[str]) -> BatchBegun:
    """Take the locks of the samples' runs and read what judging them needs, in one round trip
    (`event_ids`: those of the samples' usage records, by which a recorded sample of the same id
    is found)."""
    rows = await conn.fetch(
        sql("metering_begin_batch"), [s.run_id for s in samples], [s.sample_id for s in samples], [s.observed_at for s in samples], list(event_ids)
    )
    runs, decided, neighbours = {}, set(), defaultdict(list)
    for row in rows:
        if row["role"] == "run":
            runs[row["run_id"]] = _run_row(row)
        elif row["role"] == "decision":
            decided.add(row["run_id"])
        else:
            neighbours[row["idx"] - 1].append(row)
    return BatchBegun(runs, frozenset(decided), dict(neighbours))


async def place_batch(
    conn: asyncpg.Connection,
    samples: Sequence[Sample],
    *,
    sources: Sequence[Source],
    event_ids: Sequence[str],
    tolerance: Tolerance,
    fold: timedelta | None = None,
    every: bool = True,
) -> list[asyncpg.Record]:
    """Judge and record, in one round trip, the samples of a batch the set-based rules cover
    (see metering_place_batch); the others come back as 'python'. One row per sample, read as
    (idx, outcome, of_sample, gpu_cumulative, node_cumulative, gpu_delta, node_delta, late,
    record_order, record_gpu_cumulative, record_node_cumulative, record_gpu_delta,
    record_node_delta): `idx` is 1-based in the batch; `outcome` is 'accepted' (the run's
    counters after it and the delta), 'duplicate' (of the recorded `of_sample`) or 'python' (left
    to the core: among others every run with a sample above its bound with `tolerance`, as its
    row keeps it). With `fold` (budgetgate.core.metering.FOLD), a run's accepted samples of one
    span are one point: only the latest is recorded, and its row's record_* say what its usage
    record carries (the others' are NULL); without, every accepted sample is its own point.
    `every` false: no row for an accepted sample that is neither its span's point nor late.

    The text columns go as one text each, joined by a control character no valid sample holds,
    and the times as microseconds since the epoch: asyncpg encodes a text[] or timestamptz[]
    element by element, 0.3 and 0.9 µs each (0.2 ms for the whole of a joined text of 15,000)."""
    return await conn.fetch(
        sql("metering_place_batch"),
        _joined([s.run_id for s in samples]), _joined([s.sample_id for s in samples]), [(s.observed_at - EPOCH) // _MICROSECOND for s in samples],
        [s.counters.gpu for s in samples], [s.counters.node for s in samples], _joined([s.exporter for s in samples]),
        _joined(sources), _joined(event_ids), tolerance.ppm, tolerance.slack // _MICROSECOND, fold, every,
    )  # fmt: skip


def _joined(texts: Sequence[str]) -> str:
    """`texts` as metering_place_batch's query splits them (a separator before each, so that one
    empty text stays one). Validated identifiers and exporters, sources and event ids hold no
    control character (budgetgate.core.metering.validate); one that did would shift every column
    after it, so it is refused."""
    if not texts:
        return ""  # (a single separator would split into one empty text)
    joined = _SEPARATOR + _SEPARATOR.join(texts)
    if joined.count(_SEPARATOR) != len(texts):
        raise ValueError(f"a text of the batch holds the separator {_SEPARATOR!r}: {next(t for t in texts if _SEPARATOR in t)!r}")
    return joined


_USAGE_COLUMNS = (
    "run_id", "sample_id", "observed_at", "gpu_milli_hours", "node_milli_hours", "gpu_milli_hours_cumulative",
    "node_milli_hours_cumulative", "gpu_milli_hours_delta", "node_milli_hours_delta", "late", "exporter", "source", "event_id",
)  # fmt: skip


async def record_batch(conn: asyncpg.Connection, recorded: Sequence[tuple[Accepted, Source, str]], announce: outbox.Bundle) -> None:
    """Store accepted samples (each with its source and usage event id; their runs' locks held,
    judged with `assess_batch`), raise their runs' high-water marks and write the outbox bundle
    of their usage records: COPY for the rows, one statement for the runs, one for the bundle."""
    if not recorded:
        return
    rows, runs = [], {}
    for accepted, source, event_id in recorded:
        sample = accepted.sample
        rows.append((
            sample.run_id, sample.sample_id, sample.observed_at, sample.counters.gpu, sample.counters.node, accepted.cumulative.gpu,
            accepted.cumulative.node, accepted.delta.gpu, accepted.delta.node, accepted.late, sample.exporter, source, event_id,
        ))  # fmt: skip
        cumulative, added, latest, earliest = runs.get(sample.run_id, (Counters(), 0, sample.observed_at, sample.observed_at))
        runs[sample.run_id] = (cumulative.high_water(accepted.cumulative), added + 1, max(latest, sample.observed_at), min(earliest, sample.observed_at))
    await conn.copy_records_to_table("usage_records", records=rows, columns=_USAGE_COLUMNS)
    await outbox.enqueue_bundle(conn, announce)
    ids = sorted(runs)
    await conn.execute(
        sql("raise_usage_runs"), ids, [runs[r][0].gpu for r in ids], [runs[r][0].node for r in ids], [runs[r][1] for r in ids], [runs[r][2] for r in ids],
        [runs[r][3] for r in ids], [row[0] for row in rows], [row[1] for row in rows],
    )  # fmt: skip


async def add_pending(conn: asyncpg.Connection, pending: PendingSample, *, expires_at: datetime) -> tuple[bytes, tuple[tuple[str, bytes], ...]] | None:
    """Keep a sample until its run is known. A sample id kept already for the same sender is not
    kept again: the kept one's payload and headers come back, for the caller to judge the new one
    against. A limited sender's samples are kept apart from everyone else's."""
    sender = pending.sender
    row = await conn.fetchrow(
        sql("insert_pending"),
        pending.run_id,
        pending.sample_id,
        pending.observed_at,
        expires_at,
        pending.source,
        pending.topic,
        pending.partition,
        pending.offset,
        pending.payload,
        _pack_headers(pending.headers),
        sender.name if sender is not None else "",
        list(sender.namespaces) if sender is not None else [],
        list(sender.tenants) if sender is not None else [],
    )
    return None if row is None else (bytes(row["payload"]), _unpack_headers(bytes(row["headers"])))


async def take_pending(conn: asyncpg.Connection, run_id: str) -> list[PendingSample]:
    """Remove and return the run's pending samples, earliest observation first."""
    rows = await conn.fetch(sql("take_pending_of_run"), run_id)
    return sorted((_pending(row) for row in rows), key=lambda p: p.observed_at)


async def take_expired(conn: asyncpg.Connection, *, now: datetime, limit: int) -> list[PendingSample]:
    """Remove and return pending samples past their grace whose run still has no decision."""
    return [_pending(row) for row in await conn.fetch(sql("take_expired_pending"), now, limit)]


async def runs_pending_with_decision(conn: asyncpg.Connection, *, limit: int) -> list[str]:
    """Runs with pending samples that have a decision by now."""
    return [row["run_id"] for row in await conn.fetch(sql("pending_runs_with_decision"), limit)]


async def pending_count(conn: asyncpg.Connection | asyncpg.Pool) -> int:
    return int(await conn.fetchval(sql("pending_count")))


def _pending(row: asyncpg.Record) -> PendingSample:
    return PendingSample(
        run_id=row["run_id"],
        sample_id=row["sample_id"],
        observed_at=row["observed_at"],
        source=row["source"],
        topic=row["topic"],
        payload=bytes(row["payload"]),
        headers=_unpack_headers(bytes(row["headers"])),
        partition=row["kafka_partition"],
        offset=row["kafka_offset"],
        sender=Principal(row["sender"], frozenset(), tuple(row["sender_namespaces"]), tuple(row["sender_tenants"])) if row["sender"] else None,
    )


def _pack_headers(headers: Sequence[tuple[str, bytes]]) -> bytes:
    # Base64 in bytea: Kafka header values are arbitrary bytes, which neither text nor jsonb
    # can hold in general (NUL), and a header must never turn a sample into a database error.
    return json.dumps([[name, base64.b64encode(value or b"").decode("ascii")] for name, value in headers]).encode()


def _unpack_headers(packed: bytes) -> tuple[tuple[str, bytes], ...]:
    return tuple((name, base64.b64decode(value)) for name, value in json.loads(packed))
