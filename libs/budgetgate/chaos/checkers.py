"""The checkers: each promise judged from a history alone (budgetgate.chaos.recorder), so that
`budgetgate chaos check HISTORY` judges a kept history again, and a doctored one shows a checker
catching what it should (tests/unit/test_chaos_checkers.py).

Operations whose answer never came (`outcome` "info") may or may not have taken effect: they
are never counted as acknowledged, and never held against the system either.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

# Milli-GPU-seconds in one GPU-hour: the ledger's unit for gpu_hours budgets.
MILLI_PER_GPU_HOUR = 3_600_000
# Outcomes that settle nothing: (sample results) what the service reports as counted.
COUNTED_SAMPLE_RESULTS = ("accepted", "duplicate", "pending")
TERMINAL_LIFECYCLE = ("COMPLETED", "FAILED", "CANCELLED")
# Time a background loop may take beyond its deadline before a leftover counts (a reconciler
# ticks every 2 s; after faults it may be restarting).
DEADLINE_SLACK_SECONDS = 30.0


@dataclass
class Violation:
    checker: str
    message: str
    operations: list[int] = field(default_factory=list)  # plan indices of the operations involved

    def as_dict(self) -> dict[str, Any]:
        return {"checker": self.checker, "message": self.message, "operations": self.operations}


@dataclass
class Verdict:
    """What every checker found: per checker how many things it judged, and the violations."""

    judged: dict[str, int] = field(default_factory=dict)
    violations: list[Violation] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.violations

    def as_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "judged": self.judged, "violations": [v.as_dict() for v in self.violations], "notes": self.notes}


class History:
    """A history's lines, sorted by kind, with the lookups the checkers share."""

    def __init__(self, lines: Iterable[dict[str, Any]]) -> None:
        lines = list(lines)
        setups = [line for line in lines if line["type"] == "setup"]
        if not setups:
            raise ValueError("the history has no setup line: it is not a campaign's history, or the campaign died before it began")
        self.setup = setups[0]
        self.ops = [line for line in lines if line["type"] == "op"]
        self.faults = [line for line in lines if line["type"] == "fault"]
        self.ledger = [line for line in lines if line["type"] == "ledger"]
        observations = [line for line in lines if line["type"] == "observation"]
        self.observation: dict[str, Any] | None = observations[-1] if observations else None
        self.budgets = {b["namespace"]: b for b in self.setup["budgets"]}
        # A cost budget has two hard policies: GPU-hours, and money (`<id>/cost`).
        self.hard_policies = {f"chaos/{b['namespace']}": b for b in self.setup["budgets"] if b["kind"] != "soft"}
        self.hard_policies.update({f"chaos/{b['namespace']}/cost": b for b in self.setup["budgets"] if b.get("cost") is not None})
        # A budget every namespace shares, on a ledger of several shards: its own ledger key and
        # each tenant's escrow lease of it, judged together (campaign setup's `company`).
        self.company: str | None = (self.setup.get("company") or {}).get("policy_id")

    def acked(self, *kinds: str) -> list[dict[str, Any]]:
        return [op for op in self.ops if op["kind"] in kinds and op.get("outcome") == "ok"]

    def decisions_told(self) -> list[dict[str, Any]]:
        """Acknowledged submissions and retries whose answer is a decision."""
        return [op for op in self.acked("submit", "retry") if op.get("status") == 200 and isinstance(op.get("answer"), dict) and "decision_id" in op["answer"]]


Checker = Callable[[History, Verdict], None]


def check(lines: Iterable[dict[str, Any]]) -> Verdict:
    """Run every checker over a history."""
    history = History(lines)
    verdict = Verdict()
    for checker in CHECKERS:
        checker(history, verdict)
    if history.observation is None:
        verdict.violations.append(Violation("settled", "the history has no observation: the campaign did not settle and look at the stores"))
    return verdict


