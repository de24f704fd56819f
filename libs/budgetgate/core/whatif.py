"""What a candidate policy bundle would have decided over a recorded period, simulated purely.

The recorded submissions are decided again, in time order, by the same core admission decides
with (`plan`, `decide`), on a simulated ledger: it starts from each ledger key as the period's
first decision on it read it, takes a reservation for every run the candidate admits, and turns
it into consumption when the run's recorded end comes (its metered actual, scaled to each
budget's unit by the run's actual/projected ratio; nothing when it never started). A run the
candidate would have refused consumes nothing; a run it would admit that history refused holds
its projected amount to the end of the period (no actual was ever metered for it). So a
changed limit changes later decisions too.

Only budgets are simulated. Concurrency limits (tenant quotas — max GPUs, nodes, concurrent
allocations —, the sensitive pool, token pools) are not, nor soft penalties, external
accounting (it judges soft budgets only) or a DELAY's time. A recorded decision that something
other than its budgets decided — a concurrency limit's refusal, or an outcome its own budget
evaluations do not explain (`Recorded.budgets_outcome`) — is not simulated: history's outcome
stands for it on the simulated ledger (a refused run holds nothing), it is never a flip, and it
is reported apart (`Outcome.not_simulated`) with what decided it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime

from budgetgate.core.escrow import lease_of
from budgetgate.core.evaluation import Plan, Reading, Submission, UnknownFlavor, decide, plan
from budgetgate.core.ledger_key import AmountOutOfRange
from budgetgate.core.policy import BudgetPolicy, Enforcement, PolicyBundle
from budgetgate.core.quotas import concurrency_limit


@dataclass(frozen=True, slots=True)
class Recorded:
    """A recorded decision: the submission, when, and what history decided; its reason, and
    what its budgets alone decided (`budgets_outcome` of its evaluations; None when unknown)."""

    submission: Submission
    outcome: str
    decision_id: str = ""
    reason: str = ""
    budgets_outcome: str | None = None


def budgets_outcome(evaluations: Iterable[tuple[str, str]]) -> str:
    """What a decision's budgets alone decided, from its evaluations' (enforcement, outcome):
    a hard policy's DENY (no room, or missing labels) denies, else a hard DELAY delays, else it
    admits; soft and dry-run policies never block (`decide`)."""
    hard = {outcome for enforcement, outcome in evaluations if enforcement == Enforcement.HARD}
    return "DENY" if "DENY" in hard else "DELAY" if "DELAY" in hard else "ALLOW"


OTHER = "other than its budgets"


def decided_by(recorded: Recorded) -> str | None:
    """What decided a recorded decision when the simulation does not model it: the concurrency
    limit that refused it (tenant quota, sensitive pool, token pool), or OTHER when its outcome
    is not the one its budgets alone decided; None when its budgets decided it."""
    found = concurrency_limit(recorded.reason)
    if found is not None:
        return found
    if recorded.budgets_outcome is not None and recorded.budgets_outcome != recorded.outcome:
        return OTHER
    return None


@dataclass(frozen=True, slots=True)
class Ended:
    """A run's recorded end: its metered GPU use, or `released` when it gave its hold back unused."""

    run_id: str
    at: datetime
    actual_gpu: int
    released: bool = False


@dataclass(frozen=True, slots=True)
class Start:
    """A ledger key as the period's first decision on it read it, and when."""

    reserved: int
    consumed: int
    read_at: datetime | None = None


@dataclass(frozen=True, slots=True)
class Flip:
    run_id: str
    attempt: int
    at: datetime
    before: str
    after: str
    reason: str


@dataclass(frozen=True, slots=True)
class NotSimulated:
    """A recorded decision something the simulation does not model decided (`decided_by`):
    history's outcome stands for it; `budgets_after` is what the candidate's budgets alone
    would decide (None when the candidate cannot price it)."""

    run_id: str
    attempt: int
    at: datetime
    outcome: str
    decided_by: str
    reason: str
    budgets_after: str | None


@dataclass(slots=True)
class BudgetChange:
    """One candidate budget: what its runs admitted as recorded and under the candidate."""

    policy_id: str
    scope_id: str
    unit: str
    admitted_gpu_before: int = 0
    admitted_gpu_after: int = 0
    cost_before: int = 0  # showback micros
    cost_after: int = 0
    currency: str | None = None
    exhausted_at: datetime | None = None  # first decision that found or left it without room


