"""deploy/kubernetes/kueue: valid against the Kubernetes schemas (Kueue's AdmissionCheck aside),
the check names budgetgate's controller, the controller's role allows what it does, it carries
a token, and the namespace's network policies let it reach the API server and admission."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import kubernetes_validate
import yaml

from budgetgate.client.endpoints import TOKEN_VARIABLE
from budgetgate.adapters.kueue_workloads import CONTROLLER_NAME

KUEUE = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes" / "kueue"
BASE = KUEUE.parent / "base"


def docs() -> dict[str, dict[str, Any]]:
    kustomization = yaml.safe_load((KUEUE / "kustomization.yaml").read_text())
    assert sorted(kustomization["resources"]) == sorted(p.name for p in KUEUE.glob("*.yaml") if p.name != "kustomization.yaml")
    return {f"{d['kind']}/{d['metadata']['name']}": d for name in kustomization["resources"] for d in yaml.safe_load_all((KUEUE / name).read_text())}


def test_manifests_are_valid_and_wired() -> None:
    found = docs()
    for doc in found.values():
        if not doc["apiVersion"].startswith("kueue.x-k8s.io/"):
            kubernetes_validate.validate(doc, "1.30.0", strict=True)
    assert found["AdmissionCheck/budget"]["spec"]["controllerName"] == CONTROLLER_NAME
    pod = found["Deployment/budgetgate-kueue-admission-check"]["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "budgetgate-kueue" and pod["automountServiceAccountToken"] is True
    command = pod["containers"][0]["command"]
    assert command[:3] == ["python", "-m", "budgetgate.cli.main"] and importlib.util.find_spec(command[2]) is not None
    from click.testing import CliRunner

    from budgetgate.cli.main import cli

    assert CliRunner().invoke(cli, [*command[3:], "--help"]).exit_code == 0
    check = found["AdmissionCheck/budget"]
    assert check["apiVersion"] == "kueue.x-k8s.io/v1beta2" and set(check["spec"]) == {"controllerName"}  # v1beta2 has no retryDelayMinutes
    binding = found["ClusterRoleBinding/budgetgate-kueue"]
    assert binding["roleRef"]["name"] == "budgetgate-kueue" and binding["subjects"][0]["name"] == pod["serviceAccountName"]


def test_the_role_allows_what_the_controller_does() -> None:
    rules = docs()["ClusterRole/budgetgate-kueue"]["rules"]
    allowed = {(resource, verb) for rule in rules for resource in rule["resources"] for verb in rule["verbs"]}
    needed = {
        ("workloads", "list"),
        ("workloads", "watch"),
        ("workloads", "patch"),
        ("workloads/status", "patch"),
        ("admissionchecks", "list"),
        ("admissionchecks/status", "patch"),
    }
    assert needed <= allowed
    assert not any(verb in {"create", "delete", "update", "*"} for _, verb in allowed)


def test_the_controller_sends_a_token_from_a_secret() -> None:
    # Without one every submission is a 401 and no Workload is ever decided.
    (container,) = docs()["Deployment/budgetgate-kueue-admission-check"]["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e for e in container["env"]}
    assert env[TOKEN_VARIABLE]["valueFrom"]["secretKeyRef"] == {"name": "budgetgate-kueue-token", "key": "token"}
    readme = (KUEUE.parent / "README.md").read_text()
    assert "budgetgate-kueue-token" in readme and "--name kueue --role submitter" in readme


def _egress_ports(policies: list[dict[str, Any]], labels: dict[str, str]) -> set[tuple[str, int]]:
    """The ports the policies selecting `labels` open for egress (they add up)."""
    selecting = [p for p in policies if "Egress" in p["spec"]["policyTypes"] and _selects(p["spec"]["podSelector"], labels)]
    assert selecting, "no egress policy selects the pods: they may reach anything"
    return {(port.get("protocol", "TCP"), port["port"]) for p in selecting for rule in p["spec"].get("egress", []) for port in rule["ports"]}


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in (selector.get("matchLabels") or {}).items())


def test_the_controller_may_reach_dns_the_api_server_and_admission() -> None:
    found = docs()
    deployment = found["Deployment/budgetgate-kueue-admission-check"]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    base = [d for d in yaml.safe_load_all((BASE / "networkpolicies.yaml").read_text()) if d["kind"] == "NetworkPolicy"]
    ours = [d for d in found.values() if d["kind"] == "NetworkPolicy"]
    assert ours and all(p["spec"]["podSelector"]["matchLabels"] == deployment["spec"]["selector"]["matchLabels"] for p in ours)  # the controller alone
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    admission_port = urlsplit(next(e["value"] for e in container["env"] if e["name"] == "BUDGETGATE_ADMISSION_URL")).port
    assert {("UDP", 53), ("TCP", 443), ("TCP", 6443), ("TCP", admission_port)} <= _egress_ports(base + ours, labels)
    assert ("TCP", 443) not in _egress_ports(base, labels)  # what the base alone allows does not cover it


def test_two_controllers_never_overlap_in_a_rollout() -> None:
    # No leader election yet: a RollingUpdate would run the old and the new pod at once.
    spec = docs()["Deployment/budgetgate-kueue-admission-check"]["spec"]
    assert spec["replicas"] == 1 and spec["strategy"] == {"type": "Recreate"}
