"""`budgetgate submit`: submit a workload to admission as a platform does (POST /v1/admissions)
and print the decision with the figures behind it; `--wait` follows a DELAY until the run is
admitted, refused for good, or the wait's upper bound is reached.

Waiting keeps to admission's resubmission rules (services/admission/resubmission.py): the same
request under the same run id, each time with the next attempt (a higher attempt after a DELAY
is decided afresh; the same attempt would only be answered again), sent at the next eligible
time the DELAY named, or sooner once admission says the run fits now (GET /v1/admissions/{run_id}:
`waiting.headroom`, asked every `--interval` seconds: a limit raised, a run ended early), and
never sooner than `--interval` after the last submission. A next eligible time past the end of
the wait is waited for only in that way, until the wait ends. A 409 while waiting (someone else
decided the run id for another request) ends the wait: the run id is no longer this command's
alone.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from budgetgate.cli.calling import call
from budgetgate.cli.quote import label_pairs, request_body
from budgetgate.cli.tables import table

if TYPE_CHECKING:
    from budgetgate.client import Client
    from budgetgate.contracts.admission import AdmissionResponse

ALLOWED, DENIED, USAGE, DELAYED, FAILED, INTERRUPTED = 0, 1, 2, 3, 4, 130
EXIT_CODES = {"ALLOW": ALLOWED, "DENY": DENIED, "DELAY": DELAYED}
MOST_ATTEMPTS = 100_000  # AdmissionRequest.attempt's bound

EXIT_HELP = f"""\b
Exit codes:
  {ALLOWED}    ALLOW: the run may start
  {DENIED}    DENY: it must not
  {USAGE}    usage error: a bad option or request (nothing was sent)
  {DELAYED}    DELAY: resubmit later (with --wait: still delayed when the wait ended)
  {FAILED}    budgetgate error: an error answer (409, 422, 401/403, 503) or no answer
  {INTERRUPTED}  interrupted (Ctrl-C) while waiting"""


class Failed(click.ClickException):
    """A submission budgetgate did not decide: exit 4."""

    exit_code = FAILED


_DURATION = re.compile(r"^(\d+(?:\.\d+)?)\s*(s|m|h|d)?$")
_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, None: 1}


def _duration(_ctx: click.Context, _param: click.Parameter, value: str) -> float:
    found = _DURATION.match(value.strip())
    if found is None:
        raise click.BadParameter(f"{value!r} is not a duration like 90s, 30m or 2h (or a number of seconds)")
    seconds = float(found.group(1)) * _SECONDS[found.group(2)]
    if seconds <= 0 or seconds > 31 * 86400:
        raise click.BadParameter(f"{value!r} is not between 0 and 31 days")
    return seconds


@click.command(epilog=EXIT_HELP)
@click.option(
    "--file",
    "body_file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="A submission body as JSON (what POST /v1/admissions takes); the options below override its fields.",
)
@click.option("--run-id", default=None, help="The run id; the same on every retry (default: a fresh one, printed).")
@click.option(
    "--attempt", type=click.IntRange(1, MOST_ATTEMPTS), default=None, help="The attempt (default 1); a higher attempt after a DELAY is decided afresh."
)
@click.option("--namespace", "-n", default=None, help="The namespace the workload runs in.")
@click.option("--label", "-l", "labels", multiple=True, callback=label_pairs, help="A label, KEY=VALUE; repeatable.")
@click.option("--gpus", type=click.IntRange(min=0), default=None, help="GPUs asked for (0 for CPU-only work).")
@click.option("--nodes", type=click.IntRange(min=1), default=None, help="Nodes asked for (default 1).")
@click.option("--flavor", default=None, help="The resource flavor, e.g. h100.")
@click.option("--region", default=None, help="The region, for regional prices.")
@click.option("--hours", "runtime_hours", type=click.FloatRange(min=0, min_open=True), default=None, help="Projected runtime in hours.")
@click.option("--json", "as_json", is_flag=True, help="Print the answer as JSON (as POST /v1/admissions answers it).")
@click.option(
    "--wait",
    is_flag=True,
    help="On DELAY, resubmit with the next attempt at the next eligible time, or once admission says the run fits, until it is admitted or refused.",
)
@click.option(
    "--wait-timeout",
    default="1h",
    show_default=True,
    callback=_duration,
    help="With --wait: how long to wait at most (90s, 30m, 2h, 1d).",
)
@click.option(
    "--interval",
    type=click.FloatRange(min=0.1, max=3600),
    default=10.0,
    show_default=True,
    help="With --wait: how often, in seconds, to ask whether the run fits now; and the least time between two submissions.",
)
def submit(
    body_file: Path | None,
    run_id: str | None,
    attempt: int | None,
    namespace: str | None,
    labels: dict[str, str],
    gpus: int | None,
    nodes: int | None,
    flavor: str | None,
    region: str | None,
    runtime_hours: float | None,
    as_json: bool,
    wait: bool,
    wait_timeout: float,
    interval: float,
) -> None:
    """Submit a workload to admission and print the decision: for each budget its limit, what is
    used, what this run needs and reserves, what remains.

    The answer is stored and published like any platform's submission: an ALLOW reserves."""
    body = request_body(
        body_file, run_id=run_id, namespace=namespace, labels=labels, gpus=gpus, nodes=nodes, flavor=flavor,
        region=region, runtime_hours=runtime_hours, attempt=attempt,
    )  # fmt: skip
    body.setdefault("run_id", f"cli/{uuid.uuid4()}")
    body.setdefault("attempt", 1)
    deadline = datetime.now(UTC) + timedelta(seconds=wait_timeout)

    def work(client: Client) -> AdmissionResponse:
        answer = client.submit(body)
        if wait:
            answer = follow(client, body, answer, deadline=deadline, interval=interval)
        return answer

    try:
        answer = call(work, service="admission", url=lambda client: client.url, role="submitter", failure=Failed)
    except KeyboardInterrupt:
        click.echo(f"budgetgate: interrupted; run {body['run_id']} is as its last decision left it (`budgetgate status {body['run_id']}`)", err=True)
        click.get_current_context().exit(INTERRUPTED)
    if as_json:
        click.echo(json.dumps(answer.model_dump(mode="json"), indent=2))
    else:
        print_decision(answer)
    click.get_current_context().exit(EXIT_CODES[answer.decision])


