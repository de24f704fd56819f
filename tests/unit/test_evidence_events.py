"""Evidence events without servers: decisions and reconciliations to OpenLineage RunEvents with
the budget facet, the event-type mapping, the run UUID, and validity against the spec."""

from __future__ import annotations

import uuid
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import pytest
from google.protobuf.timestamp_pb2 import Timestamp
from openlineage.client.event_v2 import RunState

from budgetgate.core.accounting import EXTERNAL, LEDGER, BudgetSource, with_external
from budgetgate.core.evaluation import Reading, Resources, Submission, decide, plan
from budgetgate.core.grants import Grant, by_window
from budgetgate.core.loader import build_bundle, parse_text
from budgetgate.core.units import MILLI_PER_HOUR, Unit
from budgetgate.decisions.rendering import decision_message
from budgetgate.evidence import events, facet
from budgetgate.v1 import common_pb2, decisions_pb2, reconciliations_pb2
from tests.support.admission import budget_yaml
from tests.support.marquez import OpenLineageValidator, require_spec

AT = datetime(2026, 3, 10, 12, tzinfo=UTC)
SHA = "a" * 40
H = MILLI_PER_HOUR


def bundle(*yaml_docs: str):  # type: ignore[no-untyped-def]
    documents = [doc for i, text in enumerate(yaml_docs) for doc in parse_text(text, f"p{i}.yaml")]
    return build_bundle(documents, git_sha=SHA)


def decided(
    policies,
    *,
    gpus: int = 8,
    hours: str = "6",
    labels: dict[str, str] | None = None,
    used: dict[str, int] | None = None,
    releases=None,
    run_id: str = "flyte/vision/exec-1/n0",
    accounting: BudgetSource | None = None,
) -> decisions_pb2.Decision:  # type: ignore[no-untyped-def]
    """A Decision message as admission publishes it, from the real core and renderer; with
    `accounting`, decided on its figure as admission does (deciding.conclude)."""
    sub = Submission(
        run_id=run_id,
        namespace="vision-prod",
        labels=labels if labels is not None else {"team": "vision"},
        resources=Resources(gpus=gpus),
        runtime_hours=Decimal(hours),
        at=AT,
    )
    p = plan(policies, sub)
    readings = {c.ledger_key: Reading(limit=c.policy.limit.amount, reserved=(used or {}).get(c.policy.id, 0), consumed=0) for c in p.charges}
    d = decide(p, with_external(p, readings, accounting) if p.charges else None, outlooks=releases)
    return decision_message(
        plan=p, decision=d, decision_id=str(uuid.uuid4()), decided_at=AT, job=("vision-prod", "train-resnet"), readings=readings, accounting=accounting
    )


def stamp(at: datetime) -> Timestamp:
    ts = Timestamp()
    ts.FromDatetime(at)
    return ts


def event_for(message: decisions_pb2.Decision) -> dict[str, Any]:
    fields = facet.decision_fields(message)
    event = events.run_event(
        event_type=events.decision_event_type(fields["decision"]),
        at=AT,
        run_id=message.run_id,
        job=("vision-prod", "train-resnet"),
        fields=fields,
        producer=events.producer_uri(),
    )
    return events.to_json(event)


TEAM = budget_yaml("team", limit="gpu_hours: 100")
ORG = budget_yaml("org", labels="{}", limit="gpu_hours: 1000")
WAITING = budget_yaml("waiting", limit="gpu_hours: 100", on_exhausted="delay")
WAITING_WEEK = budget_yaml("waiting-week", labels="{}", limit="gpu_hours: 60", on_exhausted="delay", window="{calendar: week}")


