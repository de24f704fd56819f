"""The webhooks' Kubernetes terms, without servers: answers whose status reason agrees with their
code and whose warnings fit the API's 120 characters; Kueue's queued objects left to Kueue (and
resumable only by a controller); run ids fixed once named; and the mutating webhook's JSON
patch, applied as the API server applies it (jsonpatch, RFC 6902), naming the run on the object
and on every pod template."""

from __future__ import annotations

import copy
from typing import Any

import jsonpatch
import pytest
from pydantic import ValidationError

from budgetgate.platforms.kubernetes import (
    STATUS_REASONS,
    Controlled,
    Queued,
    Refuse,
    Skip,
    Submit,
    decided,
    naming,
    priority_class_for,
    review,
    submission,
    templates,
)
from budgetgate.platforms.reviews import At, ask
from budgetgate.platforms.run_labels import RUN_LABEL, pod_run_id, run_label_value
from budgetgate.services.admission.routes.kubernetes import KubernetesWebhookSettings
from tests.support.kubernetes import admission_review, as_json, container, job, job_spec, jobset, pod, raycluster, rayjob

QUEUE = {"kueue.x-k8s.io/queue-name": "team-a"}


def test_every_denial_carries_the_status_reason_of_its_code() -> None:
    # metav1.StatusReason: each code has its reason; a 409 or 422 answered "Forbidden" told
    # kubectl and client-go the wrong thing.
    expected = {403: "Forbidden", 409: "Conflict", 422: "Invalid", 429: "TooManyRequests", 503: "ServiceUnavailable", 400: "BadRequest"}
    assert expected == STATUS_REASONS
    for code, reason in expected.items():
        status = review("u", allowed=False, code=code, message="no")["response"]["status"]
        assert (status["code"], status["reason"], status["message"]) == (code, reason, "no")
    assert review("u", allowed=False, message="no")["response"]["status"]["reason"] == "Forbidden"
    allowed = review("u", allowed=True, message="fine")["response"]
    assert allowed["status"] == {"code": 200, "message": "fine"}
    with pytest.raises(ValueError, match="a denial's code is one of .* got 418"):
        review("u", allowed=False, code=418, message="teapot")
    with pytest.raises(ValueError, match="an admission's code is 200, got 403"):
        review("u", allowed=True, code=403, message="?")


def test_warnings_fit_the_apis_120_characters() -> None:
    long = "budgetgate: " + "x" * 300
    (cut,) = review("u", allowed=True, warnings=[long])["response"]["warnings"]
    assert len(cut) == 120 and cut.endswith("...") and cut.startswith("budgetgate: xxx")
    answer = {
        "run_id": "r", "attempt": 1, "decision": "ALLOW", "reason": "admitted", "priority_penalty": 0.73, "preemptible": True,
        "evaluations": [{"policy_id": "p" * 200, "decision": "DENY", "enforcement": "dry-run"}],
    }  # fmt: skip
    warnings = decided("u", answer)["response"]["warnings"]
    assert len(warnings) == 3 and all(len(w) <= 120 for w in warnings), warnings
    assert "priority penalty 0.73" in warnings[0] and "preemptible" in warnings[1]


def test_a_delay_is_429_saying_when_and_sets_no_retry_after() -> None:
    answer = {
        "run_id": "r", "attempt": 2, "decision": "DELAY", "reason": "delayed: budget 'b' is used up until the window ends",
        "evaluations": [{"policy_id": "b", "decision": "DELAY", "next_eligible_time": "2026-12-01T00:00:00Z"}],
    }  # fmt: skip
    response = decided("u", answer)["response"]
    assert response["allowed"] is False and response["status"]["code"] == 429 and response["status"]["reason"] == "TooManyRequests"
    assert "retry at or after 2026-12-01T00:00:00Z" in response["status"]["message"] and "budgetgate.io/attempt=3" in response["status"]["message"]
    # client-go sleeps retryAfterSeconds inside the call: a delay of hours must not be one.
    assert "details" not in response["status"]
    # A quote gives the time at the top level.
    quoted = decided("u", {**answer, "evaluations": [], "next_eligible_time": "2026-12-02T00:00:00Z"}, dry_run=True)["response"]
    assert "retry at or after 2026-12-02T00:00:00Z" in quoted["status"]["message"]
    denied = decided("u", {**answer, "decision": "DENY"})["response"]["status"]
    assert (denied["code"], denied["reason"]) == (403, "Forbidden")


def _suspended(obj: dict[str, Any], labels: dict[str, str] | None = QUEUE) -> dict[str, Any]:
    changed = copy.deepcopy(obj)
    changed["metadata"]["labels"] = {**(changed["metadata"].get("labels") or {}), **(labels or {})}
    changed["spec"]["suspend"] = True
    return changed


def _kinds() -> dict[str, dict[str, Any]]:
    return {
        "Job": as_json(job(gpus=8, deadline=3600)),
        "JobSet": jobset("js", [(2, job_spec(gpus=1, deadline=3600))]),
        "RayJob": rayjob("rj", head_gpus=1, workers=[(1, 1, 1)], deadline=3600),
        "RayCluster": raycluster("rc", head_gpus=1, workers=[(1, 1, 1)], annotations={"budgetgate.io/projected-runtime-hours": "1"}),
    }


