"""The run id as a Kubernetes label, so pods carry it where only labels travel (dcgm-exporter
exports pod labels, not annotations; Kueue's `podSetUpdates` write labels).

A label value is at most 63 characters of `[A-Za-z0-9._-]`, starting and ending alphanumeric, so
not every run id fits (a Flyte execution path holds `/`, an annotation may be long). The rule:
- a run id that is a valid label value is the label value itself (an object's UID always is);
- any other is `bg-` and the first 60 hex digits of its SHA-256, and the pod also carries the
  run id whole in the annotation `budgetgate.io/run-id`, from which a reader that has the pod
  (the lifecycle controller, the meter) takes it back (`run_id_of`).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from typing import Any

RUN_LABEL = "budgetgate.io/run-id"
RUN_ANNOTATION = "budgetgate.io/run-id"
HASHED_PREFIX = "bg-"
_LABEL_VALUE = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?")


def label_safe(value: str) -> bool:
    return bool(_LABEL_VALUE.fullmatch(value))


def run_label_value(run_id: str) -> str:
    """The label value that stands for `run_id` (itself when it is label-safe)."""
    if not run_id:
        raise ValueError("a run id is not empty")
    if label_safe(run_id) and not run_id.startswith(HASHED_PREFIX):
        return run_id
    return HASHED_PREFIX + hashlib.sha256(run_id.encode()).hexdigest()[:60]


def run_id_of(labels: Mapping[str, str] | None, annotations: Mapping[str, str] | None = None) -> str | None:
    """The run id a pod's labels (and annotations, for a hashed label) name, or None.

    A hashed label whose annotation is missing or does not hash to it names no run: a label
    cannot be trusted to say which run an unlabelled run id would be."""
    value = (labels or {}).get(RUN_LABEL)
    if not value:
        return None
    if not value.startswith(HASHED_PREFIX):
        return value
    whole = (annotations or {}).get(RUN_ANNOTATION)
    return whole if whole and run_label_value(whole) == value else None


def pod_run_id(pod: Mapping[str, Any]) -> str | None:
    meta = pod.get("metadata") or {}
    return run_id_of(meta.get("labels"), meta.get("annotations"))
