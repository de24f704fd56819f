"""Evaluation: which budgets a submission falls under, and the decision the ledger's readings give."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest

from budgetgate.core.evaluation import (
    Decision,
    Evaluation,
    Plan,
    Reading,
    Resources,
    Submission,
    UnknownFlavor,
    decide,
    deciding_index,
    describe,
    fits,
    ledger_key,
    eligible_at,
    plan,
)
from budgetgate.core.eligibility import Held, Outlook
from budgetgate.core.policy import (
    BudgetPolicy,
    Enforcement,
    Limit,
    OnExhausted,
    PolicyBundle,
    Rate,
    RateCard,
    Scope,
    Source,
)
from budgetgate.core.units import Unit, to_amount
from budgetgate.core.windows import WindowSpec, window_at

AT = datetime(2026, 3, 10, 12, tzinfo=UTC)
MONTH = WindowSpec(calendar="month")
MARCH = (datetime(2026, 3, 1, tzinfo=UTC), datetime(2026, 4, 1, tzinfo=UTC))
GPU_48 = 48 * 3_600_000  # 8 GPUs × 6 h
VISION_LABELS = {"team": "vision", "cost-center": "1042", "environment": "prod"}


def budget(
    policy_id: str,
    *,
    namespaces: tuple[str, ...] = (),
    labels: Mapping[str, str] | None = None,
    unit: Unit = Unit.GPU_HOURS,
    limit: str = "100",
    currency: str | None = None,
    enforcement: Enforcement = Enforcement.HARD,
    on_exhausted: OnExhausted = OnExhausted.DENY,
    window: WindowSpec = MONTH,
) -> BudgetPolicy:
    return BudgetPolicy(
        id=policy_id,
        scope=Scope(namespaces=frozenset(namespaces), labels=dict(labels or {})),
        window=window,
        limit=Limit(unit=unit, amount=to_amount(unit, limit), currency=currency),
        enforcement=enforcement,
        on_exhausted=on_exhausted,
        source=Source(f"{policy_id}.yaml", 1),
    )


RATES = RateCard(
    id="rates",
    currency="USD",
    rates=(Rate("h100", Decimal("3.933")), Rate("h100", Decimal("4.25"), region="eu-west-1")),
    source=Source("rates.yaml", 1),
)

TEAM = budget("team-vision", namespaces=("vision-prod",), labels={"team": "vision"}, limit="500")
COST_CENTER = budget("cc-1042", labels={"cost-center": "1042"}, unit=Unit.COST, limit="5000", currency="USD")
ORG = budget("org", labels={"environment": "*"}, limit="10000", window=WindowSpec(rolling_days=30))


def bundle(*policies: BudgetPolicy, rates: bool = True) -> PolicyBundle:
    return PolicyBundle(git_sha="f" * 40, policies=policies, rate_cards=(RATES,) if rates else ())


def submission(
    *,
    namespace: str = "vision-prod",
    labels: Mapping[str, str] | None = None,
    gpus: int = 8,
    nodes: int = 1,
    hours: str = "6",
    flavor: str | None = "h100",
    region: str | None = None,
    at: datetime = AT,
) -> Submission:
    return Submission(
        run_id="run-1",
        namespace=namespace,
        labels=dict(VISION_LABELS if labels is None else labels),
        resources=Resources(gpus=gpus, nodes=nodes, flavor=flavor, region=region),
        runtime_hours=Decimal(hours),
        at=at,
    )


def room(p: Plan, **remaining_by_policy: int) -> dict[str, Reading]:
    """Readings with plenty of room, except where a policy's remaining amount is given."""
    readings = {}
    for charge in p.charges:
        limit = charge.policy.limit.amount
        left = remaining_by_policy.get(charge.policy.id.replace("-", "_"), limit)
        readings[charge.ledger_key] = Reading(limit=limit, reserved=limit - left, consumed=0)
    return readings


def by_policy(decision: Decision) -> dict[str, Evaluation]:
    return {e.policy_id: e for e in decision.evaluations}


# --- matching -----------------------------------------------------------------------------------


def test_namespace_and_exact_labels_match() -> None:
    p = plan(bundle(TEAM), submission())
    assert [c.policy.id for c in p.charges] == ["team-vision"]
    assert p.violations == ()


def test_label_value_must_be_equal() -> None:
    p = plan(bundle(TEAM), submission(labels={"team": "nlp"}))
    assert p.charges == ()
    assert p.violations == ()


def test_other_namespace_does_not_match() -> None:
    p = plan(bundle(TEAM), submission(namespace="vision-research"))
    assert p.charges == () and p.violations == ()


def test_any_of_several_namespaces_matches() -> None:
    policy = budget("nlp", namespaces=("nlp-prod", "nlp-dev"), labels={"team": "nlp"})
    assert len(plan(bundle(policy), submission(namespace="nlp-dev", labels={"team": "nlp"})).charges) == 1
    assert len(plan(bundle(policy), submission(namespace="nlp-prod", labels={"team": "nlp"})).charges) == 1
    assert plan(bundle(policy), submission(namespace="nlp-test", labels={"team": "nlp"})).charges == ()


def test_star_means_present_with_any_value() -> None:
    p = plan(bundle(ORG), submission(labels={"environment": "anything-at-all"}))
    assert [c.policy.id for c in p.charges] == ["org"]
    assert plan(bundle(ORG), submission(labels={"environment": ""})).charges != ()
    assert plan(bundle(ORG), submission(labels={"team": "vision"})).charges == ()


