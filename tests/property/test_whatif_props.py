"""What-if simulation without servers: the same core decides, a lowered limit flips later
decisions, recorded ends free room, and a hard budget is never over-admitted."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta
from decimal import Decimal

from hypothesis import given, settings
from hypothesis import strategies as st

from budgetgate.core.evaluation import Reading, Resources, Submission, decide, plan
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


# Histories as admission records them: budgets, and the concurrency limits the simulation does
# not model (a tenant quota, the sensitive pool, a token pool), refusing what they refuse.
QUOTA_DOCS = """apiVersion: budgetgate/v1
kind: Quota
metadata: {{id: tenant-vision}}
spec: {{tenant: vision, max_gpus: {max_gpus}, max_concurrent_allocations: {max_allocations}}}
---
apiVersion: budgetgate/v1
kind: Quota
metadata: {{id: sensitive-pool}}
spec: {{sensitive_pool_size: {sensitive}, sensitive_unit: gpus, sensitive_label: {{key: sensitive, value: "true"}}}}
---
apiVersion: budgetgate/v1
kind: ResourcePool
metadata: {{id: warehouse}}
spec: {{namespace: "snowflake:wh-1", quota: {tokens}, lease_seconds: 3600}}
"""


def limited_bundle(limit_hours: int, on_exhausted: str, max_gpus: int, max_allocations: int, sensitive: int, tokens: int, soft_hours: int):  # type: ignore[no-untyped-def]
    text = "---\n".join(
        [
            budget_yaml("team", limit=f"gpu_hours: {limit_hours}", on_exhausted=on_exhausted),
            budget_yaml("team-soft", limit=f"gpu_hours: {soft_hours}", enforcement="soft", window="{calendar: week}"),
            budget_yaml("team-dry", limit=f"gpu_hours: {soft_hours}", enforcement="dry-run", window="{calendar: day}"),
            QUOTA_DOCS.format(max_gpus=max_gpus, max_allocations=max_allocations, sensitive=sensitive, tokens=tokens),
        ]
    )
    return build_bundle(parse_text(text, "b.yaml"), git_sha="d" * 40)


# A run: GPUs, hours, sensitive, asks a pool token, minutes it runs, % of its projection it uses
# (None: it never started and gave its hold back), and how many attempts it makes if refused.
runs_strategy = st.lists(
    st.tuples(
        st.integers(1, 8),
        st.sampled_from(["0.5", "1", "2", "6"]),
        st.booleans(),
        st.booleans(),
        st.integers(1, 60),
        st.one_of(st.none(), st.integers(0, 100)),
        st.integers(1, 3),
    ),
    min_size=1,
    max_size=40,
)


def as_admission_recorded(bundle, runs) -> tuple[list[Recorded], list[Ended], set[tuple[str, int]]]:  # type: ignore[no-untyped-def]
    """Decide `runs` as admission does — budgets on the ledger, then the concurrency limits in
    the same atomic step — with the reconciler's settlement at each admitted run's end. Returns
    the recorded decisions, the recorded ends, and (run id, attempt) of each decision a
    concurrency limit refused."""
    import heapq

    from budgetgate.core.quotas import Holdings, PoolOutcome, pool_rejection, quota_violation, sensitive_violation
    from budgetgate.core.quotas import Request as Wanted
    from budgetgate.core.whatif import budgets_outcome
    from budgetgate.decisions.concurrency import refused

    quota, pool = bundle.quota_for("vision"), bundle.pools[0]
    ledger: dict[str, list[int]] = {}
    tenant, sensitive, tokens = [0, 0, 0], [0, 0, 0], [0]
    events: list[tuple] = []  # (at, 0 = an end, 1 = a submission, seq, payload): an end first at the same instant
    for i, (gpus, hours, is_sensitive, token, minutes, used, attempts) in enumerate(runs):
        heapq.heappush(events, (AT + timedelta(minutes=3 * i), 1, i, (i, 1)))
    decisions, ends, by_limits, held = [], [], set(), {}
    seq = len(runs)
    while events:
        at, kind, _, payload = heapq.heappop(events)
        if kind == 0:
            run_id = payload
            amounts, projected, gpus, is_sensitive, token, used = held.pop(run_id)
            for key, amount in amounts.items():
                ledger[key][0] -= amount
                if used is not None:
                    ledger[key][1] += amount * (projected * used // 100) // projected
            tenant[0] -= gpus
            tenant[2] -= 1
            sensitive[0] -= gpus if is_sensitive else 0
            tokens[0] -= 1 if token else 0
            ends.append(Ended(run_id, at, 0 if used is None else projected * used // 100, released=used is None))
            continue
        i, attempt = payload
        gpus, hours, is_sensitive, token, minutes, used, attempts = runs[i]
        labels = {"team": "vision", **({"sensitive": "true"} if is_sensitive else {})}
        sub = Submission(f"r{i}", "vision-prod", labels, Resources(gpus=gpus), Decimal(hours), at, attempt)
        the_plan = plan(bundle, sub)
        readings = {c.ledger_key: Reading(c.policy.limit.amount, *ledger.setdefault(c.ledger_key, [0, 0])) for c in the_plan.charges}
        decision = decide(the_plan, readings)
        wanted = Wanted(gpus=gpus, nodes=1)
        limit_reason = (
            quota_violation("vision", quota, Holdings(*tenant), wanted)
            or (sensitive_violation(bundle.sensitive, Holdings(*sensitive), wanted) if is_sensitive else None)
            or (pool_rejection([PoolOutcome(pool.namespace, "EXHAUSTED" if tokens[0] >= pool.quota else "OK", tokens[0], pool.quota)]) if token else None)
        )
        if limit_reason is not None:
            decision = refused(decision, limit_reason)
            by_limits.add((sub.run_id, attempt))
        verdicts = [(str(e.enforcement), e.outcome) for e in decision.evaluations]
        decisions.append(Recorded(sub, decision.outcome, reason=decision.reason, budgets_outcome=budgets_outcome(verdicts)))
        if decision.admitted:
            amounts = {c.ledger_key: c.amount for c in the_plan.charges}
            for key, amount in amounts.items():
                ledger[key][0] += amount
            tenant[0] += gpus
            tenant[2] += 1
            sensitive[0] += gpus if is_sensitive else 0
            tokens[0] += 1 if token else 0
            held[sub.run_id] = (amounts, the_plan.projected_gpu, gpus, is_sensitive, token, used)
            heapq.heappush(events, (at + timedelta(minutes=minutes), 0, seq, sub.run_id))
        elif attempt < attempts:
            heapq.heappush(events, (at + timedelta(minutes=7), 1, seq, (i, attempt + 1)))
        seq += 1
    return decisions, ends, by_limits


@settings(max_examples=300, deadline=None)
@given(
    limit=st.integers(5, 300),
    on_exhausted=st.sampled_from(["deny", "delay"]),
    max_gpus=st.integers(2, 48),
    max_allocations=st.integers(1, 10),
    sensitive=st.integers(1, 24),
    tokens=st.integers(1, 4),
    soft=st.integers(1, 100),
    runs=runs_strategy,
)
def test_an_unchanged_bundle_never_flips_whatever_the_concurrency_limits_refused(
    limit: int, on_exhausted: str, max_gpus: int, max_allocations: int, sensitive: int, tokens: int, soft: int, runs: list
) -> None:
    bundle = limited_bundle(limit, on_exhausted, max_gpus, max_allocations, sensitive, tokens, soft)
    decisions, ends, by_limits = as_admission_recorded(bundle, runs)
    outcome = simulate(bundle, start={}, decisions=decisions, ends=ends)
    assert outcome.flips == []
    # Exactly the decisions a limit refused are reported apart, each with the limit that did.
    assert {(n.run_id, n.attempt) for n in outcome.not_simulated} == by_limits
    recorded = {(r.submission.run_id, r.submission.attempt): r for r in decisions}
    for n in outcome.not_simulated:
        assert n.outcome == "DENY" and n.reason == recorded[(n.run_id, n.attempt)].reason
        assert n.decided_by in ("tenant quota", "sensitive pool", "token pool")
    # History's admissions, and only they, are the candidate's.
    team = outcome.by_budget["team"]
    assert team.admitted_gpu_before == team.admitted_gpu_after


def test_a_quota_refusal_is_not_simulated_and_frees_nothing_it_never_held() -> None:
    # r0 holds 8 of the tenant's 12 GPUs, so history refused r1 (8) for the quota; r2 (4) fit.
    # Replayed without quotas r1 would be admitted and hold 48 GPU-hours, refusing r2 in turn.
    bundle = limited_bundle(100, "deny", max_gpus=12, max_allocations=10, sensitive=24, tokens=4, soft_hours=100)
    decisions, ends, by_limits = as_admission_recorded(
        bundle, [(8, "6", False, False, 240, 100, 1), (8, "6", False, False, 240, 100, 1), (4, "6", False, False, 240, 100, 1)]
    )
    assert [r.outcome for r in decisions] == ["ALLOW", "DENY", "ALLOW"] and by_limits == {("r1", 1)}
    outcome = simulate(bundle, start={}, decisions=decisions, ends=ends)
    assert outcome.flips == []
    [skipped] = outcome.not_simulated
    assert (skipped.run_id, skipped.outcome, skipped.decided_by, skipped.budgets_after) == ("r1", "DENY", "tenant quota", "ALLOW")
    assert skipped.reason.startswith('allocation rejected: tenant "vision" would exceed max_gpus quota')
    # A candidate that changes the budget still flips what its budget decides, and only that.
    lower = simulate(limited_bundle(40, "deny", 12, 10, 24, 4, 100), start={}, decisions=decisions, ends=ends)
    assert [(f.run_id, f.before, f.after) for f in lower.flips] == [("r0", "ALLOW", "DENY")]  # 48 of 40; r2's 24 fit
    assert [(n.run_id, n.budgets_after) for n in lower.not_simulated] == [("r1", "DENY")]


def test_a_budget_held_by_escrow_leases_reads_as_their_sum() -> None:
    """On a ledger of several shards a budget tenants share is held by each tenant's escrow lease
    (its readings and holds are the leases'): the candidate's budget, filed under the budget's own
    key, reads as the leases together, and an end frees room on the lease the run held."""
    from budgetgate.core.escrow import lease_key

    key = plan(bundle(100), run(1, 1).submission).charges[0].ledger_key
    vision, nlp = lease_key(key, "vision"), lease_key(key, "nlp")
    start = {vision: Start(reserved=40 * H, consumed=10 * H, read_at=AT), nlp: Start(reserved=0, consumed=30 * H, read_at=AT)}
    holds = {"old": ({vision: 40 * H}, 40 * H)}
    refused = simulate(bundle(100), start=start, decisions=[run(10, 21)], ends=[], holds=holds)
    assert [f.run_id for f in refused.flips] == ["r10"]  # 40 + 10 + 30 held or used: 20 left, 21 needed
    fits = simulate(bundle(100), start=start, decisions=[run(10, 20)], ends=[], holds=holds)
    assert fits.flips == []
    ended = simulate(bundle(100), start=start, decisions=[run(10, 40)], ends=[Ended("old", AT + timedelta(minutes=5), 20 * H)], holds=holds)
    assert ended.flips == []  # the old run used 20 of its 40 on vision's lease: 60 used in all, 40 left
