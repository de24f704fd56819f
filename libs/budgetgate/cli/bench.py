"""`budgetgate bench …`: benchmarks against the obvious alternative (see budgetgate.benchmark)."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Callable

import click

from budgetgate.benchmark.admission_runner import SYSTEMS
from budgetgate.benchmark.workload import DEFAULT_SCENARIOS, SCENARIOS


def _rounds(description: str) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """--rounds N: a benchmark measured N times on a machine whose speed drifts (benchmark.rounds)."""
    return click.option("--rounds", default=1, show_default=True, type=click.IntRange(1), help=description)


@click.group()
def bench() -> None:
    """Measure budgetgate against a baseline (not part of the test run)."""


@bench.command()
@click.option("--requests", default=2000, show_default=True, type=click.IntRange(1), help="Measured submissions per system and scenario.")
@click.option("--concurrency", default=32, show_default=True, type=click.IntRange(1), help="Concurrent HTTP clients.")
@click.option("--warmup", default=100, show_default=True, type=click.IntRange(0), help="Submissions sent before measuring.")
@click.option("--budgets", default=100, show_default=True, type=click.IntRange(1), help="Budgets of the spread scenario.")
@click.option("--allow-fraction", default=0.8, show_default=True, type=click.FloatRange(0.0, 1.0), help="Share of measured submissions the budgets fit.")
@click.option(
    "--scenario",
    "scenarios",
    multiple=True,
    type=click.Choice(SCENARIOS),
    help="hot: one budget; spread: --budgets budgets; shared: spread, and one budget they all fall under too. Default: hot and spread.",
)
@click.option("--system", "systems", multiple=True, type=click.Choice(SYSTEMS), help="Default: both.")
@click.option(
    "--ceiling/--no-ceiling", default=True, show_default=True, help="Also measure a FastAPI endpoint that validates the same body and answers a constant."
)
@click.option(
    "--open-loop-rate",
    default=0.0,
    show_default=True,
    type=click.FloatRange(0.0),
    help="Also offer this many submissions/s to each system, whatever its answers (0: no open loop).",
)
@click.option("--open-loop-seconds", default=30.0, show_default=True, type=click.FloatRange(0.1), help="How long the open loop offers its rate.")
@_rounds(
    "Measure every scenario, system and the ceiling this many times, the systems taking turns to go first; "
    "the ratios are paired per round and their median is reported."
)
@click.option(
    "--replicas",
    default=1,
    show_default=True,
    type=click.IntRange(1),
    help="Processes of each system (and of the ceiling) on the one database and Redis, driven as one service: client k on process k mod N.",
)
@click.option(
    "--ledger-shards",
    default=1,
    show_default=True,
    type=click.IntRange(1, 64),
    help="Shards of budgetgate's Redis ledger (BUDGETGATE_LEDGER_SHARDS): the spread scenario's teams spread over them; on a Redis Cluster, over its masters.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def admission(
    requests: int,
    concurrency: int,
    warmup: int,
    budgets: int,
    allow_fraction: float,
    scenarios: tuple[str, ...],
    systems: tuple[str, ...],
    ceiling: bool,
    open_loop_rate: float,
    open_loop_seconds: float,
    rounds: int,
    replicas: int,
    ledger_shards: int,
    as_json: bool,
) -> None:
    """Admission decisions/s and latency: budgetgate vs. a FastAPI + Postgres row-lock service.

    Each system and scenario gets a fresh database on the Postgres server of
    BUDGETGATE_POSTGRES_DSN; budgetgate uses BUDGETGATE_REDIS_URL and BUDGETGATE_KAFKA_BOOTSTRAP,
    or a Tansu broker started for the run. Also measures, in the same run, a FastAPI endpoint
    that validates the same body (the ceiling), and with --open-loop-rate an open loop at a fixed
    offered rate (p50/p99/p99.9, errors). With --replicas N, each system runs as N processes
    and the CPU figures show each one and their sum. Exits 1 if any budget was over-admitted.
    """
    from budgetgate.benchmark import admission_runner, report

    try:
        options = admission_runner.Options(
            requests=requests, concurrency=concurrency, warmup=warmup, budgets=budgets, allow_fraction=allow_fraction,
            scenarios=scenarios or DEFAULT_SCENARIOS, systems=systems or SYSTEMS, ceiling=ceiling,
            open_loop_rate=open_loop_rate, open_loop_seconds=open_loop_seconds, rounds=rounds, replicas=replicas,
            ledger_shards=ledger_shards,
        )  # fmt: skip
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    try:
        measured = asyncio.run(admission_runner.run(options, echo=lambda message: click.echo(message, err=True)))
    except (KeyboardInterrupt, asyncio.CancelledError):
        click.echo("interrupted; everything the benchmark started was stopped", err=True)
        sys.exit(130)
    except admission_runner.BENCH_ERRORS as exc:
        raise click.ClickException(f"benchmark aborted: {type(exc).__name__}: {exc}") from exc
    if as_json:
        click.echo(json.dumps(report.as_json(options, measured), indent=2))
    else:
        click.echo(report.as_text(options, measured))
    if not measured.correct:
        raise click.ClickException("correctness check failed: see the lines above")


@bench.command()
@click.option("--samples", default=10_000, show_default=True, type=click.IntRange(1), help="Distinct samples in the load.")
@click.option("--runs", default=100, show_default=True, type=click.IntRange(1), help="Runs the samples are spread over (round robin).")
@click.option("--resend-every", default=10, show_default=True, type=click.IntRange(0), help="Resend every n-th sample under a new event id (0: never).")
@click.option("--partitions", default=3, show_default=True, type=click.IntRange(1), help="Partitions of the metering topic.")
@_rounds("Run the whole benchmark this many times, each service run paired with its own COPY; the median ratio is reported.")
@click.option(
    "--replicas", default=1, show_default=True, type=click.IntRange(1), help="metering-ingest processes in the one consumer group (at most --partitions)."
)
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def metering(samples: int, runs: int, resend_every: int, partitions: int, rounds: int, replicas: int, as_json: bool) -> None:
    """Metering ingest samples/s into Postgres through the real consumer, vs. a plain COPY.

    The load is published to Kafka first; then metering-ingest is started and timed from ready
    until its polls have applied every sample. The rows it wrote are then COPYed into a fresh database
    with the same schema, timed. Uses BUDGETGATE_POSTGRES_DSN, and BUDGETGATE_KAFKA_BOOTSTRAP or
    a Tansu broker started for the run. With --replicas N, N processes share the partitions and
    the CPU figures show each one and their sum. Exits 1 if the recorded usage is wrong.
    """
    from budgetgate.benchmark import admission_runner, metering_report, metering_runner

    try:
        options = metering_runner.Options(samples=samples, runs=runs, resend_every=resend_every, partitions=partitions, rounds=rounds, replicas=replicas)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    try:
        results = asyncio.run(metering_runner.run(options, echo=lambda message: click.echo(message, err=True)))
    except (KeyboardInterrupt, asyncio.CancelledError):
        click.echo("interrupted; everything the benchmark started was stopped", err=True)
        sys.exit(130)
    except admission_runner.BENCH_ERRORS as exc:
        raise click.ClickException(f"benchmark aborted: {type(exc).__name__}: {exc}") from exc
    click.echo(json.dumps(metering_report.as_json(options, results), indent=2) if as_json else metering_report.as_text(options, results))
    if not all(result.correct for result in results):
        raise click.ClickException("correctness check failed: see the lines above")


@bench.command("metering-statement")
@click.option("--samples", default=200_000, show_default=True, type=click.IntRange(1), help="Distinct samples in the load.")
@click.option("--runs", default=2_000, show_default=True, type=click.IntRange(1), help="Runs the samples are spread over (round robin).")
@click.option("--resend-every", default=10, show_default=True, type=click.IntRange(0), help="Resend every n-th sample under a new event id (0: never).")
@click.option("--poll", default=15_000, show_default=True, type=click.IntRange(1), help="Samples per poll (metering-ingest's consumer_max_records).")
@_rounds("Place the whole load this many times, each on a fresh database; medians are reported.")
@click.option("--explain", is_flag=True, help="Also place the last poll under auto_explain and print its plans (needs a superuser).")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def metering_statement(samples: int, runs: int, resend_every: int, poll: int, rounds: int, explain: bool, as_json: bool) -> None:
    """What Postgres spends per sample in metering_place_batch alone, called poll by poll as the
    Kafka route calls it: no broker, no service. Uses BUDGETGATE_POSTGRES_DSN; with --explain,
    the per-node plans of one poll's statements. Exits 1 if the recorded usage is wrong."""
    from budgetgate.benchmark import admission_runner, metering_statement as statement
    from budgetgate.runtime.settings import CommonSettings

    options = statement.Options(samples=samples, runs=runs, resend_every=resend_every, poll=poll, rounds=rounds, explain=explain)
    try:
        results = asyncio.run(statement.run(options, server_dsn=CommonSettings().postgres_dsn, echo=lambda message: click.echo(message, err=True)))
    except (KeyboardInterrupt, asyncio.CancelledError):
        click.echo("interrupted; the benchmark's database was dropped", err=True)
        sys.exit(130)
    except (RuntimeError, *admission_runner.BENCH_ERRORS) as exc:
        raise click.ClickException(f"benchmark aborted: {type(exc).__name__}: {exc}") from exc
    click.echo(json.dumps(statement.as_json(options, results), indent=2) if as_json else statement.as_text(results))
    if not all(result.correct for result in results):
        raise click.ClickException("correctness check failed: see the lines above")