def test_a_literal_star_on_the_submission_is_just_a_value() -> None:
    # "*" in the policy matches it like any value; a policy asking for "prod" does not.
    assert len(plan(bundle(ORG), submission(labels={"environment": "*"})).charges) == 1
    exact = budget("exact", labels={"environment": "prod"})
    assert plan(bundle(exact), submission(labels={"environment": "*"})).charges == ()


def test_missing_required_label_in_a_covered_namespace_is_a_violation() -> None:
    policy = budget("team-vision", namespaces=("vision-prod",), labels={"team": "vision", "cost-center": "*"})
    p = plan(bundle(policy), submission(labels={"environment": "prod"}))
    assert p.charges == ()
    assert [(v.policy.id, v.missing) for v in p.violations] == [("team-vision", ("cost-center", "team"))]


def test_violation_denies_without_ledger_readings() -> None:
    policy = budget("team-vision", namespaces=("vision-prod",), labels={"team": "vision", "cost-center": "*"})
    p = plan(bundle(policy), submission(labels={"team": "vision"}))
    decision = decide(p, None)
    assert decision.outcome == "DENY"
    assert not decision.admitted and not decision.reserves
    [evaluation] = decision.evaluations
    assert evaluation.missing_labels == ("cost-center",)
    assert evaluation.outcome == "DENY"
    assert evaluation.ledger_key is None and evaluation.remaining is None
    assert evaluation.admitted == 0
    assert "'team-vision'" in decision.reason
    assert "requires label cost-center" in decision.reason
    assert "'vision-prod'" in decision.reason
    assert "Add the missing labels" in decision.reason


def test_violation_reason_names_every_missing_label() -> None:
    policy = budget("strict", namespaces=("vision-prod",), labels={"team": "vision", "cost-center": "1042"})
    decision = decide(plan(bundle(policy), submission(labels={})), None)
    assert "requires labels cost-center, team" in decision.reason


def test_violation_denies_even_when_other_budgets_match() -> None:
    strict = budget("strict", namespaces=("vision-prod",), labels={"owner": "*"})
    p = plan(bundle(strict, TEAM), submission())
    assert [c.policy.id for c in p.charges] == ["team-vision"]
    decision = decide(p, None)
    assert decision.outcome == "DENY"
    assert all(e.admitted == 0 for e in decision.evaluations)
    assert by_policy(decision)["strict"].missing_labels == ("owner",)


def test_label_only_policies_do_not_violate_they_just_do_not_match() -> None:
    p = plan(bundle(COST_CENTER, ORG), submission(labels={"team": "vision"}))
    assert p.charges == () and p.violations == ()
    decision = decide(p, None)
    assert decision.outcome == "ALLOW"
    assert not decision.reserves
    assert "no budget policy covers namespace 'vision-prod'" in decision.reason


def test_wrong_label_value_in_covered_namespace_is_not_a_violation() -> None:
    p = plan(bundle(TEAM), submission(labels={"team": "nlp"}))
    assert p.violations == ()
    assert decide(p, None).outcome == "ALLOW"


# --- charges ------------------------------------------------------------------------------------


def test_a_run_under_three_policies_gets_three_charges() -> None:
    p = plan(bundle(TEAM, COST_CENTER, ORG), submission())
    assert [c.policy.id for c in p.charges] == ["team-vision", "cc-1042", "org"]
    amounts = {c.policy.id: c.amount for c in p.charges}
    assert amounts == {"team-vision": GPU_48, "cc-1042": 188_784_000, "org": GPU_48}
    assert len({c.ledger_key for c in p.charges}) == 3
    assert p.projected_gpu == GPU_48
    assert (p.showback_micros, p.currency) == (188_784_000, "USD")
    assert p.bundle_sha == "f" * 40


def test_charge_windows_and_ledger_keys() -> None:
    p = plan(bundle(TEAM, ORG), submission())
    team, org = p.charges
    assert (team.window.start, team.window.end) == MARCH
    assert team.ledger_key == "ns=vision-prod;team=vision|2026-03-01T00:00:00Z/2026-04-01T00:00:00Z|gpu_hours"
    assert org.ledger_key == "environment=*|rolling-30d|gpu_hours"
    assert team.ledger_key == ledger_key(TEAM, window_at(MONTH, AT))
    assert team.hard


def test_node_and_wall_hour_charges() -> None:
    nodes = budget("nodes", namespaces=("vision-prod",), unit=Unit.NODE_HOURS)
    wall = budget("wall", namespaces=("vision-prod",), unit=Unit.WALL_HOURS)
    p = plan(bundle(nodes, wall), submission(gpus=0, nodes=3, hours="2.5", flavor=None))
    assert {c.policy.id: c.amount for c in p.charges} == {"nodes": to_amount(Unit.NODE_HOURS, "7.5"), "wall": to_amount(Unit.WALL_HOURS, "2.5")}
    assert p.projected_gpu == 0


def test_region_rate_prices_the_cost_charge() -> None:
    p = plan(bundle(COST_CENTER), submission(region="eu-west-1"))
    assert p.charges[0].amount == 204_000_000  # 48 × 4.25


