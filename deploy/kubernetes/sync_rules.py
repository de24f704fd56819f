"""Write deploy/kubernetes/base/prometheusrule.yaml from deploy/prometheus/alerts.yml (one set of
alert rules for docker-compose's Prometheus and the Prometheus Operator).

    python deploy/kubernetes/sync_rules.py
"""

from __future__ import annotations

from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
SOURCE = ROOT / "deploy" / "prometheus" / "alerts.yml"
TARGET = ROOT / "deploy" / "kubernetes" / "base" / "prometheusrule.yaml"
HEADER = """\
# The alert rules of deploy/prometheus/alerts.yml for the Prometheus Operator. Generated: edit
# alerts.yml, then run `python deploy/kubernetes/sync_rules.py` (tests/unit/test_kubernetes.py
# fails while the two differ).
"""


def render() -> str:
    groups = yaml.safe_load(SOURCE.read_text())["groups"]
    rule = {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {"name": "budgetgate", "labels": {"app.kubernetes.io/name": "budgetgate"}},
        "spec": {"groups": groups},
    }
    return HEADER + yaml.safe_dump(rule, sort_keys=False, width=200, allow_unicode=True)


if __name__ == "__main__":
    TARGET.write_text(render())
