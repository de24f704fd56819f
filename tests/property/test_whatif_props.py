"""What-if simulation without servers: the same core decides, a lowered limit flips later
decisions, recorded ends free room, and a hard budget is never over-admitted."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta
from decimal import Decimal

from hypothesis import given, settings
from hypothesis import strategies as st

from budgetgate.core.evaluation import Resources, Submission, plan
from budgetgate.core.loader import build_bundle, parse_text
from budgetgate.core.units import MILLI_PER_HOUR as H
from budgetgate.core.whatif import Ended, Recorded, Start, simulate
from tests.support.admission import budget_yaml

AT = datetime(2026, 3, 10, 12, tzinfo=UTC)


def bundle(limit_hours: int, *, sha: str = "c" * 40):  # type: ignore[no-untyped-def]
    return build_bundle(parse_text(budget_yaml("team", limit=f"gpu_hours: {limit_hours}"), "b.yaml"), git_sha=sha)


def run(i: int, gpus: int, hours: str = "1", outcome: str = "ALLOW") -> Recorded:
    sub = Submission(
        run_id=f"r{i}",
        namespace="vision-prod",
        labels={"team": "vision"},
        resources=Resources(gpus=gpus),
        runtime_hours=Decimal(hours),
        at=AT + timedelta(minutes=i),
    )
    return Recorded(sub, outcome)


def test_a_lowered_limit_flips_the_later_decisions_and_reports_the_change() -> None:
    history = [run(1, 48), run(2, 48), run(3, 2)]  # all admitted under 100 GPU-hours
    same = simulate(bundle(100), start={}, decisions=history, ends=[])
    assert same.decisions == 3 and same.flips == [] and same.by_budget["team"].exhausted_at is None
    lower = simulate(bundle(50), start={}, decisions=history, ends=[])
    assert [(f.run_id, f.before, f.after) for f in lower.flips] == [("r2", "ALLOW", "DENY")]
    team = lower.by_budget["team"]
    assert (team.admitted_gpu_before, team.admitted_gpu_after) == (98 * H, 50 * H)
    assert team.exhausted_at == AT + timedelta(minutes=3)  # r3 took the last 2 GPU-hours


def test_exhaustion_is_the_first_decision_that_left_no_room() -> None:
    outcome = simulate(bundle(96), start={}, decisions=[run(1, 48), run(2, 48), run(3, 1)], ends=[])
    assert outcome.by_budget["team"].exhausted_at == AT + timedelta(minutes=2)
    assert [f.run_id for f in outcome.flips] == ["r3"]


def test_a_recorded_end_frees_what_the_run_did_not_use() -> None:
    history = [run(1, 48), run(3, 60)]
    held = simulate(bundle(100), start={}, decisions=history, ends=[])
    assert [f.run_id for f in held.flips] == ["r3"]  # 48 held, 60 does not fit
    ended = simulate(bundle(100), start={}, decisions=history, ends=[Ended("r1", AT + timedelta(minutes=2), 24 * H)])
    assert ended.flips == []  # r1 consumed 24 of its 48: 76 left


def test_the_start_reading_counts_and_ends_it_already_shows_do_not() -> None:
    charge = plan(bundle(100), run(1, 1).submission).charges[0]
    start = {charge.ledger_key: Start(reserved=60 * H, consumed=0, read_at=AT + timedelta(minutes=5))}
    holds = {"old": ({charge.ledger_key: 60 * H}, 60 * H)}
    # The old run gave its 60 back before the reading was taken: the 60 the reading shows are others'.
    outcome = simulate(bundle(100), start=start, decisions=[run(10, 48)], ends=[Ended("old", AT, 0, released=True)], holds=holds)
    assert [f.run_id for f in outcome.flips] == ["r10"]  # 40 left, 48 needed
    after = simulate(bundle(100), start=start, decisions=[run(10, 48)], ends=[Ended("old", AT + timedelta(minutes=7), 0, released=True)], holds=holds)
    assert after.flips == []  # released after the reading: 100 left


@settings(max_examples=200, deadline=None)
@given(limit=st.integers(1, 500), sizes=st.lists(st.integers(0, 64), min_size=1, max_size=40))
def test_a_hard_budget_is_never_over_admitted(limit: int, sizes: list[int]) -> None:
    history = [run(i, gpus) for i, gpus in enumerate(sizes)]
    outcome = simulate(bundle(limit), start={}, decisions=history, ends=[])
    team = outcome.by_budget["team"]
    assert team.admitted_gpu_after <= limit * H
    # Exactly the runs history admitted and the candidate refused (or the reverse) are flips.
    assert team.admitted_gpu_before == sum(sizes) * H
    assert all(f.before == "ALLOW" and f.after == "DENY" for f in outcome.flips)
    assert team.admitted_gpu_before - team.admitted_gpu_after == sum(sizes[int(f.run_id[1:])] for f in outcome.flips) * H


@settings(max_examples=100, deadline=None)
@given(limit=st.integers(1, 300), sizes=st.lists(st.integers(1, 64), min_size=1, max_size=30))
def test_history_decided_by_the_same_bundle_replays_without_flips(limit: int, sizes: list[int]) -> None:
    first = simulate(bundle(limit), start={}, decisions=[run(i, g) for i, g in enumerate(sizes)], ends=[])
    flipped = {f.run_id: f.after for f in first.flips}
    recorded = [run(i, g, outcome=flipped.get(f"r{i}", "ALLOW")) for i, g in enumerate(sizes)]
    again = simulate(bundle(limit), start={}, decisions=recorded, ends=[])
    assert again.flips == []


def retried(i: int, gpus: int, outcomes: list[str]) -> list[Recorded]:
    """Run r{i}'s attempts as history decided them, a minute apart."""
    first = run(i, gpus).submission
    return [Recorded(replace(first, attempt=n, at=first.at + timedelta(minutes=n - 1)), outcome) for n, outcome in enumerate(outcomes, 1)]


