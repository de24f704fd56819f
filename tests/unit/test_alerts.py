"""deploy/prometheus/alerts.yml: Prometheus's rule-file structure, every expression parsed by a
PromQL parser, and every metric it reads exported by budgetgate."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import promql_parser
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "alerts.yml"
BUDGET_LABELS = {"policy_id", "scope_id", "unit"}
# Prometheus's own series.
BUILTIN = {"up"}
# What the OpenTelemetry Prometheus exporter appends to an instrument's name.
SUFFIXES = re.compile(r"(_bucket|_sum|_count)?$")


@pytest.fixture(scope="module")
def rules() -> list[dict[str, Any]]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    assert len({g["name"] for g in groups}) == len(groups), "group names must be unique"
    return [rule for group in groups for rule in group["rules"]]


def _selectors(expr: str) -> list[Any]:
    found: list[Any] = []
    promql_parser.walk(promql_parser.parse(expr), lambda node: found.append(node) if isinstance(node, promql_parser.VectorSelector) else None)
    return found


def _instrument(series: str) -> str:
    """The instrument name the code declares, from the series name Prometheus stores."""
    name = SUFFIXES.sub("", series)
    return name.removesuffix("_total").removesuffix("_seconds")


def _exported_in_source() -> str:
    return "\n".join(p.read_text() for folder in ("libs", "services") for p in (ROOT / folder).rglob("*.py"))


def test_every_rule_is_a_well_formed_alert(rules: list[dict[str, Any]]) -> None:
    assert rules
    names = [rule["alert"] for rule in rules]
    assert len(names) == len(set(names)), "alert names must be unique"
    for rule in rules:
        assert set(rule) <= {"alert", "expr", "for", "keep_firing_for", "labels", "annotations"}, rule["alert"]
        assert rule["labels"]["severity"] in {"warning", "critical"}, rule["alert"]
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], rule["alert"]
        if "for" in rule:
            assert promql_parser.parse_duration(rule["for"]).total_seconds() > 0, rule["alert"]
        for text in rule["annotations"].values():
            assert text.count("{{") == text.count("}}"), f"{rule['alert']}: unbalanced template"


def test_every_expression_parses_and_reads_an_exported_metric(rules: list[dict[str, Any]]) -> None:
    source = _exported_in_source()
    for rule in rules:
        selectors = _selectors(rule["expr"])
        assert selectors, f"{rule['alert']} reads no series"
        for selector in selectors:
            name = selector.name
            if name in BUILTIN:
                continue
            assert f'"{_instrument(name)}"' in source, f"{rule['alert']} reads {name}, which no budgetgate code exports"


def test_a_broken_expression_does_not_parse() -> None:
    with pytest.raises(ValueError):
        promql_parser.parse("max by (policy_id (budgetgate_budget_committed_ratio) >= 0.8")


def test_budget_alerts_cover_80_percent_100_percent_and_holds_per_budget(rules: list[dict[str, Any]]) -> None:
    by_name = {rule["alert"]: rule for rule in rules}
    expectations = {"BudgetCommitted80Percent": ("budgetgate_budget_committed_ratio", "0.8"), "BudgetFull": ("budgetgate_budget_committed_ratio", "1"),
                    "BudgetConsumed80Percent": ("budgetgate_budget_consumed_ratio", "0.8"), "BudgetExhausted": ("budgetgate_budget_consumed_ratio", "1"),
                    "BudgetHeld": ("budgetgate_budget_held", "1")}  # fmt: skip
    for alert, (metric, threshold) in expectations.items():
        expr = by_name[alert]["expr"]
        assert [s.name for s in _selectors(expr)] == [metric]
        assert re.search(rf"(>=|==) {re.escape(threshold)}\b", expr), f"{alert}: {expr}"
        # One alert per budget, however many admission replicas export the gauge.
        grouping = re.search(r"max by \(([^)]*)\)", expr)
        assert grouping and {g.strip() for g in grouping.group(1).split(",")} == BUDGET_LABELS, alert


def test_the_pipeline_is_watched(rules: list[dict[str, Any]]) -> None:
    read = {_instrument(s.name) for rule in rules for s in _selectors(rule["expr"])}
    for metric in (
        "up",
        "budgetgate_evidence_oldest_undelivered_age",
        "budgetgate_ledger_drift_keys",
        "budgetgate_reconciliation_lag",
        "budgetgate_metering_rejections",
        # A dead-lettered settlement leaves its reservation held: budget nobody will use.
        "budgetgate_reconciler_dead_lettered",
    ):
        assert metric in read, f"no alert reads {metric}"


def test_a_dead_lettered_settlement_alerts_until_it_is_resolved(rules: list[dict[str, Any]]) -> None:
    # What a dead-lettered settlement holds stays held until an operator resolves it: the alert
    # reads how many are dead-lettered now, and so fires as long as one is. Counting the dead
    # letters of the last hour went quiet an hour later, the hold still held.
    [rule] = [r for r in rules if r["alert"] == "BudgetgateSettlementDeadLettered"]
    assert [s.name for s in _selectors(rule["expr"])] == ["budgetgate_reconciler_dead_lettered"]
    # Above zero; one alert however many reconcilers export the gauge (each counts them all).
    assert re.fullmatch(r"max\(budgetgate_reconciler_dead_lettered\) > 0", rule["expr"].strip()), rule["expr"]
    assert "for" not in rule or promql_parser.parse_duration(rule["for"]).total_seconds() <= 300
    assert "budgetgate settlements" in rule["annotations"]["description"]
