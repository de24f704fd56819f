"""`budgetgate submit` against a real admission service (Postgres, Redis, Kafka): the decision
with each budget's figures, `--json`, an exit code for each answer (0 ALLOW, 1 DENY, 2 usage
error, 3 DELAY, 4 an error or no answer), and `--wait`, which follows a DELAY by resubmitting
the same request with the next attempt at its next eligible time (here: when a never-started
run's reservation is given back by the reconciler)."""

from __future__ import annotations

import asyncio
import json
import time
from datetime import datetime, timedelta
from pathlib import Path

import asyncpg
import pytest
from click.testing import CliRunner, Result

from budgetgate.cli.main import cli
from tests.support.admission import apply_policies, budget_yaml
from tests.support.principals import token_in_env  # noqa: F401 - a fixture, used by name
from tests.support.reconciler import reconciler_factory  # noqa: F401 - a fixture, used by name

pytestmark = pytest.mark.usefixtures("token_in_env")

VISION = ["-n", "vision-prod", "-l", "cost-center=1042", "-l", "team=vision", "-l", "environment=prod", "--flavor", "h100", "--region", "us-east-1"]
TEN_DELAY = {"d.yaml": budget_yaml("ten", limit="gpu_hours: 10", on_exhausted="delay")}
TEAM = ["-n", "vision-prod", "-l", "team=vision"]


def run(url: str, *args: str) -> Result:
    # No local stack is found (BUDGETGATE_HOME names none): only the URL and the test's token.
    return CliRunner().invoke(cli, ["submit", *args], env={"BUDGETGATE_ADMISSION_URL": url, "BUDGETGATE_HOME": "/nonexistent"})


async def submit(url: str, *args: str) -> Result:
    # The service runs on this test's event loop: the command runs beside it.
    return await asyncio.to_thread(run, url, *args)


def when(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


async def decisions(dsn: str, run_id: str) -> list[tuple[int, str, datetime]]:
    conn = await asyncpg.connect(dsn)
    try:
        rows = await conn.fetch("SELECT attempt, outcome, decided_at FROM decisions WHERE run_id = $1 ORDER BY attempt", run_id)
    finally:
        await conn.close()
    return [(r["attempt"], r["outcome"], r["decided_at"]) for r in rows]


def rows_of(output: str) -> dict[str, dict[str, str]]:
    """The figures table of the human output, by budget: each row's cells under its header."""
    lines = output.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("budget "))
    header, rule = lines[start], lines[start + 1]
    spans, at = [], 0
    for dashes in rule.split("  "):  # columns are separated by two spaces, the rule by column
        spans.append((at, at + len(dashes)))
        at += len(dashes) + 2
    names = [header[a:b].strip() for a, b in spans]
    found = {}
    for line in lines[start + 2 :]:
        if not line.strip() or not line.startswith(tuple("abcdefghijklmnopqrstuvwxyz")):
            break
        cells = dict(zip(names, (line[a:b].strip() for a, b in spans), strict=True))
        found[cells["budget"]] = cells
    return found


async def test_allow_prints_each_budgets_figures_and_json_is_the_answer(admission) -> None:
    shown = await submit(admission.url, *VISION, "--gpus", "8", "--hours", "6", "--run-id", "cli/allow")
    assert shown.exit_code == 0, (shown.output, shown.exception)
    assert shown.stdout.startswith("ALLOW run cli/allow attempt 1: 48 GPU-hours, 188.78 USD\nadmitted: ")
    # The same request again is answered from its decision; --json is that answer.
    again = await submit(admission.url, *VISION, "--gpus", "8", "--hours", "6", "--run-id", "cli/allow", "--json")
    assert again.exit_code == 0, again.output
    answer = json.loads(again.stdout)
    assert (answer["decision"], answer["replayed"], answer["run_id"], answer["attempt"]) == ("ALLOW", True, "cli/allow", 1)
    table = rows_of(shown.stdout)
    assert answer["evaluations"] and set(table) == {e["policy_id"] for e in answer["evaluations"]}
    for e in answer["evaluations"]:
        row = table[e["policy_id"]]
        assert (row["decision"], row["enforcement"], row["limit"], row["needs"], row["reserves"]) == (
            e["decision"], e["enforcement"], f"{e['limit']:g}", f"{e['projected']:g}", f"{e['admitted']:g}",
        )  # fmt: skip
        assert (row["remaining"], row["used"]) == (f"{e['remaining']:g}", f"{e['limit'] - e['remaining']:g}")
    vision = table["gpu-budget/team-vision-prod"]
    assert (vision["unit"], vision["limit"], vision["needs"], vision["reserves"]) == ("gpu-hours", "500", "48", "48")


