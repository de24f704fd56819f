"""Which fields make a resubmission of a run id a different request, and what a resend is to the
run's latest decision: replayed, decided afresh, or a conflict naming each change."""

from __future__ import annotations

import json

from budgetgate.services.admission.resubmission import Conflict, changes, decided_afresh, differences, resent
from budgetgate.contracts.admission import AdmissionRequest

BODY = {
    "run_id": "r", "attempt": 1, "namespace": "ns", "labels": {"team": "a", "env": "prod"},
    "resources": {"gpus": 8, "flavor": "h100"}, "projected_runtime_hours": 2.0,
}  # fmt: skip


def request(**overrides: object) -> AdmissionRequest:
    return AdmissionRequest.model_validate({**BODY, **overrides})


def test_the_same_request_differs_in_nothing_whatever_the_label_order_or_defaults() -> None:
    stored = json.dumps({**BODY, "labels": {"env": "prod", "team": "a"}, "resources": {"gpus": 8, "nodes": 1, "flavor": "h100"}})
    assert differences(stored, request()) == []


def test_each_changed_field_is_named() -> None:
    stored = request().model_dump(mode="json")
    changed = request(namespace="other", labels={"team": "b"}, resources={"gpus": 4, "flavor": "a100"}, projected_runtime_hours=3.0)
    assert differences(stored, changed) == ["namespace", "labels", "resources.gpus", "resources.flavor", "projected_runtime_hours"]


def test_only_a_higher_attempt_after_a_refusal_is_decided_afresh() -> None:
    assert decided_afresh("DENY", 1, 2) and decided_afresh("DELAY", 1, 3)
    assert not decided_afresh("ALLOW", 1, 2)
    assert not decided_afresh("DENY", 2, 2) and not decided_afresh("DELAY", 2, 1)


def prior(outcome: str, attempt: int = 1, **overrides: object) -> dict[str, object]:
    """A run's latest decision as admission reads it: its stored request, outcome and attempt."""
    return {"request": json.dumps(request(attempt=attempt, **overrides).model_dump(mode="json")), "outcome": outcome, "attempt": attempt}


def test_a_changed_request_after_an_allow_is_a_conflict_at_any_attempt_naming_old_and_new() -> None:
    admitted = prior("ALLOW", resources={"gpus": 1}, projected_runtime_hours=1.0)
    for attempt in (1, 2, 7):
        bigger = request(attempt=attempt, resources={"gpus": 500, "flavor": "a100"}, projected_runtime_hours=100.0)
        conflict = resent(admitted, bigger, tenant_label="team")
        assert isinstance(conflict, Conflict), (attempt, conflict)
        assert conflict.fields == ["resources.gpus", "resources.flavor", "projected_runtime_hours"] and conflict.next_attempt is None
        assert "resources.gpus: 1 → 500" in str(conflict) and "projected_runtime_hours: 1.0 → 100.0" in str(conflict)
        assert 'resources.flavor: none → "a100"' in str(conflict) and "under a new run id" in str(conflict)
        assert conflict.problem()["changes"][0] == {"field": "resources.gpus", "was": 1, "now": 500}
    # Unchanged, it is a resend: the stored answer, whatever the attempt.
    same = prior("ALLOW")
    assert resent(same, request(attempt=3), tenant_label="team") == "replay"


def test_each_changed_label_and_job_field_is_named_with_its_values() -> None:
    before = prior("ALLOW", job={"namespace": "ns", "name": "a"})
    after = request(labels={"team": "a", "env": "dev", "tier": "gold"}, job={"namespace": "ns", "name": "b"})
    conflict = resent(before, after, tenant_label="team")
    assert isinstance(conflict, Conflict) and conflict.fields == ["labels", "job"]
    assert [str(c) for c in changes(before["request"], after)] == ['labels.env: "prod" → "dev"', 'labels.tier: none → "gold"', 'job.name: "a" → "b"']


def test_after_a_refusal_a_higher_attempt_is_decided_afresh_changed_or_not_and_the_same_attempt_is_a_conflict() -> None:
    for outcome in ("DENY", "DELAY"):
        refused = prior(outcome, attempt=2, resources={"gpus": 64})
        assert resent(refused, request(attempt=3), tenant_label="team") == "decide"  # a new question: the refused run holds nothing
        assert resent(refused, request(attempt=3, resources={"gpus": 64}), tenant_label="team") == "decide"
        assert resent(refused, request(attempt=2, resources={"gpus": 64}), tenant_label="team") == "replay"
        for attempt in (1, 2):  # the attempt that was refused, or an older one, asking something else
            conflict = resent(refused, request(attempt=attempt), tenant_label="team")
            assert isinstance(conflict, Conflict) and conflict.next_attempt == 3 and "as attempt 3" in str(conflict), conflict
    assert resent(None, request(), tenant_label="team") == "decide"


def test_another_owner_is_a_conflict_that_shows_nothing_of_the_run() -> None:
    theirs = prior("ALLOW", namespace="nlp-prod", labels={"team": "nlp"}, resources={"gpus": 64})
    conflict = resent(theirs, request(attempt=2), tenant_label="team")
    assert isinstance(conflict, Conflict) and conflict.fields == ["namespace", "labels.team"] and conflict.next_attempt is None
    assert "nlp" not in str(conflict) and "64" not in str(conflict) and "changes" not in conflict.problem()
