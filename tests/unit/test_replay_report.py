"""Pieces of explain, replay and what-if without servers: periods, and how two answers differ."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import click
import pytest

from budgetgate.cli.explain import since
from budgetgate.decisions.explain import differences


def test_since_takes_periods_and_dates() -> None:
    now = datetime.now(UTC)
    assert abs(since("30d") - (now - timedelta(days=30))) < timedelta(seconds=5)
    assert abs(since("12h") - (now - timedelta(hours=12))) < timedelta(seconds=5)
    assert abs(since("2w") - (now - timedelta(days=14))) < timedelta(seconds=5)
    assert since("2026-01-01") == datetime(2026, 1, 1, tzinfo=UTC)
    assert since("2026-01-01T00:00:00+02:00").utcoffset() == timedelta(hours=2)
    with pytest.raises(click.BadParameter, match="30d"):
        since("last month")


def test_differences_name_each_field_decision_first() -> None:
    stored = {"reason": "a", "decision": "ALLOW", "evaluations": [{"remaining": 500.0, "limit": 500.0}], "replayed": True}
    recomputed = {"reason": "b", "decision": "DENY", "evaluations": [{"remaining": 452.0, "limit": 500.0}], "replayed": False}
    assert differences(stored, recomputed) == [
        "decision: stored 'ALLOW', recomputed 'DENY'",
        "reason: stored 'a', recomputed 'b'",
        "evaluations[0].remaining: stored 500.0, recomputed 452.0",
    ]
    assert differences(stored, stored) == []
    assert differences({"evaluations": [1]}, {"evaluations": [1, 2]}) == ["evaluations: stored [1], recomputed [1, 2]"]
