"""What a campaign does, drawn from its seed alone: the budgets, the operations and the faults.

Pure: no I/O, no clock. One `random.Random(seed)` per stream (operations, faults), so the same
seed and duration always give the same plan (tests/unit/test_chaos_schedule.py holds it to that),
whatever the machine. What a run does with the plan depends on the answers it gets: a sample or
a lifecycle event of a run that was not admitted is skipped, and recorded as skipped.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import asdict, dataclass, field
from typing import Any

# Every service process the stack runs, by the name the nemesis and the history use.
SERVICE_PROCESSES = (
    "admission-1",
    "admission-2",
    "metering-1",
    "metering-2",
    "reconciler-1",
    "reconciler-2",
    "evidence",
)
STORES = ("postgres", "redis")

# Fault kinds, each with its weight in the schedule. The Postgres kinds need the campaign's own
# server (`--postgres own`, the default); on a shared server they are skipped and said so.
FAULT_KINDS: dict[str, int] = {
    "kill-service": 4,
    "redis-kill": 1,
    "redis-flushall": 1,
    "redis-old-snapshot": 1,
    "redis-failover": 1,
    "broker-kill": 1,
    "broker-pause": 1,
    "proxy-cut": 2,
    "proxy-delay": 2,
    "proxy-blackhole": 2,
    "clock-skew": 1,
    "postgres-kill": 1,
    "postgres-pause": 1,
    # Last, so that `--without marquez-outage` plans what a seed planned before it came.
    "marquez-outage": 1,
}

GPU_CHOICES = (1, 2, 4, 8)
FLAVORS = ("h100", "a100")


@dataclass(frozen=True)
class Budget:
    """One namespace's budget. `kind`: hard (deny), delaying (hard, DELAY when exhausted), soft,
    or cost (a hard limit in money on top of a hard GPU-hour one)."""

    namespace: str
    kind: str
    gpu_hours: float
    cost: float | None = None

    @property
    def policy_id(self) -> str:
        return f"chaos/{self.namespace}"

    @property
    def hard(self) -> bool:
        return self.kind in ("hard", "delaying", "cost")


@dataclass(frozen=True)
class Operation:
    """One planned client operation: `at` seconds after the start, `kind`, and its parameters."""

    index: int
    at: float
    kind: str
    params: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Fault:
    """One planned fault: starts `at` seconds after the start, lasts `duration` seconds (0: an
    instant fault such as a FLUSHALL; a killed process is restarted after `duration`)."""

    index: int
    at: float
    kind: str
    target: str
    duration: float
    params: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Plan:
    seed: int
    duration: float
    budgets: tuple[Budget, ...]
    operations: tuple[Operation, ...]
    faults: tuple[Fault, ...]

    def fingerprint(self) -> str:
        """A digest of the whole plan: two runs with one fingerprint planned the same things."""
        data = json.dumps(asdict(self), sort_keys=True, default=str).encode()
        return hashlib.sha256(data).hexdigest()[:16]


def budgets_for(seed: int, count: int = 8) -> tuple[Budget, ...]:
    rng = random.Random(f"budgets/{seed}")
    kinds = ["hard", "hard", "delaying", "soft", "cost"]
    out = []
    for i in range(count):
        kind = kinds[i % len(kinds)]
        # Small limits, so that budgets run out within a minute and refusals are common.
        gpu_hours = round(rng.uniform(0.15, 0.6), 3)
        out.append(Budget(namespace=f"chaos-{i:02d}", kind=kind, gpu_hours=gpu_hours, cost=round(gpu_hours * 2.0, 2) if kind == "cost" else None))
    return tuple(out)


def plan(seed: int, duration: float, *, rate: float = 8.0, faults: bool = True, fault_kinds: tuple[str, ...] | None = None) -> Plan:
    """The plan of a campaign of `duration` seconds: about `rate` submissions a second (each with
    its follow-ups: retries, lifecycle events, samples), and with `faults` a fault every few seconds
    from the first tenth of the run to 85 % of it, so the end is quiet enough to settle."""
    if duration <= 0:
        raise ValueError(f"a campaign lasts a positive number of seconds, not {duration}")
    if rate <= 0:
        raise ValueError(f"the rate is a positive number of submissions a second, not {rate}")
    budgets = budgets_for(seed)
    operations = _operations(random.Random(f"operations/{seed}"), duration, rate, budgets, seed)
    kinds = tuple(FAULT_KINDS) if fault_kinds is None else fault_kinds
    unknown = [k for k in kinds if k not in FAULT_KINDS]
    if unknown:
        raise ValueError(f"unknown fault kind(s) {', '.join(unknown)}; known: {', '.join(FAULT_KINDS)}")
    schedule = _faults(random.Random(f"faults/{seed}"), duration, kinds) if faults and kinds else ()
    return Plan(seed=seed, duration=duration, budgets=budgets, operations=operations, faults=schedule)


def _operations(rng: random.Random, duration: float, rate: float, budgets: tuple[Budget, ...], seed: int) -> tuple[Operation, ...]:
    planned: list[tuple[float, str, dict[str, Any]]] = []
    t = 0.0
    n = 0
    # Submissions stop a little before the end, so their follow-ups fall within the run.
    last_submission = duration * 0.8
    while True:
        t += rng.expovariate(rate)
        if t >= last_submission:
            break
        run_id = f"chaos/{seed}/r{n}"
        n += 1
        budget = rng.choice(budgets)
        gpus = rng.choice(GPU_CHOICES)
        runtime_hours = round(rng.uniform(0.005, 0.02), 4)  # 18 s to 72 s
        body = {
            "run_id": run_id,
            "attempt": 1,
            "namespace": budget.namespace,
            "labels": {"team": budget.namespace, "environment": "chaos"},
            "resources": {"gpus": gpus, "nodes": 1, "flavor": rng.choice(FLAVORS), "region": "us-east-1"},
            "projected_runtime_hours": runtime_hours,
            "job": {"namespace": budget.namespace, "name": f"job-{n % 7}"},
        }
        target = rng.randrange(2)
        planned.append((t, "submit", {"run_id": run_id, "body": body, "instance": target}))
        if rng.random() < 0.25:  # the same submission again, to either instance
            planned.append((t + rng.uniform(0.0, 3.0), "retry", {"run_id": run_id, "body": body, "instance": rng.randrange(2)}))
        if rng.random() < 0.05:  # the same run id with other resources: a conflict, never a second decision
            changed = {**body, "resources": {**body["resources"], "gpus": gpus * 2 if gpus < 8 else 1}}
            planned.append((t + rng.uniform(0.5, 4.0), "conflict", {"run_id": run_id, "body": changed, "instance": rng.randrange(2)}))
        if rng.random() < 0.1:
            continue  # admitted but never started: its reservation must go back at the start deadline
        start = t + rng.uniform(1.0, 4.0)
        planned.append((start, "lifecycle", {"run_id": run_id, "type": "STARTED", "gpus": gpus, "instance": rng.randrange(2)}))
        runs_for = runtime_hours * 3600 * rng.uniform(0.3, 0.9)
        # Every run ends within the campaign, so its settlement can be judged.
        runs_for = max(0.5, min(runs_for, duration * 0.95 - start))
        samples = rng.randint(1, 4)
        for k in range(samples):
            at = start + runs_for * (k + 1) / (samples + 1)
            sample = {"run_id": run_id, "sample_id": f"s{k}", "gpus": gpus, "cap_seconds": runtime_hours * 3600 * 0.9, "instance": rng.randrange(2)}
            roll = rng.random()
            if roll < 0.15:
                sample["late_by"] = round(rng.uniform(5.0, 30.0), 1)  # observed well before it is sent
            planned.append((at, "sample", sample))
            if roll > 0.8:  # sent again, identical: must count once
                planned.append((at + rng.uniform(0.1, 5.0), "sample", {**sample, "instance": rng.randrange(2), "resend": True}))
        end = start + runs_for
        kind = rng.choices(("COMPLETED", "FAILED", "CANCELLED"), weights=(8, 1, 1))[0]
        planned.append((end, "lifecycle", {"run_id": run_id, "type": kind, "gpus": gpus, "instance": rng.randrange(2)}))
    # Operator actions, every so often.
    t = 0.0
    while True:
        t += rng.uniform(8.0, 25.0)
        if t >= duration * 0.85:
            break
        roll = rng.random()
        if roll < 0.3:
            planned.append((t, "policy-apply", {"revision": len(planned), "instance": rng.randrange(2)}))
        elif roll < 0.5:
            planned.append(
                (t, "tenant-override", {"tenant": rng.choice(budgets).namespace, "max_gpus": rng.choice((8, 16, 64, None)), "instance": rng.randrange(2)})
            )
        else:
            token = f"tok-{len(planned)}"
            planned.append((t, "pool-allocate", {"token": token, "project": f"p{rng.randrange(3)}", "instance": rng.randrange(2)}))
            if rng.random() < 0.7:
                planned.append((t + rng.uniform(1.0, 10.0), "pool-release", {"token": token, "instance": rng.randrange(2)}))
    # Follow-ups (a resend, a release) drawn past the end happen at the end.
    planned = [(min(at, duration), kind, params) for at, kind, params in planned]
    planned.sort(key=lambda p: p[0])
    return tuple(Operation(index=i, at=round(at, 3), kind=kind, params=params) for i, (at, kind, params) in enumerate(planned))


def _faults(rng: random.Random, duration: float, kinds: tuple[str, ...]) -> tuple[Fault, ...]:
    weights = [FAULT_KINDS[k] for k in kinds]
    out: list[Fault] = []
    t = max(3.0, duration * 0.1)
    end = duration * 0.85
    # In a short campaign every kind still comes up: the first faults go through the kinds in a
    # seeded order, then they are drawn by weight.
    order = list(kinds)
    rng.shuffle(order)
    while t < end:
        kind = order.pop() if order else rng.choices(kinds, weights=weights)[0]
        target, length, params = _fault_details(rng, kind)
        length = min(length, max(1.0, end - t))
        out.append(Fault(index=len(out), at=round(t, 3), kind=kind, target=target, duration=round(length, 3), params=params))
        t += length + rng.uniform(2.0, 6.0)
    return tuple(out)


def _fault_details(rng: random.Random, kind: str) -> tuple[str, float, dict[str, Any]]:
    if kind == "kill-service":
        return rng.choice(SERVICE_PROCESSES), rng.uniform(1.0, 6.0), {}
    if kind in ("proxy-cut", "proxy-delay", "proxy-blackhole"):
        # One service's link to one store, or (one time in four) every service's link to it.
        store = rng.choice(STORES)
        target = f"*->{store}" if rng.random() < 0.25 else f"{rng.choice(SERVICE_PROCESSES)}->{store}"
        params = {"delay_ms": rng.choice((50, 200, 800))} if kind == "proxy-delay" else {}
        return target, rng.uniform(2.0, 8.0), params
    if kind == "clock-skew":
        return rng.choice(SERVICE_PROCESSES), rng.uniform(8.0, 20.0), {"skew_seconds": rng.choice((-90, -20, 20, 90))}
    if kind == "broker-pause":
        return "broker", rng.uniform(2.0, 8.0), {}
    if kind == "broker-kill":
        return "broker", rng.uniform(1.0, 4.0), {}
    if kind == "postgres-kill":
        return "postgres", rng.uniform(1.0, 4.0), {}
    if kind == "postgres-pause":
        return "postgres", rng.uniform(2.0, 8.0), {}
    if kind == "redis-failover":
        return "redis", rng.uniform(1.0, 3.0), {"replica_lag_seconds": round(rng.uniform(1.0, 4.0), 1)}
    if kind == "marquez-outage":
        return "marquez", rng.uniform(3.0, 20.0), {"outage": rng.choice(("503", "reset"))}
    if kind == "redis-old-snapshot":
        return "redis", rng.uniform(0.5, 2.0), {}
    if kind == "redis-kill":
        return "redis", rng.uniform(1.0, 4.0), {}
    return "redis", 0.0, {}  # redis-flushall: instant
