"""deploy/kubernetes/meter: valid against the Kubernetes schemas, one meter replaced with Recreate,
its state on a PersistentVolumeClaim where its --state points, its role allows the reads it
makes and nothing more, and the network policies let it reach the API server, the exporters and
Kafka."""

from __future__ import annotations

import importlib.util
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import yaml

METER = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes" / "meter"
BASE = METER.parent / "base"
DEPLOYMENT = "Deployment/budgetgate-meter-dcgm"


def docs() -> dict[str, dict[str, Any]]:
    kustomization = yaml.safe_load((METER / "kustomization.yaml").read_text())
    assert sorted(kustomization["resources"]) == sorted(p.name for p in METER.glob("*.yaml") if p.name != "kustomization.yaml")
    return {f"{d['kind']}/{d['metadata']['name']}": d for name in kustomization["resources"] for d in yaml.safe_load_all((METER / name).read_text())}


def pod_spec() -> dict[str, Any]:
    return docs()[DEPLOYMENT]["spec"]["template"]["spec"]


def meter_params() -> dict[str, Any]:
    """The meter's options as its command line gives them (parsed by the command itself)."""
    from budgetgate.cli.meter import dcgm

    (container,) = pod_spec()["containers"]
    command = container["command"]
    assert command[:6] == ["python", "-m", "budgetgate.cli.main", "meter", "dcgm", "--discover"]
    return dcgm.make_context("dcgm", list(command[5:])).params


def test_manifests_are_valid_and_wired() -> None:
    found = docs()
    for doc in found.values():
        kubernetes_validate.validate(doc, "1.30.0", strict=True)
    deployment = found[DEPLOYMENT]
    assert deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"] == {"type": "Recreate"}
    spec = pod_spec()
    assert spec["serviceAccountName"] == "budgetgate-meter" and spec["automountServiceAccountToken"] is True
    binding = found["ClusterRoleBinding/budgetgate-meter"]
    assert binding["roleRef"]["name"] == "budgetgate-meter" and binding["subjects"][0]["name"] == spec["serviceAccountName"]
    (container,) = spec["containers"]
    assert importlib.util.find_spec(container["command"][2]) is not None
    from click.testing import CliRunner

    from budgetgate.cli.main import cli

    assert CliRunner().invoke(cli, [*container["command"][3:], "--help"]).exit_code == 0
    assert {"configMapRef": {"name": "budgetgate-config"}} in container["envFrom"]  # the Kafka bootstrap and topic prefix


def test_the_state_is_on_a_claim_where_the_meter_keeps_it() -> None:
    found = docs()
    spec = pod_spec()
    (container,) = spec["containers"]
    params = meter_params()
    assert params["discover_namespace"] == "gpu-operator" and params["no_state"] is False
    state = PurePosixPath(str(params["state_file"]))
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    (mount,) = [path for path in mounts if state.is_relative_to(path)]
    claim = volumes[mounts[mount]]["persistentVolumeClaim"]["claimName"]
    assert found[f"PersistentVolumeClaim/{claim}"]["spec"]["accessModes"] == ["ReadWriteOnce"]
    assert spec["securityContext"]["fsGroup"] == spec["securityContext"]["runAsUser"]  # the volume is writable by the meter


def test_the_role_allows_what_the_meter_reads_and_nothing_more() -> None:
    rules = docs()["ClusterRole/budgetgate-meter"]["rules"]
    allowed = {(group, resource, verb) for rule in rules for group in rule["apiGroups"] for resource in rule["resources"] for verb in rule["verbs"]}
    assert {("", "pods", "get"), ("", "pods", "list")} <= allowed
    assert not any(verb not in {"get", "list", "watch"} for _, _, verb in allowed)


def _egress_ports(policies: list[dict[str, Any]], labels: dict[str, str]) -> set[tuple[str, int]]:
    selecting = [p for p in policies if "Egress" in p["spec"]["policyTypes"] and _selects(p["spec"]["podSelector"], labels)]
    assert selecting, "no egress policy selects the pods: they may reach anything"
    return {(port.get("protocol", "TCP"), port["port"]) for p in selecting for rule in p["spec"].get("egress", []) for port in rule["ports"]}


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in (selector.get("matchLabels") or {}).items())


def test_the_meter_may_reach_dns_the_api_server_the_exporters_and_kafka() -> None:
    found = docs()
    deployment = found[DEPLOYMENT]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    base = [d for d in yaml.safe_load_all((BASE / "networkpolicies.yaml").read_text()) if d["kind"] == "NetworkPolicy"]
    ours = [d for d in found.values() if d["kind"] == "NetworkPolicy"]
    assert ours and all(p["spec"]["podSelector"]["matchLabels"] == deployment["spec"]["selector"]["matchLabels"] for p in ours)
    config = yaml.safe_load((BASE / "config.yaml").read_text())["data"]
    kafka_port = urlsplit(f"//{config['BUDGETGATE_KAFKA_BOOTSTRAP']}").port
    assert {("UDP", 53), ("TCP", 443), ("TCP", 6443), ("TCP", meter_params()["exporter_port"]), ("TCP", kafka_port)} <= _egress_ports(base + ours, labels)


@pytest.mark.parametrize("name", ["meter/", "budgetgate-meter-state"])
def test_the_readme_describes_it(name: str) -> None:
    assert name in (METER.parent / "README.md").read_text()


def test_every_kustomization_of_the_repository_is_validated_by_a_test() -> None:
    # A folder added under deploy/kubernetes without its own schema test would ship unchecked.
    folders = sorted(p.parent.name for p in METER.parent.glob("*/kustomization.yaml"))
    tests = [p.read_text() for p in Path(__file__).parent.glob("test_*.py")]
    validating = [text for text in tests if "kubernetes_validate.validate(" in text]
    unchecked = [name for name in folders if not any(f'"kubernetes" / "{name}"' in text for text in validating)]
    assert "meter" in folders and unchecked == []