def test_unknown_flavor_when_a_cost_policy_applies() -> None:
    with pytest.raises(UnknownFlavor, match="'cc-1042'.*flavor 'b200'"):
        plan(bundle(COST_CENTER), submission(flavor="b200"))
    with pytest.raises(UnknownFlavor, match="in region 'ap-south-1'"):
        plan(bundle(COST_CENTER, rates=False), submission(region="ap-south-1"))


def test_cost_policy_needs_a_flavor() -> None:
    with pytest.raises(UnknownFlavor, match="must name a resources.flavor"):
        plan(bundle(COST_CENTER), submission(flavor=None))


def test_unknown_flavor_is_fine_when_no_cost_policy_applies() -> None:
    p = plan(bundle(TEAM, COST_CENTER), submission(flavor="b200", labels={"team": "vision"}))
    assert [c.policy.id for c in p.charges] == ["team-vision"]
    assert p.showback_micros is None and p.currency is None


def test_a_flavor_no_rate_card_prices_is_said_in_a_warning() -> None:
    """h200 for h100: admitted, and told why it has no showback cost (before, silently null)."""
    p = plan(bundle(TEAM), submission(flavor="h200", labels={"team": "vision"}))
    known = ", ".join(sorted({r.flavor for r in RATES.rates}))
    assert p.warnings == (f"no rate card prices flavor 'h200' (priced: {known}): showback_cost is null",)
    assert plan(bundle(TEAM), submission(labels={"team": "vision"})).warnings == ()  # priced
    assert plan(bundle(TEAM, rates=False), submission(flavor="h200", labels={"team": "vision"})).warnings == ()  # nothing is priced at all
    assert plan(bundle(TEAM), submission(flavor=None, labels={"team": "vision"})).warnings == ()


def test_a_rate_card_can_make_an_unknown_flavor_an_error() -> None:
    strict = PolicyBundle(git_sha="f" * 40, policies=(TEAM,), rate_cards=(dataclasses.replace(RATES, unknown_flavor="reject"),))
    with pytest.raises(UnknownFlavor, match="no rate card prices flavor 'h200'.*rejects unknown flavors"):
        plan(strict, submission(flavor="h200", labels={"team": "vision"}))
    assert plan(strict, submission(labels={"team": "vision"})).showback_micros is not None


# --- decisions ----------------------------------------------------------------------------------


def test_no_policy_allows_without_reserving() -> None:
    decision = decide(plan(bundle(), submission()), {})
    assert decision.outcome == "ALLOW" and decision.admitted
    assert decision.evaluations == ()
    assert not decision.reserves


def test_allow_reserves_the_projected_amount_on_every_key() -> None:
    p = plan(bundle(TEAM, COST_CENTER, ORG), submission())
    decision = decide(p, room(p))
    assert decision.outcome == "ALLOW" and decision.reserves
    assert [(e.policy_id, e.admitted, e.projected, e.outcome) for e in decision.evaluations] == [
        ("team-vision", GPU_48, GPU_48, "ALLOW"),
        ("cc-1042", 188_784_000, 188_784_000, "ALLOW"),
        ("org", GPU_48, GPU_48, "ALLOW"),
    ]
    team = decision.evaluations[0]
    assert team.policy_git_sha == "f" * 40
    assert team.scope_id == "ns=vision-prod;team=vision"
    assert (team.window_start, team.window_end) == MARCH
    assert team.limit == team.remaining == 500 * 3_600_000
    assert team.unit is Unit.GPU_HOURS
    assert team.enforcement is Enforcement.HARD
    assert team.on_exhausted == "deny"
    assert team.deficit is None and team.next_eligible_time is None


def test_exactly_the_remaining_amount_fits() -> None:
    p = plan(bundle(TEAM), submission())
    assert decide(p, room(p, team_vision=GPU_48)).outcome == "ALLOW"
    assert decide(p, room(p, team_vision=GPU_48 - 1)).outcome == "DENY"


def test_fits_is_remaining_after_reserved_and_consumed() -> None:
    assert fits(10, Reading(limit=100, reserved=50, consumed=40))
    assert not fits(11, Reading(limit=100, reserved=50, consumed=40))
    assert fits(0, Reading(limit=100, reserved=0, consumed=100))
    assert not fits(1, Reading(limit=100, reserved=0, consumed=120))
    assert Reading(limit=100, reserved=30, consumed=90).remaining == -20


@pytest.mark.parametrize(
    ("on_exhausted", "outcome"),
    [
        (OnExhausted.DENY, "DENY"),
        (OnExhausted.DELAY, "DELAY"),
        (OnExhausted.HOLD, "DELAY"),
        (OnExhausted.HOLD_AND_DRAIN, "DELAY"),
    ],
)
def test_hard_policy_without_room_blocks_by_on_exhausted(on_exhausted: OnExhausted, outcome: str) -> None:
    policy = budget("team", namespaces=("vision-prod",), on_exhausted=on_exhausted)
    p = plan(bundle(policy), submission())
    decision = decide(p, room(p, team=to_amount(Unit.GPU_HOURS, 2)))
    assert decision.outcome == outcome
    assert not decision.reserves and not decision.admitted
    [evaluation] = decision.evaluations
    assert evaluation.outcome == outcome
    assert evaluation.admitted == 0
    assert evaluation.deficit == GPU_48 - to_amount(Unit.GPU_HOURS, 2)