@bench.command()
@click.option("--runs", default=600, show_default=True, type=click.IntRange(1), help="Runs fed through their whole lifecycle.")
@click.option("--rate", default=20.0, show_default=True, type=click.FloatRange(0.1), help="Completed runs per second (open loop).")
@click.option("--samples", default=4, show_default=True, type=click.IntRange(1), help="Usage records per run.")
@click.option("--budgets", default=20, show_default=True, type=click.IntRange(1), help="Team budgets the runs spread over.")
@click.option(
    "--records-per-s", type=click.FloatRange(1), default=None, help="Steady load instead: usage records per second, half on short runs, half on long ones."
)
@click.option(
    "--run-lengths",
    default="100,10000",
    show_default=True,
    help="With --records-per-s: samples per short run, and the history of the long runs (preloaded by COPY).",
)
@click.option(
    "--long-runs", default=10, show_default=True, type=click.IntRange(1), help="With --records-per-s: long runs fed at once (short runs: as many at a time)."
)
@click.option("--duration", default=30.0, show_default=True, type=click.FloatRange(1), help="With --records-per-s: seconds of load.")
@click.option(
    "--token-pool",
    is_flag=True,
    help="With --records-per-s: every run takes a token of a pool with its admission, which the reconciler renews as the run shows it is alive.",
)
@click.option(
    "--replicas",
    default=1,
    show_default=True,
    type=click.IntRange(1),
    help="Reconciler processes in the one consumer group (at most the topics' partitions, BUDGETGATE_TOPIC_PARTITIONS).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def reconciliation(
    runs: int,
    rate: float,
    samples: int,
    budgets: int,
    records_per_s: float | None,
    run_lengths: str,
    long_runs: int,
    duration: float,
    token_pool: bool,
    replicas: int,
    as_json: bool,
) -> None:
    """Reconciliation lag p50/p99: a run's COMPLETED event sent -> its actuals committed; with
    --records-per-s, a usage record sent -> the ledger showing it, for short and long runs.

    Starts admission and the reconciler as subprocesses on a fresh database of the Postgres of
    BUDGETGATE_POSTGRES_DSN, with BUDGETGATE_REDIS_URL and BUDGETGATE_KAFKA_BOOTSTRAP (or a Tansu
    broker started for the run). With --replicas N, N reconcilers share the consumer group. Either
    way the CPU per message (per usage record) of each reconciler, their sum, Postgres, Redis and
    the broker is reported. Exits 1 if the ledger does not add up afterwards.
    """
    from budgetgate.benchmark import reconciliation_runner as bench_reconciliation

    try:
        bench_reconciliation.check_replicas(replicas)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    if records_per_s is not None:
        _steady(records_per_s, run_lengths, long_runs, duration, budgets, replicas, token_pool, as_json)
        return
    if token_pool:
        raise click.UsageError("--token-pool goes with --records-per-s")
    options = bench_reconciliation.Options(runs=runs, rate=rate, samples=samples, budgets=budgets, replicas=replicas)
    try:
        report = asyncio.run(bench_reconciliation.run(options, echo=lambda message: click.echo(message, err=True)))
    except (KeyboardInterrupt, asyncio.CancelledError):
        click.echo("interrupted; everything the benchmark started was stopped", err=True)
        sys.exit(130)
    click.echo(json.dumps(report.as_json(), indent=2) if as_json else report.as_text())
    if not report.ledger_ok or report.runs_settled < runs:
        raise click.ClickException("the ledger does not add up, or runs were left unsettled: see above")


