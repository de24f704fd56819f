"""Where a benchmarked admission service spent a submission's time, stage by stage: its
`budgetgate_admission_stage_seconds` histogram (services/admission/stages.py) read from
`/metrics` before and after the measured load, so that only the load's submissions count, and
each stage's p50 and p99 estimated from the buckets as Prometheus's histogram_quantile does
(linearly within the bucket the rank falls in). Replicas of the service are read one by one and
their histograms added up (`combine`): the stages of every submission, whichever replica
answered it."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

log = logging.getLogger(__name__)

FAMILY = "budgetgate_admission_stage_seconds"

# Per stage, the cumulative count of each bucket: (upper bound, count), +Inf last.
Buckets = dict[str, list[tuple[float, float]]]


@dataclass(frozen=True)
class Stage:
    """One stage over the measured load: how many timed submissions passed it, their p50 and p99
    and their mean, in milliseconds."""

    name: str
    count: int
    p50_ms: float | None
    p99_ms: float | None
    mean_ms: float | None

    def as_json(self) -> dict[str, object]:
        return {"count": self.count, "p50_ms": _round(self.p50_ms), "p99_ms": _round(self.p99_ms), "mean_ms": _round(self.mean_ms)}


def parse(text: str) -> tuple[Buckets, dict[str, float]]:
    """The stage histogram's buckets and sums (seconds) per stage, from a Prometheus text
    exposition; empty when the service has none."""
    buckets: Buckets = {}
    sums: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name != FAMILY:
            continue
        for sample in family.samples:
            stage = sample.labels.get("stage")
            if stage is None:
                continue
            if sample.name.endswith("_bucket"):
                buckets.setdefault(stage, []).append((float(sample.labels["le"]), sample.value))
            elif sample.name.endswith("_sum"):
                sums[stage] = sample.value
    return {stage: sorted(found) for stage, found in buckets.items()}, sums


def combine(readings: Sequence[tuple[Buckets, dict[str, float]] | None]) -> tuple[Buckets, dict[str, float]] | None:
    """The histograms of several replicas as one (bucket counts and sums added, as Prometheus's
    `sum by (le)` does); None when one of them could not be read (its submissions would be missing)."""
    if not readings or any(reading is None for reading in readings):
        return None
    counts: dict[str, dict[float, float]] = {}
    sums: dict[str, float] = {}
    for buckets, seconds in (reading for reading in readings if reading is not None):
        for stage, cumulative in buckets.items():
            for bound, count in cumulative:
                counts.setdefault(stage, {})[bound] = counts.setdefault(stage, {}).get(bound, 0.0) + count
        for stage, spent in seconds.items():
            sums[stage] = sums.get(stage, 0.0) + spent
    return {stage: sorted(found.items()) for stage, found in counts.items()}, sums


async def read_all(base_urls: Sequence[str]) -> tuple[Buckets, dict[str, float]] | None:
    """The stage histogram of every replica at `base_urls`, added up; None when one cannot be read."""
    return combine([await read(url) for url in base_urls])


def between(before: tuple[Buckets, dict[str, float]], after: tuple[Buckets, dict[str, float]]) -> list[Stage]:
    """Each stage as recorded between two readings of the histogram, in the order the service
    lists them."""
    (counts_before, sums_before), (counts_after, sums_after) = before, after
    stages = []
    for name, cumulative in counts_after.items():
        earlier = dict(counts_before.get(name, []))
        grown = [(bound, count - earlier.get(bound, 0.0)) for bound, count in cumulative]
        total = grown[-1][1] if grown else 0.0
        seconds = sums_after.get(name, 0.0) - sums_before.get(name, 0.0)
        stages.append(
            Stage(name, int(total), _quantile_ms(grown, 0.5), _quantile_ms(grown, 0.99), seconds / total * 1000 if total else None),
        )
    return stages


def _quantile_ms(cumulative: list[tuple[float, float]], q: float) -> float | None:
    """The q-quantile of a cumulative histogram (bounds ascending, +Inf last), in milliseconds."""
    if not cumulative or cumulative[-1][1] <= 0:
        return None
    rank = q * cumulative[-1][1]
    lower, below = 0.0, 0.0
    for bound, count in cumulative:
        if count >= rank:
            if math.isinf(bound):
                return lower * 1000  # above the highest finite bound: that bound, as Prometheus says
            share = (rank - below) / (count - below) if count > below else 1.0
            return (lower + (bound - lower) * share) * 1000
        lower, below = bound, count
    return lower * 1000


async def read(base_url: str) -> tuple[Buckets, dict[str, float]] | None:
    """The service's stage histogram now; None when it cannot be read (an addition to a run,
    never its failure)."""
    try:
        async with httpx.AsyncClient(base_url=base_url, timeout=5) as client:
            response = await client.get("/metrics")
            response.raise_for_status()
    except httpx.HTTPError as exc:
        log.warning("stage figures left out: %s", exc)
        return None
    return parse(response.text)


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)
