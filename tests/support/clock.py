"""Scenarios set in the recent past, read off this month's window."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest


def this_month(ago: timedelta) -> datetime:
    """now − `ago`: the start of a scenario whose figures the test reads off this month's ledger
    keys (the calendar month, UTC, of the example policies and of budget_yaml). In a month's first
    `ago` the scenario would begin in the month before, whose keys the test does not read: it is
    skipped then, naming why. Usage on both sides of a month's start is tested on its own, at any
    time of the month (test_reconciler.py, test_usage_on_both_sides_of_a_month_boundary_settles_in_each_window)."""
    now = datetime.now(UTC)
    start = now - ago
    if (start.year, start.month) != (now.year, now.month):
        pytest.skip(f"the scenario begins {ago} ago, in the month before this one, and the test reads this month's window")
    return start
