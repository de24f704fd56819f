"""A capacity model from measured costs: what a platform of N GPUs needs (cores per service, Redis
shards, Kafka partitions, Postgres cores, its write rate and its storage), computed from the CPU
each part spent, and the bytes Postgres wrote, per decision and per sample in `budgetgate bench admission --json` and `budgetgate bench
metering --json` (and per reconciliation record, when `bench reconciliation --json` measured it).

Nothing here measures: the benchmarks do, and this module turns their figures and a platform's
load (`Load`, every assumption named and overridable) into the resources at peak. A figure the
reports did not measure is None and printed as such, never guessed.

How a cost is read from the reports:
- a part is `postgres`, `redis` (a Redis Cluster's nodes `redis-*` added up), `broker`, or the
  service (every other counted part: one admission process or several replicas, added up); the
  load generator is not counted;
- admission: per part, the median over the rounds of budgetgate's closed loop (decisions in
  group-commit batches) and, separately, of its open loop (decisions at a real rate, mostly
  alone in their batch, so dearer); the model takes the dearer of the two per part, so the
  figures hold whether peaks arrive spread out or in bursts;
- metering: per part, the median over the rounds.
Postgres's bytes per unit (WAL written, more stored on disk) are read the same way, from each
run's `cpu.postgres_bytes_per_unit`; a report from before they were measured leaves them None.
"""

from __future__ import annotations

import functools
import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

PARTS = ("service", "postgres", "redis", "broker")
DAYS_PER_MONTH = 365.25 / 12
# Parts a benchmark shows but the model does not count as the system's.
NOT_COUNTED = frozenset({"load generator"})


class CostsMissing(ValueError):
    """A report lacks the figures the model needs; the message says which and how to get them."""


@dataclass(frozen=True)
class UnitCost:
    """CPU µs one unit of work (a decision, a sample, a record) costs each part; None when the
    report did not measure that part."""

    service: float | None = None
    postgres: float | None = None
    redis: float | None = None
    broker: float | None = None

    def of(self, part: str) -> float | None:
        return getattr(self, part)

    @classmethod
    def dearer(cls, a: UnitCost, b: UnitCost) -> UnitCost:
        return cls(**{p: _dearer(a.of(p), b.of(p)) for p in PARTS})


def _dearer(x: float | None, y: float | None) -> float | None:
    known = [v for v in (x, y) if v is not None]
    return max(known) if known else None


