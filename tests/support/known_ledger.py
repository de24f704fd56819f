"""A small known ledger in this month for the page for tenants and finance: an account tree
(acme > research > vision, nlp), two scope budgets and one attached to research, two metered runs and one with a label made to break
HTML, written as admission, metering-ingest and the reconciler would have left them, plus the
figures the page must show for it."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime, timedelta

import asyncpg

from budgetgate.core.evaluation import ledger_key
from budgetgate.core.units import MILLI_PER_HOUR as H
from budgetgate.core.windows import window_at
from budgetgate.core.loader import build_bundle, parse_text
from tests.support.admission import apply_policies, budget_yaml

SHA = "d" * 40
EVIL = '<script>alert("x")</script>'
POLICIES = {
    "rates.yaml": """apiVersion: budgetgate/v1
kind: RateCard
metadata: {id: rates/ui}
spec:
  currency: USD
  rates:
    - {flavor: h100, rate_per_gpu_hour: 2.5}
    - {flavor: a100, rate_per_gpu_hour: 1}
""",
    "accounts.yaml": """apiVersion: budgetgate/v1
kind: Account
metadata: {id: acme}
spec: {level: organisation}
---
apiVersion: budgetgate/v1
kind: Account
metadata: {id: research}
spec: {level: department, parent: acme}
---
apiVersion: budgetgate/v1
kind: Account
metadata: {id: vision}
spec: {level: team, parent: research, scope: {namespace: vision-prod, labels: {team: vision}}}
---
apiVersion: budgetgate/v1
kind: Account
metadata: {id: nlp}
spec: {level: team, parent: research, scope: {namespace: nlp-prod, labels: {team: nlp}}}
""",
    "budgets.yaml": budget_yaml("gpu/vision", limit="gpu_hours: 100")
    + "---\n"
    + budget_yaml("gpu/nlp", namespace="nlp-prod", labels="{team: nlp}", limit="gpu_hours: 50")
    + "---\napiVersion: budgetgate/v1\nkind: BudgetPolicy\nmetadata: {id: gpu/research}\n"
    + "spec: {account: research, window: {calendar: month}, limit: {gpu_hours: 500}}\n",
}
# run: namespace, team, flavor, budgets reserved on, projected GPU-hours, held, metered GPU-hours (observed an hour after the month's start and on)
RUNS = {
    "ui/vision-1": ("vision-prod", "vision", "h100", ("gpu/vision", "gpu/research"), 10, False, 6),
    "ui/nlp-1": ("nlp-prod", "nlp", "a100", ("gpu/nlp", "gpu/research"), 20, True, 4),
    "ui/evil-1": ("lab", EVIL, "h100", (), 1, False, 0),
}
# What the page must show: each budget's consumed / limit / reserved (GPU-hours), and each account's roll-up (GPU-hours, USD, reserved GPU-hours).
BUDGETS = {"gpu/vision": (6.0, 100.0, 0.0), "gpu/nlp": (4.0, 50.0, 20.0), "gpu/research": (10.0, 500.0, 20.0)}
ACCOUNTS = {"acme": (10.0, 19.0, 16.0), "research": (10.0, 19.0, 16.0), "vision": (6.0, 15.0, 0.0), "nlp": (4.0, 4.0, 16.0)}


def month_start(now: datetime | None = None) -> datetime:
    now = now or datetime.now(UTC)
    return datetime(now.year, now.month, 1, tzinfo=UTC)


async def write_known_ledger(dsn: str) -> None:
    """The policies applied and the runs above recorded, in the current month."""
    await apply_policies(dsn, POLICIES, sha=SHA)
    bundle = build_bundle([doc for name, text in POLICIES.items() for doc in parse_text(text, name)], git_sha=SHA)
    start, now = month_start(), datetime.now(UTC)
    keys = {p.id: ledger_key(p, window_at(p.window, now)) for p in bundle.policies}
    consumed = {p: 0 for p in keys}
    for _run, (_ns, _team, _flavor, budgets, _projected, _held, metered) in RUNS.items():
        for budget in budgets:
            consumed[budget] += metered * H
    conn = await asyncpg.connect(dsn)
    try:
        for policy in bundle.policies:
            window = window_at(policy.window, now)
            await conn.execute(
                "INSERT INTO ledger_entries (ledger_key, scope_id, unit, window_key, window_start, window_end, policy_id, policy_git_sha, "
                "limit_amount, consumed) VALUES ($1, $2, 'gpu_hours', $3, $4, $5, $6, $7, $8, $9)",
                keys[policy.id], policy.scope.scope_id, window.key, window.start, window.end, policy.id, SHA, policy.limit.amount, consumed[policy.id],
            )  # fmt: skip
        for n, (run_id, (namespace, team, flavor, budgets, projected, held, metered)) in enumerate(RUNS.items()):
            decision_id, decided = uuid.uuid4(), start + timedelta(minutes=10 + n)
            labels = {"team": team, "user": "alice"}
            request = {"run_id": run_id, "attempt": 1, "namespace": namespace, "labels": labels}
            response = {"run_id": run_id, "attempt": 1, "decision": "ALLOW", "reason": f"fits every budget of {team}", "decided_at": decided.isoformat()}
            await conn.execute(
                "INSERT INTO decisions (decision_id, run_id, attempt, outcome, reason, namespace, labels, projected_gpu, request, response, "
                "decided_at, flavor, policy_bundle_sha) VALUES ($1, $2, 1, 'ALLOW', $3, $4, $5, $6, $7, $8, $9, $10, $11)",
                decision_id, run_id, response["reason"], namespace, json.dumps(labels), projected * H, json.dumps(request), json.dumps(response),
                decided, flavor, SHA,
            )  # fmt: skip
            for budget in budgets:
                await conn.execute(
                    "INSERT INTO reservations (run_id, ledger_key, decision_id, amount, state, expected_end) VALUES ($1, $2, $3, $4, $5, $6)",
                    run_id, keys[budget], decision_id, projected * H, "held" if held else "reconciled", decided + timedelta(hours=projected),
                )  # fmt: skip
            if metered:
                await conn.execute(
                    "INSERT INTO usage_records (run_id, sample_id, observed_at, gpu_milli_hours, node_milli_hours, gpu_milli_hours_cumulative, "
                    "node_milli_hours_cumulative, gpu_milli_hours_delta, node_milli_hours_delta, late, exporter, source, event_id) "
                    "VALUES ($1, 's1', $2, $3, 0, $3, 0, $3, 0, false, 'test', 'http', $1)",
                    run_id, start + timedelta(hours=1 + n), metered * H,
                )  # fmt: skip
                await conn.execute(
                    "INSERT INTO usage_runs (run_id, gpu_milli_hours_cumulative, node_milli_hours_cumulative) VALUES ($1, $2, 0)", run_id, metered * H
                )
    finally:
        await conn.close()
