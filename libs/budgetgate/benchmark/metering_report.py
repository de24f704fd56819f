"""`budgetgate bench metering` results as text and as JSON."""

from __future__ import annotations

import os
from typing import Any

from budgetgate.benchmark.metering_runner import COPY_TRIES, Options, Result


def as_json(options: Options, result: Result) -> dict[str, Any]:
    """The whole report as one JSON document."""
    ingest_rows_per_s = _per_second(result.rows, result.ingest_seconds)
    copy_rows_per_s = _per_second(result.rows, result.copy_seconds)
    return {
        "options": {"samples": options.samples, "runs": options.runs, "resend_every": options.resend_every, "partitions": options.partitions},
        "load": {"messages": result.messages, "distinct_samples": result.distinct, "resends": result.messages - result.distinct, "runs": result.runs},
        "ingest": {
            "seconds": round(result.ingest_seconds, 3),
            "messages_per_second": _per_second(result.messages, result.ingest_seconds),
            "rows": result.rows,
            "rows_per_second": ingest_rows_per_s,
            "usage_records": result.published,
            "outbox_unpublished_at_end": result.unpublished_at_end,
        },
        "copy": {"seconds": round(result.copy_seconds, 3), "rows": result.rows, "rows_per_second": copy_rows_per_s, "best_of": COPY_TRIES},
        "ratio_rows_per_second": round(ingest_rows_per_s / copy_rows_per_s, 5) if copy_rows_per_s else None,
        "cpu": {**result.cpu.as_json(result.cpu_samples), "samples": result.cpu_samples, "bound": _bound(result, copy_rows_per_s)} if result.cpu else None,
        "garbage_collection": result.collections.as_json() if result.collections else None,
        "correct": result.correct,
        "problems": result.problems,
        "cpus": os.cpu_count(),
        "run_tag": result.tag,
    }


def as_text(options: Options, result: Result) -> str:
    """A table of both figures, the ratio and the correctness check."""
    data = as_json(options, result)
    ingest, copy = data["ingest"], data["copy"]
    lines = [
        f"load: {result.messages} samples ({result.distinct} distinct + {result.messages - result.distinct} resends under new event ids) "
        f"of {result.runs} runs, pre-published to {options.partitions} partition(s); {data['cpus']} CPUs shared by everything",
        "",
        f"{'system':<26}{'rows':>8}{'seconds':>10}{'rows/s':>11}{'samples/s':>11}",
        f"{'metering-ingest (Kafka)':<26}{result.rows:>8}{ingest['seconds']:>10.2f}{ingest['rows_per_second']:>11.1f}{ingest['messages_per_second']:>11.1f}",
        f"{'COPY into usage_records':<26}{result.rows:>8}{copy['seconds']:>10.2f}{copy['rows_per_second']:>11.1f}{'-':>11}",
        "",
        f"ratio (metering-ingest / COPY, rows/s): {data['ratio_rows_per_second']}x (COPY: the best of {COPY_TRIES})",
        f"usage records published: {result.published} ({result.unpublished_at_end} still in the outbox when the last sample was consumed)",
    ]
    if result.cpu is not None:
        lines.append(f"from its first commit on ({result.cpu_samples} samples), {result.cpu.line(result.cpu_samples, 'sample consumed')}")
        bound, held = result.cpu.bound_line(result.cpu_samples, "sample", against=[("metering-ingest", ingest["messages_per_second"])]), data["cpu"]["bound"]
        if bound is not None and held is not None:
            against_copy = "" if held["ratio_rows_per_second"] is None else f": {held['ratio_rows_per_second']}x COPY"
            lines.append(f"  {bound}; in rows {held['rows_per_second']:.0f}/s{against_copy}")
    if result.collections is not None:
        lines.append(result.collections.line())
    if result.correct:
        lines.append(f"correctness: OK - {result.rows} usage rows, one per distinct sample; every run's cumulative equals the clean stream's")
    else:
        lines.extend(f"correctness: FAILED - {problem}" for problem in result.problems)
    return "\n".join(lines)


def _bound(result: Result, copy_rows_per_s: float) -> dict[str, float | None] | None:
    """The CPU bound (CpuUse.bound_per_second) in rows, a resend being a sample that writes
    none, and held against COPY: the highest ratio the measured costs allow on this machine."""
    samples = result.cpu.bound_per_second(result.cpu_samples) if result.cpu else None
    if samples is None or not result.messages:
        return None
    rows = samples * result.rows / result.messages
    return {"rows_per_second": round(rows, 1), "ratio_rows_per_second": round(rows / copy_rows_per_s, 5) if copy_rows_per_s else None}


def _per_second(count: int, seconds: float) -> float:
    return round(count / seconds, 1) if seconds > 0 else 0.0
