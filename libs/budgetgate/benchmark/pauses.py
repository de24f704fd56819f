"""What the garbage collector cost a benchmarked service: its passes and the seconds they took
(the service's `/metrics`, budgetgate.runtime.garbage) against the CPU the process spent, both since it
started. A sampling profiler does not show these pauses (they land in whatever frame allocated),
and thresholds that suit one load do not suit every load, so the benchmarks report them."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

from budgetgate.benchmark.cpu import process_seconds

log = logging.getLogger(__name__)

GENERATIONS = ("young", "middle", "full")


@dataclass(frozen=True)
class Collections:
    """The collector's passes and seconds per generation, and the process's CPU seconds."""

    passes: tuple[int, ...]
    seconds: tuple[float, ...]
    cpu_seconds: float

    @property
    def share(self) -> float | None:
        """The share of the process's CPU spent in collections."""
        return sum(self.seconds) / self.cpu_seconds if self.cpu_seconds > 0 else None

    replicas: int = 1  # processes added up (`total`)

    @classmethod
    def total(cls, found: Sequence[Collections | None]) -> Collections | None:
        """The replicas of a service as one: their passes, seconds and CPU added up; None when one
        of them could not be read."""
        if not found or any(c is None for c in found):
            return None
        known = [c for c in found if c is not None]
        passes = tuple(sum(c.passes[g] for c in known) for g in range(len(GENERATIONS)))
        seconds = tuple(sum(c.seconds[g] for c in known) for g in range(len(GENERATIONS)))
        return cls(passes, seconds, sum(c.cpu_seconds for c in known), sum(c.replicas for c in known))

    def line(self) -> str:
        counts = ", ".join(f"{name} {count}" for name, count in zip(GENERATIONS, self.passes, strict=True))
        whose = "the service" if self.replicas == 1 else f"the service's {self.replicas} replicas, added up,"
        share = "" if self.share is None else f" = {self.share:.1%} of {'its' if self.replicas == 1 else 'their'} {self.cpu_seconds:.2f} s CPU"
        return f"garbage collection in {whose} since it started: {sum(self.passes)} passes ({counts}), {sum(self.seconds):.3f} s{share}"

    def as_json(self) -> dict[str, object]:
        return {
            "passes": dict(zip(GENERATIONS, self.passes, strict=True)),
            "seconds": {name: round(s, 4) for name, s in zip(GENERATIONS, self.seconds, strict=True)},
            "cpu_seconds": round(self.cpu_seconds, 3),
            "share": None if self.share is None else round(self.share, 4),
            "replicas": self.replicas,
        }


async def observed(base_url: str, pid: int) -> Collections | None:
    """`read`, or None when the figures cannot be read: like the CPU figures, an addition to a
    benchmark run, never its failure."""
    try:
        return await read(base_url, pid)
    except Exception as exc:  # noqa: BLE001 - see the docstring
        log.warning("garbage collection figures left out: %s", exc)
        return None


async def observed_all(services: Sequence[tuple[str, int]]) -> Collections | None:
    """`observed` for each replica (base URL, pid) of a service, added up (`Collections.total`)."""
    return Collections.total([await observed(url, pid) for url, pid in services])


async def read(base_url: str, pid: int) -> Collections:
    """The service's collections (its `/metrics` at `base_url`) and its process's CPU so far."""
    async with httpx.AsyncClient(base_url=base_url, timeout=5) as client:
        response = await client.get("/metrics")
        response.raise_for_status()
    cpu_seconds = process_seconds(pid)
    if cpu_seconds is None:
        raise ValueError(f"the CPU of process {pid} cannot be read on this machine")
    return parse(response.text, cpu_seconds=cpu_seconds)


def parse(text: str, *, cpu_seconds: float) -> Collections:
    """`Collections` from a Prometheus text exposition; ValueError when it has no such figures."""
    passes, seconds = [0] * len(GENERATIONS), [0.0] * len(GENERATIONS)
    found = set()
    for family in text_string_to_metric_families(text):
        if family.name not in ("budgetgate_gc_collections", "budgetgate_gc_pause_seconds"):
            continue
        for sample in family.samples:
            if sample.name.endswith("_total"):
                generation = int(sample.labels["generation"])
                if family.name == "budgetgate_gc_collections":
                    passes[generation] = int(sample.value)
                else:
                    seconds[generation] = float(sample.value)
                found.add(family.name)
    if len(found) < 2:
        raise ValueError("the service's /metrics has no garbage collector figures (budgetgate_gc_collections, budgetgate_gc_pause_seconds)")
    return Collections(tuple(passes), tuple(seconds), cpu_seconds)