def test_any_deny_makes_the_decision_deny() -> None:
    deny = budget("deny", namespaces=("vision-prod",))
    delay = budget("delay", labels={"team": "vision"}, on_exhausted=OnExhausted.DELAY)
    p = plan(bundle(deny, delay), submission())
    assert decide(p, room(p, deny=0, delay=0)).outcome == "DENY"
    assert decide(p, room(p, delay=0)).outcome == "DELAY"
    assert decide(p, room(p, deny=0)).outcome == "DENY"
    both = decide(p, room(p, deny=0, delay=0))
    assert {e.policy_id: e.outcome for e in both.evaluations} == {"deny": "DENY", "delay": "DELAY"}


def test_all_or_nothing_when_one_budget_is_short() -> None:
    p = plan(bundle(TEAM, COST_CENTER, ORG), submission())
    decision = decide(p, room(p, org=0))
    assert decision.outcome == "DENY"
    assert [e.admitted for e in decision.evaluations] == [0, 0, 0]
    assert {e.policy_id: e.outcome for e in decision.evaluations} == {"team-vision": "ALLOW", "cc-1042": "ALLOW", "org": "DENY"}
    assert {e.policy_id: e.deficit for e in decision.evaluations} == {"team-vision": None, "cc-1042": None, "org": GPU_48}


@pytest.mark.parametrize("enforcement", [Enforcement.SOFT, Enforcement.DRY_RUN])
def test_soft_and_dry_run_never_block(enforcement: Enforcement) -> None:
    policy = budget("trial", namespaces=("vision-prod",), enforcement=enforcement)
    p = plan(bundle(policy), submission())
    decision = decide(p, room(p, trial=-to_amount(Unit.GPU_HOURS, 50)))
    assert decision.outcome == "ALLOW" and decision.reserves
    assert decision.evaluations[0].admitted == GPU_48
    assert not p.charges[0].hard


def test_dry_run_records_what_it_would_have_decided() -> None:
    dry_deny = budget("dry-deny", namespaces=("vision-prod",), enforcement=Enforcement.DRY_RUN)
    dry_delay = budget("dry-delay", labels={"team": "vision"}, enforcement=Enforcement.DRY_RUN, on_exhausted=OnExhausted.DELAY)
    soft = budget("soft", labels={"environment": "*"}, enforcement=Enforcement.SOFT)
    p = plan(bundle(dry_deny, dry_delay, soft), submission())
    decision = decide(p, room(p, dry_deny=0, dry_delay=0, soft=0))
    assert decision.outcome == "ALLOW"
    assert {e.policy_id: e.outcome for e in decision.evaluations} == {"dry-deny": "DENY", "dry-delay": "DELAY", "soft": "ALLOW"}


def test_dry_run_over_its_limit_next_to_a_blocking_hard_policy() -> None:
    hard = budget("hard", namespaces=("vision-prod",))
    dry = budget("dry", labels={"team": "vision"}, enforcement=Enforcement.DRY_RUN, on_exhausted=OnExhausted.DELAY)
    p = plan(bundle(hard, dry), submission())
    decision = decide(p, room(p, hard=0, dry=GPU_48 - 10))
    assert decision.outcome == "DENY"
    assert by_policy(decision)["dry"].outcome == "DELAY"
    assert by_policy(decision)["dry"].deficit == 10
    assert "'dry'" not in decision.reason  # only blocking budgets explain the answer


def test_soft_policy_alone_never_changes_a_denial_into_delay() -> None:
    hard = budget("hard", namespaces=("vision-prod",), on_exhausted=OnExhausted.DELAY)
    soft = budget("soft", labels={"team": "vision"}, enforcement=Enforcement.SOFT, on_exhausted=OnExhausted.DENY)
    p = plan(bundle(hard, soft), submission())
    assert decide(p, room(p, hard=0, soft=0)).outcome == "DELAY"


def test_deficit_counts_overconsumption() -> None:
    p = plan(bundle(TEAM), submission())
    key = p.charges[0].ledger_key
    limit = TEAM.limit.amount
    decision = decide(p, {key: Reading(limit=limit, reserved=0, consumed=limit + 1000)})
    assert decision.evaluations[0].remaining == -1000
    assert decision.evaluations[0].deficit == GPU_48 + 1000


# --- next eligible time -------------------------------------------------------------------------


def delayed(policy: BudgetPolicy, remaining: int, outlook: Outlook | None = None, **kwargs: object) -> Decision:
    p = plan(bundle(policy), submission(**kwargs))  # type: ignore[arg-type]
    key = p.charges[0].ledger_key
    limit = policy.limit.amount
    return decide(p, {key: Reading(limit=limit, reserved=limit - remaining, consumed=0)}, outlooks={key: outlook or Outlook()})


def running(amount: int, *, ends: datetime) -> Held:
    return Held(amount, started=True, start_deadline=AT - timedelta(hours=1), expected_end=ends)


def unstarted(amount: int, *, deadline: datetime) -> Held:
    return Held(amount, started=False, start_deadline=deadline, expected_end=deadline + timedelta(hours=6))


WAITING = budget("waiting", namespaces=("vision-prod",), on_exhausted=OnExhausted.DELAY)
ROLLING = budget("rolling", namespaces=("vision-prod",), on_exhausted=OnExhausted.DELAY, window=WindowSpec(rolling_days=7))
GPU_H = 3_600_000


