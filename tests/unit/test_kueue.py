"""Kueue's AdmissionCheck protocol for budgets (pure): a Workload shaped as Kueue v1beta2 (its
AdmissionCheckState: state, message, lastTransitionTime, requeueAfterSeconds, retryCount,
podSetUpdates) becomes a submission, and each decision the check's state: Retry, with when to
try again, for what time fixes, Rejected for what it does not."""

from __future__ import annotations

import copy
import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from budgetgate.client import BudgetgateError, Conflict, InvalidRequest, NotFound, RateLimited, Unauthorized, Unavailable
from budgetgate.platforms.kubernetes import Mapping, Unmappable
from budgetgate.platforms.run_labels import run_id_of, run_label_value
from budgetgate.adapters.kueue_workloads import (
    MAX_REQUEUE_SECONDS,
    PRIORITY_BOOST,
    Refusal,
    Retries,
    active,
    asks_no_gpu,
    carried_over,
    concurrency,
    decided,
    error_answer,
    let_through,
    pending_checks,
    pod_set_updates,
    refusal,
    requeue_seconds,
    run_label_conflict,
    submission,
    unavailable,
    unchanged,
    undecided,
)

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


def test_a_workload_being_evicted_or_deactivated_is_not_decided() -> None:
    # Kueue resets every check to Pending when it evicts, while the quota is still reserved
    # until the job has stopped: deciding then would submit a Workload that is on its way out.
    evicting = workload()
    evicting["status"]["conditions"].append({"type": "Evicted", "status": "True", "reason": "AdmissionCheck", "message": "Evicted due to ..."})
    assert pending_checks(evicting, {"budget"}) == []
    readmitted = copy.deepcopy(evicting)
    readmitted["status"]["conditions"][-1].update(status="False", reason="QuotaReserved")  # reserved again: Evicted false
    assert pending_checks(readmitted, {"budget"}) == ["budget"]
    inactive = workload()
    inactive["spec"]["active"] = False
    assert pending_checks(inactive, {"budget"}) == []


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
    return {"run_id": "7b6f2e10-93c4-4d2a-8e51-f0a9c3b4d5e6", "decision_id": "d-1", "decision": decision, "reason": f"{decision.lower()}ed for a reason",
            "attempt": 1, "evaluations": [], **extra}  # fmt: skip


def evaluation(decision: str, *, enforcement: str = "hard", limit: float = 500.0, projected: float = 48.0, **extra: Any) -> dict[str, Any]:
    return {"decision": decision, "enforcement": enforcement, "limit": limit, "projected": projected, "next_eligible_time": None, "missing_labels": [],
            **extra}  # fmt: skip


def ours(patch_status: dict[str, Any]) -> dict[str, Any]:
    return next(c for c in patch_status["status"]["admissionChecks"] if c["name"] == "budget")


def test_allow_is_ready_and_a_penalty_lowers_the_priority() -> None:
    patch = decided(workload(), "budget", answer("ALLOW", priority_penalty=0.42), now=NOW)
    assert states(patch.status) == {"budget": ("Ready", "budgetgate: allowed for a reason"), "provisioning": ("Ready", "Provisioned")}
    assert patch.status["metadata"]["resourceVersion"] == "48213"  # a concurrent change is a conflict, not lost
    assert patch.annotations == {PRIORITY_BOOST: "-420"}
    assert decided(workload(), "budget", answer("ALLOW"), now=NOW).annotations == {}


def test_ready_labels_every_pod_set_with_the_run_id() -> None:
    two = workload()
    two["spec"]["podSets"].append({**copy.deepcopy(two["spec"]["podSets"][0]), "name": "workers"})
    patch = decided(two, "budget", answer("ALLOW"), now=NOW)
    assert ours(patch.status)["podSetUpdates"] == [
        {"name": "main", "labels": {"budgetgate.io/run-id": "7b6f2e10-93c4-4d2a-8e51-f0a9c3b4d5e6"}},
        {"name": "workers", "labels": {"budgetgate.io/run-id": "7b6f2e10-93c4-4d2a-8e51-f0a9c3b4d5e6"}},
    ]  # a UID is a label value as it is: no annotation needed
    # A run id that is not a label value: its hash as the label, the whole id in the annotation,
    # from which a reader of the pod takes it back.
    run_id = "flyte/vision/exec-7f3a/n0"
    (update,) = pod_set_updates(workload(), run_id)
    assert update == {"name": "main", "labels": {"budgetgate.io/run-id": run_label_value(run_id)}, "annotations": {"budgetgate.io/run-id": run_id}}
    assert update["labels"]["budgetgate.io/run-id"].startswith("bg-") and run_id_of(update["labels"], update["annotations"]) == run_id
    # Only a Ready check carries them; a state written after it does not keep them.
    ready = workload()
    ready["status"]["admissionChecks"][0] = ours(patch.status)
    assert "podSetUpdates" not in ours(undecided(ready, "budget", "token refused", now=NOW).status)