def _median(values: Iterable[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return round(statistics.median(known), 1) if known else None


@dataclass(frozen=True)
class WriteCost:
    """Bytes one unit of work makes Postgres write: `wal` (the server's WAL) and `stored` (more
    on disk: rows, indexes, TOAST, until archived); None when the report did not measure it."""

    wal: float | None = None
    stored: float | None = None

    @classmethod
    def read(cls, cpu: Mapping[str, Any]) -> WriteCost:
        """From one run's `cpu` figures (`postgres_bytes_per_unit`)."""
        each = cpu.get("postgres_bytes_per_unit") or {}
        return cls(*(None if each.get(k) is None else float(each[k]) for k in ("wal", "stored")))

    @classmethod
    def dearer(cls, a: WriteCost, b: WriteCost) -> WriteCost:
        return cls(*(_dearer(getattr(a, k), getattr(b, k)) for k in ("wal", "stored")))

    @classmethod
    def median(cls, costs: Sequence[WriteCost]) -> WriteCost:
        return cls(*(_median(getattr(c, k) for c in costs) for k in ("wal", "stored")))


@dataclass(frozen=True)
class Costs:
    decision: UnitCost
    sample: UnitCost
    record: UnitCost | None = None  # a reconciliation record; None when not measured
    sources: tuple[str, ...] = ()  # what each figure was read from, for the report
    decision_writes: WriteCost = WriteCost()
    sample_writes: WriteCost = WriteCost()
    record_writes: WriteCost | None = None

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Load:
    """A platform's load at its peak, per its GPUs. Every default is an assumption, printed with
    the model's output; set them to the platform's own figures."""

    utilization: float = 0.85  # share of the GPUs running work at the peak
    gpus_per_run: float = 8.0  # mean GPUs of a running run
    submissions_per_s_per_1000_gpus: float = 2.0  # peak admission requests (retries and requeues included)
    sample_seconds: float = 15.0  # one metering sample per running run this often (`budgetgate meter dcgm`'s interval)
    records_per_sample: float = 1.0  # reconciliation records the reconciler applies per sample
    headroom: float = 0.5  # the share of a core planned busy at the peak (the rest absorbs bursts and failover)
    retention_months: int = 12  # months of decisions and usage Postgres keeps before `budgetgate ledger archive` (BUDGETGATE_LEDGER_RETENTION_MONTHS)
    mean_load: float = 0.5  # the load over a month, as a share of its peak (for the storage the retention holds)
    min_replicas: int = 2  # per service, so that one can fail or be upgraded
    partitions_per_consumer: int = 2  # Kafka partitions per consumer process, to scale out without repartitioning
    min_partitions: int = 6

    def __post_init__(self) -> None:
        for name in ("utilization", "headroom", "mean_load"):
            value = getattr(self, name)
            if not 0 < value <= 1:
                raise ValueError(f"{name} must be in (0, 1], got {value}")
        for name in ("gpus_per_run", "submissions_per_s_per_1000_gpus", "sample_seconds", "records_per_sample"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("min_replicas", "partitions_per_consumer", "min_partitions", "retention_months"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")


@dataclass(frozen=True)
class Need:
    """What one part needs at the peak: CPU cores busy (None when a cost is missing) and what to
    run (replicas, shards) at the load's headroom."""

    cores_busy: float | None
    units: int | None


@dataclass(frozen=True)
class Plan:
    gpus: int
    running_runs: float
    decisions_per_s: float
    samples_per_s: float
    records_per_s: float
    admission: Need
    metering: Need
    reconciler: Need
    postgres: Need
    redis: Need
    broker: Need
    partitions: dict[str, int | None] = field(default_factory=dict)
    binding: str | None = None  # the part with the most cores busy
    postgres_wal_bytes_per_s: float | None = None  # WAL Postgres writes at the peak
    postgres_stored_bytes_per_day: float | None = None  # what a day at the peak adds to its disk
    postgres_stored_bytes_retained: float | None = None  # what the retention holds, at the mean load
    # False when reconciliation was not measured: Postgres, Redis and the broker then lack the
    # reconciler's share, and their figures are lower bounds.
    complete: bool = True

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


# -- reading the benchmarks' reports ----------------------------------------------------------


def _part(name: str) -> str | None:
    if name in NOT_COUNTED:
        return None
    if name in ("postgres", "broker"):
        return name
    if name == "redis" or name.startswith("redis-"):
        return "redis"
    return "service"


def unit_cost(us_per_unit: Mapping[str, float | None]) -> UnitCost:
    """One run's `cpu.us_per_unit` grouped into the model's parts (replicas and Redis nodes
    added up). A part the benchmark does not meter is 0: the service does not use it (the
    metering bench meters no Redis: metering-ingest never calls it). A part metered but not
    read (None) stays None, as does a sum with such a member."""
    sums: dict[str, float | None] = dict.fromkeys(PARTS, 0.0)
    for name, us in us_per_unit.items():
        part = _part(name)
        if part is None or sums[part] is None:
            continue
        sums[part] = None if us is None else (sums[part] or 0.0) + float(us)
    return UnitCost(**sums)


def median_cost(costs: Sequence[UnitCost]) -> UnitCost:
    """Per part, the median of the rounds that measured it."""
    return UnitCost(**{p: _median(c.of(p) for c in costs) for p in PARTS})


def _admission_runs(report: Mapping[str, Any], scenario: str) -> tuple[list[Mapping[str, Any]], list[Mapping[str, Any]]]:
    """The `cpu` figures of budgetgate's closed-loop and open-loop runs in `scenario`."""
    if not isinstance(report.get("results"), list):
        raise CostsMissing("not a `budgetgate bench admission --json` report: no `results`")

    def runs(rows: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
        return [r["cpu"] for r in rows if r.get("system") == "budgetgate" and r.get("scenario") == scenario and r.get("cpu")]

    closed, open_ = runs(report["results"]), runs(report.get("open_loop") or [])
    if not closed and not open_:
        raise CostsMissing(
            f"the admission report has no CPU figures of budgetgate in scenario {scenario!r}: run `budgetgate bench admission --scenario {scenario} --json`"
        )
    return closed, open_


def admission_cost(report: Mapping[str, Any], *, scenario: str = "spread") -> tuple[UnitCost, str]:
    """The dearer per part of budgetgate's closed and open loops in `scenario` (see the module
    doc), from `bench admission --json`."""
    closed, open_ = _admission_runs(report, scenario)
    cost = {name: median_cost([unit_cost(c["us_per_unit"]) for c in runs]) for name, runs in (("closed loop", closed), ("open loop", open_)) if runs}
    if len(cost) == 2:
        return UnitCost.dearer(
            cost["closed loop"], cost["open loop"]
        ), f"admission: dearer of closed loop ({len(closed)} rounds) and open loop ({len(open_)} rounds), {scenario}"
    ((which, only),) = cost.items()
    return only, f"admission: {which} only ({len(closed or open_)} rounds), {scenario}"


def admission_writes(report: Mapping[str, Any], *, scenario: str = "spread") -> WriteCost:
    """Postgres's bytes per decision, read as admission_cost reads the CPU."""
    medians = [WriteCost.median([WriteCost.read(c) for c in runs]) for runs in _admission_runs(report, scenario) if runs]
    return functools.reduce(WriteCost.dearer, medians)


def _metering_rounds(report: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    found = [r["cpu"] for r in report.get("rounds") or [report] if r.get("cpu")]
    if not found:
        raise CostsMissing("the metering report has no CPU figures (its measuring window was empty): run `budgetgate bench metering --json` with more samples")
    return found


def metering_cost(report: Mapping[str, Any]) -> tuple[UnitCost, str]:
    """Per part, the median over the rounds of `bench metering --json`'s CPU per sample."""
    found = _metering_rounds(report)
    return median_cost([unit_cost(c["us_per_unit"]) for c in found]), f"metering: median of {len(found)} rounds"


def _reconciliation_rounds(report: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    measured = [r["cpu"] for r in report.get("rounds") or [report] if isinstance(r.get("cpu"), Mapping) and "us_per_unit" in r["cpu"]]
    if not measured:
        raise CostsMissing("the reconciliation report has no CPU figures per record")
    units = {m.get("unit", "usage record") for m in measured}
    if units != {"usage record"}:
        # The lifecycle mode counts every message (events and records): not the model's unit.
        raise CostsMissing(f"the reconciliation report is per {', '.join(sorted(units))}: run `budgetgate bench reconciliation --records-per-s N --json`")
    return measured


def reconciliation_cost(report: Mapping[str, Any]) -> tuple[UnitCost, str]:
    """Per part, the median over the rounds of `bench reconciliation --json`'s CPU per record."""
    measured = _reconciliation_rounds(report)
    return median_cost([unit_cost(m["us_per_unit"]) for m in measured]), f"reconciliation: median of {len(measured)} rounds"


def costs(admission: Mapping[str, Any], metering: Mapping[str, Any], reconciliation: Mapping[str, Any] | None = None, *, scenario: str = "spread") -> Costs:
    decision, a = admission_cost(admission, scenario=scenario)
    sample, m = metering_cost(metering)
    record, r = reconciliation_cost(reconciliation) if reconciliation is not None else (None, "reconciliation: not measured")
    return Costs(
        decision,
        sample,
        record,
        (a, m, r),
        decision_writes=admission_writes(admission, scenario=scenario),
        sample_writes=WriteCost.median([WriteCost.read(c) for c in _metering_rounds(metering)]),
        record_writes=None if reconciliation is None else WriteCost.median([WriteCost.read(c) for c in _reconciliation_rounds(reconciliation)]),
    )


# -- the model --------------------------------------------------------------------------------


def _cores(*terms: tuple[float, float | None]) -> float | None:
    """Cores busy for (units per second, µs per unit) terms; None when a cost is missing."""
    if any(us is None for _, us in terms):
        return None
    return sum(rate * (us or 0.0) for rate, us in terms) / 1e6


def _replicas(cores: float | None, load: Load, *, minimum: int) -> int | None:
    """Processes (or Redis shards: one core each) to keep `cores` at the load's headroom."""
    if cores is None:
        return None
    return max(minimum, math.ceil(cores / load.headroom - 1e-9))


def plan(gpus: int, costs: Costs, load: Load = Load()) -> Plan:
    """What `gpus` GPUs need at their peak, at the measured costs."""
    if gpus <= 0:
        raise ValueError(f"gpus must be positive, got {gpus}")
    runs = gpus * load.utilization / load.gpus_per_run
    decisions = gpus / 1000 * load.submissions_per_s_per_1000_gpus
    samples = runs / load.sample_seconds
    records = samples * load.records_per_sample

    def part(name: str) -> float | None:
        terms = [(decisions, costs.decision.of(name)), (samples, costs.sample.of(name))]
        if costs.record is not None:
            terms.append((records, costs.record.of(name)))
        return _cores(*terms)

    admission = _cores((decisions, costs.decision.service))
    metering = _cores((samples, costs.sample.service))
    reconciler = _cores((records, costs.record.service)) if costs.record is not None else None
    postgres, redis, broker = part("postgres"), part("redis"), part("broker")
    wal, stored = (_written(kind, costs, ((decisions, "decision"), (samples, "sample"), (records, "record"))) for kind in ("wal", "stored"))
    per_day = None if stored is None else stored * 86_400
    metering_procs = _replicas(metering, load, minimum=load.min_replicas)
    reconciler_procs = _replicas(reconciler, load, minimum=load.min_replicas)
    busy = {"admission": admission, "metering-ingest": metering, "reconciler": reconciler, "postgres": postgres, "redis": redis, "broker": broker}
    known = {k: v for k, v in busy.items() if v is not None}
    return Plan(
        gpus=gpus,
        running_runs=round(runs, 1),
        decisions_per_s=round(decisions, 3),
        samples_per_s=round(samples, 3),
        records_per_s=round(records, 3),
        admission=Need(admission, _replicas(admission, load, minimum=load.min_replicas)),
        metering=Need(metering, metering_procs),
        reconciler=Need(reconciler, reconciler_procs),
        postgres=Need(postgres, None if postgres is None else max(1, math.ceil(postgres / load.headroom - 1e-9))),
        redis=Need(redis, _replicas(redis, load, minimum=1)),
        broker=Need(broker, None if broker is None else max(1, math.ceil(broker / load.headroom - 1e-9))),
        partitions={
            "metering samples": None if metering_procs is None else max(load.min_partitions, load.partitions_per_consumer * metering_procs),
            "usage records": None if reconciler_procs is None else max(load.min_partitions, load.partitions_per_consumer * reconciler_procs),
        },
        binding=max(known, key=lambda k: known[k]) if known else None,
        complete=costs.record is not None,
        postgres_wal_bytes_per_s=None if wal is None else round(wal, 1),
        postgres_stored_bytes_per_day=None if per_day is None else round(per_day),
        postgres_stored_bytes_retained=None if per_day is None else round(per_day * DAYS_PER_MONTH * load.retention_months * load.mean_load),
    )


def _written(kind: str, costs: Costs, rates: Iterable[tuple[float, str]]) -> float | None:
    """Bytes/s of `kind` ("wal", "stored") Postgres writes at these rates of each unit; None when
    a measured unit's bytes are missing. A unit whose CPU was not measured (the reconciliation
    record) is left out, as the CPU figures leave it (the plan is then not complete)."""
    total = 0.0
    for rate, unit in rates:
        if unit == "record" and costs.record is None:
            continue
        written = getattr(costs, f"{unit}_writes")
        each = None if written is None else getattr(written, kind)
        if each is None:
            return None
        total += rate * each
    return total


# -- output -----------------------------------------------------------------------------------


def _fmt(value: float | int | None, digits: int = 2) -> str:
    if value is None:
        return "not measured"
    return str(value) if isinstance(value, int) else f"{value:.{digits}f}"


def as_markdown(plans: Sequence[Plan], costs: Costs, load: Load) -> str:
    """The model's table (one column per platform size), the costs and the assumptions."""
    head = "| | " + " | ".join(f"{p.gpus:,} GPUs" for p in plans) + " |"
    rows = [head, "|---|" + "---|" * len(plans)]

    def row(label: str, cells: Iterable[str]) -> None:
        rows.append(f"| {label} | " + " | ".join(cells) + " |")

    row("running runs at the peak", (f"{p.running_runs:,.0f}" for p in plans))
    row("admission requests/s", (_fmt(p.decisions_per_s, 1) for p in plans))
    row("metering samples/s", (_fmt(p.samples_per_s, 1) for p in plans))
    row("reconciliation records/s", (_fmt(p.records_per_s, 1) for p in plans))
    for label, pick, unit, shared in (
        ("admission", lambda p: p.admission, "replicas", False),
        ("metering-ingest", lambda p: p.metering, "replicas", False),
        ("reconciler", lambda p: p.reconciler, "replicas", False),
        ("Postgres", lambda p: p.postgres, "cores", True),
        ("Redis", lambda p: p.redis, "shards", True),
        ("broker", lambda p: p.broker, "cores", True),
    ):
        # A store's figures lack the reconciler's share when it was not measured: at least these.
        least = "≥ " if shared and plans and not plans[0].complete else ""
        row(f"{label}: cores busy", (least + _fmt(pick(p).cores_busy, 3) if pick(p).cores_busy is not None else _fmt(None) for p in plans))
        row(f"{label}: {unit}", (least + _fmt(pick(p).units) if pick(p).units is not None else _fmt(None) for p in plans))
    for topic in plans[0].partitions if plans else ():
        row(f"Kafka partitions, {topic}", (_fmt(p.partitions.get(topic)) for p in plans))
    least = "≥ " if plans and not plans[0].complete else ""
    for label, pick, scale in (
        ("Postgres: WAL written at the peak, MB/s", lambda p: p.postgres_wal_bytes_per_s, 1e6),
        ("Postgres: stored per day at the peak, GB", lambda p: p.postgres_stored_bytes_per_day, 1e9),
        (f"Postgres: stored over {load.retention_months} months at {load.mean_load:.0%} of the peak, GB", lambda p: p.postgres_stored_bytes_retained, 1e9),
    ):
        row(label, (_fmt(None) if pick(p) is None else least + _fmt(pick(p) / scale, 3) for p in plans))
    row("binds first (most cores busy)", ((p.binding or "not measured") for p in plans))
    lines = ["\n".join(rows), "", "Costs per unit (CPU µs by part; bytes Postgres writes):", ""]
    for name, cost, writes in (
        ("decision", costs.decision, costs.decision_writes),
        ("sample", costs.sample, costs.sample_writes),
        ("reconciliation record", costs.record, costs.record_writes),
    ):
        if cost is None:
            lines.append(f"- {name}: not measured")
            continue
        cpu = ", ".join(f"{p} {_fmt(cost.of(p), 1)}" for p in PARTS)
        written = "not measured" if writes is None else f"WAL {_fmt(writes.wal, 0)}, stored {_fmt(writes.stored, 0)}"
        lines.append(f"- {name}: {cpu}; bytes: {written}")
    lines += ["", "Read from: " + "; ".join(costs.sources) + ".", "", "Load assumed: " + ", ".join(f"{k} {v}" for k, v in asdict(load).items()) + "."]
    return "\n".join(lines)
