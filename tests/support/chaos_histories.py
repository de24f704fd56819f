"""Histories of the fault campaign for its checkers' tests: a small clean one (every checker
passes), which a test then doctors with the bug it plants."""

from __future__ import annotations

from typing import Any

LIMIT = 3_600_000  # one GPU-hour, in milli-GPU-seconds
RUN_AMOUNT = 1_800_000  # 1 GPU for half an hour


def submit(index: int, run_id: str, decision: str, decision_id: str, *, at: float, kind: str = "submit", gpus: int = 1) -> dict[str, Any]:
    body = {
        "run_id": run_id,
        "attempt": 1,
        "namespace": "chaos-00",
        "labels": {"team": "chaos-00"},
        "resources": {"gpus": gpus},
        "projected_runtime_hours": 0.5,
    }
    answer = {"run_id": run_id, "decision_id": decision_id, "decision": decision}
    return {"type": "op", "index": index, "kind": kind, "invoke": at, "complete": at + 0.1, "request": body, "status": 200, "answer": answer, "outcome": "ok"}


def clean_history() -> list[dict[str, Any]]:
    setup = {
        "type": "setup",
        "seed": 7,
        "fingerprint": "f",
        "budgets": [
            {"namespace": "chaos-00", "kind": "hard", "gpu_hours": 1.0, "cost": None},
            {"namespace": "chaos-01", "kind": "soft", "gpu_hours": 1.0, "cost": None},
        ],
        "settings": {
            "client_timeout_seconds": 30.0,
            "start_deadline_seconds": 20.0,
            "provisional_grace_seconds": 10.0,
            "pool_quota": 2,
            "pool_lease_seconds": 30,
        },
    }
    ops = [
        submit(0, "r0", "ALLOW", "d0", at=1.0),
        submit(1, "r1", "ALLOW", "d1", at=2.0),
        submit(2, "r2", "DENY", "d2", at=3.0),
        submit(3, "r0", "ALLOW", "d0", at=4.0, kind="retry"),
        {
            "type": "op",
            "index": 4,
            "kind": "lifecycle",
            "invoke": 5.0,
            "complete": 5.1,
            "request": {"run_id": "r0", "type": "STARTED"},
            "status": 202,
            "outcome": "ok",
        },
        {
            "type": "op",
            "index": 5,
            "kind": "lifecycle",
            "invoke": 5.0,
            "complete": 5.1,
            "request": {"run_id": "r1", "type": "STARTED"},
            "status": 202,
            "outcome": "ok",
        },
        {
            "type": "op",
            "index": 6,
            "kind": "sample",
            "invoke": 6.0,
            "complete": 6.1,
            "request": {"run_id": "r0", "sample_id": "s0"},
            "status": 200,
            "answer": {"results": [{"status": "accepted"}]},
            "outcome": "ok",
        },
        {
            "type": "op",
            "index": 7,
            "kind": "sample",
            "invoke": 7.0,
            "complete": 7.1,
            "request": {"run_id": "r0", "sample_id": "s0"},
            "status": 200,
            "answer": {"results": [{"status": "duplicate"}]},
            "outcome": "ok",
        },
        {
            "type": "op",
            "index": 8,
            "kind": "pool-allocate",
            "invoke": 8.0,
            "complete": 8.1,
            "request": {"token": "t0"},
            "status": 200,
            "answer": {"status": "Granted"},
            "outcome": "ok",
        },
        {
            "type": "op",
            "index": 9,
            "kind": "pool-allocate",
            "invoke": 8.0,
            "complete": 8.2,
            "request": {"token": "t1"},
            "status": 200,
            "answer": {"status": "Granted"},
            "outcome": "ok",
        },
        {
            "type": "op",
            "index": 10,
            "kind": "submit",
            "invoke": 9.0,
            "complete": 9.2,
            "request": {"run_id": "r9"},
            "status": 503,
            "answer": {"detail": "Redis down"},
            "outcome": "info",
        },
    ]
    ledger = [
        {
            "type": "ledger",
            "source": "postgres",
            "at": 4.5,
            "keys": {"k0": {"policy_id": "chaos/chaos-00", "unit": "gpu_hours", "limit": LIMIT, "held": 2 * RUN_AMOUNT, "consumed": 0}},
        },
        {
            "type": "ledger",
            "source": "redis",
            "at": 4.6,
            "keys": {"k0": {"policy_id": "chaos/chaos-00", "limit": LIMIT, "held": 2 * RUN_AMOUNT, "consumed": 0}},
        },
        # A soft budget may go over its limit.
        {"type": "ledger", "source": "postgres", "at": 4.7, "keys": {"k1": {"policy_id": "chaos/chaos-01", "limit": LIMIT, "held": 3 * LIMIT, "consumed": 0}}},
    ]
    observation = {
        "type": "observation",
        "at": 60.0,
        "ledger_entries": [{"ledger_key": "k0", "policy_id": "chaos/chaos-00", "unit": "gpu_hours", "limit": LIMIT, "consumed": 0}],
        "reservations": [
            {"run_id": "r0", "ledger_key": "k0", "decision_id": "d0", "amount": RUN_AMOUNT, "state": "held", "age_seconds": 59.0},
            {"run_id": "r1", "ledger_key": "k0", "decision_id": "d1", "amount": RUN_AMOUNT, "state": "held", "age_seconds": 58.0},
        ],
        "decisions": [
            {"decision_id": "d0", "run_id": "r0", "attempt": 1, "outcome": "ALLOW"},
            {"decision_id": "d1", "run_id": "r1", "attempt": 1, "outcome": "ALLOW"},
            {"decision_id": "d2", "run_id": "r2", "attempt": 1, "outcome": "DENY"},
        ],
        "usage_records": [{"run_id": "r0", "sample_id": "s0", "gpu_delta": 500}],
        "usage_runs": [{"run_id": "r0", "gpu_cumulative": 500}],
        "metering_pending": [],
        "topic_decisions": ["d0", "d1", "d2"],
        "topic_read": True,
        "evidence": [{"decision_id": d, "event_type": "START", "event_time": "2026-01-01T00:00:00Z"} for d in ("d0", "d1", "d2")],
        "redis_drift": {"loaded": True, "keys": {}, "runs": {}, "counters": {}, "pools": {}},
    }
    return [setup, *ops, *ledger, observation, {"type": "end", "at": 61.0}]
