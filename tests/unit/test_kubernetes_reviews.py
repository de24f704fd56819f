"""Malformed AdmissionReviews, without servers: a review that is not an admission.k8s.io/v1
AdmissionReview with a request uid cannot be answered as one (NotAReview: the webhook's 400), and
a field of the review or its object of another type than the API gives it is refused naming the
field and what it must be, never with Python's own exception text."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import pytest

from budgetgate.platforms.kubernetes import Mapping, Submit, Unmappable, decided, naming, submission
from budgetgate.platforms.reviews import NotAReview, ask, review_uid
from tests.support.kubernetes import admission_review, as_json, container, job, job_spec, jobset, pod, raycluster, rayjob

H100 = {"budgetgate.io/flavor": "h100", "budgetgate.io/run-id": "fuzzed", "budgetgate.io/attempt": "1"}
# What Python says when a value of the wrong type reaches code that expected another one.
PYTHON = ("object has no attribute", "unsupported operand", "NoneType", "not subscriptable", "not iterable", "invalid literal", "can't multiply",
          "not supported between", "object is not", "takes no", "argument must be", "must be real number", "Traceback")  # fmt: skip
ONLY_V1 = 'only admission.k8s.io/v1 AdmissionReviews are answered (the webhook configuration\'s admissionReviewVersions must be ["v1"])'
WRONG = [None, "abc", "", -1, 2.5, True, [], {}, ["x"], {"a": 1}]


def samples() -> dict[str, dict[str, Any]]:
    """One object of each kind the webhook admits, with every field budgetgate reads set."""
    return {
        "pod": as_json(pod(containers=[container(gpus=2), container("b", gpus=1, limits_only=False)],
                           init=[container("warm", gpus=1), container("proxy", gpus=1, sidecar=True)], deadline=3600, annotations=H100)),
        "job": as_json(job(gpus=2, parallelism=4, completions=8, pod_deadline=600, annotations=H100)),
        "jobset": jobset("js", [(2, job_spec(gpus=1, parallelism=2, deadline=3600))], annotations=H100),
        "rayjob": annotated(rayjob("rj", head_gpus=1, workers=[(1, 2, 1)], deadline=3600, autoscaling=True), H100),
        "raycluster": raycluster("rc", head_gpus=0, workers=[(2, 1, 1)], max_replicas=3, annotations={**H100, "budgetgate.io/projected-runtime-hours": "2"}),
    }  # fmt: skip


def annotated(obj: dict[str, Any], annotations: dict[str, str]) -> dict[str, Any]:
    obj["metadata"]["annotations"] = dict(annotations)
    return obj


def paths(value: Any, at: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """Every path into `value` (keys of objects, indexes of lists), the deepest last."""
    if isinstance(value, dict):
        for key, inner in value.items():
            yield from paths(inner, (*at, key))
    elif isinstance(value, list):
        for index, inner in enumerate(value):
            yield from paths(inner, (*at, index))
    if at:
        yield at


def replaced(review: dict[str, Any], path: tuple[Any, ...], value: Any) -> dict[str, Any]:
    changed = copy.deepcopy(review)
    node = changed
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return changed


def outcome(review: dict[str, Any]) -> object:
    """What the mapping makes of `review` (as the webhook asks it: also as a run of its own), and
    the mutating webhook's patch naming its run."""
    found: list[object] = []
    attempts = [lambda: submission(review, Mapping(), own_run=False), lambda: submission(review, Mapping(), own_run=True)]
    attempts.append(lambda: naming(ask(review), "fuzzed/run", Mapping(), priority_class="gpu-low"))
    for attempt in attempts:
        try:
            found.append(attempt())
        except Unmappable as refused:
            message = str(refused)
            assert message and not any(text in message for text in PYTHON), message
            found.append(refused)
    return found


@pytest.mark.parametrize("kind", list(samples()))
@pytest.mark.parametrize("operation", ["CREATE", "UPDATE"])
def test_every_field_of_every_shape_replaced_by_a_wrong_type_is_mapped_or_refused_in_words(kind: str, operation: str) -> None:
    obj = samples()[kind]
    review = admission_review(obj, operation=operation, old=obj if operation == "UPDATE" else None)
    assert isinstance(submission(review), Submit if operation == "CREATE" else object)
    tried = 0
    for path in paths(review["request"]):
        for value in WRONG:
            outcome(replaced(review, ("request", *path), value))  # raises anything but Unmappable, or says it in Python's words
            tried += 1
    assert tried > 300


