"""One truth for alerts: one budget driven across 80 % and 100 % committed, then 80 % and 100 %
consumed, and at each step the CLI (`budgetgate budgets --json`), the Prometheus gauges, the alert
rules evaluated on those gauges, and the THRESHOLD_ALERT actions say the same thing
(core/thresholds.py)."""

from __future__ import annotations

import asyncio
import json
import re
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import yaml
from click.testing import CliRunner

from budgetgate.cli.main import cli
from budgetgate.v1 import actions_pb2
from tests.support.admission import apply_policies, budget_yaml, submission
from tests.support.reconciler import feed, lifecycle, outbox, reconciler_factory, usage, wait_caught_up  # noqa: F401 - pytest fixtures
from tests.support.waiting import wait_for

RULES = Path(__file__).resolve().parents[2] / "deploy" / "prometheus" / "alerts.yml"
BUDGET_RULES = {"BudgetCommitted80Percent", "BudgetFull", "BudgetConsumed80Percent", "BudgetExhausted"}
_EXPR = re.compile(r"^max by \([^)]*\) \((\w+)\) >= ([0-9.]+)(?: < ([0-9.]+))?$")


def _firing(metrics: dict[str, float]) -> set[str]:
    """The budget rules of alerts.yml whose expression holds on `metrics` (this budget's gauges)."""
    rules = [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"] if r["alert"] in BUDGET_RULES]
    assert {r["alert"] for r in rules} == BUDGET_RULES
    firing = set()
    for rule in rules:
        match = _EXPR.match(rule["expr"])
        assert match, f"{rule['alert']}: an expression of another shape than this test evaluates: {rule['expr']}"
        value = metrics[match.group(1)]
        if value >= float(match.group(2)) and (match.group(3) is None or value < float(match.group(3))):
            firing.add(rule["alert"])
    return firing


async def test_cli_gauges_rules_and_actions_say_the_same_at_80_and_100_percent_of_each_measure(  # type: ignore[no-untyped-def]
    admission_factory, reconciler_factory, feed, pg_dsn
) -> None:
    await apply_policies(pg_dsn, {"b.yaml": budget_yaml("team", labels="{team: vision}", limit="gpu_hours: 10")}, sha="c" * 40)
    admission = await admission_factory()
    await admission.wait_ready()
    reconciler = await reconciler_factory()

    async def submit(run_id: str, gpus: int, hours: float) -> None:
        body = submission(run_id=run_id, resources={"gpus": gpus, "nodes": 1, "flavor": "h100"}, projected_runtime_hours=hours)
        answer = (await admission.client.post("/v1/admissions", json=body)).json()
        assert answer["decision"] == "ALLOW", answer

    async def settle(run_id: str, gpus: int, hours: float) -> None:
        start = datetime.now(UTC) - timedelta(hours=hours, minutes=1)
        await feed.send(
            lifecycle(run_id, "STARTED", start, gpus=gpus),
            usage(run_id, "s1", start + timedelta(hours=hours), gpus * hours),
            lifecycle(run_id, "COMPLETED", start + timedelta(hours=hours)),
        )
        await wait_caught_up(reconciler)

    async def cli_line() -> dict[str, Any]:
        shown = await asyncio.to_thread(CliRunner().invoke, cli, ["budgets", "--json"], env={"BUDGETGATE_POSTGRES_DSN": pg_dsn})
        assert shown.exit_code == 0, shown.output
        [line] = json.loads(shown.stdout)["budgets"]
        return line

    async def gauges() -> dict[str, float]:
        await admission.rt.board.refresh()
        text = (await admission.client.get("/metrics")).text
        found = {}
        for name in ("budgetgate_budget_committed_ratio", "budgetgate_budget_consumed_ratio"):
            match = re.search(rf'^{name}\{{[^}}]*policy_id="team"[^}}]*\}} (\S+)$', text, re.M)
            assert match, f"{name} not in /metrics"
            found[name] = float(match.group(1))
        return found

    async def actions() -> set[str]:
        sent = await outbox(pg_dsn, "budget.actions.v1", actions_pb2.BudgetAction)
        alerts = [a for a in sent if a.type == actions_pb2.THRESHOLD_ALERT]
        named = [f"{a.measure} {a.threshold_percent}%" for a in alerts]
        assert len(named) == len(set(named)), f"an alert was sent twice: {named}"
        return set(named)

    async def everyone_says(alerts: set[str], *, committed: float, consumed: float, state: str, firing: set[str]) -> None:
        # The action feed follows at the reconciler's next tick (0.2 s here): wait for it, then
        # read all four at the same moment.
        await wait_for(lambda: _equal(actions(), alerts), what=f"THRESHOLD_ALERT actions {sorted(alerts)}")
        line = await cli_line()
        assert (line["committed_percent"], line["consumed_percent"], line["state"]) == (committed, consumed, state)
        assert set(line["alerts"]) == alerts
        measured = await gauges()
        assert measured == {"budgetgate_budget_committed_ratio": committed / 100, "budgetgate_budget_consumed_ratio": consumed / 100}
        assert _firing(measured) == firing
        assert await actions() == alerts

    await submit("a", gpus=2, hours=4)  # 8 of 10 GPU-hours committed
    await everyone_says({"committed 80%"}, committed=80.0, consumed=0.0, state="alerting", firing={"BudgetCommitted80Percent"})
    await submit("b", gpus=1, hours=2)  # 10 of 10: full, nothing consumed yet
    await everyone_says({"committed 80%", "committed 100%"}, committed=100.0, consumed=0.0, state="full", firing={"BudgetFull"})
    await settle("a", gpus=2, hours=4)  # a's 8 GPU-hours are actuals now
    await everyone_says(
        {"committed 80%", "committed 100%", "consumed 80%"}, committed=100.0, consumed=80.0, state="full", firing={"BudgetFull", "BudgetConsumed80Percent"}
    )
    await settle("b", gpus=1, hours=2)
    await everyone_says(
        {"committed 80%", "committed 100%", "consumed 80%", "consumed 100%"}, committed=100.0, consumed=100.0, state="exhausted",
        firing={"BudgetFull", "BudgetExhausted"},
    )  # fmt: skip


async def _equal(found: Any, wanted: set[str]) -> bool:
    return await found == wanted
