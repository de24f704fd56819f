"""A recorded decision recomputed from its recorded inputs — the submission, the policy bundle at
its SHA and the readings stored with it — by the same code admission decides with
(deciding.prepare and deciding.conclude), and told in plain language: explain and replay."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

import orjson

from budgetgate.core.accounting import BudgetSource
from budgetgate.core.evaluation import Decision, deciding_index, describe
from budgetgate.core.policy import Enforcement, PolicyBundle
from budgetgate.core.windows import iso
from budgetgate.ledger.archive import archives_within
from budgetgate.ledger.queries import owned_by
from budgetgate.policies.policy_store import PolicyStore
from budgetgate.decisions.deciding import (
    Disagreement,
    InvalidSubmission,
    conclude,
    prepare,
    rebuilt_outlooks,
    rebuilt_result,
    rebuilt_usage,
)
from budgetgate.decisions.rendering import canonical, response_body
from budgetgate.contracts.admission import AdmissionRequest

sql = owned_by("budgetgate.decisions")

NOT_REPLAYABLE = "recorded before decisions carried their readings (migration 0014): its ledger readings are unknown"
_COMPARED_OUT = ("replayed",)


@dataclass
class Recomputed:
    """A stored decision beside its recomputation; `replayable` False when it cannot be recomputed."""

    row: dict[str, Any]
    stored: dict[str, Any]
    replayable: bool
    recomputed: dict[str, Any] | None = None
    decision: Decision | None = None
    differences: list[str] = field(default_factory=list)
    why_not: str | None = None

    @property
    def identical(self) -> bool | None:
        return None if not self.replayable else not self.differences

    def mismatch(self) -> dict[str, Any]:
        return {"run_id": self.row["run_id"], "attempt": self.row["attempt"], "decision_id": str(self.row["decision_id"]),
                "decided_at": self.stored.get("decided_at"), "stored": self.stored.get("decision"),
                "recomputed": (self.recomputed or {}).get("decision"), "reason": "; ".join(self.differences)}  # fmt: skip


def _json(value: Any) -> Any:
    return orjson.loads(value) if isinstance(value, str | bytes) else value


def recompute(row: dict[str, Any], bundle: PolicyBundle | None) -> Recomputed:
    """Recompute the decision of `row` (a decisions row with request, response, decided_at and
    readings) under `bundle`, the bundle at its SHA."""
    stored = canonical(dict(_json(row["response"])))
    stored["replayed"] = False
    recorded = _json(row["readings"])
    if recorded is None:
        return Recomputed(row, stored, replayable=False, why_not=NOT_REPLAYABLE)
    if bundle is None:
        return Recomputed(row, stored, replayable=False, why_not=f"policy bundle {row['policy_bundle_sha']} is not stored")
    decided_at: datetime = row["decided_at"]
    request = AdmissionRequest.model_validate(_json(row["request"]))
    try:
        p = prepare(bundle, request, decided_at, tenant_label=recorded.get("tenant_label", "team"), leased=recorded.get("leased", False))
        p = replace(p, accounting=BudgetSource.recorded(recorded.get("accounting")))
        decision, view = conclude(p, rebuilt_result(recorded), rebuilt_outlooks(recorded), rebuilt_usage(recorded, decided_at))
    except (Disagreement, InvalidSubmission, KeyError, ValueError) as exc:
        return Recomputed(row, stored, replayable=True, differences=[f"cannot be recomputed from its readings: {exc}"])
    body = response_body(plan=p.plan, decision=decision, decision_id=stored["decision_id"], decided_at=decided_at, standing=view)
    body = canonical(orjson.loads(orjson.dumps(body)))
    for added in ("override_revision", "accounting"):  # answers recorded before they were
        if added not in stored:
            body.pop(added, None)
    found = differences(stored, body) + amount_differences(_json(row.get("amounts")) or {}, decision)
    return Recomputed(row, stored, replayable=True, recomputed=body, decision=decision, differences=found)


def amount_differences(stored: dict[str, list[Any]], decision: Decision) -> list[str]:
    """Where the stored evaluations' amounts, in the ledger's own units, differ from the
    recomputed ones: the answer shows hours and cents, which can hide a difference of one unit."""
    names = ("outcome", "limit", "projected", "remaining", "admitted", "deficit")
    found = []
    for e in decision.evaluations:
        before = stored.get(e.policy_id)
        if before is None:
            continue  # a decision recorded without evaluations' rows: the answer alone compares
        after = [e.outcome, e.limit, e.projected, e.remaining, e.admitted, e.deficit]
        found += [f"{e.policy_id} {name} (ledger units): stored {a!r}, recomputed {b!r}" for name, a, b in zip(names, before, after, strict=True) if a != b]
    return found


def differences(stored: Any, recomputed: Any, path: str = "") -> list[str]:
    """Where two answers differ, as `path: stored X, recomputed Y` (the decision first)."""
    if isinstance(stored, dict) and isinstance(recomputed, dict):
        keys = [k for k in ("decision", "reason") if k in stored or k in recomputed]
        keys += [k for k in {**stored, **recomputed} if k not in keys and k not in _COMPARED_OUT]
        return [d for k in keys for d in differences(stored.get(k), recomputed.get(k), f"{path}.{k}" if path else k)]
    if isinstance(stored, list) and isinstance(recomputed, list) and len(stored) == len(recomputed):
        return [d for i, (a, b) in enumerate(zip(stored, recomputed, strict=True)) for d in differences(a, b, f"{path}[{i}]")]
    return [] if stored == recomputed else [f"{path}: stored {stored!r}, recomputed {recomputed!r}"]


def explanation(found: Recomputed, bundle: PolicyBundle | None) -> dict[str, Any]:
    """The explain answer: stored and recomputed side by side, and a plain-language account."""
    row = found.row
    recorded = _json(row["readings"]) or {}
    readings = [{**r, "remaining": r["limit"] - r["reserved"] - r["consumed"]} for r in recorded.get("ledger", [])]
    return {
        "run_id": row["run_id"],
        "attempt": row["attempt"],
        "decision_id": str(row["decision_id"]),
        "policy_bundle_sha": row["policy_bundle_sha"],
        "replayable": found.replayable,
        "identical": found.identical,
        "differences": found.differences if found.replayable else [found.why_not],
        "stored": found.stored,
        "recomputed": found.recomputed,
        "readings": readings,
        "account": account(found, bundle, readings),
    }


def account(found: Recomputed, bundle: PolicyBundle | None, readings: list[dict[str, Any]]) -> list[str]:
    """The decision told in sentences: what matched and why, each budget's figures, what decided."""
    row, stored = found.row, found.stored
    request = _json(row["request"])
    lines = [
        f"Run {row['run_id']!r} attempt {row['attempt']} was decided {stored['decision']} at {stored['decided_at']} "
        f"under policy bundle {row['policy_bundle_sha']}."
    ]
    if not found.replayable:
        lines.append(f"It cannot be recomputed: {found.why_not}.")
    elif found.identical:
        lines.append("Recomputed from the recorded submission, bundle and readings, it comes out identical.")
    else:
        lines.append("Recomputed from the recorded submission, bundle and readings, it differs: " + "; ".join(found.differences) + ".")
    labels = request.get("labels", {})
    if bundle is not None:
        for policy in bundle.policies:
            scope = policy.scope
            if not scope.covers_namespace(request["namespace"]):
                continue
            where = f"namespace {request['namespace']!r} is " + (
                f"one of its namespaces ({', '.join(sorted(scope.namespaces))})" if scope.namespaces else "covered (it names no namespace)"
            )
            missing = scope.missing_labels(labels)
            if missing and scope.namespaces:
                # A soft or dry-run policy never blocks: its violation is a waived evaluation.
                waived = f"which is recorded, not enforced (a {policy.enforcement} policy never blocks)"
                verdict = "so it denies" if policy.enforcement is Enforcement.HARD else waived
                lines.append(f"Policy {policy.id!r} applies: {where}, but the submission lacks its required label(s) {', '.join(missing)}, {verdict}.")
            elif missing:
                lines.append(f"Policy {policy.id!r} does not apply: the submission lacks label(s) {', '.join(missing)}.")
            else:
                wanted = ", ".join(f"{k}={labels.get(k)}" for k in sorted(scope.labels)) or "none required"
                lines.append(f"Policy {policy.id!r} ({policy.enforcement}, on exhaustion {policy.on_exhausted}) matched: {where}; labels {wanted}.")
    by_key = {r["ledger_key"]: r for r in readings}
    evaluations = found.decision.evaluations if found.decision else ()
    for e in evaluations:
        r = by_key.get(e.ledger_key or "")
        if r is None:
            continue
        currency = stored.get("currency")
        fig = lambda amount: describe(e.unit, amount, currency)  # noqa: E731
        verdict = (
            "it fits" if e.outcome == "ALLOW" and (e.deficit is None) else f"{e.outcome}" + (f", short by {fig(e.deficit)}" if e.deficit is not None else "")
        )
        window = f"{iso(e.window_start)} to {iso(e.window_end)}" if e.window_start and e.window_end else "its window"
        lines.append(
            f"Budget {e.policy_id!r} (window {window}): limit {fig(r['limit'])}, reserved {fig(r['reserved'])}, consumed {fig(r['consumed'])}, "
            f"remaining {fig(r['remaining'])} at that instant; this run needs {fig(e.projected)}: {verdict}."
        )
    if found.decision is not None:
        index = deciding_index(found.decision)
        if index is None:
            lines.append("No budget policy applied, so nothing could refuse it.")
        else:
            lines.append(f"Deciding: {found.decision.evaluations[index].policy_id!r} — {found.decision.reason}")
    return lines


async def replay(conn: Any, *, since: datetime, scope: str | None = None) -> dict[str, Any]:
    """Recompute every decision recorded from `since` on (only those with an evaluation on
    `scope`, a scope id or policy id, when given), in the order they were made, each from its
    own recorded readings: how many were replayed, which could not be, every mismatch, and, when
    there are any, the months of the period that are archived (`archived`: their decisions are
    not in Postgres to replay)."""
    bundles = PolicyStore()
    replayed, not_replayable, mismatches = 0, [], []
    async with conn.transaction():
        async for row in conn.cursor(sql("decisions_since"), since, scope, prefetch=500):
            found = recompute(dict(row), await bundles.under(conn, row["policy_bundle_sha"], row["override_revision"]))
            if not found.replayable:
                not_replayable.append({"run_id": row["run_id"], "attempt": row["attempt"], "decision_id": str(row["decision_id"]), "reason": found.why_not})
                continue
            replayed += 1
            if found.differences:
                mismatches.append(found.mismatch())
    report: dict[str, Any] = {"replayed": replayed, "mismatches": mismatches, "not_replayable": not_replayable}
    archived = await archives_within(conn, "decisions", since)
    if archived:  # only then: a period Postgres holds whole reads as it always did
        report["archived"] = archived
    return report
