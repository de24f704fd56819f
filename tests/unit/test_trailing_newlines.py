"""Identifiers end where their text ends. A Python pattern anchored with `$` and applied with
`match` also takes a text with one newline after it ("run-1\n"), which admission's own rule (a
pydantic pattern, whose `$` is the end of the text) refuses: metering would then accept samples,
the reconciler lifecycle events, of a run id no submission can have, and a label value with a
newline would be handed to Kubernetes as safe."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import click
import pytest
from pydantic import TypeAdapter, ValidationError

from budgetgate.cli.token import _valid_name
from budgetgate.contracts.admission import RunId
from budgetgate.contracts.lifecycle_rules import run_id_problem
from budgetgate.core.metering import RawSample, Rejected, validate
from budgetgate.platforms.run_labels import HASHED_PREFIX, label_safe, run_label_value

NOW = datetime(2026, 3, 1, 12, tzinfo=UTC)


def test_admission_refuses_a_run_id_with_a_trailing_newline() -> None:
    # The rule the others follow.
    assert TypeAdapter(RunId).validate_python("run-1") == "run-1"
    with pytest.raises(ValidationError):
        TypeAdapter(RunId).validate_python("run-1\n")


@pytest.mark.parametrize("run_id", ["run-1\n", "\n", "x" * 256 + "\n"])
def test_metering_refuses_a_sample_of_such_a_run_id(run_id: str) -> None:
    raw = RawSample(run_id, "s1", NOW - timedelta(minutes=1), 60.0, 0.0, "dcgm")
    assert validate(raw._replace(run_id="run-1"), now=NOW, max_skew=timedelta(minutes=5)).run_id == "run-1"
    with pytest.raises(Rejected, match="run_id must be 1-256 printable ASCII characters without spaces"):
        validate(raw, now=NOW, max_skew=timedelta(minutes=5))


def test_lifecycle_rules_refuse_such_a_run_id() -> None:
    assert run_id_problem("run-1") is None
    assert run_id_problem("run-1\n") == "run_id must be 1 to 256 printable ASCII characters without spaces"


def test_a_label_value_with_a_trailing_newline_is_not_label_safe_and_is_hashed() -> None:
    assert label_safe("run-1") and run_label_value("run-1") == "run-1"
    assert not label_safe("run-1\n")
    assert run_label_value("run-1\n").startswith(HASHED_PREFIX)


def test_a_token_name_with_a_trailing_newline_is_refused() -> None:
    assert _valid_name(None, None, "flyte-prod") == "flyte-prod"  # type: ignore[arg-type]
    with pytest.raises(click.BadParameter):
        _valid_name(None, None, "flyte-prod\n")  # type: ignore[arg-type]