def test_the_issue_repro_a_running_reservation_ending_frees_nothing() -> None:
    # 10 GPU-hours, one 6-hour run admitted: a second 1 GPU × 6 h run must wait for the next
    # window, not for the first run's end (its reservation then becomes consumption).
    ten = budget("ten", namespaces=("vision-prod",), limit="10", on_exhausted=OnExhausted.DELAY)
    first = running(6 * GPU_H, ends=AT + timedelta(hours=6))
    decision = delayed(ten, remaining=4 * GPU_H, outlook=Outlook(holds=(first,)), gpus=1)
    assert decision.outcome == "DELAY"
    assert decision.evaluations[0].next_eligible_time == MARCH[1]


def test_next_eligible_is_the_next_window_start_without_releases() -> None:
    decision = delayed(WAITING, remaining=0)
    assert decision.evaluations[0].next_eligible_time == MARCH[1]
    assert "Resubmit at or after 2026-04-01T00:00:00Z" in decision.reason


def test_unstarted_runs_give_their_reservation_back_at_their_start_deadline() -> None:
    soon, later, latest = AT + timedelta(hours=1), AT + timedelta(hours=2), AT + timedelta(hours=3)
    # 20 GPU-hours free; needs 28 more: the first unstarted run frees 10, the second 20 → `later`.
    holds = (unstarted(GPU_48, deadline=latest), unstarted(10 * GPU_H, deadline=soon), unstarted(20 * GPU_H, deadline=later), running(GPU_48, ends=soon))
    decision = delayed(WAITING, remaining=20 * GPU_H, outlook=Outlook(holds=holds))
    assert decision.evaluations[0].deficit == 28 * GPU_H
    assert decision.evaluations[0].next_eligible_time == later


def test_a_start_deadline_already_passed_counts_from_now() -> None:
    decision = delayed(WAITING, remaining=0, outlook=Outlook(holds=(unstarted(GPU_48, deadline=AT - timedelta(minutes=5)),)))
    assert decision.evaluations[0].next_eligible_time == AT


def test_release_that_frees_exactly_the_deficit_is_enough() -> None:
    soon = AT + timedelta(minutes=5)
    decision = delayed(WAITING, remaining=GPU_48 - 7, outlook=Outlook(holds=(unstarted(7, deadline=soon),)))
    assert decision.evaluations[0].next_eligible_time == soon


def test_releases_that_do_not_free_enough_fall_back_to_the_next_window() -> None:
    decision = delayed(WAITING, remaining=0, outlook=Outlook(holds=(unstarted(GPU_48 - 1, deadline=AT + timedelta(hours=1)),)))
    assert decision.evaluations[0].next_eligible_time == MARCH[1]


def test_releases_after_the_window_end_do_not_count() -> None:
    decision = delayed(WAITING, remaining=0, outlook=Outlook(holds=(unstarted(GPU_48, deadline=MARCH[1] + timedelta(days=3)),)))
    assert decision.evaluations[0].next_eligible_time == MARCH[1]


def test_a_run_larger_than_a_delaying_budget_is_denied_not_delayed() -> None:
    # Waiting can never make it fit, so DELAY would have the platform retry forever.
    small = budget("small", namespaces=("vision-prod",), limit="40", on_exhausted=OnExhausted.DELAY)
    decision = delayed(small, remaining=to_amount(Unit.GPU_HOURS, 40), outlook=Outlook(holds=(unstarted(GPU_48, deadline=AT),)))
    assert decision.outcome == "DENY"
    assert decision.evaluations[0].next_eligible_time is None
    assert "larger than the whole budget" in decision.reason


def test_run_exactly_the_size_of_the_limit_can_wait() -> None:
    exact = budget("exact", namespaces=("vision-prod",), limit="48", on_exhausted=OnExhausted.DELAY)
    assert delayed(exact, remaining=0).evaluations[0].next_eligible_time == MARCH[1]


def test_rolling_window_waits_for_recorded_usage_to_age_out_hour_by_hour() -> None:
    # 100 GPU-hours over 7 days, all used: 30 in the 09:00 bucket three days ago, 70 at 10:00.
    # The run needs 48, so the 10:00 bucket must be gone too: 7 days after it ends.
    three_days_ago = AT - timedelta(days=3)
    buckets = ((three_days_ago.replace(hour=9), 30 * GPU_H), (three_days_ago.replace(hour=10), 70 * GPU_H))
    decision = delayed(ROLLING, remaining=0, outlook=Outlook(buckets=buckets))
    assert decision.evaluations[0].next_eligible_time == three_days_ago.replace(hour=11) + timedelta(days=7)
    # Needing only 30 (18 free already), the older bucket is enough.
    decision = delayed(ROLLING, remaining=18 * GPU_H, outlook=Outlook(buckets=buckets))
    assert decision.evaluations[0].next_eligible_time == three_days_ago.replace(hour=10) + timedelta(days=7)


def test_rolling_window_ages_a_running_reservation_out_after_its_expected_end() -> None:
    ends = AT + timedelta(hours=5, minutes=30)
    decision = delayed(ROLLING, remaining=0, outlook=Outlook(holds=(running(100 * GPU_H, ends=ends),)))
    assert decision.evaluations[0].next_eligible_time == AT + timedelta(hours=6) + timedelta(days=7)