@pytest.mark.parametrize("kind", list(_kinds()))
def test_a_suspended_object_labelled_for_kueue_is_left_to_kueue_and_the_label_alone_passes_nothing(kind: str) -> None:
    obj = _kinds()[kind]
    queued = submission(admission_review(_suspended(obj)))
    assert isinstance(queued, Queued) and queued.queue == "team-a" and "left to Kueue" in queued.reason
    # Labelled but running at once: decided here, with a warning saying why.
    labelled = copy.deepcopy(obj)
    labelled["metadata"]["labels"] = {**labelled["metadata"]["labels"], **QUEUE}
    decided_here = submission(admission_review(labelled))
    assert isinstance(decided_here, Submit) and any("not suspended" in w for w in decided_here.warnings)
    # Suspended without the label: a run like any other.
    assert isinstance(submission(admission_review(_suspended(obj, labels={}))), Submit)


def test_a_bare_pod_labelled_for_kueue_is_decided() -> None:
    labelled = as_json(pod(containers=[container(gpus=1)], deadline=60, labels={"team": "vision", **QUEUE}))
    assert isinstance(submission(admission_review(labelled)), Submit)


def _update(old: dict[str, Any], change: Any) -> Any:
    new = copy.deepcopy(old)
    change(new)
    return submission(admission_review(new, operation="UPDATE", old=old))


def test_only_a_controller_resumes_what_kueue_queued_or_takes_it_out_of_the_queue() -> None:
    queued = _suspended(as_json(job(gpus=8, deadline=3600)))
    resumed = _update(queued, lambda o: o["spec"].update(suspend=False))
    assert isinstance(resumed, Controlled) and "only Kueue resumes it" in resumed.reason
    unqueued = _update(queued, lambda o: o["metadata"]["labels"].pop("kueue.x-k8s.io/queue-name"))
    assert isinstance(unqueued, Controlled) and "delete it and create it again without the label" in unqueued.reason
    # Moved to another queue, or reshaped while suspended: Kueue decides it when it admits it.
    assert isinstance(_update(queued, lambda o: o["metadata"]["labels"].update({"kueue.x-k8s.io/queue-name": "team-b"})), Skip)
    assert isinstance(_update(queued, lambda o: o["spec"].update(parallelism=4)), Skip)
    # Kueue suspending a running one (preemption) is anybody's; resuming it again is Kueue's.
    running = copy.deepcopy(queued)
    running["spec"]["suspend"] = False
    assert isinstance(_update(running, lambda o: o["spec"].update(suspend=True)), Skip)
    # Not queued: scaling up is refused whoever does it, as before.
    plain = as_json(job(gpus=8, deadline=3600))
    assert isinstance(_update(plain, lambda o: o["spec"].update(parallelism=2)), Refuse)
    assert isinstance(_update(plain, lambda o: o["spec"].update(suspend=True)), Skip)


def _named(obj: dict[str, Any], run_id: str) -> dict[str, Any]:
    asked = ask(admission_review(obj))
    return jsonpatch.apply_patch(obj, naming(asked, run_id))


@pytest.mark.parametrize("kind", list(_kinds()) + ["Pod"])
def test_the_run_id_label_is_the_controllers_once_named(kind: str) -> None:
    obj = _kinds()[kind] if kind != "Pod" else as_json(pod(containers=[container(gpus=1)], deadline=60))
    named = _named(obj, "run-1")

    def relabel(o: dict[str, Any]) -> None:
        o["metadata"]["labels"][RUN_LABEL] = "someone-elses-run"

    changed = _update(named, relabel)
    assert isinstance(changed, Controlled) and "may not change once created" in changed.reason and RUN_LABEL in changed.reason
    removed = _update(named, lambda o: o["metadata"]["annotations"].pop("budgetgate.io/run-id"))
    assert isinstance(removed, Controlled)
    added = _update(obj, lambda o: o["metadata"].setdefault("labels", {}).update({RUN_LABEL: "x"}))
    assert isinstance(added, Controlled)
    assert isinstance(_update(named, lambda o: o["metadata"]["labels"].update(color="blue")), Skip)
    if kind != "Pod":  # a pod template's label names the run its pods are metered to, too
        template_pointer = templates("", kind, At(named, ""))[-1][0]
        patch = [{"op": "replace", "path": f"{template_pointer}/metadata/labels/{RUN_LABEL.replace('/', '~1')}", "value": "other"}]
        retemplated = jsonpatch.apply_patch(named, patch)
        renamed = submission(admission_review(retemplated, operation="UPDATE", old=named))
        assert isinstance(renamed, Controlled) and "template" in renamed.reason


def _pod_templates(obj: dict[str, Any]) -> list[dict[str, Any]]:
    return [t.value for _pointer, t, pod_template in templates("", obj["kind"], At(obj, "")) if pod_template]


