"""Metering ingest: validate → load the run → assess (the core) → record + outbox, or keep the
sample pending while its run has no decision yet.

Everything about one sample happens in the caller's Postgres transaction, under the run's lock:
the usage row, the run's new high-water mark and the outbox row of its usage record (for a
batch, one outbox bundle of all its usage records) commit together or not at all, and so does a
sample kept pending. The Kafka consumer calls this with its inbox row in the same transaction;
HTTP ingest with a transaction per sample.

A run is known once a decision for it exists. A sample of an unknown run is kept in
metering_pending until observed_at + the grace period: admission decides before a run starts,
so a decision that has not appeared by then is taken to never come (unknown_run, dead-lettered
through the outbox). Pending samples are applied, earliest observation first, as soon as their
run is known: by the next sample of that run, or by `recheck`, which runs periodically.

A sample posted by a sender limited to namespaces or tenants (an exporter token's limits) whose
run had no decision when the request was checked (access.py) is kept pending with the sender's
limits, whatever the run has by the time it is placed; once the run has a decision, it is applied
only if the run is within those limits, else dead-lettered as out_of_scope (never charged).

A sample above what its run can have used (its GPUs (nodes) x the time since its earliest
decision, plus the tolerance: budgetgate.core.metering.UsageBound) is rejected as
impossible_usage. The run's capacity is kept on its usage_runs row when it is introduced; before
a sample is refused by it, the capacity is read again from the run's decisions (a later attempt
may have asked for more), so the row only ever sends a sample to a closer look.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from typing import NamedTuple, Protocol

import asyncpg
from aiokafka import ConsumerRecord

from budgetgate.messaging import outbox

from budgetgate.contracts import topics, wire
from budgetgate.core.metering import (
    DEFAULT_USAGE_TOLERANCE,
    Accepted,
    Counters,
    Duplicate,
    Problem,
    Rejected,
    Rejection,
    RunView,
    Sample,
    Tolerance,
    UsageBound,
    assess,
    assess_batch,
    pending_conflict,
    reason_code,
    usage_event_id,
    validate,
)
from budgetgate.core.principals import Principal
from budgetgate.services.metering_ingest import store
from budgetgate.services.metering_ingest.codecs import raw_sample, timestamp, usage_draft, usage_record, with_run_figures
from budgetgate.contracts.trace_context import inject_headers
from budgetgate.services.metering_ingest.store import Owner, PendingSample, RunState, Source
from budgetgate.v1.metering_pb2 import MeteringSample

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Pending:
    """A sample kept until its run has a decision, or dead-lettered at `until`."""

    sample: Sample
    until: datetime


class Folded:
    """An accepted sample whose figures were not read: neither its span's point nor late, one of
    the samples a point stands for (Ingestor.place_batch with `every` false). One instance,
    FOLDED."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "FOLDED"


FOLDED = Folded()

Outcome = Accepted | Duplicate | Pending


class Origin(NamedTuple):
    """Where a sample came from, kept with it while pending and on its way to the DLQ (a tuple:
    one is made per sample of every batch)."""

    source: Source
    topic: str  # as the sample arrived on it (prefixed); HTTP samples name the metering topic
    payload: bytes
    headers: tuple[tuple[str, bytes], ...]
    partition: int | None = None
    offset: int | None = None
    # A sender limited to namespaces or tenants, whose limits the run is still to be checked
    # against (it had no decision when the request was checked): the sample is kept pending.
    sender: Principal | None = None


class RecordOrigin:
    """The Origin of a sample consumed from Kafka, read off its record only when it is needed
    (a sample kept pending): one is made per sample of every batch."""

    __slots__ = ("record",)
    source: Source = "kafka"
    sender: Principal | None = None  # Kafka names no principal: the topic's ACLs say who writes

    def __init__(self, record: ConsumerRecord) -> None:
        self.record = record

    @property
    def topic(self) -> str:
        return str(self.record.topic)

    @property
    def payload(self) -> bytes:
        return bytes(self.record.value)

    @property
    def headers(self) -> tuple[tuple[str, bytes], ...]:
        return tuple(self.record.headers or ())

    @property
    def partition(self) -> int | None:
        return int(self.record.partition)

    @property
    def offset(self) -> int | None:
        return int(self.record.offset)


