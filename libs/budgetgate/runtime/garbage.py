"""The cyclic garbage collector of a long-running budgetgate process: how often it runs, and how
long its passes take (counted for the `/metrics` of every service).

CPython's default thresholds (700, 10, 10) suit small heaps. A consumer applying a poll of
thousands of messages holds a few hundred thousand tracked objects for the length of the poll,
so with them a young collection ran every 700 allocations, walking what the batch still held,
and a full collection (every 100 young ones) walked the whole heap. The young generation counts
allocations less deallocations, so a first threshold above what the polls in flight hold (two
polls of up to 15,000 samples in metering-ingest) is reached only by what outlives them:
collections become rare, and each walks little that is still alive.

Measured in metering-ingest with `budgetgate bench metering --samples 200000 --runs 2000` (its
garbage collection line): at (700, 10, 10), 6,312 young, 574 middle and 52 full passes, 4.25 s =
22.5 % of the service's CPU; at (50_000, 20, 100), 74 passes, 1.97 s = 10.6 %; at (200_000, 10,
10), 9 passes, 0.05 s = 0.3 %. With polls of up to 15,000 samples, (200_000, 10, 10) ran 23
passes, 0.75 s = 8.5 %; (600_000, 10, 10) 10 passes, 0.10 s = 1.2 %. Admission, whose objects
die with their request, made one pass in 6,000 decisions at a first threshold of 200,000 (two
in 2,100 at 600,000, 0.0 % of its CPU), against 2.3-2.5 % of its CPU at CPython's.
Nearly all of a service's objects die by reference counting; the collector only has cycles to
find, and it still finds them, later and in fewer passes.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Sequence
from typing import Any

# Only the first differs from CPython's: the older generations are still collected every 10
# passes of the one before, so cycles that outlived a young pass are not kept for days.
THRESHOLDS = (600_000, 10, 10)


class Collections:
    """The collector's passes and the seconds they took, per generation, since counting began.

    Updated from `gc.callbacks`, which run inside whatever allocation triggered a pass: plain
    arithmetic only there, no lock (a lock taken by the interrupted code would deadlock)."""

    def __init__(self) -> None:
        self.passes = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]
        self._started = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        generation = info["generation"]
        self.passes[generation] += 1
        self.seconds[generation] += time.perf_counter() - self._started


_counting: Collections | None = None


def collections() -> Collections:
    """This process's count of collections, started on the first call (the collector is one per
    process, and so is its count)."""
    global _counting
    if _counting is None:
        _counting = Collections()
        gc.callbacks.append(_counting)
    return _counting


def settle(thresholds: Sequence[int]) -> None:
    """Called once a service is built: what exists by then lives as long as the process and is
    moved out of the collector's sight (gc.freeze), and collections run at `thresholds`."""
    gc.freeze()
    gc.set_threshold(*thresholds)