def test_a_pod_template_naming_another_run_is_a_conflict_kueue_would_refuse() -> None:
    labelled = workload()
    labelled["spec"]["podSets"][0]["template"]["metadata"]["labels"]["budgetgate.io/run-id"] = "someone-else"
    why = run_label_conflict(labelled, "7b6f2e10-93c4-4d2a-8e51-f0a9c3b4d5e6")
    assert why is not None and "budgetgate.io/run-id='someone-else'" in why and "'main'" in why
    labelled["spec"]["podSets"][0]["template"]["metadata"]["labels"]["budgetgate.io/run-id"] = "7b6f2e10-93c4-4d2a-8e51-f0a9c3b4d5e6"
    assert run_label_conflict(labelled, "7b6f2e10-93c4-4d2a-8e51-f0a9c3b4d5e6") is None  # the same value: no conflict
    assert run_label_conflict(workload(), "flyte/vision/exec-7f3a/n0") is None


def test_delay_is_retry_until_the_next_eligible_time_and_the_next_attempt() -> None:
    evaluations = [
        evaluation("DELAY", next_eligible_time="2026-08-01T00:00:00Z"),
        evaluation("DELAY", next_eligible_time="2026-07-20T00:00:00Z"),
        evaluation("DELAY", enforcement="dry-run", next_eligible_time="2027-01-01T00:00:00Z"),  # never blocks: not waited for
    ]
    patch = decided(workload(), "budget", answer("DELAY", evaluations=evaluations), now=NOW)
    state, message = states(patch.status)["budget"]
    assert state == "Retry" and message.endswith("retry at or after 2026-08-01T00:00:00Z")
    assert patch.annotations == {"budgetgate.io/attempt": "2"}
    check = ours(patch.status)
    assert check["lastTransitionTime"] == "2026-07-14T09:30:07Z"
    # Kueue queues it again at lastTransitionTime + requeueAfterSeconds: the latest budget's time.
    assert check["requeueAfterSeconds"] == (datetime(2026, 8, 1, tzinfo=UTC) - NOW).total_seconds() == 1_520_993


def test_requeue_seconds_never_end_before_the_time_nor_outside_an_int32() -> None:
    # lastTransitionTime is written to the second: counted from there, rounded up.
    now = datetime(2026, 7, 14, 9, 30, 7, 600_000, tzinfo=UTC)
    assert requeue_seconds(datetime(2026, 7, 14, 9, 30, 10, 200_000, tzinfo=UTC), now) == 4  # 09:30:07 + 4 s ≥ 09:30:10.2
    assert requeue_seconds(datetime(2026, 7, 14, 9, 0, tzinfo=UTC), now) == 1  # a replayed DELAY whose time has passed
    assert requeue_seconds(datetime(2100, 1, 1, tzinfo=UTC), now) == MAX_REQUEUE_SECONDS
    assert requeue_seconds(datetime(2026, 7, 14, 9, 0, tzinfo=UTC), now, Retries(minimum_seconds=5)) == 5
    with pytest.raises(ValueError, match="quota_seconds"):
        Retries(quota_seconds=-1)


def test_a_delay_naming_no_time_is_retried_after_the_delay_setting() -> None:
    patch = decided(workload(), "budget", answer("DELAY", evaluations=[evaluation("DELAY")]), now=NOW, retries=Retries(delay_seconds=600))
    assert ours(patch.status)["state"] == "Retry" and ours(patch.status)["requeueAfterSeconds"] == 600
    assert "no budget names when it has room again" in ours(patch.status)["message"]