def eligible_at(answer: AdmissionResponse) -> datetime | None:
    """When a DELAY may be resubmitted: the latest next eligible time of the hard budgets that
    delayed it (a dry-run or soft policy's own DELAY blocks nothing); None when one of them
    names none (no instant will do) or none delayed it."""
    times = [e.next_eligible_time for e in answer.evaluations if e.decision == "DELAY" and e.enforcement == "hard"]
    if not times or any(t is None for t in times):
        return None
    return max(t for t in times if t is not None)


def follow(
    client: Client,
    body: dict[str, Any],
    answer: AdmissionResponse,
    *,
    deadline: datetime,
    interval: float,
    sleep: Callable[[float], None] = time.sleep,
) -> AdmissionResponse:
    """Resubmit `body` while the answer is a DELAY, until `deadline`: with the next attempt, at
    the DELAY's next eligible time, or sooner when admission says the run fits now (its
    `waiting.headroom`, asked every `interval` seconds); never two submissions closer than
    `interval`. The last answer; progress goes to stderr."""
    from budgetgate.client import Unauthorized

    last_sent = datetime.now(UTC)
    ask = True  # whether lookups may be made (a token without the lookup role cannot)
    while answer.decision == "DELAY":
        tried = max(answer.attempt, int(body["attempt"]))
        if tried >= MOST_ATTEMPTS:
            _say(f"DELAY at attempt {tried}, the last attempt a run may have: not waiting")
            return answer
        when = eligible_at(answer)
        earliest = last_sent + timedelta(seconds=interval)
        at = max(when, earliest) if when is not None else None
        if at is not None and at <= deadline:
            _say(f"DELAY at attempt {tried}: resubmitting as attempt {tried + 1} at {_iso(at)} (in {_seconds(at):.0f}s), or once it fits")
        else:
            said = f"next eligible at {_iso(when)}, after the wait ends" if when is not None else "no time named when it will fit"
            _say(f"DELAY at attempt {tried}: {said}; waiting until {_iso(deadline)} for room (a raised limit, a run that ends early)")
        while at is None or datetime.now(UTC) < at:
            left = _seconds(deadline)
            if left <= 0:
                _say(f"the wait ended at {_iso(deadline)}: run {answer.run_id} is still DELAYed at attempt {tried}")
                return answer
            sleep(max(0.0, min(interval, left, _seconds(at) if at is not None else left)))
            if ask and datetime.now(UTC) >= earliest and (at is None or datetime.now(UTC) < at):
                try:
                    found = client.lookup(answer.run_id)
                except Unauthorized as exc:
                    ask = False
                    _say(f"cannot ask whether the run fits now ({exc.detail}): waiting for the next eligible time only")
                    continue
                if found is not None and found.waiting is not None and found.waiting.headroom:
                    _say(f"run {answer.run_id} fits now: {found.waiting.summary}")
                    break
        body["attempt"] = tried + 1
        last_sent = datetime.now(UTC)
        answer = client.submit(body)
        _say(f"attempt {answer.attempt}: {answer.decision}" + (" (answered before: replayed)" if answer.replayed else ""))
    return answer


