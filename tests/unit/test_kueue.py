"""Kueue's AdmissionCheck protocol for budgets (pure): a Workload shaped as Kueue v1beta1 writes
it to a submission, and each decision to the check's state."""

from __future__ import annotations

import copy
import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from budgetgate.client import Conflict, InvalidRequest, Unauthorized, Unavailable
from budgetgate.platforms.kubernetes import Mapping, Unmappable
from budgetgate.adapters.kueue_workloads import PRIORITY_BOOST, active, decided, error_answer, pending_checks, submission, unchanged, undecided

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "kueue"
NOW = datetime(2026, 7, 14, 9, 30, 7, tzinfo=UTC)


def workload() -> dict[str, Any]:
    return json.loads((FIXTURES / "workload-job.json").read_text())


def states(patch_status: dict[str, Any]) -> dict[str, tuple[str, str]]:
    return {c["name"]: (c["state"], c["message"]) for c in patch_status["status"]["admissionChecks"]}


def test_only_our_pending_checks_of_workloads_with_quota() -> None:
    assert pending_checks(workload(), {"budget"}) == ["budget"]
    assert pending_checks(workload(), {"provisioning"}) == []  # Ready already
    waiting = workload()
    waiting["status"]["conditions"] = []
    assert pending_checks(waiting, {"budget"}) == []


def test_the_workload_is_one_run_of_all_its_pod_sets() -> None:
    request = submission(workload())
    assert request.run_id == "7b6f2e10-93c4-4d2a-8e51-f0a9c3b4d5e6"  # the Job's UID
    assert (request.resources.gpus, request.resources.nodes, request.resources.flavor, request.projected_runtime_hours) == (8, 2, "h100", 6.0)
    assert request.labels == {"team": "vision", "cost-center": "1042", "environment": "prod"}
    assert request.namespace == "vision-prod" and request.job is not None and request.job.name == "train-resnet"


def test_runtime_falls_back_to_the_annotation_then_the_namespace_default() -> None:
    found = workload()
    del found["spec"]["maximumExecutionTimeSeconds"]
    with pytest.raises(Unmappable, match="maximumExecutionTimeSeconds"):
        submission(found)
    assert submission(found, Mapping(namespace_runtime_hours={"vision-prod": 3.0})).projected_runtime_hours == 3.0
    found["metadata"]["annotations"] = {"budgetgate.io/projected-runtime-hours": "1.5", "budgetgate.io/attempt": "2"}
    assert (submission(found).projected_runtime_hours, submission(found).attempt) == (1.5, 2)


def answer(decision: str, **extra: Any) -> dict[str, Any]:
    return {"decision": decision, "reason": f"{decision.lower()}ed for a reason", "attempt": 1, "evaluations": [], **extra}


def test_allow_is_ready_and_a_penalty_lowers_the_priority() -> None:
    patch = decided(workload(), "budget", answer("ALLOW", priority_penalty=0.42), now=NOW)
    assert states(patch.status) == {"budget": ("Ready", "budgetgate: allowed for a reason"), "provisioning": ("Ready", "Provisioned")}
    assert patch.status["metadata"]["resourceVersion"] == "48213"  # a concurrent change is a conflict, not lost
    assert patch.annotations == {PRIORITY_BOOST: "-420"}
    assert decided(workload(), "budget", answer("ALLOW"), now=NOW).annotations == {}


def test_delay_is_retry_with_the_time_and_the_next_attempt() -> None:
    evaluations = [{"decision": "DELAY", "next_eligible_time": "2026-08-01T00:00:00Z"}]
    patch = decided(workload(), "budget", answer("DELAY", evaluations=evaluations), now=NOW)
    state, message = states(patch.status)["budget"]
    assert state == "Retry" and message.endswith("retry at or after 2026-08-01T00:00:00Z")
    assert patch.annotations == {"budgetgate.io/attempt": "2"}
    (ours,) = [c for c in patch.status["status"]["admissionChecks"] if c["name"] == "budget"]
    assert ours["lastTransitionTime"] == "2026-07-14T09:30:07Z"