def test_a_run_history_admitted_on_a_later_attempt_counts_before_when_the_candidate_admitted_it_earlier() -> None:
    # History delayed attempt 1 and admitted attempt 2; the candidate admits attempt 1, and its
    # ALLOW stands for attempt 2. Both worlds admitted the run: no change in GPU-hours.
    outcome = simulate(bundle(100), start={}, decisions=retried(1, 10, ["DELAY", "ALLOW"]), ends=[])
    team = outcome.by_budget["team"]
    assert (team.admitted_gpu_before, team.admitted_gpu_after) == (10 * H, 10 * H)
    assert [(f.run_id, f.attempt, f.before, f.after) for f in outcome.flips] == [("r1", 1, "DELAY", "ALLOW")]


@settings(max_examples=100, deadline=None)
@given(
    limit=st.integers(1, 300),
    runs=st.lists(st.tuples(st.integers(1, 64), st.lists(st.sampled_from(["ALLOW", "DELAY", "DENY"]), min_size=1, max_size=4)), min_size=1, max_size=20),
)
def test_history_counts_each_run_it_admitted_once_whatever_the_candidate_did(limit: int, runs: list[tuple[int, list[str]]]) -> None:
    # History stops deciding a run at its ALLOW: later attempts replay it.
    histories = [outcomes[: outcomes.index("ALLOW") + 1] if "ALLOW" in outcomes else outcomes for _, outcomes in runs]
    decisions = sorted((r for i, ((gpus, _), h) in enumerate(zip(runs, histories, strict=True)) for r in retried(i, gpus, h)), key=lambda r: r.submission.at)
    outcome = simulate(bundle(limit), start={}, decisions=decisions, ends=[])
    assert outcome.by_budget["team"].admitted_gpu_before == sum(gpus for (gpus, _), h in zip(runs, histories, strict=True) if "ALLOW" in h) * H
