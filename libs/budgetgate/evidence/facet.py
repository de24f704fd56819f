"""The `budget` run facet: what a decision or a reconciliation tells about a run, as plain fields.

Pure: built from the Kafka messages alone (and, for a reconciliation, the facet of the decision
it settles), so the same message always gives the same facet. Its JSON schema is published in
schemas/facets/budget/<version>/BudgetRunFacet.json under the URL in SCHEMA_URL.

When several policies apply, every evaluation is listed under `evaluations` in the decision's
order, and the top-level policy fields repeat the one marked `deciding: true`: the one admission
named in the message (`deciding_evaluation`, by budgetgate.core.evaluation.deciding_index, the
one rule), none when it named none (no budget was charged: an unmatched run, or one whose only
evaluations are waived soft or dry-run policies). That rule picks:

- DENY: the hard policy whose labels the run lacks, else the denying budget (hard first) short
  by the largest part of the run;
- DELAY: the delaying budget (hard first) with the latest next eligible time (it sets when the
  run may start). Each budget's time is the earliest instant it will have room under its own
  rules (budgetgate.core.eligibility): a run ending as projected frees nothing, so it is the next
  window's start, the instant enough usage ages out of a rolling window, or an unstarted run's
  start deadline; the facet repeats the deciding budget's time as the decision gave it;
- ALLOW: the charged hard budget (else any charged) with the least room left after the run,
  relative to its limit (the "tightest" budget admission's reason names).

Ties go to the smallest policy id.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from google.protobuf.timestamp_pb2 import Timestamp

from budgetgate.core.ledger_key import LedgerKey
from budgetgate.core.units import MILLI_PER_HOUR, Unit, display, hours
from budgetgate.v1 import common_pb2, decisions_pb2, reconciliations_pb2

FACET_KEY = "budget"
SCHEMA_VERSION = "1-5-0"
SCHEMA_BASE = "https://budgetgate.dev/schemas/"
SCHEMA_ID = f"{SCHEMA_BASE}facets/budget/{SCHEMA_VERSION}/BudgetRunFacet.json"
SCHEMA_URL = f"{SCHEMA_ID}#/$defs/BudgetRunFacet"

DECISION, RECONCILIATION = "decision", "reconciliation"
Fields = dict[str, Any]


class UnusableMessage(ValueError):
    """A message no facet can be built from; the reason goes with it to the dead-letter topic."""


def decision_fields(message: decisions_pb2.Decision) -> Fields:
    """The facet fields of one admission decision."""
    if not message.run_id:
        raise UnusableMessage(f"decision {message.decision_id or message.event_id!r} has no run_id")
    outcome = common_pb2.Outcome.Name(message.outcome)
    if outcome not in ("ALLOW", "DENY", "DELAY"):
        raise UnusableMessage(f"decision {message.decision_id!r} has outcome {outcome}")
    projected_gpu = message.projected_gpu_milli_hours
    evaluations = [_evaluation(e, projected_gpu) for e in message.evaluations]
    # Admission names the deciding evaluation, and none when no budget was charged.
    named = message.HasField("deciding_evaluation") and 0 <= message.deciding_evaluation < len(evaluations)
    deciding = message.deciding_evaluation if named else None
    if deciding is not None:
        evaluations[deciding]["deciding"] = True
    fields: Fields = {
        "stage": DECISION,
        "run_id": message.run_id,
        "decision_id": message.decision_id or message.event_id,
        "attempt": max(message.attempt, 1),
        "decision": outcome,
        "reason": message.reason,
        "policy_bundle_sha": message.policy_bundle_sha,
        "override_revision": message.override_revision,
        "projected_gpu_hours": hours(projected_gpu),
        "admitted_gpu_hours": hours(projected_gpu) if outcome == "ALLOW" else 0.0,
        "evaluations": evaluations,
        "submission": submission(message),
    }
    if message.HasField("accounting"):
        fields["accounting"] = accounting(message.accounting)
    if deciding is not None:
        chosen = evaluations[deciding]
        for key in ("policy_id", "policy_git_sha", "scope_id", "window_key", "window_start", "window_end"):
            if key in chosen:
                fields[key] = chosen[key]
        if outcome != "ALLOW":
            fields["deficit_gpu_hours"] = chosen.get("deficit_gpu_hours", 0.0)
            if "next_eligible_time" in chosen:
                fields["next_eligible_time"] = chosen["next_eligible_time"]
    elif outcome != "ALLOW":
        fields["deficit_gpu_hours"] = 0.0
    return fields


def submission(message: decisions_pb2.Decision) -> Fields:
    """What was asked, as the decision recorded it: with each evaluation's `reading`, what the
    decision can be recomputed and explained from (with the bundle at `policy_bundle_sha`)."""
    res = message.resources
    resources: Fields = {"gpus": res.gpus, "nodes": res.nodes}
    resources.update({k: v for k, v in (("flavor", res.flavor), ("region", res.region)) if v})
    return {"namespace": message.namespace, "labels": dict(message.labels), "resources": resources, "projected_runtime_hours": message.projected_runtime_hours}


def accounting(source: decisions_pb2.Decision.Accounting) -> Fields:
    """Which figure the tenant's soft GPU-hour budget `policy_id` was judged on: `external`
    (the accounting system's remaining budget stood for its room, in GPU-hours and, so the
    decision can be recomputed exactly, in the ledger's integers) or `ledger`, `detail` saying
    where the figure came from or why the ledger's was used."""
    fields: Fields = {"policy_id": source.policy_id, "source": source.source}
    if source.HasField("remaining_amount"):
        fields["remaining_gpu_hours"] = hours(source.remaining_amount)
        fields["remaining_amount"] = source.remaining_amount
    fields["detail"] = source.detail
    return fields


# The fields a reconciliation contributes; the rest of its facet is the settled decision's.
RECONCILED_KEYS = (
    "stage", "run_id", "decision_id", "reconciliation_id", "final_state", "provisional", "projected_gpu_hours",
    "actual_gpu_hours", "reservation_error_gpu_hours", "reservation_error_ratio", "charges",
)  # fmt: skip


def reconciliation_fields(message: reconciliations_pb2.Reconciliation, decided: Mapping[str, Any] | None) -> Fields:
    """The facet fields of a reconciliation: the settled decision's, plus the actuals.

    `decided` is the facet of the run's decision when the emitter has seen it; without it the
    decision is inferred from the message (a reconciled run was admitted, on the keys charged),
    and with_decision() puts the real one in once it arrives.
    """
    if not message.run_id:
        raise UnusableMessage(f"reconciliation {message.event_id!r} has no run_id")
    projected, actual = message.projected_gpu_milli_hours, message.actual_gpu_milli_hours
    charges = [_charge(c) for c in message.charges]
    error = actual - projected
    own: Fields = {
        "stage": RECONCILIATION,
        "run_id": message.run_id,
        "reconciliation_id": message.event_id,
        "final_state": normalized_state(message.final_state),
        "provisional": message.provisional,
        "projected_gpu_hours": hours(projected),
        "actual_gpu_hours": hours(actual),
        "reservation_error_gpu_hours": hours(error),
        "charges": charges,
    }
    if message.decision_id:
        own["decision_id"] = message.decision_id
    if projected > 0:
        own["reservation_error_ratio"] = round(error / projected, 6)
    if message.policy_bundle_sha:
        own["policy_bundle_sha"] = message.policy_bundle_sha
    return with_decision(own, decided if decided is not None else _inferred_decision(message, charges))


def with_decision(reconciled: Mapping[str, Any], decided: Mapping[str, Any]) -> Fields:
    """A reconciliation's own fields on top of the facet of the decision it settles."""
    fields = {k: v for k, v in decided.items() if not k.startswith("_") and k not in RECONCILED_KEYS}
    if "decision_id" in decided:
        fields["decision_id"] = decided["decision_id"]
    fields.update({k: reconciled[k] for k in RECONCILED_KEYS if k in reconciled})
    sha = reconciled.get("policy_bundle_sha") or decided.get("policy_bundle_sha", "")
    fields["policy_bundle_sha"] = sha
    return fields


def _inferred_decision(message: reconciliations_pb2.Reconciliation, charges: Sequence[Fields]) -> Fields:
    sha = message.policy_bundle_sha
    evaluations = []
    for charge in charges:
        entry = {
            "policy_id": charge.get("policy_id", ""),
            "policy_git_sha": sha,
            "scope_id": charge["scope_id"],
            "ledger_key": charge["ledger_key"],
            "unit": charge["unit"],
            "enforcement": "hard",
            "decision": "ALLOW",
            "deciding": False,
            "limit": 0.0,
            "projected": 0.0,
            "admitted": 0.0,
            "projected_gpu_hours": hours(message.projected_gpu_milli_hours),
            "admitted_gpu_hours": hours(message.projected_gpu_milli_hours),
        }
        entry.update({k: charge[k] for k in ("window_key", "window_start", "window_end") if k in charge})
        # One entry per ledger key is what a decision lists, whatever the charges' split.
        if all(e["ledger_key"] != entry["ledger_key"] for e in evaluations):
            evaluations.append(entry)
    fields: Fields = {
        "stage": DECISION,
        "run_id": message.run_id,
        "decision": "ALLOW",
        "policy_bundle_sha": sha,
        "projected_gpu_hours": hours(message.projected_gpu_milli_hours),
        "admitted_gpu_hours": hours(message.projected_gpu_milli_hours),
        "evaluations": evaluations,
    }
    gpu = [e for e in evaluations if e["unit"] == Unit.GPU_HOURS] or evaluations
    if gpu:
        gpu[0]["deciding"] = True
        fields.update({k: gpu[0][k] for k in ("policy_id", "policy_git_sha", "scope_id", "window_key", "window_start", "window_end") if k in gpu[0]})
    return fields


def _outcome(e: decisions_pb2.Decision.Evaluation) -> str:
    return common_pb2.Outcome.Name(e.outcome)


def _evaluation(e: decisions_pb2.Decision.Evaluation, projected_gpu: int) -> Fields:
    unit = Unit(e.unit) if e.unit in Unit._value2member_map_ else None
    shown = (lambda amount: display(unit, amount)) if unit is not None else (lambda amount: float(amount))
    outcome = _outcome(e)
    entry: Fields = {
        "policy_id": e.policy_id,
        "policy_git_sha": e.policy_git_sha,
        "scope_id": e.scope_id,
        "unit": e.unit,
        "enforcement": e.enforcement,
        "decision": outcome,
        "deciding": False,
        "limit": shown(e.limit_amount),
        "projected": shown(e.projected_amount),
        "admitted": shown(e.admitted_amount),
        "projected_gpu_hours": hours(projected_gpu),
        "admitted_gpu_hours": hours(projected_gpu) if e.admitted_amount else 0.0,
    }
    if e.ledger_key:
        entry["ledger_key"] = e.ledger_key
        entry["window_key"] = window_key(e.ledger_key)
        # Label violations are judged before any ledger, so they have no remaining room.
        entry["remaining"] = shown(e.remaining_amount)
    if e.HasField("window_start"):
        entry["window_start"] = timestamp_text(e.window_start)
    if e.HasField("window_end"):
        entry["window_end"] = timestamp_text(e.window_end)
    if outcome != "ALLOW":
        entry["deficit"] = shown(e.deficit_amount)
        entry["deficit_gpu_hours"] = deficit_gpu_hours(e.deficit_amount, e.projected_amount, projected_gpu)
    if e.HasField("next_eligible_time"):
        entry["next_eligible_time"] = timestamp_text(e.next_eligible_time)
    if e.missing_labels:
        entry["missing_labels"] = list(e.missing_labels)
    if e.HasField("reserved_amount") and e.HasField("consumed_amount"):
        entry["reading"] = reading(e, shown)
    if e.HasField("policy_limit_amount"):
        # The window's limit was the policy's plus grants made over the API (1-5-0).
        entry["policy_limit"] = shown(e.policy_limit_amount)
        entry["granted"] = shown(sum(g.amount for g in e.grants))
        entry["grants"] = [{"revision": g.revision, "amount": shown(g.amount), "actor": g.actor, "reason": g.reason} for g in e.grants]
    return entry


def reading(e: decisions_pb2.Decision.Evaluation, shown: Any) -> Fields:
    """The ledger key as the decision read it, shown in the evaluation's unit and, so the
    decision can be recomputed exactly, in the ledger's own integers."""
    remaining = e.limit_amount - e.reserved_amount - e.consumed_amount
    return {
        "limit": shown(e.limit_amount),
        "reserved": shown(e.reserved_amount),
        "consumed": shown(e.consumed_amount),
        "remaining": shown(remaining),
        "limit_amount": e.limit_amount,
        "reserved_amount": e.reserved_amount,
        "consumed_amount": e.consumed_amount,
    }


def _charge(c: reconciliations_pb2.Reconciliation.WindowCharge) -> Fields:
    unit = Unit(c.unit) if c.unit in Unit._value2member_map_ else None
    entry: Fields = {
        "ledger_key": c.ledger_key,
        "scope_id": c.scope_id,
        "unit": c.unit,
        "amount": display(unit, c.amount) if unit is not None else float(c.amount),
    }
    if c.policy_id:
        entry["policy_id"] = c.policy_id
    if c.ledger_key:
        entry["window_key"] = window_key(c.ledger_key)
    if c.HasField("window_start"):
        entry["window_start"] = timestamp_text(c.window_start)
    if c.HasField("window_end"):
        entry["window_end"] = timestamp_text(c.window_end)
    return entry


def deficit_gpu_hours(deficit: int, projected: int, projected_gpu: int) -> float:
    """A budget's shortfall scaled to the run's GPU-hours: exact for GPU-hour budgets, and the
    same share of the run for node-hour, wall-hour and cost budgets."""
    if deficit <= 0 or projected <= 0:
        return 0.0
    return round(projected_gpu * min(deficit / projected, 1.0) / MILLI_PER_HOUR, 6)


def window_key(ledger_key: str) -> str:
    """The window part of a ledger key `<scope>|<window>|<unit>` (`<start>/<end>` or `rolling-<n>d`)."""
    try:
        return LedgerKey.parse(ledger_key).window_key
    except ValueError:
        return ""


def normalized_state(state: str) -> str:
    """A reconciler's final state in one spelling: `completed`, `Completed` -> `COMPLETED`."""
    return state.strip().upper().replace("-", "_").replace(" ", "_").removeprefix("LIFECYCLE_TYPE_")


def timestamp_text(stamp: Timestamp) -> str:
    """A protobuf timestamp as ISO 8601 in UTC."""
    return stamp.ToDatetime(tzinfo=UTC).isoformat()


def event_time(stamp: Timestamp) -> datetime:
    """A message's event time (UTC), or now for a producer that left it out."""
    if stamp.seconds == 0 and stamp.nanos == 0:
        return datetime.now(UTC)
    return stamp.ToDatetime(tzinfo=UTC)
