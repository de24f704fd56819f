"""The benchmark's results as a table with ratios, and as JSON."""

from __future__ import annotations

import os
import statistics
from typing import Any

from budgetgate.benchmark import load
from budgetgate.benchmark.cpu import CpuUse
from budgetgate.benchmark.rounds import spread
from budgetgate.benchmark.admission_runner import CEILING_TRIES, Measurements, Options, RunResult
from budgetgate.benchmark.workload import GPU_HOURS_EACH, GPUS, RUNTIME_HOURS

_COLUMNS = ("system", "scenario", "requests", "decisions/s", "p50 ms", "p95 ms", "p99 ms", "errors", "allowed")


def row(result: RunResult) -> dict[str, Any]:
    """One run's figures, as the JSON report carries them."""
    out = result.outcome
    return {
        "system": result.system,
        "scenario": result.scenario,
        "round": result.round,
        "budgets": len(result.workload.budgets),
        "requests": len(result.workload.measured),
        "answered": out.answered,
        "seconds": round(out.elapsed, 3),
        "decisions_per_second": round(out.answered / out.elapsed, 1) if out.elapsed else 0.0,
        "p50_ms": _round(out.percentile_ms(50)),
        "p95_ms": _round(out.percentile_ms(95)),
        "p99_ms": _round(out.percentile_ms(99)),
        "errors": out.error_count,
        "error_kinds": dict(out.errors),
        "allowed": out.count("ALLOW"),
        "denied": out.count("DENY"),
        "expected_allowed": result.workload.measured_expected_allows,
        "correct": result.audit.ok,
        "correctness": {
            "budgets": result.audit.budgets,
            "admitted_gpu_hours": result.audit.admitted_gpu_hours,
            "limit_gpu_hours": result.audit.limit_gpu_hours,
            "stored_allows": result.audit.stored_allows,
            "problems": result.audit.problems,
        },
        **({"notes": result.notes} if result.notes else {}),
        "cpu": result.cpu.as_json(out.answered) if result.cpu else None,
        "garbage_collection": result.collections.as_json() if result.collections else None,
    }


def ratios(results: list[RunResult]) -> list[dict[str, Any]]:
    """budgetgate ÷ baseline per round and scenario, for throughput and p99 latency: each
    round's budgetgate against the same round's baseline."""
    by_key = {(r.round, r.system, r.scenario): row(r) for r in results}
    out = []
    for number, scenario in dict.fromkeys((r.round, r.scenario) for r in results):
        bg, base = by_key.get((number, "budgetgate", scenario)), by_key.get((number, "baseline", scenario))
        if not bg or not base:
            continue
        out.append(
            {
                "round": number,
                "scenario": scenario,
                "throughput": _ratio(bg["decisions_per_second"], base["decisions_per_second"]),
                "p99": _ratio(bg["p99_ms"], base["p99_ms"]),
            }
        )
    return out


def medians(measured: Measurements) -> list[dict[str, Any]]:
    """Per scenario, the median over the rounds of each ratio (budgetgate against the baseline
    and against the ceiling of its own round), with the lowest and highest: the figures to
    quote when the machine's speed drifts between rounds."""
    per_round = ratios(measured.results)
    against_ceiling = ceiling_ratios(measured)
    out = []
    for scenario in dict.fromkeys(r.scenario for r in measured.results):
        figures = {
            "throughput": [r["throughput"] for r in per_round if r["scenario"] == scenario],
            "p99": [r["p99"] for r in per_round if r["scenario"] == scenario],
            "ceiling": [c["budgetgate"][scenario] for c in against_ceiling if scenario in c["budgetgate"]],
        }
        out.append({"scenario": scenario} | {name: spread(values) for name, values in figures.items()})
    return out


def as_json(options: Options, measured: Measurements) -> dict[str, Any]:
    results = measured.results
    return {
        "run_tag": measured.tag,
        "options": {
            "requests": options.requests,
            "concurrency": options.concurrency,
            "warmup": options.warmup,
            "budgets": options.budgets,
            "allow_fraction": options.allow_fraction,
            "scenarios": list(options.scenarios),
            "systems": list(options.systems),
            "rounds": options.rounds,
            "submission": {"gpus": GPUS, "runtime_hours": RUNTIME_HOURS, "gpu_hours": GPU_HOURS_EACH},
        },
        "cpus": os.cpu_count(),
        "results": [row(r) for r in results],
        "ratios": ratios(results),
        "medians": medians(measured),
        "fastapi_ceiling": ceiling(measured),
        "fastapi_ceilings": ceiling_ratios(measured),
        "open_loop": [open_row(r, options) for r in measured.open_loop],
        "correct": measured.correct,
    }