def test_deny_is_rejected_and_no_decision_stays_pending() -> None:
    assert states(decided(workload(), "budget", answer("DENY"), now=NOW).status)["budget"][0] == "Rejected"
    pending = undecided(workload(), "budget", "ledger unavailable", now=NOW)
    assert states(pending.status)["budget"] == ("Pending", "budgetgate: ledger unavailable")
    (ours,) = [c for c in pending.status["status"]["admissionChecks"] if c["name"] == "budget"]
    assert ours["lastTransitionTime"] == "2026-07-14T09:30:01Z"  # no transition: the time stays


def test_the_admission_check_is_marked_active_once() -> None:
    check = json.loads((FIXTURES / "admissioncheck.json").read_text())
    patch = active(check, now=NOW)
    assert patch is not None and patch["status"]["conditions"][0]["type"] == "Active" and patch["status"]["conditions"][0]["status"] == "True"
    marked = copy.deepcopy(check)
    marked["status"] = patch["status"]
    assert active(marked, now=NOW) is None


def test_permanent_error_answers_end_the_wait_and_outages_keep_it() -> None:
    # A 409 for a request a higher attempt decides afresh (the run was refused): Retry at that attempt.
    conflict = Conflict(409, {"detail": "run 'r' was denied at attempt 1 for another request (resources.flavor: \"h100\" → \"a100\")",
                              "fields": ["resources.flavor"], "next_attempt": 2})  # fmt: skip
    retry = error_answer(workload(), "budget", conflict, now=NOW)
    assert states(retry.status)["budget"] == ("Retry", f"budgetgate: {conflict.detail}; the next try is attempt 2")
    assert retry.annotations == {"budgetgate.io/attempt": "2"}
    # A 409 no attempt changes: the run was admitted for another request, or is another owner's.
    # Retried, each attempt was the same 409 again (or, before, the old ALLOW replayed for the new request).
    admitted = Conflict(409, {"detail": "run 'r' was admitted at attempt 1 for another request", "fields": ["resources.flavor"], "next_attempt": None})
    taken = Conflict(409, {"detail": "run 'r' is decided in another namespace", "fields": ["namespace"], "next_attempt": None})
    for final in (admitted, taken):
        rejected = error_answer(workload(), "budget", final, now=NOW)
        assert states(rejected.status)["budget"] == ("Rejected", f"budgetgate: {final.detail}") and not rejected.annotations
    invalid = InvalidRequest(422, {"detail": "invalid resources.flavor: no rate card prices it"})
    assert states(error_answer(workload(), "budget", invalid, now=NOW).status)["budget"] == (
        "Rejected", "budgetgate: not a valid submission (invalid resources.flavor: no rate card prices it)"
    )  # fmt: skip
    for status, says in ((401, "token is missing"), (403, "lacks the submitter role")):
        state, message = states(error_answer(workload(), "budget", Unauthorized(status, {"detail": "no"}), now=NOW).status)["budget"]
        assert state == "Pending" and says in message and "operator" in message
    outage = error_answer(workload(), "budget", Unavailable(503, {"title": "Service Unavailable", "detail": "ledger down"}), now=NOW)
    assert states(outage.status)["budget"][0] == "Pending" and not outage.annotations


def test_a_write_that_changes_nothing_is_known() -> None:
    pending = undecided(workload(), "budget", "ledger unavailable", now=NOW)
    assert not unchanged(workload(), pending)
    written = workload()
    written["status"]["admissionChecks"] = pending.status["status"]["admissionChecks"]
    assert unchanged(written, undecided(written, "budget", "ledger unavailable", now=NOW))
    assert not unchanged(written, undecided(written, "budget", "Postgres unavailable", now=NOW))