def conservation(history: History, verdict: Verdict) -> None:
    """No hard budget ever holds more than its limit: every ledger sample taken during the run
    (Postgres and Redis), and at the end what the acknowledged ALLOWs still hold plus what was
    consumed."""
    judged = 0
    lost = _allows_without_reservation(history)
    for sample in history.ledger:
        for key, figures in sample["keys"].items():
            if figures.get("policy_id") not in history.hard_policies or figures.get("parked"):
                continue  # a soft budget; or a Redis figure mid-settlement, deliberately tighter
            judged += 1
            # ALLOWs told before this sample that the ledger never recorded hold their projection
            # on top of what it shows (Postgres samples of gpu_hours keys).
            unseen = []
            unit = figures.get("unit") or ("gpu_hours" if key.endswith("|gpu_hours") else None)
            if sample["source"] == "postgres" and unit == "gpu_hours":
                namespace = history.hard_policies[figures["policy_id"]]["namespace"]
                unseen = [(index, amount) for index, complete, amount in lost.get(namespace, []) if complete <= sample["at"]]
            told = sum(amount for _index, amount in unseen)
            # A Redis hold of a run whose reservation Postgres has ended is a release Redis lost
            # (restored from an old snapshot): tighter than Postgres, the loss the ledger accepts
            # (seed 20261203). One Postgres has no reservation of still counts.
            ended = sum(figures["runs"][run_id]["amount"] for run_id in figures.get("ended_in_postgres", ()))
            if figures["held"] - ended + figures["consumed"] + told > figures["limit"]:
                extra = f" + {told} of ALLOWs the ledger never recorded" if told else ""
                verdict.violations.append(
                    Violation(
                        "conservation",
                        f"{sample['source']} at t={sample['at']:.1f}s: {key} holds {figures['held']} + consumed {figures['consumed']}{extra} "
                        f"> limit {figures['limit']}",
                        [index for index, _amount in unseen],
                    )
                )
    if history.company is not None:
        judged += _company_conservation(history, verdict, lost)
    observation = history.observation
    if observation is not None:
        by_run: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for r in observation["reservations"]:
            by_run[r["run_id"]].append(r)
        allowed: dict[str, dict[str, Any]] = {}
        for op in history.decisions_told():
            if op["answer"]["decision"] == "ALLOW":
                allowed.setdefault(op["request"]["run_id"], op)
        for entry in observation["ledger_entries"]:
            if entry["policy_id"] not in history.hard_policies:
                continue
            judged += 1
            namespace = history.hard_policies[entry["policy_id"]]["namespace"]
            held, involved = _held_by_allows(allowed, by_run, {entry["ledger_key"]}, namespace=namespace, projected=entry["unit"] == "gpu_hours")
            if held + entry["consumed"] > entry["limit"]:
                verdict.violations.append(
                    Violation(
                        "conservation",
                        f"{entry['ledger_key']} ({entry['policy_id']}): acknowledged ALLOWs hold {held} "
                        f"+ consumed {entry['consumed']} > limit {entry['limit']}",
                        involved,
                    )
                )
        if entries := [e for e in observation["ledger_entries"] if history.company is not None and e["policy_id"] == history.company]:
            # The budget every namespace shares: its own key and every tenant's lease together.
            judged += 1
            held, involved = _held_by_allows(allowed, by_run, {e["ledger_key"] for e in entries})
            consumed, limit = sum(e["consumed"] for e in entries), max(e["limit"] for e in entries)
            if held + consumed > limit:
                message = f"{history.company} and its leases: acknowledged ALLOWs hold {held} + consumed {consumed} > limit {limit}"
                verdict.violations.append(Violation("conservation", message, involved))
    verdict.judged["conservation"] = judged


def _company_conservation(history: History, verdict: Verdict, lost: dict[str, list[tuple[int, float, int]]]) -> int:
    """The budget every namespace shares, charged through tenants' escrow leases, never holds more
    than its limit in any ledger sample: its own key and all its leases together (a Redis sample
    with any of them mid-settlement is left out, as for a single key), with the ALLOWs told that
    the ledger never recorded on top in Postgres samples. (At the end: `conservation`.)"""
    judged = 0
    for sample in history.ledger:
        keys = {key: f for key, f in sample["keys"].items() if f.get("policy_id") == history.company}
        if not keys or any(f.get("parked") for f in keys.values()):
            continue
        judged += 1
        ended = sum(f["runs"][run_id]["amount"] for f in keys.values() for run_id in f.get("ended_in_postgres", ()))
        unseen = [(i, a) for told in lost.values() for i, complete, a in told if complete <= sample["at"]] if sample["source"] == "postgres" else []
        used = sum(f["held"] + f["consumed"] for f in keys.values()) - ended + sum(a for _i, a in unseen)
        limit = max(f["limit"] for f in keys.values())
        if used > limit:
            verdict.violations.append(
                Violation(
                    "conservation",
                    f"{sample['source']} at t={sample['at']:.1f}s: {history.company} and its {len(keys)} keys hold and consumed {used} > limit {limit}",
                    [i for i, _a in unseen],
                )
            )
    return judged


