"""What docs/evidence.md and the provisioning files promise about evidence matches the code."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml
from openlineage.client.event_v2 import RunState

from budgetgate.evidence import events, facet

ROOT = Path(__file__).resolve().parents[2]
GRAFANA = ROOT / "deploy" / "grafana"


def readme_section() -> str:
    return (ROOT / "docs" / "evidence.md").read_text()


def test_readme_mapping_is_the_code_mapping() -> None:
    rows = re.findall(r"^\| (.+?) \| `([A-Z]+)` \|$", readme_section(), re.M)
    documented = {}
    for source, event_type in rows:
        for name in re.findall(r"`([A-Z_]+)`", source):
            documented.setdefault(source.split()[0], {})[name] = event_type
    assert {d: RunState(t) for d, t in documented["decision"].items()} == dict(events.DECISION_EVENT_TYPES)
    for state, event_type in documented["reconciliation"].items():
        assert events.reconciliation_event_type(state, terminal_sent=False) is RunState(event_type), state
    assert events.reconciliation_event_type("", terminal_sent=False) is RunState.RUNNING


def test_readme_names_the_schema_url_and_the_file_holds_it() -> None:
    assert facet.SCHEMA_URL in readme_section()
    # https://budgetgate.dev/schemas/<path> is published from schemas/<path>.
    schema = json.loads((ROOT / "schemas" / facet.SCHEMA_ID.removeprefix(facet.SCHEMA_BASE)).read_text())
    assert schema["$id"] == facet.SCHEMA_ID and "BudgetRunFacet" in schema["$defs"]


def test_every_panel_uses_a_provisioned_datasource() -> None:
    provisioned = {d["uid"] for f in (GRAFANA / "datasources").glob("*.yaml") for d in yaml.safe_load(f.read_text())["datasources"]}
    boards = [json.loads(p.read_text()) for p in sorted((GRAFANA / "dashboards").glob("*.json"))]
    assert len({b["uid"] for b in boards}) == len(boards) >= 2
    for board in boards:
        ids = [p["id"] for p in board["panels"]]
        assert len(ids) == len(set(ids)), board["uid"]
        for panel in board["panels"]:
            uids = {panel["datasource"]["uid"], *(t["datasource"]["uid"] for t in panel["targets"])}
            assert uids <= provisioned, (board["uid"], panel["title"])


def test_the_dashboard_provider_reads_where_compose_mounts() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    mount = next(v for v in compose["services"]["grafana"]["volumes"] if v.startswith("./deploy/grafana:"))
    target = mount.split(":")[1]
    providers = yaml.safe_load((GRAFANA / "dashboards" / "budgetgate.yaml").read_text())["providers"]
    assert [p["options"]["path"] for p in providers] == [f"{target}/dashboards"]
    home = compose["services"]["grafana"]["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert (GRAFANA / home.removeprefix(target + "/")).is_file()
    emitter = compose["services"]["evidence_emitter"]
    assert emitter["environment"]["OPENLINEAGE_URL"] == "http://marquez:5000" and "marquez" in emitter["depends_on"]
