"""`budgetgate submit` without a service: when a DELAY may be resubmitted (only hard budgets that
delayed it count), the wait's bound as a duration, and usage errors (exit 2) before anything is
sent; the exit codes are in --help."""

from __future__ import annotations

import os
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from budgetgate.cli.main import cli
from budgetgate.cli.submit import eligible_at
from budgetgate.contracts.admission import AdmissionResponse, EvaluationOut

EXAMPLE_ANSWER = AdmissionResponse.model_config["json_schema_extra"]["examples"][0]  # type: ignore[index]
EXAMPLE_EVALUATION = EvaluationOut.model_config["json_schema_extra"]["examples"][0]  # type: ignore[index]


def delayed(*evaluations: dict[str, Any]) -> AdmissionResponse:
    return AdmissionResponse.model_validate({**EXAMPLE_ANSWER, "decision": "DELAY", "evaluations": [{**EXAMPLE_EVALUATION, **e} for e in evaluations]})


def at(hour: int) -> str:
    return datetime(2026, 7, 14, hour, tzinfo=UTC).isoformat()


def test_the_latest_time_of_the_hard_budgets_that_delayed() -> None:
    answer = delayed(
        {"policy_id": "a", "decision": "DELAY", "next_eligible_time": at(10)},
        {"policy_id": "b", "decision": "DELAY", "next_eligible_time": at(12)},
        {"policy_id": "c", "decision": "ALLOW"},
        # A dry-run policy's own DELAY blocks nothing, with or without a time of its own.
        {"policy_id": "d", "decision": "DELAY", "enforcement": "dry-run", "next_eligible_time": None},
        {"policy_id": "e", "decision": "DELAY", "enforcement": "dry-run", "next_eligible_time": at(20)},
    )
    assert eligible_at(answer) == datetime(2026, 7, 14, 12, tzinfo=UTC)


def test_no_time_when_a_delaying_budget_names_none() -> None:
    assert eligible_at(delayed({"policy_id": "a", "decision": "DELAY", "next_eligible_time": at(10)}, {"policy_id": "b", "decision": "DELAY"})) is None
    assert eligible_at(delayed({"policy_id": "a", "decision": "ALLOW"})) is None


@pytest.fixture(autouse=True)
def no_stack(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in os.environ if n.startswith("BUDGETGATE_")]:
        monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)


BODY = ["-n", "vision-prod", "--gpus", "1", "--hours", "1"]


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--gpus", "1", "--hours", "1"], "missing --namespace"),
        (["-n", "vision-prod", "--hours", "1"], "missing --gpus"),
        ([*BODY, "--gpus", "-1"], "--gpus"),
        ([*BODY, "--hours", "0"], "--hours"),
        ([*BODY, "--attempt", "0"], "--attempt"),
        ([*BODY, "--label", "team"], "not KEY=VALUE"),
        ([*BODY, "--wait", "--wait-timeout", "soon"], "not a duration"),
        ([*BODY, "--wait", "--wait-timeout", "40d"], "not between 0 and 31 days"),
        ([*BODY, "--wait", "--interval", "0"], "--interval"),
        # The service's own model, before sending: a label value Kubernetes would not take.
        ([*BODY, "--label", "team=not a value"], "labels"),
        ([*BODY, "--flavor", "h100 sxm"], "resources.flavor"),
    ],
)
def test_usage_errors_exit_2_and_send_nothing(args: list[str], words: str) -> None:
    # Port 1 answers nothing: a command that sent anything would fail with 4, not 2.
    result = CliRunner().invoke(cli, ["submit", *args], env={"BUDGETGATE_ADMISSION_URL": "http://127.0.0.1:1", "BUDGETGATE_TOKEN": "t"})
    assert result.exit_code == 2, (result.output, result.exception)
    assert words in result.stderr, result.stderr


def test_the_exit_codes_are_in_the_help() -> None:
    shown = CliRunner().invoke(cli, ["submit", "--help"]).stdout
    for line in ("0    ALLOW", "1    DENY", "2    usage error", "3    DELAY", "4    budgetgate error", "130  interrupted"):
        assert line in shown
