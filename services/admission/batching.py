"""Group commit: submissions that arrive together are decided and committed together.

A submission joins the queue; a committer takes what is queued (up to `max_batch`) and hands
it to `commit`, which answers every item. Up to `in_flight` batches run at once, so one batch's
Postgres commit overlaps the next batch's Redis step; while all are busy the queue grows and
batches get larger.

A committer waits for company only when company is coming: while another batch is in flight
and submissions have been arriving less than `max_wait` apart (the average gap, weighted towards
the latest), it first waits up to `max_wait` seconds for its batch to fill, as the submissions
would otherwise commit one by one beside the batch in flight. A submission that arrives alone,
with no batch in flight or with the last ones far apart (at 200 submissions/s they are 5 ms
apart), starts its batch at once: waiting would only add `max_wait` to its answer. With
`in_flight` 1 no other batch is ever in flight, so `max_wait` is not used: a batch is what
queued while the last one committed. Committers are started on demand and stop when the queue
is empty, so nothing runs (and nothing needs stopping) while no submission waits.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable
from typing import Generic, TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")

# The weight of the latest gap between two submissions in the average gap: a few gaps in a row
# decide whether submissions are arriving together, a single short one does not.
LATEST_GAP_WEIGHT = 0.25


class GroupCommit(Generic[T]):
    def __init__(
        self,
        commit: Callable[[list[T]], Awaitable[None]],
        *,
        max_batch: int = 64,
        max_wait: float = 0.001,
        in_flight: int = 2,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._commit = commit
        self._clock = clock  # when a submission arrives (the gaps between them)
        self.max_batch = max_batch
        self.max_wait = max_wait
        self.in_flight = in_flight
        self._queue: deque[T] = deque()
        self._committers: set[asyncio.Task[None]] = set()
        self.batches = 0  # committed batches, for metrics and tests
        self.items = 0
        self.gap = float("inf")  # the average gap between submissions, in seconds
        self._last_submitted: float | None = None

    def submit(self, item: T) -> None:
        """Queue `item`; `commit` will answer it."""
        now = self._clock()
        if self._last_submitted is not None:
            gap = now - self._last_submitted
            self.gap = gap if self.gap == float("inf") else self.gap + LATEST_GAP_WEIGHT * (gap - self.gap)
        self._last_submitted = now
        self._queue.append(item)
        self._start()

    @property
    def company_coming(self) -> bool:
        """Whether more submissions are expected within `max_wait` (they have been arriving
        closer together than that)."""
        return self.gap < self.max_wait

    def resubmit(self, items: Iterable[T]) -> None:
        """Queue `items` ahead of everything else (they were held back from a batch)."""
        self._queue.extendleft(reversed(list(items)))
        self._start()

    def _start(self) -> None:
        if len(self._committers) < self.in_flight:
            task = asyncio.get_running_loop().create_task(self._run(), name="group-commit")
            self._committers.add(task)
            task.add_done_callback(self._committers.discard)  # also when cancelled before it ran

    async def _run(self) -> None:
        try:
            while self._queue:
                if self.max_wait > 0 and len(self._queue) < self.max_batch and len(self._committers) > 1 and self.company_coming:
                    await asyncio.sleep(self.max_wait)  # let the submissions on their way join
                batch = [self._queue.popleft() for _ in range(min(self.max_batch, len(self._queue)))]
                if not batch:
                    continue
                self.batches += 1
                self.items += len(batch)
                try:
                    await self._commit(batch)
                except Exception:  # noqa: BLE001 - commit answers its items; this is a bug, not an outage
                    log.exception("a batch of %d submissions failed outside its own error handling", len(batch))
        finally:
            # Out of the set in the same step as the queue was found empty. The done callback
            # runs a step later, after the submitters this batch answered have woken: one that
            # submits again at once would find every slot taken and wait for another submission.
            self._committers.discard(asyncio.current_task())  # type: ignore[arg-type]