def ceiling(measured: Measurements) -> dict[str, Any] | None:
    """The FastAPI ceiling's requests/s (the highest of every round), and budgetgate's
    decisions/s per scenario against it (the median of its rounds')."""
    out = measured.ceiling
    if out is None or not out.elapsed:
        return None
    return _against_ceiling(out, measured.ceiling_cpu, [r for r in measured.results if r.system == "budgetgate"])


def ceiling_ratios(measured: Measurements) -> list[dict[str, Any]]:
    """Per round, the ceiling of that round and budgetgate's decisions/s against it."""
    return [
        {"round": number, **_against_ceiling(out, cpu, [r for r in measured.results if r.system == "budgetgate" and r.round == number])}
        for number, (out, cpu) in sorted(measured.ceilings.items())
        if out.elapsed
    ]


def _against_ceiling(out: load.Outcome, cpu: CpuUse | None, budgetgate: list[RunResult]) -> dict[str, Any]:
    per_second = out.answered / out.elapsed
    rates: dict[str, list[float]] = {}
    for r in budgetgate:
        if r.outcome.elapsed:
            rates.setdefault(r.scenario, []).append(r.outcome.answered / r.outcome.elapsed)
    return {
        "requests_per_second": round(per_second, 1),
        "p99_ms": _round(out.percentile_ms(99)),
        "errors": out.error_count,
        "cpu": cpu.as_json(out.answered) if cpu else None,
        "budgetgate": {scenario: _ratio(round(statistics.median(values), 1), per_second) for scenario, values in rates.items()},
    }


# The open loop's percentiles are also given per this many seconds of the run, so that a
# latency growing with the data shows (it did: a plan kept from an empty table).
OPEN_LOOP_WINDOW_SECONDS = 5.0


def open_row(result: RunResult, options: Options) -> dict[str, Any]:
    out = result.outcome
    return {
        "system": result.system,
        "offered_per_second": options.open_loop_rate,
        "seconds": options.open_loop_seconds,
        "requests": len(result.workload.measured),
        "answered_per_second": round(out.answered / out.elapsed, 1) if out.elapsed else 0.0,
        "p50_ms": _round(out.percentile_ms(50)),
        "p99_ms": _round(out.percentile_ms(99)),
        "p999_ms": _round(out.percentile_ms(99.9)),
        "window_seconds": OPEN_LOOP_WINDOW_SECONDS,
        "p50_ms_by_window": [_round(v) for v in out.percentile_ms_by_window(50, OPEN_LOOP_WINDOW_SECONDS)],
        "p99_ms_by_window": [_round(v) for v in out.percentile_ms_by_window(99, OPEN_LOOP_WINDOW_SECONDS)],
        "errors": out.error_count,
        "error_kinds": dict(out.errors),
        "correct": result.audit.ok,
    }