def test_allow_is_start_with_the_deciding_budget() -> None:
    message = decided(bundle(TEAM))
    data = event_for(message)
    assert data["eventType"] == "START"
    budget = data["run"]["facets"]["budget"]
    assert budget["_schemaURL"] == facet.SCHEMA_URL and budget["_producer"].startswith("https://")
    assert budget["decision"] == "ALLOW" and budget["stage"] == "decision"
    assert budget["policy_id"] == "team" and budget["policy_git_sha"] == SHA
    assert budget["scope_id"] == "ns=vision-prod;team=vision"
    assert budget["window_start"] == "2026-03-01T00:00:00+00:00" and budget["window_end"] == "2026-04-01T00:00:00+00:00"
    assert budget["projected_gpu_hours"] == 48.0 and budget["admitted_gpu_hours"] == 48.0
    assert "deficit_gpu_hours" not in budget and "next_eligible_time" not in budget
    assert [e["deciding"] for e in budget["evaluations"]] == [True]


def test_the_facet_names_the_override_revision_beside_the_bundle() -> None:
    from dataclasses import replace

    message = decided(replace(bundle(TEAM), override_revision=42))
    budget = event_for(message)["run"]["facets"]["budget"]
    assert (budget["policy_bundle_sha"], budget["override_revision"]) == (SHA, 42)
    assert event_for(decided(bundle(TEAM)))["run"]["facets"]["budget"]["override_revision"] == 0


SOFT = budget_yaml("gpu-soft", limit="gpu_hours: 1000", enforcement="soft", window="{calendar: week}")
ANSWERED = "remaining_budget from the accounting system"


def test_a_decision_on_an_external_accounting_figure_says_so_and_names_it() -> None:
    validator = OpenLineageValidator(require_spec())
    message = decided(bundle(TEAM, SOFT), used={"gpu-soft": 300 * H}, accounting=BudgetSource("gpu-soft", EXTERNAL, 100 * H, ANSWERED))
    assert message.accounting == decisions_pb2.Decision.Accounting(policy_id="gpu-soft", source="external", remaining_amount=100 * H, detail=ANSWERED)
    data = event_for(message)
    budget = data["run"]["facets"]["budget"]
    external = {"policy_id": "gpu-soft", "source": "external", "remaining_gpu_hours": 100.0, "remaining_amount": 100 * H, "detail": ANSWERED}
    assert budget["accounting"] == external
    # The budget's room was the accounting system's figure, not what the ledger read for it.
    soft = next(e for e in budget["evaluations"] if e["policy_id"] == "gpu-soft")
    assert soft["remaining"] == 100.0 and soft["reading"]["remaining"] == 700.0
    assert validator.errors(data) == []
    broken = {**data, "run": {"runId": data["run"]["runId"], "facets": {"budget": {**budget, "accounting": {**budget["accounting"]}}}}}
    del broken["run"]["facets"]["budget"]["accounting"]["remaining_amount"]
    assert any("remaining_amount" in e for e in validator.errors(broken))
    # A reconciliation of the run carries the decision's accounting on.
    settled = facet.reconciliation_fields(reconciliation(message.run_id, "COMPLETED"), budget)
    assert settled["accounting"] == budget["accounting"]


def test_a_decision_on_the_ledger_says_why_and_one_without_a_source_has_no_accounting() -> None:
    validator = OpenLineageValidator(require_spec())
    why = "the accounting system did not answer within 0.25 s"
    message = decided(bundle(TEAM, SOFT), used={"gpu-soft": 300 * H}, accounting=BudgetSource("gpu-soft", LEDGER, None, why))
    assert message.HasField("accounting") and not message.accounting.HasField("remaining_amount")
    data = event_for(message)
    budget = data["run"]["facets"]["budget"]
    assert budget["accounting"] == {"policy_id": "gpu-soft", "source": "ledger", "detail": why}
    assert next(e for e in budget["evaluations"] if e["policy_id"] == "gpu-soft")["remaining"] == 700.0
    assert validator.errors(data) == []
    plain = decided(bundle(TEAM, SOFT), used={"gpu-soft": 300 * H})
    assert not plain.HasField("accounting")
    assert "accounting" not in event_for(plain)["run"]["facets"]["budget"]


