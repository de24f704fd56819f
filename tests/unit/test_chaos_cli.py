"""`budgetgate chaos check HISTORY`: exit 0 when every checker passes, 1 with the seed, checker
and operations of each violation otherwise; bad input is a clear error."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from click.testing import CliRunner

from budgetgate.cli.main import cli
from tests.support.chaos_histories import clean_history as _clean
from tests.support.chaos_histories import submit as _submit


def _write(path: Path, lines: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def test_check_passes_a_clean_history(tmp_path: Path) -> None:
    result = CliRunner().invoke(cli, ["chaos", "check", str(_write(tmp_path / "h.jsonl", _clean()))])
    assert result.exit_code == 0, result.output
    assert "every checker passed" in result.output


def test_check_fails_an_over_admission_naming_seed_checker_and_operations(tmp_path: Path) -> None:
    lines = _clean()
    lines.insert(3, _submit(20, "r3", "ALLOW", "d3", at=3.5))
    observation = next(line for line in lines if line["type"] == "observation")
    observation["reservations"].append({"run_id": "r3", "ledger_key": "k0", "decision_id": "d3", "amount": 1_800_000, "state": "held", "age_seconds": 1.0})
    observation["decisions"].append({"decision_id": "d3", "run_id": "r3", "attempt": 1, "outcome": "ALLOW"})
    observation["topic_decisions"].append("d3")
    observation["evidence"].append({"decision_id": "d3", "event_type": "START", "event_time": "x"})
    result = CliRunner().invoke(cli, ["chaos", "check", str(_write(tmp_path / "h.jsonl", lines))])
    assert result.exit_code == 1
    assert "VIOLATION seed=7 checker=conservation operations=[0, 1, 20]" in result.output
    as_json = CliRunner().invoke(cli, ["chaos", "check", "--json", str(tmp_path / "h.jsonl")])
    assert as_json.exit_code == 1 and json.loads(as_json.output)["violations"][0]["checker"] == "conservation"


def test_check_refuses_what_is_not_a_history(tmp_path: Path) -> None:
    path = tmp_path / "h.jsonl"
    path.write_text("not json\n{}\n")
    result = CliRunner().invoke(cli, ["chaos", "check", str(path)])
    assert result.exit_code == 1 and "not JSON" in result.output
    _write(path, [{"type": "op"}])
    result = CliRunner().invoke(cli, ["chaos", "check", str(path)])
    assert result.exit_code == 1 and "no setup line" in result.output


def test_run_refuses_contradictory_fault_choices() -> None:
    result = CliRunner().invoke(cli, ["chaos", "run", "--seed", "1", "--fault", "redis-kill", "--without", "clock-skew"])
    assert result.exit_code == 2 and "give one of them" in result.output