def test_each_refusal_kind_is_told_by_the_answers_fields() -> None:
    labels = evaluation("DENY", projected=0.0, missing_labels=["cost-center"])
    waived = evaluation("DENY", enforcement="soft", projected=0.0, missing_labels=["owner"])  # recorded, not enforced
    assert refusal(answer("ALLOW", evaluations=[waived])) is None
    assert refusal(answer("DELAY")) is Refusal.DELAY
    assert refusal(answer("DENY", evaluations=[labels])) is Refusal.MISSING_LABELS
    assert refusal(answer("DENY", evaluations=[evaluation("DENY", limit=500.0, projected=768.0)])) is Refusal.NEVER_FITS
    assert refusal(answer("DENY", evaluations=[evaluation("DENY", limit=500.0, projected=48.0)])) is Refusal.BUDGET_DENIES
    # Denied while every hard budget had room (or only asked it to wait): a concurrency limit.
    assert refusal(answer("DENY", evaluations=[evaluation("ALLOW"), waived])) is Refusal.CONCURRENCY
    assert refusal(answer("DENY", evaluations=[evaluation("DELAY")])) is Refusal.CONCURRENCY
    assert refusal(answer("DENY")) is Refusal.CONCURRENCY

    # Which one, from the run's status: `waiting` lists each limit with what the run asks of it.
    def limit(requested: int, limit: int) -> dict[str, Any]:
        return {"kind": "quota", "name": "max_gpus", "unit": "gpus", "limit": limit, "used": 8, "requested": requested, "fits": False}

    full = {"waiting": {"state": "waiting for quota headroom", "limiting": [limit(8, 8)]}}
    too_big = {"waiting": {"state": "waiting for quota headroom", "limiting": [limit(16, 8)]}}
    assert concurrency(full) is Refusal.QUOTA
    assert concurrency(too_big) is Refusal.NEVER_FITS
    assert concurrency({"waiting": None}) is Refusal.TOKEN_POOL  # a pool's refusal does not wait for quota headroom
    assert concurrency(None) is Refusal.CONCURRENCY


def test_what_time_fixes_is_retried_and_what_it_does_not_is_rejected() -> None:
    retries = Retries(quota_seconds=45)
    for kind in (Refusal.QUOTA, Refusal.TOKEN_POOL, Refusal.CONCURRENCY):
        patch = decided(workload(), "budget", answer("DENY"), now=NOW, kind=kind, retries=retries)
        check = ours(patch.status)
        assert (check["state"], check["requeueAfterSeconds"]) == ("Retry", 45), kind
        assert "asking again in 45s" in check["message"]
        assert patch.annotations == {"budgetgate.io/attempt": "2"}  # the DENY is stored for attempt 1: the next try is a new question
    for kind in (Refusal.MISSING_LABELS, Refusal.NEVER_FITS, Refusal.BUDGET_DENIES):
        patch = decided(workload(), "budget", answer("DENY"), now=NOW, kind=kind)
        assert states(patch.status)["budget"] == ("Rejected", "budgetgate: denyed for a reason") and not patch.annotations
        assert "requeueAfterSeconds" not in ours(patch.status)
    # Without a kind the answer alone decides: a budget the run is larger than.
    assert states(decided(workload(), "budget", answer("DENY", evaluations=[evaluation("DENY", projected=768.0)]), now=NOW).status)["budget"][0] == "Rejected"


def test_a_workload_asking_for_no_gpu_is_let_through_unless_cpu_only_work_is_submitted() -> None:
    cpu = workload()
    for where in ("requests", "limits"):
        del cpu["spec"]["podSets"][0]["template"]["spec"]["containers"][0]["resources"][where]["nvidia.com/gpu"]
    assert asks_no_gpu(cpu) and not asks_no_gpu(workload())
    with pytest.raises(Unmappable, match="asks for no nvidia.com/gpu"):
        submission(cpu)
    request = submission(cpu, Mapping(submit_cpu_only=True))
    assert (request.resources.gpus, request.resources.nodes) == (0, 2)
    through = let_through(cpu, "budget", "no GPU", now=NOW)
    assert states(through.status)["budget"] == ("Ready", "budgetgate: no GPU") and "podSetUpdates" not in ours(through.status)


def test_no_decision_is_retried_after_the_outage_setting_and_an_operators_fix_stays_pending() -> None:
    outage = unavailable(workload(), "budget", "ledger unavailable", now=NOW, retries=Retries(outage_seconds=20))
    check = ours(outage.status)
    assert (check["state"], check["requeueAfterSeconds"], check["message"]) == ("Retry", 20, "budgetgate: ledger unavailable; asking again in 20s")
    assert not outage.annotations  # nothing was decided: the same attempt next time
    pending = undecided(workload(), "budget", "token refused", now=NOW)
    assert states(pending.status)["budget"] == ("Pending", "budgetgate: token refused")
    assert ours(pending.status)["lastTransitionTime"] == "2026-07-14T09:30:01Z"  # no transition: the time stays