def as_text(options: Options, measured: Measurements) -> str:
    results = measured.results
    rows = [row(r) for r in results]
    rounds = options.rounds > 1
    cells = [
        [
            r["system"],
            f"{r['scenario']} ({r['budgets']})" + (f" #{r['round']}" if rounds else ""),
            str(r["requests"]),
            f"{r['decisions_per_second']:.1f}",
            _ms(r["p50_ms"]),
            _ms(r["p95_ms"]),
            _ms(r["p99_ms"]),
            str(r["errors"]),
            f"{r['allowed']} ({100 * r['allowed'] / r['requests']:.0f}%)" if r["requests"] else "0",
        ]
        for r in rows
    ]
    widths = [max(len(c) for c in column) for column in zip(_COLUMNS, *cells, strict=True)]
    lines = [
        f"{options.concurrency} concurrent clients, {options.warmup} warm-up submissions, then the measured ones; "
        f"each asks for {GPUS} GPUs x {RUNTIME_HOURS:g} h = {GPU_HOURS_EACH:g} GPU-hours; budgets fit ~{options.allow_fraction:.0%} of them",
        "",
        "  ".join(h.ljust(w) if i < 2 else h.rjust(w) for i, (h, w) in enumerate(zip(_COLUMNS, widths, strict=True))),
    ]
    lines += ["  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths, strict=True))) for line in cells]
    lines.append("")
    for r in rows:
        lines.append(_correctness_line(r, rounds=rounds))
    for r in rows:
        if r.get("notes"):
            lines.append(f"{_name(r, rounds)}: " + ", ".join(f"{k} {v}" for k, v in r["notes"].items()) + " (right after the measured phase)")
    for ratio in ratios(results):
        lines.append(f"budgetgate/baseline, {_name(ratio, rounds, system=False)}: throughput {_x(ratio['throughput'])}, p99 latency {_x(ratio['p99'])}")
    for found in ceiling_ratios(measured) if rounds else []:
        against = ", ".join(f"{scenario} {_x(x)}" for scenario, x in found["budgetgate"].items())
        lines.append(f"fastapi ceiling, round {found['round']}: {found['requests_per_second']:.1f} requests/s; budgetgate/ceiling: {against or '-'}")
    top = ceiling(measured)
    if top is not None:
        against = ", ".join(f"{scenario} {_x(x)}" for scenario, x in top["budgetgate"].items())
        best = f"the best of {CEILING_TRIES} passes" + (f" in each of {options.rounds} rounds, the highest round" if rounds else "")
        of = "budgetgate/ceiling" + (" (budgetgate's median round)" if rounds else "")
        lines.append(
            f"fastapi ceiling (validates the same body, answers a constant; {best}): {top['requests_per_second']:.1f} requests/s, "
            f"p99 {_ms(top['p99_ms'])} ms, {top['errors']} errors; {of}: {against or '-'}"
        )
    if rounds:
        for summary in medians(measured):
            labelled = (("throughput vs baseline", summary["throughput"]), ("p99 vs baseline", summary["p99"]), ("vs its round's ceiling", summary["ceiling"]))
            parts = [f"{label} {_x(f['median'])} ({_x(f['low'])}-{_x(f['high'])})" for label, f in labelled if f is not None]
            lines.append(f"median of {options.rounds} rounds, {summary['scenario']}: " + ", ".join(parts))
    lines += _cpu_lines(measured, rounds=rounds)
    for r in measured.open_loop:
        o = open_row(r, options)
        lines.append(
            f"open loop {r.system}: {o['offered_per_second']:g}/s offered for {o['seconds']:g} s, {o['answered_per_second']:.1f}/s answered, "
            f"p50 {_ms(o['p50_ms'])} ms, p99 {_ms(o['p99_ms'])} ms, p99.9 {_ms(o['p999_ms'])} ms, {o['errors']} errors"
            + (f" ({', '.join(f'{k}: {v}' for k, v in o['error_kinds'].items())})" if o["errors"] else "")
        )
        lines.append(
            f"  by {o['window_seconds']:g} s of the run: p50 {' '.join(_ms(v) for v in o['p50_ms_by_window'])} ms; "
            f"p99 {' '.join(_ms(v) for v in o['p99_ms_by_window'])} ms"
        )
        lines.append(_correctness_line({**row(r), "scenario": "open loop"}))
    return "\n".join(lines)


def _cpu_lines(measured: Measurements, *, rounds: bool = False) -> list[str]:
    """What each part spent per answer while the measured load ran: where the throughput went;
    and for budgetgate, how far this machine's CPUs could carry it at that cost, against the
    baseline's and the ceiling's measured rates of its round (the highest ratios these costs
    allow here)."""
    rate = {(r.round, r.system, r.scenario): r.outcome.answered / r.outcome.elapsed for r in measured.results if r.outcome.elapsed}
    top = measured.ceiling
    lines = []
    for r in measured.results:
        if r.cpu is None:
            continue
        lines.append(f"{_name(row(r), rounds)}: {r.cpu.line(r.outcome.answered, 'decision')}")
        if r.system != "budgetgate":
            continue
        base = (r.round, "baseline", r.scenario)
        against = [(f"baseline/{r.scenario}", rate[base])] if base in rate else []
        own = measured.ceilings.get(r.round)
        if own is not None and own[0].elapsed:
            against.append(("the fastapi ceiling", own[0].answered / own[0].elapsed))
        bound = r.cpu.bound_line(r.outcome.answered, "decision", against=against)
        if bound is not None:
            lines.append(f"  {bound}")
        if r.collections is not None:
            lines.append(f"  {r.collections.line()}")
    if top is not None and measured.ceiling_cpu is not None:
        lines.append(f"fastapi ceiling: {measured.ceiling_cpu.line(top.answered, 'request')}")
    return lines


def _name(r: dict[str, Any], rounds: bool, *, system: bool = True) -> str:
    """A row's (or a ratio's) system/scenario, and its round when there are several."""
    return (f"{r['system']}/" if system else "") + r["scenario"] + (f" #{r['round']}" if rounds else "")


def _correctness_line(r: dict[str, Any], *, rounds: bool = False) -> str:
    c = r["correctness"]
    head = f"correctness {_name(r, rounds)}: "
    if r["correct"]:
        return head + (
            f"OK - no budget over its limit ({c['budgets']} budget(s) reached, {c['admitted_gpu_hours']:g} of "
            f"{c['limit_gpu_hours']:g} GPU-hours admitted, {c['stored_allows']} admitted runs stored, "
            f"{r['allowed']} of the {r['expected_allowed']} measured submissions that fit were allowed; retries answered alike)"
        )
    return head + "FAILED - " + "; ".join(c["problems"])


def _round(value: float | None) -> float | None:
    return round(value, 2) if value is not None else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def _ms(value: float | None) -> str:
    return f"{value:.1f}" if value is not None else "-"


def _x(value: float | None) -> str:
    return f"{value:.2f}x" if value is not None else "-"
