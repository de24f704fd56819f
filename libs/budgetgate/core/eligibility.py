"""When a budget that cannot take a run now will have room for it: the `next_eligible_time` of a
DELAY (and of a DENY, when some time will do).

The earliest instant at which the budget will have room under its own rules:

- a calendar window: the next window's start, unless releases the ledger knows of free enough
  before it;
- a rolling window: when enough recorded usage (kept in hour buckets) and held reservations have
  aged out of it, or releases free enough first.

A held reservation frees nothing when its run ends as projected: it turns into consumption of the
same size. The only releases that count are of what the ledger knows will not be consumed: a run
that has not started gives its reservation back at its start deadline (unless it starts first).
Pure: the ledger's adapter gathers the `Outlook` of each ledger key.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from budgetgate.core.windows import Window

HOUR = timedelta(hours=1)


@dataclass(frozen=True, slots=True)
class Held:
    """A reservation held on a ledger key, as the ledger knows it now."""

    amount: int
    started: bool  # the run has started (or ended): its reservation becomes consumption
    start_deadline: datetime  # an unstarted run gives the reservation back then
    expected_end: datetime  # admission time + projected runtime


@dataclass(frozen=True, slots=True)
class Outlook:
    """How a ledger key's usage will change with time alone: its held reservations and, on a
    rolling window, its consumption per hour bucket not yet aged out."""

    holds: tuple[Held, ...] = ()
    buckets: tuple[tuple[datetime, int], ...] = ()


def aged_out_at(bucket: datetime, rolling_days: int) -> datetime:
    """When usage in the hour bucket starting at `bucket` has left a rolling window: the window
    ends at the current hour, so the whole hour must lie before its start."""
    return bucket + timedelta(days=rolling_days) + HOUR


def next_eligible(*, amount: int, limit: int, remaining: int, window: Window, rolling_days: int | None, outlook: Outlook, now: datetime) -> datetime | None:
    """The earliest instant at which `amount` fits a budget of `limit` that has `remaining` room
    now (see the module doc). None when the amount is larger than the whole limit: no instant will do."""
    if amount > limit:
        return None
    needed = amount - remaining
    if needed <= 0:
        return now
    frees = [(max(h.start_deadline, now), h.amount) for h in outlook.holds if not h.started]
    if rolling_days is None:
        horizon = window.end
    else:
        frees += [(max(aged_out_at(bucket, rolling_days), now), used) for bucket, used in outlook.buckets]
        frees += [(max(aged_out_at(_hour(max(h.expected_end, now)), rolling_days), now), h.amount) for h in outlook.holds if h.started]
        # Everything the ledger holds now is gone by the latest of these; what it does not know
        # of (a reading ahead of the ledger's rows) is gone a window's length after this hour.
        horizon = max([aged_out_at(_hour(now), rolling_days), *(at for at, _ in frees)])
    freed = 0
    for at, released in sorted(frees):
        if at >= horizon:
            break
        freed += released
        if freed >= needed:
            return _second_up(at)
    return _second_up(horizon)


def _hour(at: datetime) -> datetime:
    return at.astimezone(UTC).replace(minute=0, second=0, microsecond=0)


def _second_up(at: datetime) -> datetime:
    # "At or after" this instant: rounding up to a whole second never names a moment too early.
    return at if at.microsecond == 0 else at.replace(microsecond=0) + timedelta(seconds=1)
