"""The benchmark's results as a table with ratios, and as JSON: per run its rate, latency, CPU per
decision (all parts, and each part) and the machine's busy share, budgetgate's stage breakdown;
per scenario the medians of the rounds, budgetgate against the baseline (throughput, p99, CPU)
and, with the open loop, both systems' p50 and p99 at the offered rate."""

from __future__ import annotations

import dataclasses
import os
import statistics
from typing import Any

from budgetgate.benchmark import load
from budgetgate.benchmark.cpu import CpuUse, parts_text, replica_name
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
        "replicas": result.replicas,
        "answered_by_replica": _answered_by(result),
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
        "stages": _stages_json(result),
    }


def _answered_by(result: RunResult) -> dict[str, int]:
    """How many measured submissions each replica answered, by its name in the CPU figures."""
    counts = result.outcome.answered_by(result.replicas)
    if result.replicas == 1:
        return {"service": counts[0]}
    return {replica_name("service", number): count for number, count in enumerate(counts, 1)}


def _stages_json(result: RunResult) -> dict[str, Any] | None:
    return {stage.name: stage.as_json() for stage in result.stages} if result.stages is not None else None


def _all_parts_us(result: RunResult | None) -> float | None:
    return result.cpu.all_parts_us(result.outcome.answered) if result is not None and result.cpu is not None else None


def ratios(results: list[RunResult]) -> list[dict[str, Any]]:
    """budgetgate ÷ baseline per round and scenario, for throughput and p99 latency: each
    round's budgetgate against the same round's baseline."""
    by_key = {(r.round, r.system, r.scenario): r for r in results}
    out = []
    for number, scenario in dict.fromkeys((r.round, r.scenario) for r in results):
        bg, base = by_key.get((number, "budgetgate", scenario)), by_key.get((number, "baseline", scenario))
        if not bg or not base:
            continue
        bg_row, base_row = row(bg), row(base)
        out.append(
            {
                "round": number,
                "scenario": scenario,
                "throughput": _ratio(bg_row["decisions_per_second"], base_row["decisions_per_second"]),
                "p50": _ratio(bg_row["p50_ms"], base_row["p50_ms"]),
                "p99": _ratio(bg_row["p99_ms"], base_row["p99_ms"]),
                "cpu": _ratio(_all_parts_us(bg), _all_parts_us(base)),
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
            "cpu": [r["cpu"] for r in per_round if r["scenario"] == scenario],
            "ceiling": [c["budgetgate"][scenario] for c in against_ceiling if scenario in c["budgetgate"]],
        }
        out.append({"scenario": scenario} | {name: spread(values) for name, values in figures.items()})
    return out


def cpu_medians(results: list[RunResult]) -> list[dict[str, Any]]:
    """Per scenario and system, the median over the rounds of the all-parts CPU per decision
    (µs), of the machine's busy share, and how many rounds were bound by waiting."""
    out = []
    for scenario, system in dict.fromkeys((r.scenario, r.system) for r in results):
        runs = [r for r in results if (r.scenario, r.system) == (scenario, system) and r.cpu is not None]
        out.append(
            {
                "scenario": scenario,
                "system": system,
                "all_parts_us": spread((_all_parts_us(r) for r in runs), digits=1),
                "machine_busy": spread((r.cpu.machine_busy for r in runs if r.cpu is not None), digits=3),
                "bound_by_waiting": sum(r.cpu.bound_by_waiting for r in runs if r.cpu is not None),
                "rounds": len(runs),
            }
        )
    return out


def run_medians(results: list[RunResult]) -> list[dict[str, Any]]:
    """Per scenario and system, the median over the rounds (with the lowest and highest) of its
    decisions/s, p50 and p99, and of its CPU per decision: all parts, each part (each replica of
    the service) and each group (the replicas together)."""
    out = []
    for scenario, system in dict.fromkeys((r.scenario, r.system) for r in results):
        runs = [r for r in results if (r.scenario, r.system) == (scenario, system)]
        metered = [(r.cpu, r.outcome.answered) for r in runs if r.cpu is not None]
        parts = dict.fromkeys(name for cpu, _ in metered for name in cpu.parts)
        groups = {name: members for cpu, _ in metered for name, members in cpu.groups.items()}
        out.append(
            {
                "scenario": scenario,
                "system": system,
                "rounds": len(runs),
                "decisions_per_second": spread((r.outcome.answered / r.outcome.elapsed for r in runs if r.outcome.elapsed), digits=1),
                "p50_ms": spread((r.outcome.percentile_ms(50) for r in runs), digits=2),
                "p99_ms": spread((r.outcome.percentile_ms(99) for r in runs), digits=2),
                "all_parts_us": spread((cpu.all_parts_us(n) for cpu, n in metered), digits=1),
                "parts_us": {name: spread((cpu.per_unit_us(n).get(name) for cpu, n in metered), digits=1) for name in parts},
                "groups": {name: list(members) for name, members in groups.items()},
                "group_us": {name: spread((cpu.group_us(n).get(name) for cpu, n in metered), digits=1) for name in groups},
                "not_in_all_parts": sorted({name for cpu, _ in metered for name in cpu.apart}),
            }
        )
    return out


def ceiling_cpu(measured: Measurements) -> dict[str, Any] | None:
    """The ceiling's all-parts CPU per request (its service alone), the median of its rounds."""
    figures = [cpu.all_parts_us(out.answered) for out, cpu in measured.ceilings.values() if out.elapsed]
    return spread(figures, digits=1)


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
            "replicas": options.replicas,
            "ledger_shards": options.ledger_shards,
            "submission": {"gpus": GPUS, "runtime_hours": RUNTIME_HOURS, "gpu_hours": GPU_HOURS_EACH},
        },
        "cpus": os.cpu_count(),
        "results": [row(r) for r in results],
        "ratios": ratios(results),
        "medians": medians(measured),
        "cpu_medians": cpu_medians(results),
        "run_medians": run_medians(results),
        "fastapi_ceiling": ceiling(measured),
        "fastapi_ceilings": ceiling_ratios(measured),
        "fastapi_ceiling_cpu_us": ceiling_cpu(measured),
        "open_loop": [open_row(r, options) for r in measured.open_loop],
        "open_loop_medians": open_medians(measured.open_loop),
        "open_loop_cpu_medians": cpu_medians(measured.open_loop),
        "wake_ups": dataclasses.asdict(measured.wake_ups) if measured.wake_ups is not None else None,
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
        "scenario": result.scenario,
        "round": result.round,
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
        "answered_by_replica": _answered_by(result),
        "correct": result.audit.ok,
        "cpu": result.cpu.as_json(out.answered) if result.cpu else None,
        "stages": _stages_json(result),
    }


