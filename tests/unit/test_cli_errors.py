"""Ordinary mistakes on the command line are one-line errors, never tracebacks: an option out of
range, a period reaching before the year 1, a server address that does not parse or answer, a
ledger command with no stack named (it must not fall back on 127.0.0.1's Postgres and Redis), and
a settlements command with no reconciler named or none answering."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from budgetgate.cli.main import cli
from tests.support.admission import EXAMPLES

# Nothing listens on port 1: an address that parses and does not answer.
UNREACHABLE = "postgresql://postgres@127.0.0.1:1/postgres"


@pytest.fixture(autouse=True)
def no_stack(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No BUDGETGATE_* variable and no .budgetgate/dev.json: only what a test names."""
    for name in [n for n in os.environ if n.startswith("BUDGETGATE_")]:
        monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)


def run(*args: str, **env: str) -> Result:
    return CliRunner().invoke(cli, list(args), env=env)


def refused(result: Result, *words: str, code: int = 1) -> None:
    # An exception click did not turn into a message is the traceback a user would see.
    assert isinstance(result.exception, SystemExit) and result.exit_code == code, (result.output, repr(result.exception))
    assert all(w in result.output for w in words), result.output


@pytest.mark.parametrize("command", [["ledger", "check"], ["ledger", "rebuild-redis"]])
def test_ledger_commands_need_a_stack_and_never_fall_back_on_local_servers(command: list[str]) -> None:
    refused(run(*command), "no local stack found", "BUDGETGATE_POSTGRES_DSN")
    # Postgres named, Redis not: the rebuild would rewrite whatever Redis runs on 127.0.0.1.
    refused(run(*command, BUDGETGATE_POSTGRES_DSN=UNREACHABLE), "BUDGETGATE_REDIS_URL")
    refused(run(*command, BUDGETGATE_POSTGRES_DSN=UNREACHABLE, BUDGETGATE_REDIS_URL="redis://127.0.0.1:1/0"), "cannot reach Postgres")


@pytest.mark.parametrize("command", [["settlements", "dead-letters"], ["settlements", "resolve", "r", "--release", "--reason", "x"]])
def test_settlement_commands_need_the_reconciler_and_say_when_it_does_not_answer(command: list[str]) -> None:
    # They go through the reconciler's API: its URL, never a guess.
    refused(run(*command), "no reconciler URL", "BUDGETGATE_RECONCILER_URL", "budgetgate dev up")
    refused(run(*command, BUDGETGATE_RECONCILER_URL="http://127.0.0.1:1"), "cannot reach reconciler at http://127.0.0.1:1")


def test_an_admin_command_says_when_admission_does_not_answer() -> None:
    refused(run("admin", "tenant", "show", "vision", BUDGETGATE_ADMISSION_URL="http://127.0.0.1:1"), "cannot reach admission at http://127.0.0.1:1")


@pytest.mark.parametrize("dsn", ["postgresql://postgres@127.0.0.1:abc/postgres", "postgresql://postgres@127.0.0.1:99999/postgres"])
def test_a_dsn_whose_port_does_not_parse_is_named(dsn: str) -> None:
    refused(run("token", "list", BUDGETGATE_POSTGRES_DSN=dsn), "invalid Postgres address")
    refused(run("ledger", "check", BUDGETGATE_POSTGRES_DSN=dsn, BUDGETGATE_REDIS_URL="redis://127.0.0.1:6379/0"), "invalid Postgres address")


def test_options_out_of_range_are_usage_errors() -> None:
    env = {"BUDGETGATE_POSTGRES_DSN": UNREACHABLE, "BUDGETGATE_KAFKA_BOOTSTRAP": "127.0.0.1:1"}
    cases = [
        (["replay", "--since", "99999999d"], "before the year 1"),
        (["policy", "what-if", str(EXAMPLES), "--since", "99999999d"], "before the year 1"),
        (["token", "create", "--name", "x", "--role", "reader", "--expires", "2000000w"], "longer than 100 years"),
        (["token", "create", "--name", "x", "--role", "reader", "--expires", "99999999999999999999999m"], "longer than 100 years"),
        (["admin-log", "--limit", "-1"], "--limit"),
        (["publish", "lifecycle", "--run-id", "r", "--event", "started", "--gpus", "99999999999"], "--gpus"),
        (["publish", "lifecycle", "--run-id", "r", "--event", "started", "--at", "9999-12-31T23:00:00-05:00"], "out of range"),
        # Before the earliest time the consumers take: published, it was dead-lettered unseen.
        (["publish", "lifecycle", "--run-id", "r", "--event", "started", "--at", "1970-01-01T00:00:00Z"], "before 2000-01-01"),
        # A dead-lettered settlement is resolved one way, and why is said for the admin log.
        (["settlements", "resolve", "r", "--reason", "x"], "--release"),
        (["settlements", "resolve", "r", "--release", "--settle", "--reason", "x"], "one of the two"),
        (["settlements", "resolve", "r", "--release"], "--reason"),
        (["settlements", "resolve", "r", "--release", "--reason", "  "], "say why"),
    ]
    for args, words in cases:
        refused(run(*args, **env), words, code=2)
