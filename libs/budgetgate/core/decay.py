"""Usage that counts for less the older it is, as Slurm's PriorityDecayHalfLife and Kueue's
usageHalfLifeTime weigh past usage for fair share: an amount used `age` ago weighs
2^(−age / half-life).

A sum of decayed amounts is kept as one figure and the instant it is reckoned at (`Decayed`).
Reckoning it at a later instant multiplies it by one weight, and an amount added is reckoned at
the figure's instant, so keeping a tenant's decayed usage costs the same per usage record
whatever its history, and records may arrive in any order. Amounts are the ledger's milli-hours;
a decayed figure is a real number, so it is a float (it ranks tenants, it never gates a run).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime, timedelta

from budgetgate.core.units import MILLI_PER_HOUR


def weight(age: timedelta, half_life: timedelta) -> float:
    """What one unit used `age` ago counts for now: 1 at once, ½ after one half-life."""
    return 2.0 ** (-(age / half_life))


@dataclass(frozen=True, slots=True)
class Decayed:
    """A sum of decayed amounts: `amount` is what they count for as of `reckoned`."""

    amount: float
    reckoned: datetime
    half_life: timedelta

    @classmethod
    def empty(cls, half_life: timedelta, at: datetime) -> Decayed:
        return cls(0.0, at, half_life)

    def at(self, when: datetime) -> float:
        """What the amounts count for as of `when`."""
        return self.amount * weight(when - self.reckoned, self.half_life)

    def add(self, amount: float, when: datetime) -> Decayed:
        """With `amount` used at `when` added; reckoned at the later of the two instants."""
        if when > self.reckoned:
            return Decayed(self.at(when) + amount, when, self.half_life)
        return Decayed(self.amount + amount * weight(self.reckoned - when, self.half_life), self.reckoned, self.half_life)

    def with_half_life(self, half_life: timedelta, when: datetime) -> Decayed:
        """The figure as of `when`, decaying from then on with `half_life` (a changed setting:
        what the past counts for now is kept; how it was spread over time is not known)."""
        if half_life == self.half_life:
            return self
        return Decayed(self.at(when), when, half_life)


def steady_amount(gpus: float, half_life: timedelta) -> float:
    """The decayed GPU usage (milli-GPU-hours) of holding `gpus` for ever: gpus × half-life / ln 2."""
    return gpus * MILLI_PER_HOUR * (half_life / timedelta(hours=1)) / math.log(2)


def decayed_share(amount: float, cluster_gpus: int, half_life: timedelta) -> float:
    """A decayed GPU usage as a share of the cluster: the usage of holding the whole cluster for
    ever is 1, so a tenant that has held g GPUs steadily has share g / cluster GPUs, as its raw
    share would be (an exponentially weighted average of its share over time)."""
    return max(0.0, amount) / steady_amount(cluster_gpus, half_life)