def test_deny_is_abort_with_deficit_and_next_eligible_time() -> None:
    message = decided(bundle(TEAM), used={"team": 80 * H})
    budget = event_for(message)["run"]["facets"]["budget"]
    assert event_for(message)["eventType"] == "ABORT"
    assert budget["decision"] == "DENY" and budget["admitted_gpu_hours"] == 0.0
    assert budget["deficit_gpu_hours"] == 28.0  # 48 needed, 20 left
    assert budget["next_eligible_time"] == "2026-04-01T00:00:00+00:00"


def test_delay_is_other_and_the_latest_eligible_budget_decides() -> None:
    # Both budgets are full; the weekly one frees up on Monday, the monthly one at the month's end.
    message = decided(bundle(WAITING, WAITING_WEEK), used={"waiting": 90 * H, "waiting-week": 50 * H})
    data = event_for(message)
    budget = data["run"]["facets"]["budget"]
    assert data["eventType"] == "OTHER" and budget["decision"] == "DELAY"
    assert budget["policy_id"] == "waiting"
    assert budget["next_eligible_time"] == "2026-04-01T00:00:00+00:00"
    assert budget["deficit_gpu_hours"] == 38.0
    assert [(e["policy_id"], e["decision"], e["deciding"]) for e in budget["evaluations"]] == [
        ("waiting", "DELAY", True), ("waiting-week", "DELAY", False)]  # fmt: skip
    week = budget["evaluations"][1]
    assert week["next_eligible_time"] == "2026-03-16T00:00:00+00:00" and week["deficit_gpu_hours"] == 38.0


def test_several_policies_all_listed_tightest_hard_one_decides_an_allow() -> None:
    soft = budget_yaml("soft", labels="{}", limit="gpu_hours: 50", enforcement="soft", window="{calendar: week}")
    message = decided(bundle(ORG, TEAM, soft), used={"team": 40 * H, "org": 100 * H})
    budget = event_for(message)["run"]["facets"]["budget"]
    assert budget["decision"] == "ALLOW"
    assert [e["policy_id"] for e in budget["evaluations"]] == ["org", "team", "soft"]
    deciding = [e for e in budget["evaluations"] if e["deciding"]]
    assert len(deciding) == 1 and deciding[0]["policy_id"] == "team" == budget["policy_id"]
    assert budget["evaluations"][1]["remaining"] == 60.0 and budget["evaluations"][1]["limit"] == 100.0
    assert {e["enforcement"] for e in budget["evaluations"]} == {"hard", "soft"}


def test_missing_labels_deny_names_them_without_a_time() -> None:
    strict = budget_yaml("strict", labels="{team: vision, cost-center: '*'}")
    message = decided(bundle(strict), labels={"team": "vision"})
    budget = event_for(message)["run"]["facets"]["budget"]
    assert budget["decision"] == "DENY" and budget["deficit_gpu_hours"] == 0.0
    assert "next_eligible_time" not in budget and "window_start" not in budget
    assert budget["evaluations"][0]["missing_labels"] == ["cost-center"]


def test_unmatched_allow_carries_no_policy() -> None:
    message = decided(bundle(budget_yaml("other", namespace="nlp-prod")))
    budget = event_for(message)["run"]["facets"]["budget"]
    assert budget["decision"] == "ALLOW" and budget["evaluations"] == []


def test_a_waived_policy_alone_decides_nothing_in_the_facet_as_in_admission() -> None:
    # A soft policy whose labels the run lacks is waived (recorded, never enforced): admission
    # names no deciding evaluation (core.evaluation.deciding_index), so neither does the facet.
    trial = budget_yaml("trial", labels="{team: vision, cost-center: '*'}", enforcement="soft")
    message = decided(bundle(trial), labels={"team": "vision"})
    assert not message.HasField("deciding_evaluation")
    data = event_for(message)
    budget = data["run"]["facets"]["budget"]
    assert budget["decision"] == "ALLOW"
    assert [(e["policy_id"], e["decision"], e["deciding"]) for e in budget["evaluations"]] == [("trial", "DENY", False)]
    assert "policy_id" not in budget and "scope_id" not in budget
    assert OpenLineageValidator(require_spec()).errors(data) == []
    assert "policy_id" not in budget