@pytest.mark.parametrize("kind", list(_kinds()))
@pytest.mark.parametrize("run_id", ["0b6f1c1e-8a53-4a43-9d0e-3f7c2b1a9e55", "flyte/vision/exec-9/n0"])
def test_naming_labels_the_object_and_every_pod_template(kind: str, run_id: str) -> None:
    obj = _kinds()[kind]
    named = _named(obj, run_id)
    assert named["metadata"]["annotations"]["budgetgate.io/run-id"] == run_id
    assert named["metadata"]["labels"][RUN_LABEL] == run_label_value(run_id) and named["metadata"]["labels"]["team"] == "vision"
    pods = _pod_templates(named)
    assert len(pods) == {"Job": 1, "JobSet": 1, "RayJob": 2, "RayCluster": 2}[kind]
    for template in pods:
        # What a pod made from the template says: the run, whole (through the annotation when hashed).
        assert pod_run_id(template) == run_id, template["metadata"]
        assert "priorityClassName" not in template["spec"]
    # Naming again changes nothing (a reinvoked webhook keeps what it set).
    assert naming(ask(admission_review(named)), run_id) == []
    # The validating webhook then decides under that run id.
    decided_as = submission(admission_review(named))
    assert isinstance(decided_as, Submit) and decided_as.request.run_id == run_id


def test_a_pod_is_labelled_and_its_priority_class_left_alone() -> None:
    obj = as_json(pod(containers=[container(gpus=1)], deadline=60))
    patch = naming(ask(admission_review(obj)), "run-7", priority_class="gpu-low", override_priority=True)
    named = jsonpatch.apply_patch(obj, patch)
    assert pod_run_id(named) == "run-7" and "priorityClassName" not in named["spec"]


def test_the_priority_class_goes_on_pod_templates_kept_where_set_unless_overridden() -> None:
    obj = jobset("js", [(1, job_spec(gpus=1, deadline=60)), (1, job_spec(gpus=2, deadline=60))])
    obj["spec"]["replicatedJobs"][1]["template"]["spec"]["template"]["spec"]["priorityClassName"] = "users-own"
    asked = ask(admission_review(obj))
    kept = jsonpatch.apply_patch(obj, naming(asked, "r", priority_class="gpu-low"))
    assert [t["spec"].get("priorityClassName") for t in _pod_templates(kept)] == ["gpu-low", "users-own"]
    replaced = jsonpatch.apply_patch(obj, naming(asked, "r", priority_class="gpu-low", override_priority=True))
    assert [t["spec"].get("priorityClassName") for t in _pod_templates(replaced)] == ["gpu-low", "gpu-low"]


def test_a_template_the_object_lacks_is_not_patched_into_existence() -> None:
    # An "add" below a missing member fails the whole request at the API server: absent
    # templates are left to the API's own validation.
    obj = {"apiVersion": "ray.io/v1", "kind": "RayCluster", "metadata": {"name": "rc", "namespace": "vision-prod", "labels": {}}, "spec": {}}
    patch = naming(ask(admission_review(obj)), "r", priority_class="c")
    assert jsonpatch.apply_patch(obj, patch)["metadata"]["labels"] == {RUN_LABEL: "r"}
    assert all(op["path"].startswith("/metadata/") for op in patch)


def test_priority_classes_by_penalty_band_and_fair_share() -> None:
    classes = {"0": "gpu-normal", "0.5": "gpu-low", "0.9": "gpu-last", "preemptible": "gpu-preemptible"}
    assert priority_class_for(classes, penalty=0.0, preemptible=False) == "gpu-normal"
    assert priority_class_for(classes, penalty=0.5, preemptible=False) == "gpu-low"
    assert priority_class_for(classes, penalty=0.89, preemptible=False) == "gpu-low"
    assert priority_class_for(classes, penalty=0.95, preemptible=False) == "gpu-last"
    assert priority_class_for(classes, penalty=0.1, preemptible=True) == "gpu-preemptible"
    assert priority_class_for({"0.5": "gpu-low"}, penalty=0.2, preemptible=True) is None
    assert priority_class_for({}, penalty=1.0, preemptible=True) is None


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ('{"low": "gpu-low"}', "neither a penalty bound from 0 to 1 nor 'preemptible'"),
        ('{"1.5": "gpu-low"}', "a penalty bound is from 0 to 1"),
        ('{"0": "GPU_Low"}', "is not a PriorityClass name"),
    ],
)
def test_priority_classes_are_checked_when_the_service_starts(monkeypatch: pytest.MonkeyPatch, value: str, says: str) -> None:
    monkeypatch.setenv("BUDGETGATE_KUBERNETES_PRIORITY_CLASSES", value)
    with pytest.raises(ValidationError, match=says):
        KubernetesWebhookSettings()


def test_kueues_controller_may_make_controlled_updates_and_tenants_may_not() -> None:
    settings = KubernetesWebhookSettings()
    assert settings.controls("system:serviceaccount:kueue-system:kueue-controller-manager")
    assert settings.controls("system:serviceaccount:jobset-system:jobset-controller-manager")
    assert not settings.controls("alice@example.com") and not settings.controls("system:serviceaccount:team-a:kueue-controller-manager")