def test_rolling_window_uses_an_earlier_start_deadline() -> None:
    soon = AT + timedelta(hours=2)
    decision = delayed(ROLLING, remaining=0, outlook=Outlook(holds=(unstarted(GPU_48, deadline=soon), running(52 * GPU_H, ends=AT))))
    assert decision.evaluations[0].next_eligible_time == soon


def test_rolling_window_without_an_outlook_waits_a_whole_window_past_this_hour() -> None:
    decision = delayed(ROLLING, remaining=0)
    assert decision.evaluations[0].next_eligible_time == AT + timedelta(days=7, hours=1)


def test_eligible_at_helper_directly() -> None:
    p = plan(bundle(WAITING), submission())
    charge = p.charges[0]
    reading = Reading(limit=WAITING.limit.amount, reserved=WAITING.limit.amount, consumed=0)
    assert eligible_at(charge, reading, Outlook(), AT) == MARCH[1]
    assert eligible_at(charge, reading, Outlook(holds=(unstarted(GPU_48, deadline=AT + timedelta(hours=1)),)), AT) == AT + timedelta(hours=1)
    assert eligible_at(charge, reading, Outlook(holds=(running(GPU_48, ends=AT + timedelta(hours=1)),)), AT) == MARCH[1]


def test_delay_waits_for_the_latest_of_the_blocked_budgets() -> None:
    monthly = budget("monthly", namespaces=("vision-prod",), on_exhausted=OnExhausted.DELAY)
    weekly = budget("weekly", labels={"team": "vision"}, on_exhausted=OnExhausted.DELAY, window=WindowSpec(calendar="week"))
    p = plan(bundle(monthly, weekly), submission())
    decision = decide(p, room(p, monthly=0, weekly=0))
    times = {e.policy_id: e.next_eligible_time for e in decision.evaluations}
    assert times == {"monthly": MARCH[1], "weekly": datetime(2026, 3, 16, tzinfo=UTC)}
    assert "Resubmit at or after 2026-04-01T00:00:00Z" in decision.reason


def test_one_blocked_budget_that_can_never_fit_turns_delay_into_deny() -> None:
    monthly = budget("monthly", namespaces=("vision-prod",), on_exhausted=OnExhausted.DELAY)
    tiny = budget("tiny", labels={"team": "vision"}, limit="10", on_exhausted=OnExhausted.DELAY)
    p = plan(bundle(monthly, tiny), submission())
    decision = decide(p, room(p, monthly=0, tiny=0))
    assert decision.outcome == "DENY"
    assert by_policy(decision)["monthly"].outcome == "DELAY" and by_policy(decision)["tiny"].outcome == "DENY"
    assert by_policy(decision)["tiny"].next_eligible_time is None
    assert "Resubmit at or after" not in decision.reason
    assert "larger than the whole budget" in decision.reason


# --- reasons ------------------------------------------------------------------------------------


def test_allow_reason_names_the_tightest_budget_and_what_is_left() -> None:
    p = plan(bundle(TEAM, ORG), submission())
    decision = decide(p, room(p, team_vision=to_amount(Unit.GPU_HOURS, 100)))
    assert decision.reason == "admitted: reserved on 2 budgets; tightest is 'team-vision' with 52 GPU-hours of 500 GPU-hours left after this run"


def test_allow_reason_for_one_cost_budget() -> None:
    p = plan(bundle(COST_CENTER), submission())
    decision = decide(p, room(p))
    assert decision.reason == "admitted: reserved on 1 budget; tightest is 'cc-1042' with 4,811.22 USD of 5,000.00 USD left after this run"


def test_deny_reason_names_policy_scope_window_numbers_and_what_to_do() -> None:
    p = plan(bundle(TEAM), submission())
    decision = decide(p, room(p, team_vision=to_amount(Unit.GPU_HOURS, "12.5")))
    assert decision.reason == (
        "denied: budget 'team-vision' (scope ns=vision-prod;team=vision, window 2026-03-01T00:00:00Z to 2026-04-01T00:00:00Z) "
        "has 12.5 GPU-hours of 500 GPU-hours left and this run needs 48 GPU-hours (short by 35.5 GPU-hours). "
        "Reduce the request, wait for the window to reset, or ask the budget owner to raise the limit."
    )


def test_deny_reason_for_an_overspent_cost_budget() -> None:
    p = plan(bundle(COST_CENTER), submission())
    key = p.charges[0].ledger_key
    decision = decide(p, {key: Reading(limit=COST_CENTER.limit.amount, reserved=0, consumed=to_amount(Unit.COST, "5100"))})
    assert "has 0.00 USD of 5,000.00 USD left" in decision.reason
    assert "this run needs 188.78 USD (short by 288.78 USD)" in decision.reason


def test_delay_reason_names_the_blocking_budgets() -> None:
    monthly = budget("monthly", namespaces=("vision-prod",), on_exhausted=OnExhausted.DELAY)
    weekly = budget("weekly", labels={"team": "vision"}, on_exhausted=OnExhausted.HOLD, window=WindowSpec(calendar="week"))
    p = plan(bundle(monthly, weekly), submission())
    decision = decide(p, room(p, monthly=0))
    assert decision.reason.startswith("delayed: budget 'monthly'")
    assert "'weekly'" not in decision.reason