def reconciliation(
    run_id: str, state: str, *, projected: int = 48 * H, actual: int = 40 * H, provisional: bool = False, charges: bool = True
) -> reconciliations_pb2.Reconciliation:
    message = reconciliations_pb2.Reconciliation(
        event_id=str(uuid.uuid4()), event_time=stamp(AT + timedelta(hours=7)), run_id=run_id, final_state=state,
        provisional=provisional, projected_gpu_milli_hours=projected, actual_gpu_milli_hours=actual,
        error_gpu_milli_hours=actual - projected, policy_bundle_sha=SHA, job=common_pb2.Job(namespace="vision-prod", name="train-resnet"))  # fmt: skip
    if charges:
        message.charges.append(reconciliations_pb2.Reconciliation.WindowCharge(
            ledger_key="ns=vision-prod;team=vision|2026-03-01T00:00:00Z/2026-04-01T00:00:00Z|gpu_hours",
            scope_id="ns=vision-prod;team=vision", policy_id="team", window_start=stamp(datetime(2026, 3, 1, tzinfo=UTC)),
            window_end=stamp(datetime(2026, 4, 1, tzinfo=UTC)), amount=actual, unit="gpu_hours"))  # fmt: skip
    return message


@pytest.mark.parametrize(("state", "expected"), [
    ("COMPLETED", RunState.COMPLETE), ("completed", RunState.COMPLETE), ("FAILED", RunState.FAIL), ("EVICTED", RunState.FAIL),
    ("CANCELLED", RunState.ABORT), ("never-started", RunState.ABORT), ("", RunState.RUNNING), ("RUNNING", RunState.RUNNING),
])  # fmt: skip
def test_reconciliation_event_types(state: str, expected: RunState) -> None:
    assert events.reconciliation_event_type(facet.normalized_state(state), terminal_sent=False) is expected


def test_after_the_terminal_event_corrections_are_other() -> None:
    assert events.reconciliation_event_type("COMPLETED", terminal_sent=True) is RunState.OTHER
    assert events.reconciliation_event_type("RUNNING", terminal_sent=True) is RunState.OTHER


def test_unknown_final_state_is_unusable() -> None:
    with pytest.raises(facet.UnusableMessage, match="EXPLODED"):
        events.reconciliation_event_type("EXPLODED", terminal_sent=False)


def test_reconciliation_adds_actuals_to_the_decision_facet() -> None:
    message = decided(bundle(ORG, TEAM))
    decision_facet = event_for(message)["run"]["facets"]["budget"]
    fields = facet.reconciliation_fields(reconciliation(message.run_id, "COMPLETED"), decision_facet)
    assert fields["stage"] == "reconciliation" and fields["decision"] == "ALLOW"
    assert fields["policy_id"] == decision_facet["policy_id"] and fields["evaluations"] == decision_facet["evaluations"]
    assert fields["actual_gpu_hours"] == 40.0 and fields["reservation_error_gpu_hours"] == -8.0
    assert fields["reservation_error_ratio"] == round(-8 / 48, 6)
    assert fields["final_state"] == "COMPLETED" and fields["provisional"] is False
    assert fields["charges"][0]["window_key"] == "2026-03-01T00:00:00Z/2026-04-01T00:00:00Z"


def test_reconciliation_without_its_decision_infers_it_from_the_charges() -> None:
    fields = facet.reconciliation_fields(reconciliation("run-x", "FAILED", actual=50 * H), None)
    assert fields["decision"] == "ALLOW" and fields["policy_id"] == "team" and fields["policy_git_sha"] == SHA
    assert [e["scope_id"] for e in fields["evaluations"]] == ["ns=vision-prod;team=vision"]
    assert fields["reservation_error_gpu_hours"] == 2.0


