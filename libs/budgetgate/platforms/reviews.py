"""AdmissionReviews read and checked, without I/O.

- `review_uid`: the body must be an admission.k8s.io/v1 AdmissionReview with a request uid, or
  no AdmissionReview can answer it (`NotAReview`, the webhook's 400). The API server sends the
  version the webhook configuration's admissionReviewVersions names, and cannot read an answer
  of another version than it sent: only v1 is answered.
- `ask`: the request's fields of the types the API gives them.
- `At`: the JSON of an object read field by field, each field checked for the type the
  Kubernetes API gives it. A field of another type is an `Unmappable` naming it as a person
  writes it (`spec.template.spec.containers[0].resources.limits['nvidia.com/gpu']`), what it
  must be and what it was. An absent field, or a null, reads as the API's default (nothing, an
  empty object or list); only the fields budgetgate reads are checked.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any, NoReturn

ANSWERED_VERSION = "admission.k8s.io/v1"
OPERATIONS = ("CREATE", "UPDATE", "DELETE", "CONNECT")

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_LARGEST = 2**63 - 1  # Kubernetes' counts and durations are int32 or int64


class Unmappable(ValueError):
    """The object cannot be turned into a submission; the message says what to add or fix."""


def shown(value: Any) -> str:
    """A JSON value as a message shows it: strings quoted, objects and lists by their kind."""
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, list):
        return "a list"
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    text = repr(value) if isinstance(value, str) else json.dumps(value)
    return text if len(text) <= 80 else text[:77] + "..."


@dataclass(frozen=True)
class At:
    """A value of the object and where it is (`path`; "" for the object itself)."""

    value: Any
    path: str

    def fail(self, must: str) -> NoReturn:
        raise Unmappable(f"{self.path or 'the object'} {must}, got {shown(self.value)}")

    def field(self, name: str) -> At:
        """Member `name` of this object (None when absent)."""
        value = self.value.get(name) if isinstance(self.value, dict) else None
        if not self.path:
            return At(value, name)
        return At(value, f"{self.path}.{name}" if _NAME.match(name) else f"{self.path}[{name!r}]")

    def entry(self, key: str) -> At:
        """Entry `key` of this map (labels, annotations, resource lists), written `path['key']`."""
        return At(self.value.get(key) if isinstance(self.value, dict) else None, f"{self.path}[{key!r}]")

    def obj(self, name: str | None = None) -> At:
        """This value (or member `name`) as an object: absent or null is an empty one."""
        at = self.field(name) if name is not None else self
        if at.value is None:
            return At({}, at.path)
        if not isinstance(at.value, dict):
            at.fail("must be an object")
        return at

    def objects(self, name: str) -> list[At]:
        """Member `name` as a list of objects: absent or null is an empty list."""
        at = self.field(name)
        if at.value is None:
            return []
        if not isinstance(at.value, list):
            at.fail("must be a list")
        return [At(item, f"{at.path}[{i}]").obj() for i, item in enumerate(at.value)]

    def text(self, name: str) -> str | None:
        """Member `name` as a string, or None."""
        at = self.field(name)
        if at.value is not None and not isinstance(at.value, str):
            at.fail("must be a string")
        return at.value

    def flag(self, name: str) -> bool:
        """Member `name` as a boolean (absent: false)."""
        at = self.field(name)
        if at.value is not None and not isinstance(at.value, bool):
            at.fail("must be true or false")
        return bool(at.value)

    def count(self, name: str, default: int | None = None) -> int | None:
        """Member `name` as a whole number, 0 or more (absent: `default`)."""
        at = self.field(name)
        if at.value is None:
            return default
        if isinstance(at.value, bool) or not isinstance(at.value, int) or at.value < 0:
            at.fail("must be a whole number (0 or more)")
        if at.value > _LARGEST:
            at.fail(f"must be at most {_LARGEST}")
        return at.value

    def seconds(self, name: str) -> int | None:
        """Member `name` as a duration in whole seconds above 0 (absent: None)."""
        at = self.field(name)
        if at.value is None:
            return None
        if isinstance(at.value, bool) or not isinstance(at.value, int) or at.value <= 0:
            at.fail("must be a whole number of seconds above 0")
        if at.value > _LARGEST:
            at.fail(f"must be at most {_LARGEST} seconds")
        return at.value

    def strings(self, name: str) -> dict[str, str]:
        """Member `name` as a map of strings (labels, annotations): absent or null is empty."""
        at = self.field(name)
        if at.value is None:
            return {}
        if not isinstance(at.value, dict):
            at.fail("must be an object of strings")
        for key, value in at.value.items():
            if not isinstance(value, str):
                at.entry(key).fail("must be a string")
        return dict(at.value)

    def quantity(self) -> int:
        """This value as a count of an extended resource ("8" or 8): a whole number, as
        Kubernetes requires of them."""
        value = self.value
        if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= _LARGEST:
            return value
        if not isinstance(value, (str, float)):
            self.fail("must be a whole number")
        try:
            number = float(value)
        except ValueError:
            self.fail("must be a whole number")
        if not math.isfinite(number) or number < 0 or number != int(number) or number > _LARGEST:
            self.fail("must be a whole number")
        return int(number)


class NotAReview(ValueError):
    """The body is not an admission.k8s.io/v1 AdmissionReview with a request uid, so no
    AdmissionReview can answer it; `field` is the field at fault ("body" for the whole)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def review_uid(body: Any) -> str:
    """The request uid of an admission.k8s.io/v1 AdmissionReview; raises NotAReview."""
    if not isinstance(body, dict):
        raise NotAReview("body", "must be a JSON object")
    version = body.get("apiVersion")
    if version != ANSWERED_VERSION:
        raise NotAReview(
            "apiVersion",
            f'only {ANSWERED_VERSION} AdmissionReviews are answered (the webhook configuration\'s admissionReviewVersions must be ["v1"]), '
            f"got {shown(version)}",
        )
    if body.get("kind") != "AdmissionReview":
        raise NotAReview("kind", f"must be AdmissionReview, got {shown(body.get('kind'))}")
    if body.get("request") is None:
        raise NotAReview("request", "is missing")
    if not isinstance(body["request"], dict):
        raise NotAReview("request", f"must be an object, got {shown(body['request'])}")
    uid = body["request"].get("uid")
    if not isinstance(uid, str) or not uid:
        raise NotAReview("request.uid", f"must be a non-empty string, got {shown(uid)}")
    return uid