def _seconds(at: datetime) -> float:
    return (at - datetime.now(UTC)).total_seconds()


def print_decision(answer: AdmissionResponse) -> None:
    """The decision, its reason and each budget's figures, as a person reads them."""
    cost = f", {answer.showback_cost:.2f} {answer.currency}" if answer.showback_cost is not None else ""
    replayed = " (the stored answer of an earlier identical submission)" if answer.replayed else ""
    click.echo(f"{answer.decision} run {answer.run_id} attempt {answer.attempt}: {answer.projected_gpu_hours:g} GPU-hours{cost}{replayed}")
    click.echo(answer.reason)
    if answer.evaluations:
        click.echo()
        for line in table(*_figures(answer)):
            click.echo(line)
    else:
        click.echo("no budget policy applies to this submission")
    missing = sorted({label for e in answer.evaluations for label in e.missing_labels})
    if missing:
        click.echo(f"missing labels: {', '.join(missing)}")
    if answer.priority_penalty:
        click.echo(f"priority penalty: {answer.priority_penalty:.4f}")
    if answer.preemptible:
        click.echo("admitted above the tenant's fair-share target: preemptible")
    if answer.decision == "DELAY":
        when = eligible_at(answer)
        again = f"as attempt {answer.attempt + 1}"
        click.echo(
            f"resubmit {again} at or after {_iso(when)} (or use --wait)"
            if when
            else f"no time will do: reduce the run, or resubmit {again} once a limit is raised"
        )


def _figures(answer: AdmissionResponse) -> tuple[list[str], list[list[str]]]:
    refused = any(e.deficit is not None or e.next_eligible_time is not None for e in answer.evaluations)
    headers = ["budget", "enforcement", "decision", "unit", "limit", "used", "remaining", "needs", "reserves"]
    headers += ["short by", "eligible at"] if refused else []
    rows = []
    for e in answer.evaluations:
        used = "-" if e.remaining is None else f"{e.limit - e.remaining:g}"
        remaining = "-" if e.remaining is None else f"{e.remaining:g}"
        row = [e.policy_id, e.enforcement, e.decision, e.unit.replace("_", "-"), f"{e.limit:g}", used, remaining, f"{e.projected:g}", f"{e.admitted:g}"]
        if refused:
            row += ["-" if e.deficit is None else f"{e.deficit:g}", _iso(e.next_eligible_time) if e.next_eligible_time else "-"]
        rows.append(row)
    return headers, rows


def _iso(at: datetime) -> str:
    return at.astimezone(UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


def _say(message: str) -> None:
    click.echo(f"budgetgate: {message}", err=True)