def _steady(records_per_s: float, run_lengths: str, long_runs: int, duration: float, budgets: int, replicas: int, token_pool: bool, as_json: bool) -> None:
    from budgetgate.benchmark import reconciliation_steady

    try:
        short, long = (int(part) for part in run_lengths.split(","))
    except ValueError as exc:
        raise click.BadParameter("two numbers: SHORT,LONG", param_hint="--run-lengths") from exc
    options = reconciliation_steady.SteadyOptions(
        records_per_s=records_per_s, short_length=short, long_length=long, long_runs=long_runs, short_slots=long_runs, duration=duration, budgets=budgets,
        replicas=replicas, token_pool=token_pool,
    )  # fmt: skip
    try:
        report = asyncio.run(reconciliation_steady.run(options, echo=lambda message: click.echo(message, err=True)))
    except (KeyboardInterrupt, asyncio.CancelledError):
        click.echo("interrupted; everything the benchmark started was stopped", err=True)
        sys.exit(130)
    click.echo(json.dumps(report.as_json(), indent=2) if as_json else report.as_text())
    if not report.ledger_ok:
        raise click.ClickException("the ledger does not add up: see above")


@bench.command()
@click.option("--held", default=3000, show_default=True, type=click.IntRange(0), help="Reservations held before measuring.")
@click.option("--rate", default=40.0, show_default=True, type=click.FloatRange(0.1), help="Submissions per second (open loop).")
@click.option("--duration", default=20.0, show_default=True, type=click.FloatRange(1), help="Seconds per phase.")
@click.option("--budgets", default=50, show_default=True, type=click.IntRange(1), help="Team budgets the runs spread over.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def drift(held: int, rate: float, duration: float, budgets: int, as_json: bool) -> None:
    """Admission latency A/B: with the reconciler's drift check looping, and without it.

    Same backends as `bench reconciliation`. Exits 1 if Redis differs from Postgres at the end.
    """
    from budgetgate.benchmark import drift_runner as bench_drift

    options = bench_drift.DriftOptions(held=held, rate=rate, duration=duration, budgets=budgets)
    try:
        report = asyncio.run(bench_drift.run(options, echo=lambda message: click.echo(message, err=True)))
    except (KeyboardInterrupt, asyncio.CancelledError):
        click.echo("interrupted; everything the benchmark started was stopped", err=True)
        sys.exit(130)
    click.echo(json.dumps(report.as_json(), indent=2) if as_json else report.as_text())
    if not report.ledger_ok:
        raise click.ClickException("Redis does not equal Postgres: see above")


@bench.command("what-if")
@click.option("--decisions", default=100_000, show_default=True, type=click.IntRange(1), help="Recorded decisions in the period.")
@click.option("--teams", default=200, show_default=True, type=click.IntRange(1), help="Budgets the decisions are spread over.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def what_if(decisions: int, teams: int, as_json: bool) -> None:
    """`policy what-if` over a recorded history of DECISIONS, end to end (read and simulate).

    Records the history in a fresh database on the Postgres server of BUDGETGATE_POSTGRES_DSN
    (not timed), then times the command's own work against a candidate with every limit at 70 %."""
    from budgetgate.benchmark import whatif_runner
    from budgetgate.runtime.settings import CommonSettings

    measured = asyncio.run(
        whatif_runner.run(CommonSettings().postgres_dsn, decisions=decisions, teams=teams, echo=lambda message: click.echo(message, err=True))
    )
    click.echo(json.dumps(measured.as_json(), indent=2) if as_json else measured.as_text())


@bench.command("report")
@click.option("--records", default=1_000_000, show_default=True, type=click.IntRange(1), help="Usage records over the month.")
@click.option("--runs", default=20_000, show_default=True, type=click.IntRange(1), help="Runs the records belong to.")
@_rounds("Time the report in every grouping this many times; the median is reported.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def report(records: int, runs: int, rounds: int, as_json: bool) -> None:
    """`budgetgate report` over a month of RECORDS usage records, in a few groupings.

    Loads the month into a fresh database on the Postgres server of BUDGETGATE_POSTGRES_DSN
    (generate_series, not timed), times the report, and prints the main query's plan
    (EXPLAIN (ANALYZE, BUFFERS))."""
    from budgetgate.benchmark import chargeback_runner
    from budgetgate.runtime.settings import CommonSettings

    if records < runs:
        raise click.UsageError(f"--records ({records}) must be at least --runs ({runs}): every run has a sample")
    measured = asyncio.run(
        chargeback_runner.run(CommonSettings().postgres_dsn, records=records, runs=runs, rounds=rounds, echo=lambda message: click.echo(message, err=True))
    )
    click.echo(json.dumps(measured.as_json(), indent=2) if as_json else measured.as_text())
    if measured.gpu_milli_hours is None:
        raise click.ClickException("the groupings of the month disagree on its total GPU-hours")


def _report_file(path: str | None, what: str) -> dict | None:  # type: ignore[type-arg]
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            found = json.load(f)
    except OSError as exc:
        raise click.BadParameter(f"cannot read {path}: {exc.strerror}", param_hint=what) from exc
    except json.JSONDecodeError as exc:
        raise click.BadParameter(f"{path} is not JSON ({exc}): write it with the benchmark's --json", param_hint=what) from exc
    if not isinstance(found, dict):
        raise click.BadParameter(f"{path} is not a benchmark's JSON report", param_hint=what)
    return found


@bench.command()
@click.option("--admission", "admission_file", required=True, help="`budgetgate bench admission --json` output (open loop included, preferably).")
@click.option("--metering", "metering_file", required=True, help="`budgetgate bench metering --json` output.")
@click.option("--reconciliation", "reconciliation_file", help="`budgetgate bench reconciliation --json` output, when it measured CPU per record.")
@click.option("--scenario", type=click.Choice(SCENARIOS), default="spread", show_default=True, help="The admission scenario whose costs to use.")
@click.option("--gpus", default="1000,10000,100000", show_default=True, help="Platform sizes, comma-separated.")
@click.option("--utilization", default=0.85, show_default=True, type=click.FloatRange(0, 1, min_open=True), help="Share of the GPUs running work at the peak.")
@click.option("--gpus-per-run", default=8.0, show_default=True, type=click.FloatRange(0, min_open=True), help="Mean GPUs of a running run.")
@click.option(
    "--submissions-per-1000-gpus", default=2.0, show_default=True, type=click.FloatRange(0, min_open=True), help="Peak admission requests/s per 1,000 GPUs."
)
@click.option(
    "--sample-seconds", default=15.0, show_default=True, type=click.FloatRange(0, min_open=True), help="One metering sample per running run this often."
)
@click.option("--headroom", default=0.5, show_default=True, type=click.FloatRange(0, 1, min_open=True), help="Share of a core planned busy at the peak.")
@click.option(
    "--retention-months",
    default=12,
    show_default=True,
    type=click.IntRange(1),
    help="Months of decisions and usage Postgres keeps before `budgetgate ledger archive` moves them out.",
)
@click.option(
    "--mean-load",
    default=0.5,
    show_default=True,
    type=click.FloatRange(0, 1, min_open=True),
    help="The load over a month as a share of its peak (for the storage the retention holds).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the plans as JSON.")
def capacity(
    admission_file: str,
    metering_file: str,
    reconciliation_file: str | None,
    scenario: str,
    gpus: str,
    utilization: float,
    gpus_per_run: float,
    submissions_per_1000_gpus: float,
    sample_seconds: float,
    headroom: float,
    retention_months: int,
    mean_load: float,
    as_json: bool,
) -> None:
    """What platforms of --gpus GPUs need at their peak, from the CPU the benchmarks measured per
    decision and per sample: cores per service, Redis shards, Kafka partitions, Postgres cores, and
    from the bytes Postgres wrote per unit, its WAL rate and its storage.
    Measures nothing itself (see budgetgate.benchmark.capacity and docs/scale-out.md)."""
    from budgetgate.benchmark import capacity as model

    try:
        sizes = [int(g.replace("_", "")) for g in gpus.split(",") if g.strip()]
    except ValueError as exc:
        raise click.BadParameter(f"{gpus!r}: give whole numbers of GPUs, comma-separated", param_hint="--gpus") from exc
    if not sizes or any(g <= 0 for g in sizes):
        raise click.BadParameter(f"{gpus!r}: give positive numbers of GPUs, comma-separated", param_hint="--gpus")
    admission_report = _report_file(admission_file, "--admission")
    metering_report = _report_file(metering_file, "--metering")
    assert admission_report is not None and metering_report is not None
    try:
        costs = model.costs(admission_report, metering_report, _report_file(reconciliation_file, "--reconciliation"), scenario=scenario)
    except model.CostsMissing as exc:
        raise click.ClickException(str(exc)) from exc
    load = model.Load(
        utilization=utilization,
        gpus_per_run=gpus_per_run,
        submissions_per_s_per_1000_gpus=submissions_per_1000_gpus,
        sample_seconds=sample_seconds,
        headroom=headroom,
        retention_months=retention_months,
        mean_load=mean_load,
    )
    plans = [model.plan(g, costs, load) for g in sizes]
    if as_json:
        click.echo(json.dumps({"costs": costs.as_json(), "plans": [p.as_json() for p in plans]}, indent=2))
    else:
        click.echo(model.as_markdown(plans, costs, load))