def _held_by_allows(
    allowed: dict[str, dict[str, Any]], by_run: dict[str, list[dict[str, Any]]], keys: set[str], *, namespace: str | None = None, projected: bool = True
) -> tuple[int, list[int]]:
    """What the acknowledged ALLOWs (of `namespace`, else of any) hold on `keys` at the end, and
    which operations: their held reservations there, and, for one told ALLOW of which Postgres
    holds nothing at all, its projection (`projected`: a GPU-hour budget)."""
    held, involved = 0, []
    for run_id, op in allowed.items():
        if namespace is not None and op["request"]["namespace"] != namespace:
            continue
        rows = by_run.get(run_id)
        if not rows:
            if projected:  # told ALLOW, yet Postgres holds nothing of it: held at its projection
                body = op["request"]
                held += round(body["resources"]["gpus"] * body["projected_runtime_hours"] * MILLI_PER_GPU_HOUR)
                involved.append(op["index"])
            continue
        for row in rows:
            if row["ledger_key"] in keys and row["state"] == "held":
                held += row["amount"]
                involved.append(op["index"])
    return held, involved


def _allows_without_reservation(history: History) -> dict[str, list[tuple[int, float, int]]]:
    """Per namespace, the ALLOWs told of which the final observation has no reservation at all:
    (operation index, when the answer came, projected milli-GPU-seconds)."""
    if history.observation is None:
        return {}
    reserved = {r["run_id"] for r in history.observation["reservations"]}
    found: dict[str, list[tuple[int, float, int]]] = defaultdict(list)
    seen: set[str] = set()
    for op in sorted(history.decisions_told(), key=lambda o: o["complete"]):
        body = op["request"]
        if op["answer"]["decision"] != "ALLOW" or body["run_id"] in reserved or body["run_id"] in seen:
            continue
        seen.add(body["run_id"])
        amount = round(body["resources"]["gpus"] * body["projected_runtime_hours"] * MILLI_PER_GPU_HOUR)
        found[body["namespace"]].append((op["index"], op["complete"], amount))
    return found


def decisions_durable(history: History, verdict: Verdict) -> None:
    """Every acknowledged decision is in Postgres exactly once with the answer given, on the
    decisions topic at least once, and in the evidence stand-in once after deduplication."""
    observation = history.observation
    told = history.decisions_told()
    verdict.judged["decisions"] = len(told)
    if observation is None:
        return
    stored: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for row in observation["decisions"]:
        stored[row["decision_id"]].append(row)
    on_topic = set(observation["topic_decisions"])
    evidence: dict[str, set[tuple[str, str]]] = defaultdict(set)
    for event in observation["evidence"]:
        evidence[event["decision_id"]].add((event["event_type"], event["event_time"]))
    seen: set[str] = set()
    for op in told:
        answer = op["answer"]
        decision_id = answer["decision_id"]
        rows = stored.get(decision_id, [])
        if len(rows) != 1:
            verdict.violations.append(
                Violation(
                    "decisions", f"decision {decision_id} of run {answer['run_id']} told {answer['decision']}: {len(rows)} rows in Postgres", [op["index"]]
                )
            )
        elif rows[0]["outcome"] != answer["decision"] or rows[0]["run_id"] != answer["run_id"]:
            verdict.violations.append(
                Violation(
                    "decisions",
                    f"decision {decision_id}: told {answer['decision']} for {answer['run_id']}, Postgres holds {rows[0]['outcome']} for {rows[0]['run_id']}",
                    [op["index"]],
                )
            )
        if decision_id in seen:
            continue
        seen.add(decision_id)
        if observation.get("topic_read", True) and decision_id not in on_topic:
            verdict.violations.append(
                Violation("decisions-topic", f"decision {decision_id} of run {answer['run_id']} is not on the decisions topic", [op["index"]])
            )
        events = evidence.get(decision_id, set())
        if not events:
            trail = observation.get("evidence_trail", {}).get(decision_id)
            verdict.violations.append(
                Violation(
                    "evidence",
                    f"decision {decision_id} of run {answer['run_id']} never reached the evidence stand-in" + (f"; its trail: {trail}" if trail else ""),
                    [op["index"]],
                )
            )
        elif len({event_type for event_type, _ in events}) != len(events):
            verdict.violations.append(
                Violation("evidence", f"decision {decision_id}: the stand-in holds differing events of one kind {sorted(events)}", [op["index"]])
            )
    known = set(stored)
    strays = sorted(d for d in evidence if d not in known)
    if strays:
        verdict.violations.append(Violation("evidence", f"evidence of {len(strays)} decision(s) Postgres never recorded: {strays[:5]}"))


