"""`budgetgate bench metering` results as text and as JSON."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from budgetgate.benchmark.cpu import parts_text, replica_name
from budgetgate.benchmark.metering_runner import COPY_TRIES, Options, Result
from budgetgate.benchmark.rounds import spread, spread_text


def as_json(options: Options, results: Sequence[Result]) -> dict[str, Any]:
    """The whole report as one JSON document. With several rounds: the median round's figures
    (the round whose ratio is the median, the lower one of an even count), each round's under
    `rounds`, the median and range of each figure under `medians`, and whether every round was
    correct."""
    if len(results) == 1:
        return _one(options, results[0])
    rounds = [_one(options, result) for result in results]
    middle = _median_round(rounds)
    problems = [f"round {number}: {problem}" for number, result in enumerate(results, 1) for problem in result.problems]
    return {
        **rounds[middle],
        "median_round": middle + 1,
        "rounds": rounds,
        "medians": {
            "ratio_rows_per_second": spread((r["ratio_rows_per_second"] for r in rounds), digits=5),
            "rows_per_second": spread((r["ingest"]["rows_per_second"] for r in rounds), digits=1),
            "copy_rows_per_second": spread((r["copy"]["rows_per_second"] for r in rounds), digits=1),
            "service_us_per_sample": spread((_service_us(r["cpu"]) for r in rounds), digits=1),
            "all_parts_us_per_sample": spread((r["cpu"]["all_parts_us_per_unit"] if r["cpu"] else None for r in rounds), digits=1),
            "copy_all_parts_us_per_row": spread((r["copy"]["cpu"]["all_parts_us_per_unit"] if r["copy"]["cpu"] else None for r in rounds), digits=2),
            "cpu_ratio_to_copy": spread((r["cpu_ratio_to_copy"] for r in rounds), digits=2),
            "us_per_sample": {part: spread((r["cpu"]["us_per_unit"].get(part) if r["cpu"] else None for r in rounds), digits=1) for part in _parts(rounds)},
            "window_samples_per_second": spread((r["window"]["samples_per_second"] if r["window"] else None for r in rounds), digits=1),
        },
        "correct": not problems,
        "problems": problems,
    }


def _service_us(cpu: dict[str, Any] | None) -> float | None:
    """The service's CPU per sample: its one process, or its replicas added up."""
    if cpu is None:
        return None
    return cpu["group_us_per_unit"]["service"] if "service" in cpu["group_us_per_unit"] else cpu["us_per_unit"].get("service")


def _parts(rounds: Sequence[dict[str, Any]]) -> list[str]:
    return list(dict.fromkeys(part for r in rounds if r["cpu"] for part in r["cpu"]["us_per_unit"]))


