"""Which fields make a resubmission of the same run id and attempt a different request."""

from __future__ import annotations

import json

from budgetgate.services.admission.resubmission import decided_afresh, differences
from budgetgate.services.admission.schemas import AdmissionRequest

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
