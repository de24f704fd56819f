"""Replay's guarantee without servers: whatever the ledger read, the readings recorded with a
decision (through JSON, as Postgres stores them) recompute to the very same decision and
answer; and a reading changed by one unit is seen."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from budgetgate.core.eligibility import Held, Outlook
from budgetgate.core.evaluation import fits
from budgetgate.core.loader import build_bundle, parse_text
from budgetgate.core.units import MILLI_PER_HOUR as H
from budgetgate.ledger.redis_ledger import ReserveResult
from budgetgate.decisions.deciding import conclude, prepare, readings_record, rebuilt_outlooks, rebuilt_result
from budgetgate.decisions.explain import amount_differences, differences
from budgetgate.decisions.rendering import response_body
from budgetgate.contracts.admission import AdmissionRequest
from tests.support.admission import budget_yaml, submission

AT = datetime(2026, 3, 10, 12, 30, tzinfo=UTC)
BUNDLE = build_bundle(
    [doc for i, text in enumerate([
        budget_yaml("team", limit="gpu_hours: 200"),
        budget_yaml("waiting", labels="{}", limit="gpu_hours: 300", on_exhausted="delay", window="{rolling_days: 7}"),
        budget_yaml("soft", labels="{}", namespace="vision-prod", limit="node_hours: 40", enforcement="soft"),
    ]) for doc in parse_text(text, f"p{i}.yaml")],
    git_sha="9" * 40,
)  # fmt: skip


def _decide(used: list[tuple[int, int]], holds: list[tuple[int, bool, int]], gpus: int):  # type: ignore[no-untyped-def]
    request = AdmissionRequest.model_validate(submission(labels={"team": "vision"}, resources={"gpus": gpus, "nodes": 1}, projected_runtime_hours=6.0))
    p = prepare(BUNDLE, request, AT)
    figures = tuple(used[: len(p.plan.charges)])
    hard_fit = all(fits(c.amount, _reading(c, r)) for c, r in zip(p.plan.charges, figures, strict=True) if c.hard)
    result = ReserveResult("RESERVED" if hard_fit else "REJECTED", readings=figures, counters=((0, 0, 0),))
    outlook = Outlook(holds=tuple(Held(a * H, started, AT + timedelta(hours=h), AT + timedelta(hours=h)) for a, started, h in holds))
    ahead = {c.ledger_key: outlook for c in p.plan.charges if not hard_fit}
    decision, view = conclude(p, result, ahead)
    body = response_body(plan=p.plan, decision=decision, decision_id="d", decided_at=AT, standing=view)
    return p, result, ahead, decision, body


def _reading(charge, figures):  # type: ignore[no-untyped-def]
    from budgetgate.core.evaluation import Reading

    return Reading(charge.policy.limit.amount, *figures)


used_figures = st.lists(st.tuples(st.integers(0, 400 * H), st.integers(0, 400 * H)), min_size=3, max_size=3)
held_runs = st.lists(st.tuples(st.integers(1, 100), st.booleans(), st.integers(0, 400)), max_size=5)


@settings(max_examples=150, deadline=None)
@given(used=used_figures, holds=held_runs, gpus=st.integers(0, 64))
def test_recorded_readings_recompute_to_the_same_decision(used, holds, gpus) -> None:  # type: ignore[no-untyped-def]
    p, result, ahead, decision, body = _decide(used, holds, gpus)
    stored = orjson.loads(orjson.dumps(readings_record(p, result, ahead, tenant_label="team")))
    again, view = conclude(p, rebuilt_result(stored), rebuilt_outlooks(stored))
    assert again == decision
    recomputed = response_body(plan=p.plan, decision=again, decision_id="d", decided_at=AT, standing=view)
    assert differences(orjson.loads(orjson.dumps(body)), orjson.loads(orjson.dumps(recomputed))) == []


@settings(max_examples=100, deadline=None)
@given(used=used_figures, gpus=st.integers(1, 64), which=st.integers(0, 2))
def test_one_unit_more_consumed_in_a_recorded_reading_is_a_difference(used, gpus, which) -> None:  # type: ignore[no-untyped-def]
    p, result, ahead, decision, _body = _decide(used, [], gpus)
    stored = orjson.loads(orjson.dumps(readings_record(p, result, ahead, tenant_label="team")))
    stored["ledger"][which]["consumed"] += 1
    try:
        again, _view = conclude(p, rebuilt_result(stored), rebuilt_outlooks(stored))
    except RuntimeError:
        return  # the reserving script's verdict no longer follows: a mismatch of its own
    amounts = {e.policy_id: [e.outcome, e.limit, e.projected, e.remaining, e.admitted, e.deficit] for e in decision.evaluations}
    assert amount_differences(amounts, again) != []
