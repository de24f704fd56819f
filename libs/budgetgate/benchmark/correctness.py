"""The correctness check after each run: no budget admitted more than its limit, retries
answered with the first decision, and the stored decisions match what the clients were told."""

from __future__ import annotations

from dataclasses import dataclass, field

MILLI_PER_HOUR = 3_600_000


@dataclass(frozen=True, slots=True)
class BudgetTotal:
    """One budget after a run, in milli-GPU-seconds."""

    budget: str
    limit: int
    consumed: int
    admitted: int  # held by ALLOW decisions
    allows: int
    shared: bool = False  # every submission falls under it too (the shared scenario's): its ALLOWs are the others'

    @property
    def over(self) -> bool:
        return self.admitted + self.consumed > self.limit


@dataclass
class Audit:
    budgets: int
    admitted_gpu_hours: float
    limit_gpu_hours: float
    stored_allows: int
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def check(
    totals: list[BudgetTotal],
    *,
    told_allows: int,
    expected_allows: int,
    errors: int,
    probe_mismatches: int,
    problems: list[str],
) -> Audit:
    """Judge a run from its budgets' totals and what the clients saw.

    `told_allows` counts the ALLOW answers of the warm-up and measured phases; `expected_allows`
    is how many of those fit the limits. With errors, some decisions may have been stored
    without their answer arriving, so the stored and told counts are then not compared.
    """
    audit = Audit(
        budgets=len(totals),
        admitted_gpu_hours=sum(t.admitted for t in totals) / MILLI_PER_HOUR,
        limit_gpu_hours=sum(t.limit for t in totals) / MILLI_PER_HOUR,
        stored_allows=sum(t.allows for t in totals if not t.shared),
        problems=list(problems),
    )
    for t in totals:
        if t.over:
            audit.problems.append(
                f"budget {t.budget} over its limit: admitted {t.admitted / MILLI_PER_HOUR:g} + consumed "
                f"{t.consumed / MILLI_PER_HOUR:g} > limit {t.limit / MILLI_PER_HOUR:g} GPU-hours"
            )
    if probe_mismatches:
        audit.problems.append(f"{probe_mismatches} resubmitted run id(s) did not get their first decision back")
    if not errors:
        if audit.stored_allows != told_allows:
            audit.problems.append(f"{audit.stored_allows} admitted runs stored but {told_allows} ALLOW answers given")
        if told_allows != expected_allows:
            audit.problems.append(f"{told_allows} submissions admitted where exactly {expected_allows} fit the limits")
    return audit