@dataclass(slots=True)
class Outcome:
    decisions: int = 0
    flips: list[Flip] = field(default_factory=list)
    not_simulated: list[NotSimulated] = field(default_factory=list)
    by_budget: dict[str, BudgetChange] = field(default_factory=dict)
    unplannable: list[str] = field(default_factory=list)  # run ids the candidate cannot price


@dataclass(slots=True)
class _Hold:
    amounts: dict[str, int]
    projected_gpu: int


class Simulation:
    """The simulated ledger and the tally, fed decisions and ends in time order."""

    def __init__(self, candidate: PolicyBundle, start: Mapping[str, Start]) -> None:
        self.candidate = candidate
        self.ledger: dict[str, list[int]] = {key: [s.reserved, s.consumed] for key, s in start.items()}
        self.read_at = {key: s.read_at for key, s in start.items()}
        # A budget tenants share on a ledger of several shards is held by its tenants' escrow
        # leases: a candidate's budget (filed under the budget's own key) reads as their sum.
        self.leases: dict[str, set[str]] = {}
        for key in start:
            self._note_lease(key)
        self.holds: dict[str, _Hold] = {}
        self.admitted: set[str] = set()  # by the candidate
        self.admitted_before: set[str] = set()  # by history (tallied once, at its ALLOW)
        self.outcome = Outcome(by_budget={p.id: BudgetChange(p.id, p.scope.scope_id, str(p.limit.unit)) for p in candidate.policies})
        self._covering: dict[str, PolicyBundle] = {}

    def hold(self, run_id: str, amounts: Mapping[str, int], projected_gpu: int) -> None:
        """A reservation held at the period's start by a run decided before it."""
        self.holds[run_id] = _Hold(dict(amounts), projected_gpu)
        self.admitted.add(run_id)
        self.admitted_before.add(run_id)
        for key in amounts:
            self._note_lease(key)

    def decide(self, recorded: Recorded) -> None:
        sub = recorded.submission
        if sub.run_id in self.admitted:
            # An ALLOW stands for every later attempt, so the candidate decides nothing more; but
            # history may admit the run only now (it refused an attempt the candidate admitted),
            # and its figures count that admission.
            if recorded.outcome == "ALLOW" and sub.run_id not in self.admitted_before:
                with contextlib.suppress(UnknownFlavor, AmountOutOfRange):  # unplannable: reported at its first attempt
                    self._tally_before(plan(self._policies(sub.namespace), sub), recorded)
            return
        self.outcome.decisions += 1
        factor = decided_by(recorded)
        try:
            the_plan = plan(self._policies(sub.namespace), sub)
        except (UnknownFlavor, AmountOutOfRange) as exc:  # under the proposed rate cards or policies
            self.outcome.unplannable.append(sub.run_id)
            if factor is not None:
                self._not_simulated(recorded, factor, None)
            else:
                self._flip(recorded, "DENY", str(exc))
            return
        readings = {c.ledger_key: self._reading(c.ledger_key, c.policy) for c in the_plan.charges}
        decision = decide(the_plan, readings if the_plan.charges else None)
        after = decision.outcome
        if factor is not None:
            # Not simulated: what decided it is not modelled, so history's outcome stands (a
            # quota's refusal must not turn into a hold that refuses later runs).
            self._not_simulated(recorded, factor, decision.outcome)
            after = recorded.outcome
        self._tally(the_plan, recorded, after, readings)
        if after == "ALLOW":
            amounts = {c.ledger_key: c.amount for c in the_plan.charges}
            for key, amount in amounts.items():
                self.ledger.setdefault(key, [0, 0])[0] += amount
            self.holds[sub.run_id] = _Hold(amounts, the_plan.projected_gpu)
            self.admitted.add(sub.run_id)
        if factor is None:
            self._flip(recorded, decision.outcome, decision.reason)

    def end(self, ended: Ended) -> None:
        held = self.holds.pop(ended.run_id, None)
        if held is None:
            return  # refused under the candidate: it never ran
        for key, amount in held.amounts.items():
            read_at = self.read_at.get(key)
            if read_at is not None and read_at > ended.at:
                continue  # the reading the key starts from was taken after this end: it shows it
            figures = self.ledger.setdefault(key, [0, 0])
            figures[0] -= amount
            if not ended.released:
                figures[1] += amount if held.projected_gpu <= 0 else amount * ended.actual_gpu // held.projected_gpu

    def _policies(self, namespace: str) -> PolicyBundle:
        found = self._covering.get(namespace)
        if found is None:
            found = self._covering[namespace] = replace(
                self.candidate, policies=tuple(p for p in self.candidate.policies if p.scope.covers_namespace(namespace))
            )
        return found

    def _note_lease(self, key: str) -> None:
        lease = lease_of(key)
        if lease is not None:
            self.leases.setdefault(lease[0], set()).add(key)

    def figures(self, key: str) -> tuple[int, int]:
        """A ledger key's simulated (reserved, consumed): a budget's own and its leases' together."""
        reserved, consumed = self.ledger.get(key, (0, 0))
        for lease in self.leases.get(key, ()):
            held, used = self.ledger.get(lease, (0, 0))
            reserved, consumed = reserved + held, consumed + used
        return reserved, consumed

    def _reading(self, key: str, policy: BudgetPolicy) -> Reading:
        reserved, consumed = self.figures(key)
        return Reading(policy.limit.amount, reserved, consumed)

    def _tally_before(self, the_plan: Plan, recorded: Recorded) -> None:
        """History's figures: a run counts once, at the attempt history admitted."""
        if recorded.outcome != "ALLOW" or recorded.submission.run_id in self.admitted_before:
            return
        self.admitted_before.add(recorded.submission.run_id)
        for c in the_plan.charges:
            change = self.outcome.by_budget[c.policy.id]
            change.currency = change.currency or the_plan.currency
            change.admitted_gpu_before += the_plan.projected_gpu
            change.cost_before += the_plan.showback_micros or 0

    def _tally(self, the_plan: Plan, recorded: Recorded, outcome: str, readings: Mapping[str, Reading]) -> None:
        at = recorded.submission.at
        self._tally_before(the_plan, recorded)
        for c in the_plan.charges:
            change = self.outcome.by_budget[c.policy.id]
            change.currency = change.currency or the_plan.currency
            if outcome == "ALLOW":
                change.admitted_gpu_after += the_plan.projected_gpu
                change.cost_after += the_plan.showback_micros or 0
            left = readings[c.ledger_key].remaining - (c.amount if outcome == "ALLOW" else 0)
            if change.exhausted_at is None and c.hard and left <= 0:
                change.exhausted_at = at

    def _not_simulated(self, recorded: Recorded, factor: str, budgets_after: str | None) -> None:
        sub = recorded.submission
        self.outcome.not_simulated.append(NotSimulated(sub.run_id, sub.attempt, sub.at, recorded.outcome, factor, recorded.reason, budgets_after))

    def _flip(self, recorded: Recorded, after: str, reason: str) -> None:
        if after != recorded.outcome:
            sub = recorded.submission
            self.outcome.flips.append(Flip(sub.run_id, sub.attempt, sub.at, recorded.outcome, after, reason))


def simulate(
    candidate: PolicyBundle,
    *,
    start: Mapping[str, Start],
    decisions: Iterable[Recorded],
    ends: Iterable[Ended],
    holds: Mapping[str, tuple[Mapping[str, int], int]] | None = None,
    progress: Callable[[int], None] | None = None,
) -> Outcome:
    """Decide `decisions` again under `candidate`, interleaved with `ends` by time (an end at
    the same instant as a decision comes first); `start` is each ledger key as the period's
    first decision on it read it, `holds` the reservations runs decided before the period held
    when it began (their ends before a key's reading are already in it)."""
    sim = Simulation(candidate, start)
    for run_id, (amounts, projected_gpu) in (holds or {}).items():
        sim.hold(run_id, amounts, projected_gpu)
    pending = sorted(ends, key=lambda e: e.at)
    i = 0
    for n, recorded in enumerate(decisions, 1):
        while i < len(pending) and pending[i].at <= recorded.submission.at:
            sim.end(pending[i])
            i += 1
        sim.decide(recorded)
        if progress is not None and n % 1000 == 0:
            progress(1000)
    return sim.outcome