def samples_once(history: History, verdict: Verdict) -> None:
    """Every acknowledged metering sample is counted exactly once: recorded (or kept pending)
    under its id, and every run's usage is the sum of its recorded deltas."""
    observation = history.observation
    acked = []
    for op in history.acked("sample"):
        results = (op.get("answer") or {}).get("results") or []
        if op.get("status") in (200, 202) and results and results[0].get("status") in COUNTED_SAMPLE_RESULTS:
            acked.append(op)
    verdict.judged["samples"] = len(acked)
    if observation is None:
        return
    recorded = {(r["run_id"], r["sample_id"]) for r in observation["usage_records"]}
    pending = {(r["run_id"], r["sample_id"]) for r in observation["metering_pending"]}
    for op in acked:
        result = op["answer"]["results"][0]
        # A sample with another's counters is a duplicate of that one, counted under its id.
        key = (op["request"]["run_id"], result.get("duplicateOf") or op["request"]["sample_id"])
        if key not in recorded and key not in pending:
            verdict.violations.append(
                Violation("samples", f"sample {key[1]} of run {key[0]} was acknowledged but is neither recorded nor pending", [op["index"]])
            )
    deltas: dict[str, int] = defaultdict(int)
    for r in observation["usage_records"]:
        deltas[r["run_id"]] += r["gpu_delta"]
    for run in observation["usage_runs"]:
        if deltas.get(run["run_id"], 0) != run["gpu_cumulative"]:
            verdict.violations.append(
                Violation("samples", f"run {run['run_id']}: usage {run['gpu_cumulative']} but its recorded samples add up to {deltas.get(run['run_id'], 0)}")
            )


def retries_same_decision(history: History, verdict: Verdict) -> None:
    """A retry with the same run id and body gets the same decision; a conflicting one (other
    resources) never gets a decision of its own."""
    first: dict[str, dict[str, Any]] = {}
    judged = 0
    for op in sorted(history.decisions_told(), key=lambda o: o["complete"]):
        run_id = op["request"]["run_id"]
        if run_id not in first:
            first[run_id] = op
            continue
        judged += 1
        earlier = first[run_id]["answer"]
        answer = op["answer"]
        if (answer["decision_id"], answer["decision"]) != (earlier["decision_id"], earlier["decision"]):
            verdict.violations.append(
                Violation(
                    "retries",
                    f"run {run_id}: told {earlier['decision']} ({earlier['decision_id']}), then {answer['decision']} ({answer['decision_id']}) on a retry",
                    [first[run_id]["index"], op["index"]],
                )
            )
    for op in history.acked("conflict"):
        judged += 1
        answer = op.get("answer") or {}
        earlier = first.get(op["request"]["run_id"])
        # With no acknowledged decision before it, a conflicting resubmission may be the run's
        # first decision (the first submission may never have been recorded).
        if op.get("status") == 200 and earlier is not None and answer.get("decision_id") != earlier["answer"]["decision_id"]:
            verdict.violations.append(
                Violation(
                    "retries", f"run {op['request']['run_id']}: a conflicting resubmission got a decision of its own {answer.get('decision_id')}", [op["index"]]
                )
            )
    verdict.judged["retries"] = judged