def test_a_retry_keeps_kueues_retry_count_and_a_later_state_drops_the_old_requeue() -> None:
    reset = workload()
    reset["status"]["admissionChecks"][0].update(requeueAfterSeconds=60, retryCount=2, message="Reset to Pending after eviction. Previously: Retry")
    ready = ours(decided(reset, "budget", answer("ALLOW"), now=NOW).status)
    assert ready["retryCount"] == 2 and "requeueAfterSeconds" not in ready
    retry = ours(decided(reset, "budget", answer("DENY"), now=NOW, kind=Refusal.QUOTA, retries=Retries(quota_seconds=30)).status)
    assert (retry["retryCount"], retry["requeueAfterSeconds"]) == (2, 30)


def test_the_admission_check_is_marked_active_once() -> None:
    check = json.loads((FIXTURES / "admissioncheck.json").read_text())
    patch = active(check, now=NOW)
    assert patch is not None and patch["status"]["conditions"][0]["type"] == "Active" and patch["status"]["conditions"][0]["status"] == "True"
    marked = copy.deepcopy(check)
    marked["status"] = patch["status"]
    assert active(marked, now=NOW) is None


def test_permanent_error_answers_end_the_wait_and_outages_are_retried() -> None:
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
    state, message = states(error_answer(workload(), "budget", NotFound(404, {"detail": "no route"}), now=NOW).status)["budget"]
    assert state == "Pending" and "404" in message and "operator" in message
    # budgetgate cannot decide now: Retry after the outage setting, or the Retry-After asked for when longer.
    retries = Retries(outage_seconds=30)
    for error, seconds in (
        (Unavailable(503, {"title": "Service Unavailable", "detail": "ledger down"}), 30),
        (RateLimited(429, {"detail": "slow down"}, retry_after=119.2), 120),
        (BudgetgateError(500, {"detail": "boom"}), 30),
    ):
        outage = error_answer(workload(), "budget", error, now=NOW, retries=retries)
        assert (ours(outage.status)["state"], ours(outage.status)["requeueAfterSeconds"]) == ("Retry", seconds) and not outage.annotations


def test_a_write_that_changes_nothing_is_known() -> None:
    pending = undecided(workload(), "budget", "ledger unavailable", now=NOW)
    assert not unchanged(workload(), pending)
    written = workload()
    written["status"]["admissionChecks"] = pending.status["status"]["admissionChecks"]
    assert unchanged(written, undecided(written, "budget", "ledger unavailable", now=NOW))
    assert not unchanged(written, undecided(written, "budget", "Postgres unavailable", now=NOW))


def test_a_decision_is_carried_over_to_a_version_kueue_wrote_only_while_it_still_stands() -> None:
    decided_on = workload()
    decided_on["metadata"]["resourceVersion"] = "7"
    patch = decided(decided_on, "budget", answer("DELAY", evaluations=[evaluation("DELAY", next_eligible_time="2026-08-01T00:00:00Z")]), now=NOW)
    fresh = copy.deepcopy(decided_on)
    fresh["metadata"].update(resourceVersion="9", annotations={**(fresh["metadata"].get("annotations") or {}), **patch.annotations})
    fresh["status"]["admissionChecks"][1]["message"] = "re-provisioned"
    carried = carried_over(decided_on, fresh, "budget", patch)
    assert carried is not None and carried["metadata"] == {"resourceVersion": "9"}
    # Our check as decided, Kueue's change to the other check kept.
    assert states(carried) == {"budget": states(patch.status)["budget"], "provisioning": ("Ready", "re-provisioned")}
    # Not when the decision no longer stands for the new version.
    evicted = copy.deepcopy(fresh)
    evicted["status"]["conditions"].append({"type": "Evicted", "status": "True", "reason": "Preempted"})
    moved = copy.deepcopy(fresh)
    moved["status"]["admission"]["podSetAssignments"][0]["count"] = 1
    other_attempt = copy.deepcopy(fresh)
    other_attempt["metadata"]["annotations"]["budgetgate.io/attempt"] = "5"
    decided_already = copy.deepcopy(fresh)
    decided_already["status"]["admissionChecks"][0].update(state="Ready")
    for changed in (evicted, moved, other_attempt, decided_already):
        assert carried_over(decided_on, changed, "budget", patch) is None
