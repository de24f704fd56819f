"""The lifecycle controller's rules (budgetgate.adapters.workload_phases): which lifecycle events a
run's pods, Jobs and Workloads imply, with event ids that do not depend on who derives them when."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from budgetgate.adapters.workload_phases import BadObject, RunObjects, deleted, new_facts, phases
from budgetgate.core.reconciliation import LifecycleFact, timeline

T0 = datetime(2026, 7, 14, 9, 0, tzinfo=UTC)
RUN = "3c9a6f0e-2b7d-4c1e-9a8b-5d6e7f8a9b0c"


def ts(minutes: float) -> str:
    return (T0 + timedelta(minutes=minutes)).strftime("%Y-%m-%dT%H:%M:%SZ")


def at(minutes: float) -> datetime:
    return T0 + timedelta(minutes=minutes)


def pod(
    name: str, *, phase: str = "Pending", node: str | None = None, gpus: int = 4, started: float | None = None, finished: float | None = None,
    owner: str | None = "Job", disrupted: float | None = None, reason: str | None = None, created: float = 0,
) -> dict[str, Any]:  # fmt: skip
    state: dict[str, Any] = {}
    if started is not None and finished is None and phase == "Running":
        state = {"running": {"startedAt": ts(started)}}
    elif started is not None:
        state = {"terminated": {"startedAt": ts(started), "finishedAt": ts(finished if finished is not None else started), "exitCode": 0}}
    status: dict[str, Any] = {"phase": phase, "containerStatuses": [{"name": "main", "state": state}] if state else []}
    if disrupted is not None:
        status["conditions"] = [{"type": "DisruptionTarget", "status": "True", "reason": "PreemptionByScheduler", "lastTransitionTime": ts(disrupted)}]
    if reason:
        status["reason"] = reason
    meta: dict[str, Any] = {
        "name": name,
        "namespace": "vision-prod",
        "uid": f"uid-{name}",
        "creationTimestamp": ts(created),
        "labels": {"budgetgate.io/run-id": RUN},
    }
    if owner:
        meta["ownerReferences"] = [{"apiVersion": "batch/v1", "kind": owner, "name": "train", "uid": "uid-train", "controller": True}]
    spec: dict[str, Any] = {"containers": [{"name": "main", "resources": {"limits": {"nvidia.com/gpu": str(gpus)}}}]}
    if node:
        spec["nodeName"] = node
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec, "status": status}


def job(*conditions: tuple[str, float, str], created: float = 0) -> dict[str, Any]:
    return {
        "apiVersion": "batch/v1", "kind": "Job",
        "metadata": {"name": "train", "namespace": "vision-prod", "uid": "uid-train", "creationTimestamp": ts(created)},
        "status": {"conditions": [
            {"type": t, "status": "True", "lastTransitionTime": ts(m), "reason": r, "message": f"{t} because {r}"} for t, m, r in conditions
        ]},
    }  # fmt: skip


def workload(*conditions: tuple[str, str, float, str], flavor: str = "h100") -> dict[str, Any]:
    return {
        "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "Workload",
        "metadata": {"name": "job-train", "namespace": "vision-prod", "uid": "uid-wl", "creationTimestamp": ts(0)},
        "status": {
            "conditions": [{"type": t, "status": s, "lastTransitionTime": ts(m), "reason": r} for t, s, m, r in conditions],
            "admission": {"podSetAssignments": [{"name": "main", "flavors": {"nvidia.com/gpu": flavor}, "count": 2}]},
        },
    }  # fmt: skip


def kinds(run: RunObjects) -> list[tuple[str, datetime]]:
    return sorted((f.kind, f.at) for f in phases(run).facts)


def test_a_job_run_is_stored_started_and_completed() -> None:
    running = RunObjects(RUN, pods=(pod("a", phase="Running", node="n1", started=3), pod("b", phase="Running", node="n2", started=2)), jobs=(job(created=-1),))
    found = {f.kind: f for f in phases(running).facts}
    assert set(found) == {"STORED", "STARTED"}
    assert found["STORED"].at == at(-1) and found["STARTED"].at == at(2)
    assert (found["STARTED"].gpus, found["STARTED"].nodes) == (8, 2)
    done = RunObjects(
        RUN,
        pods=(pod("a", phase="Succeeded", started=3, finished=50), pod("b", phase="Succeeded", started=2, finished=55)),
        jobs=(job(("Complete", 56, "Completed")),),
    )
    ended = {f.kind: f for f in phases(done).facts}
    assert ended["COMPLETED"].at == at(56) and phases(done).finished
    # The same run, kind and fact: the same event id, whatever else the snapshot held.
    assert ended["STARTED"].event_id == found["STARTED"].event_id and ended["STORED"].event_id == found["STORED"].event_id
    other = {f.kind: f for f in phases(RunObjects("another-run", pods=running.pods, jobs=running.jobs)).facts}
    assert other["STARTED"].event_id != found["STARTED"].event_id and len({f.event_id for f in phases(done).facts}) == 3


def test_a_failed_job_fails_the_run_with_its_reason_and_a_job_still_going_ends_nothing() -> None:
    failed = phases(RunObjects(RUN, jobs=(job(("Failed", 30, "BackoffLimitExceeded")),)))
    [end] = [f for f in failed.facts if f.kind == "FAILED"]
    assert end.at == at(30) and end.reason.startswith("BackoffLimitExceeded")
    two = RunObjects(RUN, jobs=(job(("Complete", 30, "Completed")), {**job(), "metadata": {"name": "other", "uid": "uid-2", "creationTimestamp": ts(0)}}))
    assert not phases(two).finished


def test_bare_pods_end_the_run_but_pods_of_another_controller_do_not() -> None:
    done = phases(RunObjects(RUN, pods=(pod("p", phase="Succeeded", started=1, finished=9, owner=None),)))
    assert [(f.kind, f.at) for f in done.facts if f.kind == "COMPLETED"] == [("COMPLETED", at(9))]
    failed = phases(RunObjects(RUN, pods=(pod("p", phase="Failed", started=1, finished=9, owner=None, reason="Error"),)))
    assert [f.kind for f in failed.facts if f.kind == "FAILED"] == ["FAILED"]
    replaced = phases(RunObjects(RUN, pods=(pod("p", phase="Succeeded", started=1, finished=9, owner="ReplicaSet"),)))
    assert not replaced.finished


def test_a_kubelet_eviction_of_a_bare_pod_is_an_eviction_not_a_failure() -> None:
    evicted = phases(RunObjects(RUN, pods=(pod("p", phase="Failed", started=1, finished=9, owner=None, reason="Evicted"),)))
    assert [(f.kind, f.at) for f in evicted.facts if f.kind in ("EVICTED", "FAILED")] == [("EVICTED", at(9))]
    assert evicted.evicted_at == at(9) and not evicted.finished


def test_a_pod_preempted_while_others_run_evicts_nothing_the_last_one_does_and_a_replacement_readmits() -> None:
    one_of_two = RunObjects(
        RUN, pods=(pod("a", phase="Failed", started=1, finished=20, disrupted=20), pod("b", phase="Running", node="n2", started=1)), jobs=(job(),)
    )
    assert "EVICTED" not in [k for k, _ in kinds(one_of_two)]
    alone = RunObjects(RUN, pods=(pod("a", phase="Failed", started=1, finished=20, disrupted=20), pod("b", phase="Pending")), jobs=(job(),))
    result = phases(alone)
    assert [(f.kind, f.at) for f in result.facts if f.kind == "EVICTED"] == [("EVICTED", at(20))] and result.evicted_at == at(20)
    back = RunObjects(
        RUN, pods=(pod("a", phase="Failed", started=1, finished=20, disrupted=20), pod("c", phase="Running", node="n3", started=30)), jobs=(job(),)
    )
    again = phases(back)
    assert [(f.kind, f.at) for f in again.facts if f.kind in ("EVICTED", "READMITTED")] == [("EVICTED", at(20)), ("READMITTED", at(30))]
    assert again.evicted_at is None
    # The evicted pod gone by the time its replacement runs: the controller's memory readmits it.
    remembered = RunObjects(RUN, pods=(pod("c", phase="Running", node="n3", started=30),), jobs=(job(),), evicted_at=at(20))
    assert [(f.kind, f.at) for f in phases(remembered).facts if f.kind == "READMITTED"] == [("READMITTED", at(30))]


def test_kueue_evictions_and_readmissions_each_have_their_own_event() -> None:
    evicted = workload(("Admitted", "False", 40, "Evicted"), ("Evicted", "True", 40, "Preempted"))
    run = RunObjects(RUN, pods=(pod("a", phase="Succeeded", started=5, finished=40),), jobs=(job(),), workloads=(evicted,))
    [ev] = [f for f in phases(run).facts if f.kind == "EVICTED"]
    assert ev.at == at(40) and ev.reason == "Preempted"
    readmitted = workload(("Admitted", "True", 70, "Admitted"), ("Evicted", "False", 69, "QuotaReserved"))
    facts = phases(RunObjects(RUN, jobs=(job(),), workloads=(readmitted,))).facts
    assert [(f.kind, f.at, f.flavor) for f in facts if f.kind == "READMITTED"] == [("READMITTED", at(70), "h100")]
    # A second eviction is another fact (another transition time).
    second = workload(("Admitted", "False", 90, "Evicted"), ("Evicted", "True", 90, "Preempted"))
    [ev2] = [f for f in phases(RunObjects(RUN, workloads=(second,))).facts if f.kind == "EVICTED"]
    assert ev2.event_id != ev.event_id
    finished = workload(("Finished", "True", 100, "Failed"))
    assert [f.kind for f in phases(RunObjects(RUN, workloads=(finished,))).facts if f.kind in ("COMPLETED", "FAILED")] == ["FAILED"]


def test_deletions_before_the_end_cancel_and_after_it_change_nothing() -> None:
    gone = {**job(), "metadata": {**job()["metadata"], "deletionTimestamp": ts(12)}}
    cancelled = deleted(RunObjects(RUN), gone, kind="Job", now=at(99))
    assert cancelled is not None and (cancelled.kind, cancelled.at) == ("CANCELLED", at(12))
    assert deleted(RunObjects(RUN), job(("Complete", 10, "Completed")), kind="Job", now=at(99)) is None
    bare = pod("p", phase="Running", node="n1", started=1, owner=None)
    assert deleted(RunObjects(RUN), bare, kind="Pod", now=at(5)).kind == "CANCELLED"  # type: ignore[union-attr]
    preempted = pod("p", phase="Running", node="n1", started=1, owner=None, disrupted=4)
    assert deleted(RunObjects(RUN), preempted, kind="Pod", now=at(5)).kind == "EVICTED"  # type: ignore[union-attr]
    assert deleted(RunObjects(RUN, jobs=(job(),)), bare, kind="Pod", now=at(5)) is None  # the Job decides


def test_an_unreadable_timestamp_is_named() -> None:
    broken = pod("p", phase="Running", node="n1", started=1)
    broken["status"]["containerStatuses"][0]["state"]["running"]["startedAt"] = "yesterday"
    with pytest.raises(BadObject, match=r"containerStatuses\[0\].state.running.startedAt is not an RFC 3339 timestamp"):
        phases(RunObjects(RUN, pods=(broken,)))


# -- properties ------------------------------------------------------------------------------


@st.composite
def job_histories(draw):  # type: ignore[no-untyped-def]
    """Snapshots of a Job run over time: pods pending, running, preempted and replaced, ending."""
    snapshots = []
    t = 0.0
    pods: dict[str, dict[str, Any]] = {}
    end: tuple[str, float, str] | None = None
    for step in range(draw(st.integers(1, 10))):
        t += draw(st.floats(1, 30))
        action = draw(st.sampled_from(["new", "run", "preempt", "succeed", "delete", "end"]))
        name = f"p{draw(st.integers(0, 3))}"
        if action == "new" and name not in pods:
            pods[name] = pod(name, created=t)
        elif action == "run" and name in pods and pods[name]["status"]["phase"] == "Pending":
            pods[name] = pod(name, phase="Running", node=f"n-{name}", started=t, created=0)
        elif action == "preempt" and name in pods and pods[name]["status"]["phase"] == "Running":
            started = draw(st.just(pods[name]["status"]["containerStatuses"][0]["state"]["running"]["startedAt"]))
            began = (datetime.fromisoformat(started.replace("Z", "+00:00")) - T0).total_seconds() / 60
            pods[name] = pod(name, phase="Failed", started=began, finished=t, disrupted=t)
        elif action == "succeed" and name in pods and pods[name]["status"]["phase"] == "Running":
            started = pods[name]["status"]["containerStatuses"][0]["state"]["running"]["startedAt"]
            began = (datetime.fromisoformat(started.replace("Z", "+00:00")) - T0).total_seconds() / 60
            pods[name] = pod(name, phase="Succeeded", started=began, finished=t)
        elif action == "delete" and name in pods and pods[name]["status"]["phase"] in ("Succeeded", "Failed"):
            del pods[name]
        elif action == "end" and end is None:
            end = (draw(st.sampled_from(["Complete", "Failed"])), t, "done")
        conditions = (end,) if end else ()
        snapshots.append(RunObjects(RUN, pods=tuple(pods.values()), jobs=(job(*conditions),)))
        if end:
            break
    return snapshots


def observe(snapshots: list[RunObjects]) -> dict[str, Any]:
    """A controller watching these snapshots (its memory carried along): every fact it publishes."""
    published: dict[str, Any] = {}
    evicted_at = None
    for snapshot in snapshots:
        result = phases(RunObjects(snapshot.run_id, snapshot.pods, snapshot.jobs, snapshot.workloads, evicted_at=evicted_at))
        evicted_at = result.evicted_at
        for fact in new_facts(result.facts, set(published)):
            published[fact.event_id] = fact
    return published


@settings(max_examples=300, deadline=None)
@given(history=job_histories(), data=st.data())
def test_replicas_seeing_part_of_the_history_never_count_twice(history, data) -> None:  # type: ignore[no-untyped-def]
    """One controller sees every snapshot; another (a restart, a second replica) only some, always
    the last: together they publish one STORED, one STARTED and at most one end, and what the
    reconciler makes of the union is what it makes of the full view's, once the run has ended."""
    full = observe(history)
    seen = sorted(data.draw(st.sets(st.integers(0, len(history) - 1))) | {len(history) - 1})
    partial = observe([history[i] for i in seen])
    union = {**full, **partial}
    by_kind: dict[str, set[str]] = {}
    for fact in union.values():
        by_kind.setdefault(fact.kind, set()).add(fact.event_id)
    assert len(by_kind.get("STORED", ())) <= 1 and len(by_kind.get("STARTED", ())) <= 1
    assert len(by_kind.get("COMPLETED", set()) | by_kind.get("FAILED", set())) <= 1
    # Publishing what is already published adds nothing.
    assert new_facts(phases(history[-1]).facts, set(union)) == []

    def line(facts):  # type: ignore[no-untyped-def]
        return timeline([LifecycleFact(f.event_id, f.kind, f.at) for f in facts.values()], gpus=4, nodes=1)

    if history[-1].jobs and phases(history[-1]).finished:
        assert line(union).phase == line(full).phase == "ended"
        assert line(union).ended_at == line(full).ended_at


@settings(max_examples=200, deadline=None)
@given(history=job_histories(), data=st.data())
def test_the_facts_do_not_depend_on_the_order_objects_are_listed(history, data) -> None:  # type: ignore[no-untyped-def]
    last = history[-1]
    shuffled = RunObjects(RUN, pods=tuple(data.draw(st.permutations(last.pods))), jobs=last.jobs)
    assert sorted(f.event_id for f in phases(shuffled).facts) == sorted(f.event_id for f in phases(last).facts)