def test_run_uuid_is_stable_per_run_id() -> None:
    first, again, other = events.run_uuid("flyte/a/1"), events.run_uuid("flyte/a/1"), events.run_uuid("flyte/a/2")
    assert first == again != other
    assert first.version == 5


def test_json_round_trip_is_exact() -> None:
    data = event_for(decided(bundle(TEAM, ORG), used={"team": 80 * H}))
    assert events.to_json(events.from_json(data)) == data


def test_deficit_scales_to_the_runs_gpu_hours() -> None:
    assert facet.deficit_gpu_hours(0, 10, 48 * H) == 0.0
    assert facet.deficit_gpu_hours(5, 10, 48 * H) == 24.0  # half the run did not fit
    assert facet.deficit_gpu_hours(50, 10, 48 * H) == 48.0


def test_every_kind_of_event_is_valid_against_the_spec_and_the_facet_schema() -> None:
    validator = OpenLineageValidator(require_spec())
    allow = decided(bundle(TEAM, ORG))
    samples = [
        event_for(allow),
        event_for(decided(bundle(TEAM), used={"team": 80 * H})),
        event_for(decided(bundle(WAITING, WAITING_WEEK), used={"waiting": 90 * H, "waiting-week": 50 * H})),
        event_for(decided(bundle(budget_yaml("strict", labels="{team: vision, cost-center: '*'}")))),
        event_for(decided(bundle(budget_yaml("other", namespace="nlp-prod")))),
    ]
    decision_facet = samples[0]["run"]["facets"]["budget"]
    for state, provisional in (("COMPLETED", False), ("FAILED", True), ("CANCELLED", False), ("", True)):
        fields = facet.reconciliation_fields(reconciliation(allow.run_id, state, provisional=provisional), decision_facet)
        kind = events.reconciliation_event_type(fields["final_state"], terminal_sent=False)
        samples.append(
            events.to_json(
                events.run_event(
                    event_type=kind, at=AT, run_id=allow.run_id, job=("vision-prod", "train-resnet"), fields=fields, producer=events.producer_uri()
                )
            )
        )
    assert {s["eventType"] for s in samples} == {"START", "ABORT", "OTHER", "COMPLETE", "FAIL", "RUNNING"}
    for sample in samples:
        assert validator.errors(sample) == [], sample
    broken = dict(samples[1])
    broken["run"] = {"runId": broken["run"]["runId"], "facets": {"budget": {**samples[1]["run"]["facets"]["budget"]}}}
    del broken["run"]["facets"]["budget"]["deficit_gpu_hours"]
    assert any("deficit_gpu_hours" in e for e in validator.errors(broken))


def test_the_facet_carries_each_ledger_keys_reading_so_marquez_alone_explains_it() -> None:
    validator = OpenLineageValidator(require_spec())
    data = event_for(decided(bundle(TEAM, ORG), used={"team": 30 * H, "org": 200 * H}))
    by_policy = {e["policy_id"]: e for e in data["run"]["facets"]["budget"]["evaluations"]}
    assert by_policy["team"]["reading"] == {
        "limit": 100.0,
        "reserved": 30.0,
        "consumed": 0.0,
        "remaining": 70.0,
        "limit_amount": 100 * H,
        "reserved_amount": 30 * H,
        "consumed_amount": 0,
    }
    assert by_policy["org"]["reading"]["remaining"] == 800.0 and by_policy["team"]["remaining"] == 70.0
    assert validator.errors(data) == []
    broken = {**data, "run": {"runId": data["run"]["runId"], "facets": {"budget": {**data["run"]["facets"]["budget"]}}}}
    broken["run"]["facets"]["budget"]["evaluations"] = [{**by_policy["team"], "reading": {**by_policy["team"]["reading"], "reserved_amount": "30"}}]
    assert any("reserved_amount" in e or "'30'" in e for e in validator.errors(broken))
    # With what was asked, the facet alone recomputes the decision (given the bundle at its SHA).
    assert data["run"]["facets"]["budget"]["submission"] == {
        "namespace": "vision-prod",
        "labels": {"team": "vision"},
        "resources": {"gpus": 8, "nodes": 1},
        "projected_runtime_hours": 6.0,
    }
    # A label violation consulted no ledger: no reading.
    labels = event_for(decided(bundle(budget_yaml("strict", labels="{team: vision, cost-center: '*'}"))))
    assert "reading" not in labels["run"]["facets"]["budget"]["evaluations"][0]