def reservations_end(history: History, verdict: Verdict) -> None:
    """No reservation outlives its deadline: a run never started gives its reservation back at
    the start deadline, and a finished run's reservation is settled within the provisional grace."""
    observation = history.observation
    if observation is None:
        verdict.judged["deadlines"] = 0
        return
    settings = history.setup["settings"]
    started: dict[str, bool] = defaultdict(bool)
    ended_at: dict[str, float] = {}
    index: dict[str, int] = {}
    for op in history.ops:
        if op["kind"] != "lifecycle" or op.get("outcome") not in ("ok", "info"):
            continue
        run_id = op["request"]["run_id"]
        if op["request"]["type"] == "STARTED":
            started[run_id] = True
        elif op["request"]["type"] in TERMINAL_LIFECYCLE and op.get("outcome") == "ok":
            ended_at[run_id] = op["complete"]
            index[run_id] = op["index"]
    judged = 0
    for row in observation["reservations"]:
        if row["state"] != "held":
            continue
        judged += 1
        run_id = row["run_id"]
        if not started[run_id] and row["age_seconds"] > settings["start_deadline_seconds"] + DEADLINE_SLACK_SECONDS:
            verdict.violations.append(
                Violation(
                    "deadlines",
                    f"run {run_id} never started, yet holds {row['amount']} on {row['ledger_key']} {row['age_seconds']:.0f}s after admission "
                    f"(start deadline {settings['start_deadline_seconds']:g}s)",
                )
            )
        elif run_id in ended_at and observation["at"] - ended_at[run_id] > settings["provisional_grace_seconds"] + DEADLINE_SLACK_SECONDS:
            verdict.violations.append(
                Violation(
                    "deadlines",
                    f"run {run_id} ended {observation['at'] - ended_at[run_id]:.0f}s before the end, yet still holds {row['amount']} on {row['ledger_key']}",
                    [index[run_id]],
                )
            )
    verdict.judged["deadlines"] = judged


def redis_matches_postgres(history: History, verdict: Verdict) -> None:
    """Once recovered, Redis holds what Postgres holds, key by key and run by run."""
    observation = history.observation
    verdict.judged["redis"] = 1 if observation is not None else 0
    if observation is None:
        return
    drift = observation["redis_drift"]
    if not drift["loaded"]:
        verdict.violations.append(Violation("redis", "Redis's ledger is not loaded after recovery: nothing to compare with Postgres"))
        return
    for key, (in_redis, in_postgres) in drift["keys"].items():
        verdict.violations.append(Violation("redis", f"ledger key {key}: Redis (reserved, consumed) {in_redis}, Postgres {in_postgres}"))
    for run_id, (in_redis, in_postgres) in drift["runs"].items():
        verdict.violations.append(Violation("redis", f"run {run_id}: Redis holds {in_redis}, Postgres {in_postgres}"))
    for name, what in (("counters", "counter"), ("pools", "pool"), ("sizes", "escrow lease size")):
        for key, (in_redis, in_postgres) in drift.get(name, {}).items():
            verdict.violations.append(Violation("redis", f"{what} {key}: Redis {in_redis}, Postgres {in_postgres}"))


def answers_bounded(history: History, verdict: Verdict) -> None:
    """No request answered 5xx but the 503 that fails closed, and none left unanswered past the
    client's timeout."""
    timeout = history.setup["settings"]["client_timeout_seconds"]
    judged = 0
    for op in history.ops:
        if op.get("outcome") == "skipped":
            continue
        judged += 1
        status = op.get("status")
        if isinstance(status, int) and status >= 500 and status != 503:
            verdict.violations.append(Violation("answers", f"{op['kind']} answered {status}: {str(op.get('answer'))[:300]}", [op["index"]]))
        if op.get("error", "").startswith("timeout"):
            verdict.violations.append(Violation("answers", f"{op['kind']} unanswered after {timeout:g}s ({op['error']})", [op["index"]]))
    verdict.judged["answers"] = judged


def pool_quota(history: History, verdict: Verdict) -> None:
    """A pool never has more tokens granted at once than its quota."""
    quota = history.setup["settings"]["pool_quota"]
    lease = history.setup["settings"]["pool_lease_seconds"]
    released = {op["request"]["token"]: op["invoke"] for op in history.ops if op["kind"] == "pool-release" and op.get("outcome") in ("ok", "info")}
    intervals = []
    for op in history.acked("pool-allocate"):
        if op.get("status") == 200 and (op.get("answer") or {}).get("status") == "Granted":
            token = op["request"]["token"]
            # Surely held from the grant's answer to the earlier of its release's request and
            # its lease's end counted from the grant's request.
            intervals.append((op["complete"], min(released.get(token, float("inf")), op["invoke"] + lease), op["index"]))
    verdict.judged["pools"] = len(intervals)
    for start, _end, index in intervals:
        holding = [i for s, e, i in intervals if s <= start < e]
        if len(holding) > quota:
            verdict.violations.append(Violation("pools", f"{len(holding)} tokens held at once, quota {quota}", sorted(holding)))
            break


CHECKERS: tuple[Checker, ...] = (
    conservation,
    decisions_durable,
    samples_once,
    retries_same_decision,
    reservations_end,
    redis_matches_postgres,
    answers_bounded,
    pool_quota,
)