@dataclass(frozen=True)
class Asked:
    """What an AdmissionReview's request asks: the kind (its group, "" for the core group), the
    operation, the object (paths from its own root, `spec...`) and the object before an UPDATE
    (`request.oldObject...`), each None when not sent, and who asks."""

    group: str
    kind: str
    operation: str
    namespace: str
    name: str
    uid: str | None
    username: str
    dry_run: bool
    object: At | None
    old_object: At | None


def ask(review: Any) -> Asked:
    """The request of an AdmissionReview, its fields checked; raises Unmappable."""
    request = At(review.get("request") if isinstance(review, dict) else None, "request").obj()
    kind = request.obj("kind")
    operation = request.field("operation")
    if request.text("operation") not in OPERATIONS:
        operation.fail(f"must be one of {', '.join(OPERATIONS)}")
    created, before = request.field("object"), request.field("oldObject")
    obj = At(request.obj("object").value, "") if created.value is not None else None
    meta = obj.obj("metadata") if obj is not None else At({}, "metadata")
    return Asked(
        group=kind.text("group") or "",
        kind=kind.text("kind") or "",
        operation=operation.value,
        namespace=request.text("namespace") or meta.text("namespace") or "default",
        name=meta.text("name") or meta.text("generateName") or request.text("name") or "",
        uid=meta.text("uid"),
        username=request.obj("userInfo").text("username") or "",
        dry_run=request.flag("dryRun"),
        object=obj,
        old_object=request.obj("oldObject") if before.value is not None else None,
    )