def open_medians(results: list[RunResult]) -> list[dict[str, Any]]:
    """Per scenario, the median over the rounds of each system's open-loop p50 and p99, and of
    budgetgate's against the baseline's of the same round."""
    by_key = {(r.round, r.system, r.scenario): r.outcome for r in results}
    out = []
    for scenario in dict.fromkeys(r.scenario for r in results):
        summary: dict[str, Any] = {"scenario": scenario}
        for system in dict.fromkeys(r.system for r in results):
            runs = [o for (_, name, sc), o in by_key.items() if (name, sc) == (system, scenario)]
            summary[system] = {f"p{p}_ms": spread((o.percentile_ms(p) for o in runs), digits=2) for p in (50, 99)}
        for p in (50, 99):
            paired = [
                _ratio(o.percentile_ms(p), base.percentile_ms(p))
                for (number, name, sc), o in by_key.items()
                if (name, sc) == ("budgetgate", scenario) and (base := by_key.get((number, "baseline", scenario))) is not None
            ]
            summary[f"p{p}_vs_baseline"] = spread(paired)
        out.append(summary)
    return out


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
        *(
            [
                f"each system (and the ceiling) runs as {options.replicas} processes on one database and one Redis, driven as one service: "
                f"client k on process k mod {options.replicas} (the open loop: round robin); the audit reads the one ledger they all wrote"
            ]
            if options.replicas > 1
            else []
        ),
        *([f"budgetgate's Redis ledger has {options.ledger_shards} shards: the spread scenario's teams spread over them"] if options.ledger_shards > 1 else []),
        "",
        "  ".join(h.ljust(w) if i < 2 else h.rjust(w) for i, (h, w) in enumerate(zip(_COLUMNS, widths, strict=True))),
    ]
    lines += ["  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths, strict=True))) for line in cells]
    lines.append("")
    for r in rows:
        lines.append(_correctness_line(r, rounds=rounds))
    for r in rows:
        if r["replicas"] > 1:
            lines.append(f"{_name(r, rounds)}: answered by " + ", ".join(f"{name} {count}" for name, count in r["answered_by_replica"].items()))
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
    lines += _stage_lines(measured.results, rounds=rounds)
    for r in measured.open_loop:
        o = open_row(r, options)
        lines.append(
            f"open loop {_name(o, rounds)}: {o['offered_per_second']:g}/s offered for {o['seconds']:g} s, {o['answered_per_second']:.1f}/s answered, "
            f"p50 {_ms(o['p50_ms'])} ms, p99 {_ms(o['p99_ms'])} ms, p99.9 {_ms(o['p999_ms'])} ms, {o['errors']} errors"
            + (f" ({', '.join(f'{k}: {v}' for k, v in o['error_kinds'].items())})" if o["errors"] else "")
        )
        lines.append(
            f"  by {o['window_seconds']:g} s of the run: p50 {' '.join(_ms(v) for v in o['p50_ms_by_window'])} ms; "
            f"p99 {' '.join(_ms(v) for v in o['p99_ms_by_window'])} ms"
        )
        if r.cpu is not None:
            lines.append(f"  {r.cpu.line(r.outcome.answered, 'decision')}")
        if r.stages is not None:
            lines.append(f"  {_stage_line(r.stages)}")
        lines.append(_correctness_line({**row(r), "scenario": f"{r.scenario} open loop"}, rounds=rounds))
    if measured.wake_ups is not None:
        lines.append(measured.wake_ups.line())
    over = _over(options.rounds, rounds)
    for summary in open_medians(measured.open_loop):
        figures = [
            f"{system} p50 {_spread(summary[system]['p50_ms'], rounds, '{:.1f}')} ms, p99 {_spread(summary[system]['p99_ms'], rounds, '{:.1f}')} ms"
            for system in options.systems
            if system in summary and summary[system]["p50_ms"] is not None and summary[system]["p99_ms"] is not None
        ]
        against = [f"{p} {_spread(f, rounds, '{:.2f}x')}" for p in ("p50", "p99") if (f := summary[f"{p}_vs_baseline"]) is not None]
        lines.append(f"open loop{over}, {summary['scenario']}: " + "; ".join(figures) + (f"; budgetgate/baseline {', '.join(against)}" if against else ""))
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
    per_round = ratios(measured.results)
    for summary in cpu_medians(measured.results):
        figure, busy = summary["all_parts_us"], summary["machine_busy"]
        if figure is None:
            continue
        paired = spread(r["cpu"] for r in per_round if r["scenario"] == summary["scenario"]) if summary["system"] == "budgetgate" else None
        waiting = summary["bound_by_waiting"]
        lines.append(
            f"CPU per decision, all parts{_over(summary['rounds'], rounds)}, {summary['system']}/{summary['scenario']}: {_spread(figure, rounds, '{:.0f}')} µs"
            + (f", {_spread(paired, rounds, '{:.2f}x')} the baseline's" if paired else "")
            + (f"; machine {_spread(busy, rounds, '{:.0%}')} busy" if busy else "")
            + ((f"; {waiting} of {summary['rounds']} rounds bound by waiting, not by CPU" if rounds else ": bound by waiting, not by CPU") if waiting else "")
        )  # fmt: skip
    if rounds:
        lines += [_run_median_line(summary) for summary in run_medians(measured.results)]
    top_cpu = ceiling_cpu(measured)
    if top_cpu is not None:
        lines.append(f"CPU per request, all parts{_over(top_cpu['rounds'], rounds)}, fastapi ceiling: {_spread(top_cpu, rounds, '{:.0f}')} µs")
    return lines


def _run_median_line(summary: dict[str, Any]) -> str:
    """`median of 3 rounds, budgetgate/hot: 1650 decisions/s (1500-1700), p50 …, p99 …; CPU µs per
    decision: all parts 650 (service 410 = service 1 200 + service 2 210, postgres 200, …)`."""
    figures = [
        f"{label}{_spread(f, True, form)}{unit}"
        for label, f, form, unit in (
            ("", summary["decisions_per_second"], "{:.0f}", " decisions/s"),
            ("p50 ", summary["p50_ms"], "{:.1f}", " ms"),
            ("p99 ", summary["p99_ms"], "{:.1f}", " ms"),
        )
        if f is not None
    ]
    head = f"median of {summary['rounds']} rounds, {summary['system']}/{summary['scenario']}: " + ", ".join(figures)
    if summary["all_parts_us"] is None and not summary["parts_us"]:
        return head
    medians = {name: None if f is None else f["median"] for name, f in summary["parts_us"].items()}
    sums = {name: None if f is None else f["median"] for name, f in summary["group_us"].items()}
    by_part = parts_text(medians, summary["groups"], sums, apart=summary["not_in_all_parts"])
    total = "-" if summary["all_parts_us"] is None else _spread(summary["all_parts_us"], True, "{:.0f}")
    return f"{head}; CPU µs per decision: all parts {total} ({by_part})"


def _stage_lines(results: list[RunResult], *, rounds: bool) -> list[str]:
    return [f"{_name(row(r), rounds)}: {_stage_line(r.stages)}" for r in results if r.stages is not None]


def _stage_line(breakdown: list[Any]) -> str:
    """`stages, ms p50/p99 (412 timed): body_and_auth 0.05/0.10, plan 0.03/0.06, ...`."""
    timed = max((stage.count for stage in breakdown), default=0)
    figures = ", ".join(f"{stage.name} {_ms2(stage.p50_ms)}/{_ms2(stage.p99_ms)}" for stage in breakdown)
    return f"stages, ms p50/p99 ({timed} submissions timed): {figures or '-'}"


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


def _over(count: int, rounds: bool) -> str:
    return f", median of {count} rounds" if rounds else ""


def _spread(figure: dict[str, Any], rounds: bool, form: str) -> str:
    """A median (`spread`) as `form` writes it, with its lowest and highest when there were
    several rounds."""
    if not rounds:
        return form.format(figure["median"])
    return f"{form.format(figure['median'])} ({form.format(figure['low'])}-{form.format(figure['high'])})"


def _ms2(value: float | None) -> str:
    return f"{value:.2f}" if value is not None else "-"


def _x(value: float | None) -> str:
    return f"{value:.2f}x" if value is not None else "-"
