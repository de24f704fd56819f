"""Properties of decide(): it admits exactly when every hard charge fits, and all or nothing."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest
from hypothesis import given
from hypothesis import strategies as st

from budgetgate.core.eligibility import Held, Outlook
from budgetgate.core.evaluation import Charge, Plan, Reading, Resources, Submission, decide, fits, plan
from budgetgate.core.policy import BudgetPolicy, Enforcement, Limit, OnExhausted, PolicyBundle, Scope, Source
from budgetgate.core.units import Unit, hours_amount
from budgetgate.core.windows import WindowSpec, window_at

pytestmark = pytest.mark.property

AT = datetime(2026, 3, 10, 12, tzinfo=UTC)
BIG = 10**12

windows = st.one_of(
    st.builds(WindowSpec, calendar=st.sampled_from(["month", "week", "day"]), timezone=st.sampled_from(["UTC", "America/New_York", "Asia/Kolkata"])),
    st.builds(WindowSpec, rolling_days=st.integers(min_value=1, max_value=90)),
)


@st.composite
def charge_and_reading(draw: st.DrawFn, index: int) -> tuple[Charge, Reading]:
    limit = draw(st.integers(min_value=1, max_value=BIG))
    spec = draw(windows)
    policy = BudgetPolicy(
        id=f"p{index}",
        scope=Scope(namespaces=frozenset({f"ns-{index}"})),
        window=spec,
        limit=Limit(unit=Unit.GPU_HOURS, amount=limit),
        enforcement=draw(st.sampled_from(list(Enforcement))),
        on_exhausted=draw(st.sampled_from(list(OnExhausted))),
        source=Source(f"p{index}.yaml", 1),
    )
    amount = draw(st.integers(min_value=0, max_value=2 * limit))
    reading = Reading(
        limit=limit,
        reserved=draw(st.integers(min_value=0, max_value=2 * limit)),
        consumed=draw(st.integers(min_value=0, max_value=2 * limit)),
    )
    return Charge(policy, window_at(spec, AT), amount), reading


@st.composite
def plans(draw: st.DrawFn) -> tuple[Plan, dict[str, Reading], dict[str, Outlook]]:
    count = draw(st.integers(min_value=1, max_value=6))
    pairs = [draw(charge_and_reading(i)) for i in range(count)]
    submission = Submission(run_id="run", namespace="ns", labels={}, resources=Resources(gpus=1), runtime_hours=Decimal(1), at=AT)
    p = Plan(
        submission=submission,
        bundle_sha="sha",
        charges=tuple(c for c, _ in pairs),
        violations=(),
        projected_gpu=0,
        showback_micros=None,
        currency=None,
    )
    readings = {c.ledger_key: r for c, r in pairs}
    instants = st.datetimes(min_value=datetime(2026, 1, 1), max_value=datetime(2026, 9, 1), timezones=st.just(UTC))
    held = st.builds(Held, amount=st.integers(min_value=1, max_value=BIG), started=st.booleans(), start_deadline=instants, expected_end=instants)
    bucket = st.tuples(instants.map(lambda at: at.replace(minute=0, second=0, microsecond=0)), st.integers(min_value=1, max_value=BIG))
    outlooks = {c.ledger_key: Outlook(tuple(draw(st.lists(held, max_size=4))), tuple(draw(st.lists(bucket, max_size=4)))) for c, _ in pairs}
    return p, readings, outlooks


@given(case=plans())
def test_allow_iff_every_hard_charge_fits(case: tuple[Plan, dict[str, Reading], dict[str, Outlook]]) -> None:
    p, readings, releases = case
    decision = decide(p, readings, outlooks=releases)
    every_hard_fits = all(fits(c.amount, readings[c.ledger_key]) for c in p.charges if c.hard)
    assert (decision.outcome == "ALLOW") == every_hard_fits
    assert decision.admitted == every_hard_fits
    assert decision.reserves == every_hard_fits
    assert [e.policy_id for e in decision.evaluations] == [c.policy.id for c in p.charges]
    assert [e.projected for e in decision.evaluations] == [c.amount for c in p.charges]
    admitted = [e.admitted for e in decision.evaluations]
    if every_hard_fits:
        assert admitted == [c.amount for c in p.charges]
    else:
        assert admitted == [0] * len(p.charges)


@given(case=plans())
def test_blocked_outcome_follows_on_exhausted(case: tuple[Plan, dict[str, Reading], dict[str, Outlook]]) -> None:
    p, readings, releases = case
    decision = decide(p, readings, outlooks=releases)
    blocked = [c for c in p.charges if c.hard and not fits(c.amount, readings[c.ledger_key])]
    if not blocked:
        assert decision.outcome == "ALLOW"
        return
    can_wait = [c.policy.on_exhausted.delays and c.amount <= c.policy.limit.amount for c in blocked]
    expected = "DELAY" if all(can_wait) else "DENY"
    assert decision.outcome == expected
    assert decision.reason.startswith("delayed: " if expected == "DELAY" else "denied: ")
    for charge in blocked:
        assert repr(charge.policy.id) in decision.reason
    by_id = {e.policy_id: e for e in decision.evaluations}
    for charge in blocked:
        evaluation = by_id[charge.policy.id]
        reading = readings[charge.ledger_key]
        waits = charge.policy.on_exhausted.delays and charge.amount <= charge.policy.limit.amount
        assert evaluation.outcome == ("DELAY" if waits else "DENY")
        assert evaluation.deficit == charge.amount - reading.remaining > 0
        eligible = evaluation.next_eligible_time
        outlook = releases[charge.ledger_key]
        if charge.amount > charge.policy.limit.amount:
            assert eligible is None
        elif charge.policy.window.rolling_days is None:
            # A calendar window: the next window's start, or earlier only when runs that have not
            # started give back enough by their start deadlines. A run's end frees nothing.
            assert eligible is not None and AT <= eligible <= charge.window.end
            if eligible < charge.window.end:
                freed = sum(h.amount for h in outlook.holds if not h.started and max(h.start_deadline, AT) <= eligible)
                assert freed >= evaluation.deficit
        else:
            days = timedelta(days=charge.policy.window.rolling_days)
            assert eligible is not None and AT <= eligible
            freed = sum(h.amount for h in outlook.holds if not h.started and max(h.start_deadline, AT) <= eligible)
            freed += sum(used for bucket, used in outlook.buckets if bucket + days + timedelta(hours=1) <= eligible)
            freed += sum(h.amount for h in outlook.holds if h.started and max(h.expected_end, AT) + days <= eligible)
            everything_gone = eligible >= AT.replace(minute=0) + days + timedelta(hours=1)
            assert freed >= evaluation.deficit or everything_gone


@given(case=plans(), data=st.data())
def test_more_room_never_turns_an_admission_into_a_refusal(case: tuple[Plan, dict[str, Reading], dict[str, Outlook]], data: st.DataObject) -> None:
    p, readings, _ = case
    roomier = {key: replace(r, reserved=data.draw(st.integers(min_value=0, max_value=r.reserved))) for key, r in readings.items()}
    if decide(p, readings).outcome == "ALLOW":
        assert decide(p, roomier).outcome == "ALLOW"


@given(case=plans())
def test_soft_and_dry_run_readings_never_change_the_outcome(case: tuple[Plan, dict[str, Reading], dict[str, Outlook]]) -> None:
    p, readings, _ = case
    exhausted = {
        c.ledger_key: (Reading(limit=c.policy.limit.amount, reserved=BIG * 3, consumed=0) if not c.hard else readings[c.ledger_key]) for c in p.charges
    }
    assert decide(p, exhausted).outcome == decide(p, readings).outcome


# --- through plan(): real matching, real amounts --------------------------------------------------

gpu_hours = st.decimals(min_value=1, max_value=5000, places=2)


@given(
    gpus=st.integers(min_value=0, max_value=64),
    runtime=st.decimals(min_value=0, max_value=720, places=3),
    team_limit=gpu_hours,
    org_limit=gpu_hours,
    team_used=st.integers(min_value=0, max_value=2 * 5000 * 3_600_000),
    org_used=st.integers(min_value=0, max_value=2 * 5000 * 3_600_000),
    org_enforcement=st.sampled_from(list(Enforcement)),
)
def test_planned_submission_is_admitted_iff_its_hard_budgets_have_room(
    gpus: int,
    runtime: Decimal,
    team_limit: Decimal,
    org_limit: Decimal,
    team_used: int,
    org_used: int,
    org_enforcement: Enforcement,
) -> None:
    def policy(policy_id: str, scope: Scope, limit: Decimal, enforcement: Enforcement) -> BudgetPolicy:
        return BudgetPolicy(
            id=policy_id,
            scope=scope,
            window=WindowSpec(calendar="month"),
            limit=Limit(unit=Unit.GPU_HOURS, amount=int(limit * 3_600_000)),
            enforcement=enforcement,
            on_exhausted=OnExhausted.DELAY,
            source=Source("p.yaml", 1),
        )

    team = policy("team", Scope(namespaces=frozenset({"vision-prod"}), labels={"team": "vision"}), team_limit, Enforcement.HARD)
    org = policy("org", Scope(labels={"environment": "*"}), org_limit, org_enforcement)
    bundle = PolicyBundle(git_sha="sha", policies=(team, org))
    submission = Submission(
        run_id="run",
        namespace="vision-prod",
        labels={"team": "vision", "environment": "prod"},
        resources=Resources(gpus=gpus),
        runtime_hours=runtime,
        at=AT,
    )
    p = plan(bundle, submission)
    projected = hours_amount(gpus, runtime)
    assert [(c.policy.id, c.amount) for c in p.charges] == [("team", projected), ("org", projected)]
    readings = {
        p.charges[0].ledger_key: Reading(limit=team.limit.amount, reserved=0, consumed=team_used),
        p.charges[1].ledger_key: Reading(limit=org.limit.amount, reserved=org_used, consumed=0),
    }
    # A zero charge (a CPU-only run on a GPU budget) fits even an over-run budget.
    team_fits = projected == 0 or projected <= team.limit.amount - team_used
    org_fits = projected == 0 or projected <= org.limit.amount - org_used
    expected = team_fits and (org_fits or org_enforcement is not Enforcement.HARD)
    decision = decide(p, readings)
    assert decision.admitted == expected
    too_big = projected > team.limit.amount or (org_enforcement is Enforcement.HARD and projected > org.limit.amount and not org_fits)
    assert decision.outcome == ("ALLOW" if expected else "DENY" if too_big else "DELAY")
    assert sum(e.admitted for e in decision.evaluations) == (2 * projected if expected else 0)


@given(case=plans())
def test_the_evidence_marks_deciding_the_evaluation_admission_named(case: tuple[Plan, dict[str, Reading], dict[str, Outlook]]) -> None:
    from budgetgate.core.evaluation import deciding_index
    from budgetgate.decisions.rendering import decision_message
    from budgetgate.evidence.facet import decision_fields

    p, readings, releases = case
    decision = decide(p, readings, outlooks=releases)
    message = decision_message(plan=p, decision=decision, decision_id="d", decided_at=AT, job=None)
    assert message.HasField("deciding_evaluation")
    assert message.deciding_evaluation == deciding_index(decision)
    fields = decision_fields(message)
    assert [i for i, e in enumerate(fields["evaluations"]) if e["deciding"]] == [message.deciding_evaluation]
    assert fields["policy_id"] == decision.evaluations[message.deciding_evaluation].policy_id