@pytest.mark.parametrize(
    ("unit", "amount", "currency", "text"),
    [
        (Unit.GPU_HOURS, GPU_48, None, "48 GPU-hours"),
        (Unit.GPU_HOURS, 1_800_000, None, "0.5 GPU-hours"),
        (Unit.GPU_HOURS, to_amount(Unit.GPU_HOURS, 1234), None, "1,234 GPU-hours"),
        (Unit.GPU_HOURS, 0, None, "0 GPU-hours"),
        (Unit.NODE_HOURS, to_amount(Unit.NODE_HOURS, "12.25"), None, "12.25 node-hours"),
        (Unit.WALL_HOURS, to_amount(Unit.WALL_HOURS, 100), None, "100 wall-hours"),
        (Unit.COST, 188_784_000, "USD", "188.78 USD"),
        (Unit.COST, 5_000_000_000, "EUR", "5,000.00 EUR"),
        (Unit.COST, 5_000, None, "0.01"),
    ],
)
def test_describe(unit: Unit, amount: int, currency: str | None, text: str) -> None:
    assert describe(unit, amount, currency) == text


def test_a_run_too_small_for_the_unit_cannot_slip_through_an_exhausted_budget() -> None:
    p = plan(bundle(TEAM), submission(gpus=1, hours="0.000000001"))
    [charge] = p.charges
    assert charge.amount == 1 and p.projected_gpu == 1
    decision = decide(p, {charge.ledger_key: Reading(limit=TEAM.limit.amount, reserved=TEAM.limit.amount, consumed=0)})
    assert decision.outcome == "DENY"


def test_cpu_only_work_charges_nothing_on_gpu_budgets_and_is_never_blocked_by_them() -> None:
    nodes = budget("nodes", namespaces=("vision-prod",), unit=Unit.NODE_HOURS, limit="10")
    p = plan(bundle(TEAM, nodes), submission(gpus=0, nodes=2, hours="3"))
    amounts = {c.policy.id: c.amount for c in p.charges}
    assert amounts == {"team-vision": 0, "nodes": 6 * 3_600_000}
    over_run = {
        c.ledger_key: Reading(limit=c.policy.limit.amount, reserved=0, consumed=c.policy.limit.amount + (5 if c.policy.id == "team-vision" else 0))
        for c in p.charges
    }
    over_run[p.charges[1].ledger_key] = Reading(limit=nodes.limit.amount, reserved=0, consumed=0)
    decision = decide(p, over_run)
    assert decision.outcome == "ALLOW"


def test_amounts_beyond_the_ledger_range_are_refused_at_planning() -> None:
    # A year of a million GPUs is 3.2e16 milli-GPU-seconds, past the ledger's 2**53 - 1; a cost
    # passes it far sooner (micro-units at a high rate). Every amount is bounded where the plan
    # makes it, so none reaches Lua or Postgres.
    from budgetgate.core.ledger_key import MAX_AMOUNT, AmountOutOfRange

    with pytest.raises(AmountOutOfRange, match=r"projected GPU-hours .* beyond the ledger's range"):
        plan(bundle(TEAM), submission(gpus=1_000_000, hours="8784"))
    pricey = RateCard(id="rates", currency="USD", rates=(Rate("h100", Decimal("1000000")),), source=Source("rates.yaml", 1))
    costly = PolicyBundle(git_sha="f" * 40, policies=(COST_CENTER,), rate_cards=(pricey,))
    with pytest.raises(AmountOutOfRange, match="projected cost in micro-units"):
        plan(costly, submission(gpus=1_000, hours="1000"))
    nodes = budget("nodes", labels={"team": "vision"}, unit=Unit.NODE_HOURS, limit="100")
    with pytest.raises(AmountOutOfRange, match="projected node-hours"):
        plan(bundle(nodes), submission(gpus=0, nodes=1_000_000, hours="8784"))  # past what the API takes: the core bounds it too
    # Just inside: planned as usual.
    hours = Decimal(MAX_AMOUNT) / (1_000_000 * 3_600_000)
    inside = submission(gpus=1_000_000, hours=str(hours.quantize(Decimal("0.001"), rounding="ROUND_DOWN")), flavor=None)
    assert plan(bundle(TEAM), inside).projected_gpu <= MAX_AMOUNT


# --- soft and dry-run policies never block, whatever the submission lacks -----------------------

NOT_HARD = [Enforcement.SOFT, Enforcement.DRY_RUN]


@pytest.mark.parametrize("enforcement", NOT_HARD)
def test_missing_labels_of_a_soft_or_dry_run_policy_are_recorded_not_blocking(enforcement: Enforcement) -> None:
    # The issue's trial: an org-wide cap requiring cost-center, not yet enforced.
    trial = budget("a-trial", namespaces=("vision-prod",), labels={"cost-center": "*"}, enforcement=enforcement)
    p = plan(bundle(trial, TEAM), submission(labels={"team": "vision"}))
    assert p.violations == ()
    assert [(w.policy.id, w.missing) for w in p.waived] == [("a-trial", ("cost-center",))]
    assert [c.policy.id for c in p.charges] == ["team-vision"]
    decision = decide(p, room(p))
    assert decision.outcome == "ALLOW" and decision.reserves
    recorded = by_policy(decision)["a-trial"]
    assert (recorded.outcome, recorded.missing_labels, recorded.enforcement) == ("DENY", ("cost-center",), enforcement)
    assert recorded.ledger_key is None and recorded.admitted == 0 and recorded.projected == 0
    assert by_policy(decision)["team-vision"].admitted == GPU_48
    assert f"not enforced: {enforcement} policy 'a-trial' requires label cost-center" in decision.reason
    assert decision.evaluations[deciding_index(decision)].policy_id == "team-vision"  # type: ignore[index]