Origins = Origin | RecordOrigin


class Counts(Protocol):
    """Where outcomes found outside a request or a consumed message are counted."""

    def outcome(self, outcome: Outcome, *, source: str) -> None: ...

    def rejected(self, reason: Rejection, *, source: str) -> None: ...


class Ingestor:
    """Turns samples into usage in Postgres; see the module docstring for the rules."""

    def __init__(
        self,
        *,
        max_skew: timedelta,
        grace: timedelta,
        counts: Counts,
        tenant_label: str = "team",
        usage_tolerance: float = DEFAULT_USAGE_TOLERANCE,
        usage_slack: timedelta | None = None,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
        fold: timedelta | None = None,
    ) -> None:
        self.max_skew = max_skew
        # A run's samples of one quarter hour in one consumed batch are one point, one usage row
        # and one usage record (None: every sample its own, as HTTP ingest always records them).
        self.fold = fold
        self.grace = grace
        # A sample above its run's GPUs (nodes) x the time since its earliest decision, plus the
        # clock slack (by default as far as a sample may be from the future) and this ratio, is
        # impossible (budgetgate.core.metering.UsageBound).
        self.tolerance = Tolerance.of(usage_tolerance, slack=max_skew if usage_slack is None else usage_slack)
        self.counts = counts
        self.tenant_label = tenant_label  # the decisions' label naming a run's tenant
        self.clock = clock

    def validate(self, message: MeteringSample, *, now: datetime | None = None) -> Sample:
        """The normalized sample; raises Rejected naming every bad field (`now`: the clock's, read
        once for a whole batch)."""
        return validate(raw_sample(message), now=now or self.clock(), max_skew=self.max_skew)

    async def ingest(self, conn: asyncpg.Connection, message: MeteringSample, origin: Origins) -> Outcome:
        """Validate and place one sample in `conn`'s transaction; raises Rejected."""
        return await self.place(conn, self.validate(message), origin)

    async def place(self, conn: asyncpg.Connection, sample: Sample, origin: Origins) -> Outcome:
        """Record a valid sample, find it a duplicate, or keep it pending; raises Rejected."""
        now = self.clock()
        if origin.sender is None:
            begun = await store.begin(conn, sample, self.tolerance)  # the run's lock is held from here on
            if begun.view is not None:
                return await self._apply(conn, sample, begun.view, origin.source, now)
            if begun.has_decision:
                state = await self._introduce(conn, sample.run_id)
                return await self._apply(conn, sample, await store.view(conn, sample, state, self.tolerance), origin.source, now)
        else:
            # Its run had no decision when the sender's limits were checked: kept pending even if
            # it has one by now, and judged against the limits when applied (_drain).
            await store.lock_run(conn, sample.run_id)
        kept = await self._keep_pending(conn, sample, origin, now)
        if isinstance(kept, Rejected):
            raise kept
        return kept

    async def place_batch(
        self,
        conn: asyncpg.Connection,
        batch: Sequence[tuple[Sample, Origins]],
        *,
        locked: Callable[[], None] = lambda: None,
        event_ids: Sequence[str] | None = None,
        every: bool = True,
    ) -> list[Outcome | Folded | Rejected]:
        """`place` for many valid samples at once, in order (two samples of one run judge each
        other as if placed one after the other); a sample's Rejected is its outcome. `event_ids`:
        those of the samples' usage records, when the caller derived them already (a Kafka
        poll's, while the poll before it was in Postgres). `every` false: an accepted sample that
        is neither its span's point nor late is FOLDED, its figures not read (a Kafka poll counts
        them only).

        Postgres judges and records the samples of the runs its set-based rules cover
        (metering_place_batch), with `fold` as one point (one row, one usage record) per run and
        quarter hour of the batch; the core judges the rest, run by run (`_judge`), a row each. `locked()` is
        called once the transaction holds the locks of every run of the batch (all it takes
        here: samples left to the core are judged under those locks) and its outbox row is
        written (budgetgate.messaging.inbox.locks_taken)."""
        now = self.clock()
        samples = [sample for sample, _ in batch]
        if event_ids is None:
            event_ids = [usage_event_id(s.run_id, s.sample_id) for s in samples]
        elif len(event_ids) != len(samples):
            raise ValueError(f"{len(event_ids)} event ids for {len(samples)} samples")
        placing = asyncio.ensure_future(
            store.place_batch(
                conn, samples, sources=[origin.source for _, origin in batch], event_ids=event_ids, tolerance=self.tolerance, fold=self.fold, every=every
            )
        )
        try:
            await asyncio.sleep(0)  # the batch goes out
            recorded_at, trace_headers = timestamp(now), inject_headers()  # the same for the whole batch
        finally:
            placed = await placing  # awaited whatever happened: the connection is not left in use
        # Without `every`, a sample without a row was accepted and folded into its span's point.
        outcomes: list[Outcome | Folded | Rejected | None] = [None if every else FOLDED] * len(batch)
        left: list[int] = []
        points = []
        for idx, outcome, of, gpu, node, gpu_delta, node_delta, late, order, *record in placed:
            index = idx - 1
            sample = samples[index]
            if outcome == "accepted":
                outcomes[index] = Accepted(sample, cumulative=Counters(gpu, node), delta=Counters(gpu_delta, node_delta), late=late)
                if order is not None:  # the point its span of the run's samples is recorded as
                    cumulative_gpu, cumulative_node, delta_gpu, delta_node = record  # the span's, as one point
                    point = Accepted(sample, cumulative=Counters(cumulative_gpu, cumulative_node), delta=Counters(delta_gpu, delta_node), late=late)
                    draft = usage_draft(sample, recorded_at=recorded_at, event_id=event_ids[index])
                    points.append((order, sample.run_id, with_run_figures(draft, point)))
            elif outcome == "duplicate":
                outcomes[index] = Duplicate(sample, of=of)
            else:
                left.append(index)
        points.sort(key=lambda point: point[0])  # a run's records raise its cumulative in order
        announce, keys = [message for _, _, message in points], [run_id for _, run_id, _ in points]
        await outbox.enqueue_bundle(conn, outbox.bundle_messages(topic=topics.USAGE, messages=announce, keys=keys, trace_headers=trace_headers))
        # Only now: the next poll's handler (its columns built and encoded, 10-15 ms of this
        # process for 15,000 samples) would otherwise run before this poll's outbox row and
        # commit are sent, and its statement waits on this poll's locks until that commit anyway.
        locked()
        if left:
            for index, outcome in zip(left, await self._judge(conn, [batch[i] for i in left], [event_ids[i] for i in left], now), strict=True):
                outcomes[index] = outcome
        assert all(o is not None for o in outcomes), "metering_place_batch left a sample out"
        return [o for o in outcomes if o is not None]

    async def _judge(
        self, conn: asyncpg.Connection, batch: Sequence[tuple[Sample, Origins]], event_ids: Sequence[str], now: datetime
    ) -> list[Outcome | Rejected]:
        """The core's judgement of samples the set-based rules leave to it (runs without a
        decision, with pending samples, with a sample above the run's bound, or with a conflict or
        regression in the batch); `event_ids`, those of their usage records."""
        samples = [sample for sample, _ in batch]
        begun = await store.begin_batch(conn, samples, event_ids)  # every run's lock is held from here on
        introduced = sorted({s.run_id for s in samples if s.run_id not in begun.runs and s.run_id in begun.decided})
        if introduced:
            for run_id in introduced:
                await self._introduce(conn, run_id)
            begun = await store.begin_batch(conn, samples, event_ids)  # re-read with their pending samples applied
        outcomes: list[Outcome | Rejected | None] = [None] * len(batch)
        known: list[int] = []
        for index, (sample, origin) in enumerate(batch):
            if sample.run_id in begun.runs:
                known.append(index)
            else:
                outcomes[index] = await self._keep_pending(conn, sample, origin, now)
        runs = await self._bounded(conn, begun.runs, [samples[i] for i in known])
        judged = assess_batch((samples[i], begun.view(i, runs[samples[i].run_id], self.tolerance)) for i in known)
        recorded, announce, keys = [], [], []
        recorded_at, trace_headers = timestamp(now), inject_headers()  # the same for the whole batch
        for index, outcome in zip(known, judged, strict=True):
            outcomes[index] = outcome
            if isinstance(outcome, Accepted):
                sample, event_id = outcome.sample, event_ids[index]
                recorded.append((outcome, batch[index][1].source, event_id))
                announce.append(usage_record(outcome, recorded_at=recorded_at, event_id=event_id))
                keys.append(sample.run_id)
        bundle = outbox.bundle_messages(topic=topics.USAGE, messages=announce, keys=keys, trace_headers=trace_headers)
        await store.record_batch(conn, recorded, bundle)
        return [o for o in outcomes if o is not None]

    async def _keep_pending(self, conn: asyncpg.Connection, sample: Sample, origin: Origins, now: datetime) -> Pending | Rejected:
        """Keep a sample of a run without a decision until its grace ends (the run's lock held)."""
        until = sample.observed_at + self.grace
        if until <= now:
            return Rejected(self._unknown_run(sample.run_id))
        pending = PendingSample(
            sample.run_id, sample.sample_id, sample.observed_at, origin.source, origin.topic, origin.payload, origin.headers, origin.partition, origin.offset,
            origin.sender,
        )  # fmt: skip
        kept = await store.add_pending(conn, pending, expires_at=until)
        if kept is not None and (conflict := self._pending_conflict(sample, *kept)) is not None:
            return Rejected(conflict)  # the sample kept first stays; this one was never kept
        return Pending(sample, until)

    def _pending_conflict(self, sample: Sample, payload: bytes, headers: tuple[tuple[str, bytes], ...]) -> Problem | None:
        """Why `sample` contradicts the one of its id kept pending before (as it arrived), if it does."""
        try:
            kept = self.validate(wire.decode(MeteringSample, payload, headers))
        except (Rejected, wire.WireError):
            return None  # the kept one is judged (and dead-lettered) when its run is known
        return pending_conflict(kept, sample)

    async def _introduce(self, conn: asyncpg.Connection, run_id: str) -> RunState:
        """Start the usage of a run that has a decision (its lock held): its pending samples first."""
        await store.create_run(conn, run_id)
        await self._drain(conn, run_id)
        state = await store.run_state(conn, run_id)
        assert state is not None
        return state

    async def _bounded(self, conn: asyncpg.Connection, runs: dict[str, RunState], samples: Sequence[Sample]) -> dict[str, RunState]:
        """`runs` with the capacity of those with a sample above their bound as their decisions
        say now (a later attempt may have asked for more than the run was introduced with)."""
        above = sorted({s.run_id for s in samples if (bound := runs[s.run_id].bound(self.tolerance)) is not None and not bound.allows(s)})
        if not above:
            return runs
        fresh = await store.refresh_capacity(conn, above)
        return {**runs, **{run_id: replace(runs[run_id], capacity=fresh.get(run_id)) for run_id in above}}

    async def _apply(self, conn: asyncpg.Connection, sample: Sample, view: RunView, source: Source, now: datetime) -> Accepted | Duplicate:
        if view.bound is not None and not view.bound.allows(sample):
            # Judged by the capacity the run's decisions give now, not the one kept on its row.
            capacity = (await store.refresh_capacity(conn, [sample.run_id])).get(sample.run_id)
            view = replace(view, bound=None if capacity is None else UsageBound(capacity, self.tolerance))
        outcome = assess(sample, view)
        if isinstance(outcome, Accepted):
            announce = outbox.row(topic=topics.USAGE, record=wire.encode(usage_record(outcome, recorded_at=now), key=sample.run_id))
            await store.record(conn, outcome, source=source, announce=announce)
        return outcome

    async def _drain(self, conn: asyncpg.Connection, run_id: str) -> None:
        """Apply the pending samples of a run that is now known (its lock held); those of a limited
        sender only if the run is within its limits, the others are dead-lettered."""
        taken = await store.take_pending(conn, run_id)
        owner = None
        if any(pending.sender is not None for pending in taken):
            owner = (await store.run_owners(conn, [run_id], tenant_label=self.tenant_label)).get(run_id)
        for pending in taken:
            if pending.sender is not None and (owner is None or not pending.sender.covers(owner.namespace, owner.tenant)):
                await self._dead_letter(conn, pending, str(_out_of_scope(pending, pending.sender, owner)))
                continue
            state = await store.run_state(conn, run_id)
            assert state is not None
            try:
                sample = self.validate(wire.decode(MeteringSample, pending.payload, pending.headers))
                outcome = await self._apply(conn, sample, await store.view(conn, sample, state, self.tolerance), pending.source, self.clock())
            except (Rejected, wire.WireError) as exc:
                await self._dead_letter(conn, pending, str(exc))
                continue
            self.counts.outcome(outcome, source=pending.source)

    async def recheck(self, pool: asyncpg.Pool, *, batch: int = 100) -> int:
        """Apply pending samples whose run now has a decision, dead-letter those whose grace
        ended; returns how many samples are still pending."""
        async with pool.acquire() as conn:
            for run_id in await store.runs_pending_with_decision(conn, limit=batch):
                async with conn.transaction():
                    await store.lock_run(conn, run_id)
                    if await store.run_state(conn, run_id) is None:
                        await self._introduce(conn, run_id)
                    else:
                        await self._drain(conn, run_id)  # not expected (a known run keeps nothing pending), but never left behind
            async with conn.transaction():
                for pending in await store.take_expired(conn, now=self.clock(), limit=batch):
                    await self._dead_letter(conn, pending, str(self._unknown_run(pending.run_id)))
            return await store.pending_count(conn)

    def _unknown_run(self, run_id: str) -> Problem:
        return Problem(Rejection.UNKNOWN_RUN, "run_id", f"run {run_id!r} has no decision {self.grace.total_seconds():g}s after the sample was observed")

    async def _dead_letter(self, conn: asyncpg.Connection, pending: PendingSample, reason: str) -> None:
        """Park a pending sample on the metering DLQ, through the outbox (so, with this transaction)."""
        log.warning("metering sample %r of run %r to the dead-letter topic: %s", pending.sample_id, pending.run_id, reason)
        record = wire.dead_letter(_Parked(pending), reason=reason)
        await outbox.enqueue(conn, topic=topics.dlq(topics.METERING), record=record)
        self.counts.rejected(reason_code(reason), source=pending.source)


def _out_of_scope(pending: PendingSample, sender: Principal, owner: Owner | None) -> Problem:
    found = "has no decision" if owner is None else f"is in namespace {owner.namespace!r}, " + (f"tenant {owner.tenant!r}" if owner.tenant else "of no tenant")
    return Problem(
        Rejection.OUT_OF_SCOPE,
        "run_id",
        f"sample {pending.sample_id!r} was posted by {sender.name!r}, limited to {sender.limits}, before run {pending.run_id!r} had a decision; "
        f"the run {found}, outside those limits, so the sample is not charged",
    )


class _Parked:
    """A pending sample seen as the consumed record wire.dead_letter expects."""

    def __init__(self, pending: PendingSample) -> None:
        self.topic = pending.topic
        self.partition = pending.partition if pending.partition is not None else -1
        self.offset = pending.offset if pending.offset is not None else -1
        self.key: bytes | None = pending.run_id.encode()
        self.value: bytes | None = pending.payload
        # The outbox keeps headers as text in jsonb, which cannot hold NUL: such a header
        # (never one budgetgate writes) is left off rather than wedge the re-check.
        self.headers = [(k, v) for k, v in pending.headers if "\x00" not in k and b"\x00" not in v]