@pytest.mark.parametrize(
    ("path", "value", "says"),
    [
        (("spec", "template", "spec", "containers", 0, "resources", "limits", "nvidia.com/gpu"), "abc",
         "spec.template.spec.containers[0].resources.limits['nvidia.com/gpu'] must be a whole number, got 'abc'"),
        (("spec", "template", "spec", "containers", 0, "resources", "limits", "nvidia.com/gpu"), True,
         "spec.template.spec.containers[0].resources.limits['nvidia.com/gpu'] must be a whole number, got true"),
        (("spec", "template", "spec", "containers"), "trainer", "spec.template.spec.containers must be a list, got 'trainer'"),
        (("spec", "template", "spec", "containers", 0), "trainer", "spec.template.spec.containers[0] must be an object, got 'trainer'"),
        (("spec", "template", "spec", "containers", 0, "resources"), ["gpu"], "spec.template.spec.containers[0].resources must be an object, got a list"),
        (("spec", "template", "spec", "containers", 0, "resources", "limits"), "8",
         "spec.template.spec.containers[0].resources.limits must be an object, got '8'"),
        (("spec", "parallelism"), "4", "spec.parallelism must be a whole number (0 or more), got '4'"),
        (("spec", "parallelism"), -1, "spec.parallelism must be a whole number (0 or more), got -1"),
        (("spec", "completions"), 2.5, "spec.completions must be a whole number (0 or more), got 2.5"),
        (("spec", "activeDeadlineSeconds"), "3600", "spec.activeDeadlineSeconds must be a whole number of seconds above 0, got '3600'"),
        (("spec", "activeDeadlineSeconds"), 0, "spec.activeDeadlineSeconds must be a whole number of seconds above 0, got 0"),
        (("spec", "template"), "pod", "spec.template must be an object, got 'pod'"),
        (("metadata",), "train", "metadata must be an object, got 'train'"),
        (("metadata", "labels"), ["team"], "metadata.labels must be an object of strings, got a list"),
        (("metadata", "labels", "team"), 5, "metadata.labels['team'] must be a string, got 5"),
        (("metadata", "annotations"), "flavor=h100", "metadata.annotations must be an object of strings, got 'flavor=h100'"),
        (("metadata", "annotations", "budgetgate.io/attempt"), 2, "metadata.annotations['budgetgate.io/attempt'] must be a string, got 2"),
        (("metadata", "annotations", "budgetgate.io/attempt"), "two", "metadata.annotations['budgetgate.io/attempt'] must be a whole number from 1, got 'two'"),
        (("metadata", "annotations", "budgetgate.io/projected-runtime-hours"), "long",
         "metadata.annotations['budgetgate.io/projected-runtime-hours'] must be a number of hours, got 'long'"),
        (("metadata", "uid"), 7, "metadata.uid must be a string, got 7"),
        (("metadata", "ownerReferences"), {"kind": "Job"}, "metadata.ownerReferences must be a list, got an object"),
        (("metadata", "ownerReferences"), [{"kind": "Job", "controller": "yes"}], "metadata.ownerReferences[0].controller must be true or false, got 'yes'"),
    ],
)  # fmt: skip
def test_a_wrong_field_is_named_with_what_it_must_be(path: tuple[Any, ...], value: Any, says: str) -> None:
    obj = as_json(job(gpus=8, parallelism=1, deadline=3600, annotations={"budgetgate.io/flavor": "h100"}))
    if path[-1] in ("budgetgate.io/attempt", "budgetgate.io/projected-runtime-hours"):
        obj["spec"].pop("activeDeadlineSeconds")
        obj["metadata"]["annotations"]["budgetgate.io/projected-runtime-hours"] = "2"
    with pytest.raises(Unmappable) as refused:
        submission(replaced(admission_review(obj), ("request", "object", *path), value))
    assert str(refused.value) == says


