"""What a benchmark run submits: the budgets of a scenario and the submissions spread over them.

Every submission asks for the same amount (8 GPUs for 1 hour), so how many fit a budget is exact
and both systems must admit the same number: a cross-check on top of the no-over-admission check.

`shared` is `spread` with one more budget every submission falls under as well (the company's,
scoped by the `environment: prod` label every submission carries), whose limit is above what the
team budgets fit together, so the team budgets still decide and the count stays exact: each
decision checks and reserves on two budgets, one of them every team shares. On a ledger of
several shards budgetgate carves that budget into each team's escrow lease; the baseline locks
its row after the team's, so every decision queues on it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

GPUS = 8
RUNTIME_HOURS = 1.0
GPU_HOURS_EACH = GPUS * RUNTIME_HOURS
SCENARIOS = ("hot", "spread", "shared")
DEFAULT_SCENARIOS = ("hot", "spread")
SHARED_ID = "bench/company"  # the budget of the shared scenario every submission also falls under
SHARED_HEADROOM = 1.1  # its limit, over what the team budgets fit together


@dataclass(frozen=True, slots=True)
class Budget:
    """One team's GPU-hour budget: one namespace, one team label, one hard limit."""

    index: int
    slots: int  # how many submissions fit

    @property
    def namespace(self) -> str:
        return f"bench-{self.index:03d}"

    @property
    def team(self) -> str:
        return f"team-{self.index:03d}"

    @property
    def limit_gpu_hours(self) -> float:
        return self.slots * GPU_HOURS_EACH


@dataclass(frozen=True, slots=True)
class Workload:
    scenario: str
    budgets: tuple[Budget, ...]
    warmup: tuple[bytes, ...]
    measured: tuple[bytes, ...]
    expected_allows: int  # over warm-up and measured phase together; every warm-up one fits
    shared_gpu_hours: int | None = None  # the limit of the budget every submission also falls under (`shared`)

    @property
    def measured_expected_allows(self) -> int:
        return self.expected_allows - len(self.warmup)

    @property
    def description(self) -> str:
        n = len(self.budgets)
        return f"{self.scenario} ({n} budget{'s' if n != 1 else ''}{' and one they share' if self.shared_gpu_hours else ''})"


def build(scenario: str, *, requests: int, warmup: int, budgets: int, allow_fraction: float, tag: str) -> Workload:
    """Submission i goes to budget i mod n; each budget fits its warm-up share plus
    `allow_fraction` of its measured share (rounded), so about that fraction is allowed."""
    if scenario not in SCENARIOS:
        raise ValueError(f"unknown scenario {scenario!r}; choose from {', '.join(SCENARIOS)}")
    n = 1 if scenario == "hot" else budgets  # spread and shared: `budgets` team budgets
    warm_counts = [_share(warmup, n, b) for b in range(n)]
    measured_counts = [_share(requests, n, b) for b in range(n)]
    fits = [math.floor(allow_fraction * m + 0.5) for m in measured_counts]
    # A limit of zero is not a budget; a budget no submission reaches keeps one slot unused.
    budget_list = tuple(Budget(b, max(w + f, 1)) for b, (w, f) in enumerate(zip(warm_counts, fits, strict=True)))
    return Workload(
        scenario=scenario,
        budgets=budget_list,
        warmup=tuple(submission(f"bench/{tag}/warm-{i}", budget_list[i % n]) for i in range(warmup)),
        measured=tuple(submission(f"bench/{tag}/run-{i}", budget_list[i % n]) for i in range(requests)),
        expected_allows=sum(min(b.slots, w + m) for b, w, m in zip(budget_list, warm_counts, measured_counts, strict=True)),
        shared_gpu_hours=math.ceil(SHARED_HEADROOM * sum(b.limit_gpu_hours for b in budget_list)) if scenario == "shared" else None,
    )


def _share(total: int, n: int, b: int) -> int:
    return total // n + (1 if b < total % n else 0)


def submission(run_id: str, budget: Budget) -> bytes:
    """The JSON body both systems receive, as a platform's submission API would send it."""
    return json.dumps(
        {
            "run_id": run_id,
            "attempt": 1,
            "namespace": budget.namespace,
            "labels": {"team": budget.team, "environment": "prod"},
            "resources": {"gpus": GPUS, "nodes": 1, "flavor": "h100", "region": "us-east-1"},
            "projected_runtime_hours": RUNTIME_HOURS,
            "job": {"namespace": budget.namespace, "name": "train"},
        },
        separators=(",", ":"),
    ).encode()


def policy_yaml(budgets: tuple[Budget, ...], shared_gpu_hours: int | None = None) -> str:
    """The budgets as budgetgate BudgetPolicy documents: hard, monthly, deny when exhausted; with
    `shared_gpu_hours`, the budget every submission falls under too."""
    documents = [_budget(f"bench/{b.team}", f"{{namespace: {b.namespace}, labels: {{team: {b.team}}}}}", b.limit_gpu_hours) for b in budgets]
    if shared_gpu_hours:
        documents.append(_budget(SHARED_ID, "{labels: {environment: prod}}", shared_gpu_hours))
    return "---\n".join(documents)


def _budget(policy_id: str, scope: str, gpu_hours: float) -> str:
    return f"""apiVersion: budgetgate/v1
kind: BudgetPolicy
metadata: {{id: {policy_id}}}
spec:
  scope: {scope}
  window: {{calendar: month}}
  limit: {{gpu_hours: {gpu_hours:g}}}
  enforcement: hard
  on_exhausted: deny
"""
