"""The run id as a label value: label-safe ids as they are, others hashed and taken back through
the annotation."""

from __future__ import annotations

import re

from hypothesis import given
from hypothesis import strategies as st

from budgetgate.platforms.run_labels import HASHED_PREFIX, RUN_ANNOTATION, RUN_LABEL, pod_run_id, run_id_of, run_label_value

LABEL = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")


@given(st.text(min_size=1, max_size=300))
def test_every_run_id_has_a_valid_label_value_that_leads_back_to_it(run_id: str) -> None:
    value = run_label_value(run_id)
    assert len(value) <= 63 and LABEL.match(value)
    assert run_id_of({RUN_LABEL: value}, {RUN_ANNOTATION: run_id}) == run_id


def test_a_uid_is_its_own_label_and_a_path_is_hashed() -> None:
    uid = "3c9a6f0e-2b7d-4c1e-9a8b-5d6e7f8a9b0c"
    assert run_label_value(uid) == uid
    assert run_id_of({RUN_LABEL: uid}) == uid
    path = "flyte/vision/prod/exec-1/n0"
    hashed = run_label_value(path)
    assert hashed.startswith(HASHED_PREFIX) and hashed != path
    assert run_id_of({RUN_LABEL: hashed}) is None  # no annotation: the label alone names no run
    assert run_id_of({RUN_LABEL: hashed}, {RUN_ANNOTATION: "another/run"}) is None
    assert pod_run_id({"metadata": {"labels": {RUN_LABEL: hashed}, "annotations": {RUN_ANNOTATION: path}}}) == path
    assert pod_run_id({"metadata": {}}) is None


def test_a_run_id_that_looks_hashed_is_hashed_itself() -> None:
    """Else `bg-…` given as a run id could stand for another run id's hash."""
    assert run_label_value("bg-abc") != "bg-abc"