@pytest.mark.parametrize(
    ("path", "value", "says"),
    [
        (("kind",), "Job", "request.kind must be an object, got 'Job'"),
        (("kind", "kind"), 3, "request.kind.kind must be a string, got 3"),
        (("operation",), 1, "request.operation must be a string, got 1"),
        (("operation",), "MAKE", "request.operation must be one of CREATE, UPDATE, DELETE, CONNECT, got 'MAKE'"),
        (("namespace",), ["a"], "request.namespace must be a string, got a list"),
        (("userInfo",), "alice", "request.userInfo must be an object, got 'alice'"),
        (("dryRun",), "true", "request.dryRun must be true or false, got 'true'"),
        (("object",), None, "request.object is missing: a CREATE carries the object it creates"),
        (("object",), "job", "request.object must be an object, got 'job'"),
    ],
)
def test_a_wrong_field_of_the_request_is_named(path: tuple[Any, ...], value: Any, says: str) -> None:
    review = admission_review(job(gpus=8, parallelism=1, deadline=3600))
    with pytest.raises(Unmappable) as refused:
        submission(replaced(review, ("request", *path), value))
    assert str(refused.value) == says


def test_a_create_or_update_without_its_object_is_refused_and_a_delete_is_not_asked_for_one() -> None:
    obj = as_json(job(gpus=8, parallelism=1, deadline=3600))
    for operation in ("CREATE", "UPDATE"):
        review = admission_review(obj, operation=operation, old=obj)
        del review["request"]["object"]
        with pytest.raises(Unmappable, match=rf"request.object is missing: an? {operation} carries the object it"):
            submission(review)
    gone = admission_review(job(gpus=8, deadline=60), operation="DELETE", old=obj)
    gone["request"]["object"] = None
    assert "DELETE is not a submission" in submission(gone).reason  # type: ignore[union-attr]
    pod_update = admission_review(pod(containers=[container(gpus=1)], deadline=60), operation="UPDATE")
    pod_update["request"]["object"] = None
    with pytest.raises(Unmappable, match="request.object is missing"):
        submission(pod_update)


@pytest.mark.parametrize(
    ("body", "field", "says"),
    [
        ([], "body", "must be a JSON object"),
        ({"kind": "AdmissionReview", "request": {"uid": "u"}}, "apiVersion", f"{ONLY_V1}, got none"),
        ({"apiVersion": "admission.k8s.io/v1beta1", "kind": "AdmissionReview", "request": {"uid": "u"}}, "apiVersion",
         f"{ONLY_V1}, got 'admission.k8s.io/v1beta1'"),
        ({"apiVersion": "admission.k8s.io/v1", "kind": "Pod", "request": {"uid": "u"}}, "kind", "must be AdmissionReview, got 'Pod'"),
        ({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview"}, "request", "is missing"),
        ({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": "x"}, "request", "must be an object, got 'x'"),
        ({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {"uid": ""}}, "request.uid", "must be a non-empty string, got ''"),
        ({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {"uid": 5}}, "request.uid", "must be a non-empty string, got 5"),
    ],
)  # fmt: skip
def test_what_is_not_a_v1_review_with_a_uid_cannot_be_answered_as_one(body: Any, field: str, says: str) -> None:
    with pytest.raises(NotAReview) as refused:
        review_uid(body)
    assert (refused.value.field, str(refused.value)) == (field, says)
    assert review_uid(admission_review(job(gpus=1, deadline=60), uid="705ab4f5")) == "705ab4f5"


def test_a_dry_run_says_what_it_would_reserve_not_that_it_reserved() -> None:
    reason = "admitted: reserved on 1 budget; tightest is 'gpu-budget/team-vision-prod' with 452 GPU-hours of 500 GPU-hours left after this run"
    answer = {"run_id": "r", "attempt": 1, "decision": "ALLOW", "reason": reason, "evaluations": []}
    message = decided("u", answer, dry_run=True)["response"]["status"]["message"]
    assert message == (
        "budgetgate (dry run, nothing reserved): would be admitted: would reserve on 1 budget; "
        "tightest is 'gpu-budget/team-vision-prod' with 452 GPU-hours of 500 GPU-hours left after this run"
    )
    assert decided("u", answer)["response"]["status"]["message"] == f"budgetgate: {reason}"
    denied = decided("u", {**answer, "decision": "DENY", "reason": "denied: budget 'b' has 2 GPU-hours left"}, dry_run=True)["response"]
    assert (
        denied["allowed"] is False and denied["status"]["message"] == "budgetgate (dry run, nothing reserved): would be denied: budget 'b' has 2 GPU-hours left"
    )
