"""The load generator's record of a run (budgetgate.benchmark.load.Outcome)."""

from __future__ import annotations

import pytest

from budgetgate.benchmark.load import Outcome


def test_open_loop_percentiles_by_window_follow_when_each_request_was_due() -> None:
    """Windows of the run's time, from the first request due; an empty window has no figure,
    and a latency that grows over the run shows window by window."""
    outcome = Outcome()
    for due, latency in [(100.0, 0.010), (100.5, 0.020), (101.2, 0.030), (103.9, 0.500), (103.0, 0.040)]:
        outcome.sent.append(due)
        outcome.latencies.append(latency)
    assert outcome.percentile_ms_by_window(50, 1.0) == [pytest.approx(10.0), pytest.approx(30.0), None, pytest.approx(40.0)]
    assert outcome.percentile_ms_by_window(99, 2.0) == [pytest.approx(30.0), pytest.approx(500.0)]
    assert outcome.percentile_ms(99) == 500.0
    assert Outcome().percentile_ms_by_window(99, 5.0) == []