async def test_a_fresh_run_id_is_made_and_printed(admission) -> None:
    first, second = await submit(admission.url, *VISION, "--gpus", "1", "--hours", "1"), await submit(admission.url, *VISION, "--gpus", "1", "--hours", "1")
    assert first.exit_code == second.exit_code == 0, (first.output, second.output)
    ids = [r.stdout.split()[2] for r in (first, second)]
    assert all(i.startswith("cli/") for i in ids) and ids[0] != ids[1]


async def test_deny_exits_1_with_the_shortfall(admission_factory, pg_dsn) -> None:
    await apply_policies(pg_dsn, {"d.yaml": budget_yaml("ten", limit="gpu_hours: 10")}, sha="d" * 40)
    server = await admission_factory()
    await server.wait_ready()
    assert (await submit(server.url, *TEAM, "--gpus", "2", "--hours", "3", "--run-id", "cli/six")).exit_code == 0
    denied = await submit(server.url, *TEAM, "--gpus", "2", "--hours", "3", "--run-id", "cli/denied")
    assert denied.exit_code == 1, denied.output
    assert denied.stdout.startswith("DENY run cli/denied attempt 1: 6 GPU-hours")
    row = rows_of(denied.stdout)["ten"]
    assert (row["decision"], row["limit"], row["used"], row["remaining"], row["needs"], row["reserves"], row["short by"]) == (
        "DENY", "10", "6", "4", "6", "0", "2",
    )  # fmt: skip


async def test_delay_exits_3_and_says_when_to_resubmit(admission_factory, pg_dsn) -> None:
    await apply_policies(pg_dsn, TEN_DELAY, sha="c" * 40)
    server = await admission_factory(start_deadline_seconds=1800)
    await server.wait_ready()
    assert (await submit(server.url, *TEAM, "--gpus", "1", "--hours", "6", "--run-id", "cli/first")).exit_code == 0
    delayed = await submit(server.url, *TEAM, "--gpus", "1", "--hours", "6", "--run-id", "cli/second", "--json")
    assert delayed.exit_code == 3, delayed.output
    [evaluation] = json.loads(delayed.stdout)["evaluations"]
    shown = await submit(server.url, *TEAM, "--gpus", "1", "--hours", "6", "--run-id", "cli/second")
    assert shown.exit_code == 3 and shown.stdout.startswith("DELAY run cli/second attempt 1")
    eligible = when(evaluation["next_eligible_time"]).isoformat().replace("+00:00", "Z")
    assert f"resubmit as attempt 2 at or after {eligible} (or use --wait)" in shown.stdout
    assert rows_of(shown.stdout)["ten"]["eligible at"] == eligible

    # Half an hour does not fit a 3 s wait: it asks whether the run fits now until the wait
    # ends, and with nothing freed it resubmits nothing.
    started = time.monotonic()
    waited = await submit(server.url, *TEAM, "--gpus", "1", "--hours", "6", "--run-id", "cli/second", "--wait", "--wait-timeout", "3s", "--interval", "0.5")
    assert waited.exit_code == 3 and 3 <= time.monotonic() - started < 30, waited.output
    assert f"next eligible at {eligible}, after the wait ends; waiting until " in waited.stderr
    assert "the wait ended at " in waited.stderr and "still DELAYed at attempt 1" in waited.stderr
    assert [(a, o) for a, o, _ in await decisions(pg_dsn, "cli/second")] == [(1, "DELAY")]

    # The same wait while the limit is raised: admission says the run fits now, and it is
    # resubmitted then, long before its next eligible time.
    waiting = asyncio.create_task(
        submit(server.url, *TEAM, "--gpus", "1", "--hours", "6", "--run-id", "cli/second", "--wait", "--wait-timeout", "2m", "--interval", "0.5")
    )
    await asyncio.sleep(1.5)
    await apply_policies(pg_dsn, {"d.yaml": budget_yaml("ten", limit="gpu_hours: 20", on_exhausted="delay")}, sha="e" * 40)
    raised = await waiting
    assert raised.exit_code == 0, (raised.stdout, raised.stderr)
    assert "run cli/second fits now" in raised.stderr and "attempt 2: ALLOW" in raised.stderr
    assert [(a, o) for a, o, _ in await decisions(pg_dsn, "cli/second")] == [(1, "DELAY"), (2, "ALLOW")]
    assert raised.stdout.startswith("ALLOW run cli/second attempt 2")