@pytest.mark.parametrize("enforcement", NOT_HARD)
def test_a_soft_or_dry_run_policy_alone_with_missing_labels_allows(enforcement: Enforcement) -> None:
    trial = budget("trial", namespaces=("vision-prod",), labels={"cost-center": "*"}, enforcement=enforcement)
    p = plan(bundle(trial), submission(labels={}))
    decision = decide(p, None)
    assert decision.outcome == "ALLOW" and not decision.reserves
    assert [(e.policy_id, e.outcome) for e in decision.evaluations] == [("trial", "DENY")]
    assert deciding_index(decision) is None  # nothing charged decided it: the waived policy did not apply


@pytest.mark.parametrize("enforcement", NOT_HARD)
@pytest.mark.parametrize(("flavor", "why"), [("b200", "no rate card prices flavor 'b200'"), (None, "must name a resources.flavor")])
def test_an_unpriced_run_under_a_soft_or_dry_run_cost_policy_is_not_charged_there(enforcement: Enforcement, flavor: str | None, why: str) -> None:
    cost = budget("cc-1042", labels={"cost-center": "1042"}, unit=Unit.COST, limit="5000", currency="USD", enforcement=enforcement)
    p = plan(bundle(TEAM, cost), submission(flavor=flavor))
    assert [c.policy.id for c in p.charges] == ["team-vision"]
    [waived] = p.waived
    assert waived.policy.id == "cc-1042" and why in waived.reason and waived.missing == ()
    decision = decide(p, room(p))
    assert decision.outcome == "ALLOW" and decision.reserves
    assert [(e.policy_id, e.outcome, e.ledger_key) for e in decision.evaluations][-1] == ("cc-1042", "DENY", None)
    assert why in decision.reason


def test_a_hard_label_violation_decides_over_a_dry_run_one() -> None:
    # The dry-run policy comes first and has the smaller id; the hard one still decides.
    dry = budget("a-dry", namespaces=("vision-prod",), labels={"owner": "*"}, enforcement=Enforcement.DRY_RUN)
    hard = budget("z-hard", namespaces=("vision-prod",), labels={"cost-center": "*"})
    p = plan(bundle(dry, hard), submission(labels={"team": "vision"}))
    assert [v.policy.id for v in p.violations] == ["z-hard"]
    decision = decide(p, None)
    assert decision.outcome == "DENY"
    assert decision.reason.startswith("denied: policy 'z-hard' requires label cost-center")
    assert decision.evaluations[deciding_index(decision)].policy_id == "z-hard"  # type: ignore[index]


def test_a_hard_cost_policy_still_refuses_an_unpriced_run() -> None:
    dry = budget("dry-cost", labels={"team": "vision"}, unit=Unit.COST, limit="5000", currency="USD", enforcement=Enforcement.DRY_RUN)
    with pytest.raises(UnknownFlavor, match="'cc-1042'"):
        plan(bundle(dry, COST_CENTER), submission(flavor="b200"))


# --- ties: the policy id decides, not the order of the files -------------------------------------


def test_the_deciding_budget_on_a_tie_does_not_depend_on_policy_order() -> None:
    one = budget("budget-b", namespaces=("vision-prod",))
    two = budget("budget-a", labels={"team": "vision"})
    for policies in ((one, two), (two, one)):
        p = plan(bundle(*policies), submission())
        allowed = decide(p, room(p))
        assert allowed.evaluations[deciding_index(allowed)].policy_id == "budget-a"  # type: ignore[index]
        assert "tightest is 'budget-a'" in allowed.reason
        denied = decide(p, room(p, budget_a=0, budget_b=0))
        assert denied.outcome == "DENY"
        assert denied.evaluations[deciding_index(denied)].policy_id == "budget-a"  # type: ignore[index]
    labels_one = budget("labels-b", namespaces=("vision-prod",), labels={"owner": "*"})
    labels_two = budget("labels-a", namespaces=("vision-prod",), labels={"project": "*"})
    for policies in ((labels_one, labels_two), (labels_two, labels_one)):
        denied = decide(plan(bundle(*policies), submission()), None)
        assert denied.evaluations[deciding_index(denied)].policy_id == "labels-a"  # type: ignore[index]


def test_delay_ties_go_to_the_smallest_policy_id() -> None:
    one = budget("wait-b", namespaces=("vision-prod",), on_exhausted=OnExhausted.DELAY)
    two = budget("wait-a", labels={"team": "vision"}, on_exhausted=OnExhausted.DELAY)
    for policies in ((one, two), (two, one)):
        p = plan(bundle(*policies), submission())
        delayed = decide(p, room(p, wait_a=0, wait_b=0))
        assert delayed.outcome == "DELAY"
        assert delayed.evaluations[deciding_index(delayed)].policy_id == "wait-a"  # type: ignore[index]