def _median_round(rounds: Sequence[dict[str, Any]]) -> int:
    by_ratio = sorted(range(len(rounds)), key=lambda i: rounds[i]["ratio_rows_per_second"] or 0.0)
    return by_ratio[(len(by_ratio) - 1) // 2]


def _one(options: Options, result: Result) -> dict[str, Any]:
    # The work is the load's distinct samples: the service records each as a usage row, or a run's
    # samples of a quarter hour in one poll as one (metering as a max-register); COPY loads a row
    # per distinct sample. "rows" below are those samples, the usage rows written are `usage_rows`.
    ingest_rows_per_s = _per_second(result.distinct, result.ingest_seconds)
    copy_rows_per_s = _per_second(result.copied, result.copy_seconds)
    return {
        "options": {
            "samples": options.samples,
            "runs": options.runs,
            "resend_every": options.resend_every,
            "partitions": options.partitions,
            "replicas": options.replicas,
        },
        "load": {"messages": result.messages, "distinct_samples": result.distinct, "resends": result.messages - result.distinct, "runs": result.runs},
        "ingest": {
            "seconds": round(result.ingest_seconds, 3),
            "messages_per_second": _per_second(result.messages, result.ingest_seconds),
            "rows": result.distinct,
            "rows_per_second": ingest_rows_per_s,
            "usage_rows": result.rows,
            "usage_records": result.published,
            "outbox_unpublished_at_end": result.unpublished_at_end,
        },
        "copy": {
            "seconds": round(result.copy_seconds, 3),
            "rows": result.copied,
            "rows_per_second": copy_rows_per_s,
            "best_of": COPY_TRIES,
            "cpu": result.copy_cpu.as_json(result.copied) if result.copy_cpu else None,
        },
        "ratio_rows_per_second": round(ingest_rows_per_s / copy_rows_per_s, 5) if copy_rows_per_s else None,
        "cpu_ratio_to_copy": _cpu_ratio(result),
        "cpu": {**result.cpu.as_json(result.cpu_samples), "samples": result.cpu_samples, "bound": _bound(result, copy_rows_per_s)} if result.cpu else None,
        "window": _window(result),
        "replicas": result.replicas,
        "consumed_by_replica": _by_replica(result),
        "garbage_collection": result.collections.as_json() if result.collections else None,
        "correct": result.correct,
        "problems": result.problems,
        "cpus": os.cpu_count(),
        "run_tag": result.tag,
    }


def as_text(options: Options, results: Sequence[Result]) -> str:
    """A table of both figures, the ratio and the correctness check; with several rounds, a line
    per round, the median round's whole report, and the median and range of the figures."""
    if len(results) == 1:
        return _one_text(options, results[0])
    data = as_json(options, results)
    lines = [_round_line(number, r) for number, r in enumerate(data["rounds"], 1)]
    middle = data["median_round"]
    lines += ["", f"the median round ({middle}):", _one_text(options, results[middle - 1]), ""]
    medians = data["medians"]
    parts = [f"ratio (metering-ingest / COPY, rows/s) {_x(medians['ratio_rows_per_second'])}"]
    parts += [f"{name} {spread_text(medians[key])}" for name, key in (("metering-ingest rows/s", "rows_per_second"), ("COPY rows/s", "copy_rows_per_second"))]
    if medians["window_samples_per_second"] is not None:
        steady = "with every replica in the group" if options.replicas > 1 else "from the first commit"
        parts.append(f"samples/s {steady} {spread_text(medians['window_samples_per_second'])}")
    if medians["service_us_per_sample"] is not None:
        parts.append(f"service CPU µs per sample {spread_text(medians['service_us_per_sample'])}")
    if medians["all_parts_us_per_sample"] is not None:
        each = ", ".join(f"{part} {spread_text(figure)}" for part, figure in medians["us_per_sample"].items())
        parts.append(f"all parts CPU µs per sample {spread_text(medians['all_parts_us_per_sample'])} ({each})")
    if medians["copy_all_parts_us_per_row"] is not None:
        parts.append(f"COPY's CPU µs per row, all parts {spread_text(medians['copy_all_parts_us_per_row'], digits=1)}")
    if medians["cpu_ratio_to_copy"] is not None:
        parts.append(f"CPU per sample / COPY's per row {_x(medians['cpu_ratio_to_copy'])}")
    lines.append(f"median of {len(results)} rounds: " + "; ".join(parts))
    lines += [f"correctness: FAILED - {problem}" for problem in data["problems"] if not problem.startswith(f"round {middle}: ")]
    return "\n".join(lines)


def _round_line(number: int, data: dict[str, Any]) -> str:
    ingest, copy = data["ingest"]["rows_per_second"], data["copy"]["rows_per_second"]
    line = f"round {number}: metering-ingest {ingest:.0f} rows/s, COPY {copy:.0f} rows/s: {data['ratio_rows_per_second']}x"
    if data["cpu"] is not None:
        cpu = data["cpu"]
        line += f"; CPU µs per sample: {parts_text(cpu['us_per_unit'], cpu['groups'], cpu['group_us_per_unit'])}"
    if data["copy"]["cpu"] is not None:
        line += f"; COPY's per row {data['copy']['cpu']['all_parts_us_per_unit']}"
        line += "" if data["cpu_ratio_to_copy"] is None else f" ({data['cpu_ratio_to_copy']}x)"
    if data["garbage_collection"] is not None and data["garbage_collection"]["share"] is not None:
        line += f"; garbage collection {data['garbage_collection']['share']:.1%} of the service's CPU"
    return line + ("" if data["correct"] else "; FAILED its check")


def _x(summary: dict[str, Any] | None) -> str:
    return "-" if summary is None else f"{summary['median']}x ({summary['low']}x-{summary['high']}x)"


def _one_text(options: Options, result: Result) -> str:
    data = _one(options, result)
    ingest, copy = data["ingest"], data["copy"]
    lines = [
        f"load: {result.messages} samples ({result.distinct} distinct + {result.messages - result.distinct} resends under new event ids) "
        f"of {result.runs} runs, pre-published to {options.partitions} partition(s); {data['cpus']} CPUs shared by everything",
        "",
        f"{'system':<26}{'rows':>8}{'seconds':>10}{'rows/s':>11}{'samples/s':>11}",
        f"{'metering-ingest (Kafka)':<26}{result.distinct:>8}{ingest['seconds']:>10.2f}{ingest['rows_per_second']:>11.1f}"
        f"{ingest['messages_per_second']:>11.1f}",
        f"{'COPY into usage_records':<26}{result.copied:>8}{copy['seconds']:>10.2f}{copy['rows_per_second']:>11.1f}{'-':>11}",
        "",
        f"ratio (metering-ingest / COPY, rows/s): {data['ratio_rows_per_second']}x (COPY: the best of {COPY_TRIES})",
        f"rows: distinct samples turned into usage (COPY: a row each); metering-ingest wrote {result.rows} usage rows for them "
        "(a run's samples of a quarter hour in one poll are one point)",
        f"usage records published: {result.published} ({result.unpublished_at_end} still in the outbox when the last sample was consumed)",
    ]
    if result.replicas > 1:
        consumed = data["consumed_by_replica"]
        each = "" if consumed is None else ": " + ", ".join(f"{name} took {count} samples" for name, count in consumed.items())
        lines.append(f"{result.replicas} metering-ingest processes in one consumer group{each} (the timing above includes their joining it)")
    if result.cpu is not None:
        since = "from its first commit on" if result.replicas == 1 else "from the first commit with every replica in the group"
        window = data["window"]
        rate = "" if window is None else f" in {window['seconds']:.2f} s = {window['samples_per_second']:.0f}/s"
        lines.append(f"{since} ({result.cpu_samples} samples{rate}), {result.cpu.line(result.cpu_samples, 'sample consumed')}")
        bound, held = result.cpu.bound_line(result.cpu_samples, "sample", against=[("metering-ingest", ingest["messages_per_second"])]), data["cpu"]["bound"]
        if bound is not None and held is not None:
            against_copy = "" if held["ratio_rows_per_second"] is None else f": {held['ratio_rows_per_second']}x COPY"
            lines.append(f"  {bound}; in rows {held['rows_per_second']:.0f}/s{against_copy}")
    if result.copy_cpu is not None:
        lines.append(f"COPY (the fastest of {COPY_TRIES}), {result.copy_cpu.line(result.copied, 'row')}")
        if data["cpu_ratio_to_copy"] is not None:
            lines.append(f"  metering-ingest's CPU per sample, all parts, is {data['cpu_ratio_to_copy']}x COPY's per row")
    if result.collections is not None:
        lines.append(result.collections.line())
    if result.correct:
        lines.append(
            "correctness: OK - every distinct sample applied once; every run's cumulative, the sum of its rows' deltas and its usage "
            "up to every quarter hour equal the clean stream's"
        )
    else:
        lines.extend(f"correctness: FAILED - {problem}" for problem in result.problems)
    return "\n".join(lines)


def _window(result: Result) -> dict[str, float] | None:
    """The samples consumed in the CPU window (from the first commit with every replica in the
    group) and their rate: the steady rate, without the start or the replicas' joining."""
    if result.cpu is None or result.cpu.seconds <= 0:
        return None
    return {"samples": result.cpu_samples, "seconds": round(result.cpu.seconds, 3), "samples_per_second": _per_second(result.cpu_samples, result.cpu.seconds)}


def _by_replica(result: Result) -> dict[str, int] | None:
    if result.consumed_by_replica is None:
        return None
    return {replica_name("service", number): count for number, count in enumerate(result.consumed_by_replica, 1)}


def _bound(result: Result, copy_rows_per_s: float) -> dict[str, float | None] | None:
    """The CPU bound (CpuUse.bound_per_second) in distinct samples, a resend being a sample that
    adds none, and held against COPY: the highest ratio the measured costs allow on this machine."""
    samples = result.cpu.bound_per_second(result.cpu_samples) if result.cpu else None
    if samples is None or not result.messages:
        return None
    rows = samples * result.distinct / result.messages
    return {"rows_per_second": round(rows, 1), "ratio_rows_per_second": round(rows / copy_rows_per_s, 5) if copy_rows_per_s else None}


def _cpu_ratio(result: Result) -> float | None:
    """The service's CPU per sample consumed, all parts, over COPY's per row, all parts (its
    client and its server): how many times dearer a sample is than a row bulk-loaded."""
    ingest = result.cpu.all_parts_us(result.cpu_samples) if result.cpu else None
    copy = result.copy_cpu.all_parts_us(result.copied) if result.copy_cpu else None
    return None if ingest is None or not copy else round(ingest / copy, 2)


def _per_second(count: int, seconds: float) -> float:
    return round(count / seconds, 1) if seconds > 0 else 0.0