async def test_wait_resubmits_with_the_next_attempt_at_the_next_eligible_time(admission_factory, reconciler_factory, pg_dsn) -> None:  # noqa: F811
    await apply_policies(pg_dsn, TEN_DELAY, sha="c" * 40)
    # A run that never starts gives its reservation back at its start deadline (the reconciler).
    server = await admission_factory(start_deadline_seconds=3)
    await server.wait_ready()
    first = await submit(server.url, *TEAM, "--gpus", "1", "--hours", "6", "--run-id", "cli/idle", "--json")
    assert first.exit_code == 0, first.output
    await reconciler_factory(start_deadline_seconds=3)
    waited = await submit(
        server.url, *TEAM, "--gpus", "1", "--hours", "6", "--run-id", "cli/waits", "--wait", "--interval", "0.5", "--wait-timeout", "2m", "--json"
    )
    assert waited.exit_code == 0, (waited.stdout, waited.stderr)
    answer = json.loads(waited.stdout)  # only the last answer on stdout; the progress on stderr
    assert answer["decision"] == "ALLOW" and answer["run_id"] == "cli/waits" and answer["attempt"] >= 2
    history = await decisions(pg_dsn, "cli/waits")
    assert [a for a, _, _ in history] == list(range(1, answer["attempt"] + 1))
    assert [o for _, o, _ in history] == ["DELAY"] * (answer["attempt"] - 1) + ["ALLOW"]
    assert "DELAY at attempt 1: resubmitting as attempt 2 at " in waited.stderr and f"attempt {answer['attempt']}: ALLOW" in waited.stderr
    # The first resubmission went no sooner than the first DELAY's next eligible time: the idle
    # run's start deadline, 3 s after its admission.
    idle = json.loads(first.stdout)
    assert history[1][2] >= when(idle["decided_at"]) + timedelta(seconds=3)
    # and never two submissions closer than --interval
    assert all((b - a).total_seconds() >= 0.5 for (_, _, a), (_, _, b) in zip(history, history[1:], strict=False))


async def test_errors_exit_4_and_usage_errors_2(admission, tmp_path: Path) -> None:
    assert (await submit(admission.url, *VISION, "--gpus", "8", "--hours", "6", "--run-id", "cli/conflict")).exit_code == 0
    # The same run id for another request: a 409, nothing decided.
    conflict = await submit(admission.url, *VISION, "--gpus", "4", "--hours", "6", "--run-id", "cli/conflict")
    assert conflict.exit_code == 4 and "409" in conflict.stderr and "resources.gpus" in conflict.stderr, conflict.output
    # A flavor the rate card does not price: the service's 422, each field named.
    unpriced = await submit(admission.url, *VISION, "--gpus", "1", "--hours", "1", "--flavor", "no-such-flavor", "--run-id", "cli/unpriced")
    assert unpriced.exit_code == 4 and "error: resources.flavor:" in unpriced.stderr, unpriced.output
    # Nothing listens on port 1 (the client's resends are spent first).
    gone = await submit("http://127.0.0.1:1", *VISION, "--gpus", "1", "--hours", "1")
    assert gone.exit_code == 4 and "cannot reach admission at http://127.0.0.1:1" in gone.stderr, gone.output

    missing = await submit(admission.url, "--gpus", "1", "--hours", "1")
    assert missing.exit_code == 2 and "--namespace" in missing.stderr
    negative = await submit(admission.url, *VISION, "--gpus", "-1", "--hours", "1")
    assert negative.exit_code == 2 and "--gpus" in negative.stderr
    # A body no submission may have is refused before it is sent, naming the field.
    body = tmp_path / "body.json"
    body.write_text(json.dumps({"namespace": "vision-prod", "resources": {"gpus": "8"}, "projected_runtime_hours": 1.0}))
    refused = await submit(admission.url, "--file", str(body), "--run-id", "cli/file")
    assert refused.exit_code == 2 and "resources.gpus" in refused.stderr, refused.output
    assert (await admission.client.get("/v1/admissions/cli/file")).status_code == 404


async def test_quote_reads_the_same_options_and_reserves_nothing(admission) -> None:
    args = [*VISION, "--gpus", "8", "--hours", "6", "--run-id", "cli/quoted"]
    env = {"BUDGETGATE_ADMISSION_URL": admission.url, "BUDGETGATE_HOME": "/nonexistent"}
    quoted = await asyncio.to_thread(CliRunner().invoke, cli, ["quote", *args, "--json"], env=env)
    assert quoted.exit_code == 0, quoted.output
    assert json.loads(quoted.stdout)["decision"] == "ALLOW" and (await admission.client.get("/v1/admissions/cli/quoted")).status_code == 404
    submitted = await submit(admission.url, *args, "--json")
    assert json.loads(submitted.stdout)["projected_gpu_hours"] == json.loads(quoted.stdout)["projected_gpu_hours"] == 48.0