def test_a_missing_spec_fails_loudly_instead_of_skipping_validation(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from tests.support.marquez import MarquezStandIn, MissingSpec

    monkeypatch.setenv("BUDGETGATE_REFERENCE_DIR", str(tmp_path))
    with pytest.raises(MissingSpec, match=str(tmp_path)):
        require_spec()
    with pytest.raises(MissingSpec):
        MarquezStandIn()
    assert MarquezStandIn(validate=False).invalid == []


def test_a_granted_window_shows_the_policys_limit_the_grants_and_validates() -> None:
    plain = bundle(TEAM)
    policy = plain.policies[0]
    key = "ns=vision-prod;team=vision|2026-03-01T00:00:00Z/2026-04-01T00:00:00Z|gpu_hours"
    made = [
        Grant(7, "team", policy.scope.scope_id, Unit.GPU_HOURS, key, AT, AT, 20 * H, 100 * H, 120 * H, "token:finance", "committee 17", AT),
        Grant(9, "team", policy.scope.scope_id, Unit.GPU_HOURS, key, AT, AT, -5 * H, 120 * H, 115 * H, "token:ops", "moved to nlp", AT),
    ]
    granted = replace(plain, grants=by_window(made), override_revision=9)
    budget = event_for(decided(granted))["run"]["facets"]["budget"]
    evaluation = budget["evaluations"][0]
    assert (evaluation["limit"], evaluation["policy_limit"], evaluation["granted"]) == (115.0, 100.0, 15.0)
    assert evaluation["grants"] == [
        {"revision": 7, "amount": 20.0, "actor": "token:finance", "reason": "committee 17"},
        {"revision": 9, "amount": -5.0, "actor": "token:ops", "reason": "moved to nlp"},
    ]
    assert evaluation["reading"]["limit_amount"] == 115 * H and budget["override_revision"] == 9
    # A window without grants has none of the three.
    assert not {"policy_limit", "granted", "grants"} & set(event_for(decided(plain))["run"]["facets"]["budget"]["evaluations"][0])


def test_the_facet_with_grants_validates_against_its_schema() -> None:
    plain = bundle(TEAM)
    key = "ns=vision-prod;team=vision|2026-03-01T00:00:00Z/2026-04-01T00:00:00Z|gpu_hours"
    made = [Grant(3, "team", "ns=vision-prod;team=vision", Unit.GPU_HOURS, key, AT, AT, -100 * H, 100 * H, 0, "token:finance", "frozen", AT)]
    event = event_for(decided(replace(plain, grants=by_window(made), override_revision=3)))
    assert event["run"]["facets"]["budget"]["evaluations"][0]["limit"] == 0.0
    assert OpenLineageValidator(require_spec()).errors(event) == []
    broken = {**event, "run": {**event["run"], "facets": {"budget": {**event["run"]["facets"]["budget"]}}}}
    broken["run"]["facets"]["budget"]["evaluations"] = [{**event["run"]["facets"]["budget"]["evaluations"][0], "grants": [{"revision": 3}]}]
    assert OpenLineageValidator(require_spec()).errors(broken) != []
