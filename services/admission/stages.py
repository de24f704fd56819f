"""Where a submission's time goes, stage by stage, for `budgetgate_admission_stage_seconds`.

A submission on `POST /v1/admissions` passes, in order:

- `body_and_auth`: the caller checked, the body read and validated (the fast path's own work;
  for a caller near its rate limit, its count awaited too);
- `plan`: the pure part of deciding (the bundle's covering policies, the plan, the asks);
- `batch_wait`: queued until the group commit starts the batch it is in (batching.py);
- `postgres_read`: a connection and `begin_batch` (the ledger lock, the runs' locks and their
  latest decisions; no BEGIN: see ledger_session);
- `redis`: the batch's check-and-reserve script (and, rarely, loading keys Redis never saw);
- `decide`: the batch's own Python work: sorting out replays and conflicts, concluding each
  decision and rendering its answer (and any wait for a caller's count on its rate limit, sent
  before its submission was planned: fastpath.py; done by then, as a rule);
- `postgres_write`: the decisions encoded (rows and messages) and stored in one statement, which
  commits as it ends (waiting for the WAL flush; no COMMIT of its own), the locks let go after
  the answer;
- `answer`: from the batch's end until the answer is written (the submitter woken, the answer
  counted and encoded).

The stages follow each other, so they add up to the time from the request's arrival at the
service to its answer. The batch stages are the batch's, and every submission in it waited
through them. A histogram record costs more CPU (6 to 10 µs) than most stages take, so not
every submission is timed: one is whenever `interval` seconds have passed since the last timed
one (0: every one); the clocks themselves cost well under a microsecond.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

STAGES = ("body_and_auth", "plan", "batch_wait", "postgres_read", "redis", "decide", "postgres_write", "answer")


@dataclass(slots=True)
class BatchClock:
    """What one batch spent: when it started and ended, and its seconds in each of its steps
    on Postgres and Redis (added up over its tries, when it is decided again)."""

    started: float = field(default_factory=time.perf_counter)
    ended: float = 0.0
    postgres_read: float = 0.0
    redis: float = 0.0
    postgres_write: float = 0.0

    @property
    def waited(self) -> float:
        return self.postgres_read + self.redis + self.postgres_write


@dataclass(slots=True)
class StageClock:
    """When one submission passed each stage's end (time.perf_counter)."""

    received: float
    read: float = 0.0  # body and auth done
    planned: float = 0.0
    batch: BatchClock | None = None

    def stages(self, answered: float) -> dict[str, float] | None:
        """Seconds per stage, given when the answer was written; None if it never reached a
        batch (answered from the plan, or failed before)."""
        batch = self.batch
        if batch is None or not self.read or not self.planned or not batch.ended:
            return None
        return {
            "body_and_auth": self.read - self.received,
            "plan": self.planned - self.read,
            "batch_wait": batch.started - self.planned,
            "postgres_read": batch.postgres_read,
            "redis": batch.redis,
            "decide": max(batch.ended - batch.started - batch.waited, 0.0),
            "postgres_write": batch.postgres_write,
            "answer": answered - batch.ended,
        }


class StageSampler:
    """Picks the submissions to time: one whenever `interval` seconds have passed since the last."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self._last = float("-inf")

    def clock(self, now: float) -> StageClock | None:
        if now - self._last < self.interval:
            return None
        self._last = now
        return StageClock(now)
