"""The load of `budgetgate bench metering`: exporters reporting every run once a minute.

Each run uses 8 GPUs on 1 node, so each snapshot adds 480 GPU-seconds and 60 node-seconds to
the run's counters. Snapshots go out round robin over the runs (as a fleet of exporters on a
fixed period does), and a share of them is sent a second time under a new event id, as an
exporter that did not hear the broker's acknowledgement resends: the service must find those
duplicates by sample id.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from google.protobuf.timestamp_pb2 import Timestamp

from budgetgate.core.metering import Accepted, Counters, MemoryUsage, Sample, milli, normalize
from budgetgate.v1.metering_pb2 import MeteringSample

GPUS = 8
PERIOD = timedelta(minutes=1)


@dataclass(frozen=True)
class MeteringWorkload:
    """The samples to publish, in order, and what they must add up to."""

    runs: list[str]
    messages: list[MeteringSample]
    distinct: int  # samples that are not resends
    expected: dict[str, Counters]  # per run, the cumulative usage of the clean stream
    clean: MemoryUsage  # the clean stream applied sample after sample: the usage to compare with
    accepted: list[Accepted]  # each sample of the clean stream as applied: a usage row each, for COPY

    @property
    def resends(self) -> int:
        return len(self.messages) - self.distinct


def build(*, samples: int, runs: int, resend_every: int, tag: str, now: datetime | None = None) -> MeteringWorkload:
    """`samples` snapshots over `runs` runs, plus a resend after every `resend_every`-th (0: none)."""
    run_ids = [f"bench-{tag}/run-{i:04d}" for i in range(runs)]
    per_run = -(-samples // runs)
    # All observed in the past, the last one a minute ago: none is rejected as from the future.
    start = (now or datetime.now(UTC)) - PERIOD * (per_run + 1)
    messages, clean = [], []
    for index in range(samples):
        run_id, step = run_ids[index % runs], index // runs + 1
        message = _snapshot(run_id, step, start + PERIOD * step)
        messages.append(message)
        clean.append(message)
        if resend_every and index % resend_every == resend_every - 1:
            again = MeteringSample()
            again.CopyFrom(message)
            again.event_id = str(uuid.uuid4())
            messages.append(again)
    store, outcomes = normalize(_core(m) for m in clean)
    accepted = [o for o in outcomes if isinstance(o, Accepted)]
    return MeteringWorkload(run_ids, messages, len(clean), {r: store.cumulative(r) for r in run_ids if store.recorded(r)}, store, accepted)


def _snapshot(run_id: str, step: int, at: datetime) -> MeteringSample:
    observed, sent = Timestamp(), Timestamp()
    observed.FromDatetime(at)
    sent.FromDatetime(at + timedelta(seconds=1))
    seconds = PERIOD.total_seconds() * step
    return MeteringSample(
        event_id=str(uuid.uuid4()), event_time=sent, sample_id=f"{run_id}/{step}", run_id=run_id,
        observed_at=observed, gpu_seconds=GPUS * seconds, node_seconds=seconds, exporter="budgetgate-bench",
    )  # fmt: skip


def _core(message: MeteringSample) -> Sample:
    return Sample(
        message.run_id, message.sample_id, message.observed_at.ToDatetime(tzinfo=UTC), Counters(milli(message.gpu_seconds), milli(message.node_seconds))
    )
