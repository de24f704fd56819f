"""deploy/kubernetes/lifecycle: valid against the Kubernetes schemas, two replicas electing a
leader on a Lease their Role lets them keep, a ClusterRole that lets them read and watch what
they follow and write nothing, an exporter token, and network policies that let them reach the API
server and metering-ingest."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import kubernetes_validate
import yaml
from click.testing import CliRunner

from budgetgate.cli.main import cli
from budgetgate.client.endpoints import METERING_VARIABLE, TOKEN_VARIABLE

LIFECYCLE = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes" / "lifecycle"
BASE = LIFECYCLE.parent / "base"


def docs() -> dict[str, dict[str, Any]]:
    kustomization = yaml.safe_load((LIFECYCLE / "kustomization.yaml").read_text())
    assert sorted(kustomization["resources"]) == sorted(p.name for p in LIFECYCLE.glob("*.yaml") if p.name != "kustomization.yaml")
    return {f"{d['kind']}/{d['metadata']['name']}": d for name in kustomization["resources"] for d in yaml.safe_load_all((LIFECYCLE / name).read_text())}


def deployment() -> dict[str, Any]:
    return docs()["Deployment/budgetgate-lifecycle"]


def test_manifests_are_valid_and_wired() -> None:
    found = docs()
    for doc in found.values():
        kubernetes_validate.validate(doc, "1.30.0", strict=True)
    spec = deployment()["spec"]
    pod = spec["template"]["spec"]
    assert spec["replicas"] == 2  # leader election: one publishes, the other stands by
    assert pod["serviceAccountName"] == "budgetgate-lifecycle" and pod["automountServiceAccountToken"] is True
    (container,) = pod["containers"]
    command = container["command"]
    assert command[:3] == ["python", "-m", "budgetgate.cli.main"] and importlib.util.find_spec(command[2]) is not None
    assert CliRunner().invoke(cli, [*command[3:], "--help"]).exit_code == 0
    env = {e["name"]: e for e in container["env"]}
    assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"  # the Lease's namespace
    for kind, name in (("ClusterRoleBinding", "budgetgate-lifecycle"), ("RoleBinding", "budgetgate-lifecycle-lease")):
        binding = found[f"{kind}/{name}"]
        assert binding["subjects"][0]["name"] == pod["serviceAccountName"] and f"{binding['roleRef']['kind']}/{binding['roleRef']['name']}" in found


def _allowed(rules: list[dict[str, Any]]) -> set[tuple[str, str, str]]:
    return {(group, resource, verb) for rule in rules for group in rule["apiGroups"] for resource in rule["resources"] for verb in rule["verbs"]}


def test_the_roles_allow_what_the_controller_does_and_no_more() -> None:
    found = docs()
    cluster = _allowed(found["ClusterRole/budgetgate-lifecycle"]["rules"])
    assert cluster == {(g, r, v) for g, r in (("", "pods"), ("batch", "jobs"), ("kueue.x-k8s.io", "workloads")) for v in ("get", "list", "watch")}
    lease_rules = found["Role/budgetgate-lifecycle-lease"]["rules"]
    assert _allowed(lease_rules) == {("coordination.k8s.io", "leases", v) for v in ("create", "get", "update")}
    named = [rule for rule in lease_rules if "get" in rule["verbs"]]
    lease_name = deployment()["spec"]["template"]["spec"]["containers"][0]["command"]
    assert all(rule["resourceNames"] == [lease_name[lease_name.index("--lease-name") + 1]] for rule in named)


def test_the_controller_sends_an_exporter_token_from_a_secret() -> None:
    (container,) = deployment()["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e for e in container["env"]}
    assert env[TOKEN_VARIABLE]["valueFrom"]["secretKeyRef"] == {"name": "budgetgate-lifecycle-token", "key": "token"}
    readme = (LIFECYCLE.parent / "README.md").read_text()
    assert "budgetgate-lifecycle-token" in readme and "--name lifecycle --role exporter" in readme


def _egress_ports(policies: list[dict[str, Any]], labels: dict[str, str]) -> set[tuple[str, int]]:
    selecting = [
        p
        for p in policies
        if "Egress" in p["spec"]["policyTypes"] and all(labels.get(k) == v for k, v in p["spec"]["podSelector"].get("matchLabels", {}).items())
    ]
    assert selecting, "no egress policy selects the pods: they may reach anything"
    return {(port.get("protocol", "TCP"), port["port"]) for p in selecting for rule in p["spec"].get("egress", []) for port in rule["ports"]}


def test_the_controller_may_reach_dns_the_api_server_and_metering_ingest() -> None:
    found = docs()
    labels = deployment()["spec"]["template"]["metadata"]["labels"]
    base = [d for d in yaml.safe_load_all((BASE / "networkpolicies.yaml").read_text()) if d["kind"] == "NetworkPolicy"]
    ours = [d for d in found.values() if d["kind"] == "NetworkPolicy"]
    assert ours and all(p["spec"]["podSelector"]["matchLabels"] == deployment()["spec"]["selector"]["matchLabels"] for p in ours)
    (container,) = deployment()["spec"]["template"]["spec"]["containers"]
    metering_port = urlsplit(next(e["value"] for e in container["env"] if e["name"] == METERING_VARIABLE)).port
    assert {("UDP", 53), ("TCP", 443), ("TCP", 6443), ("TCP", metering_port)} <= _egress_ports(base + ours, labels)
    assert ("TCP", 443) not in _egress_ports(base, labels)
