"""deploy/kubernetes/kueue: valid against the Kubernetes schemas (Kueue's AdmissionCheck aside),
the check names budgetgate's controller, and the controller's role allows what it does."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import kubernetes_validate
import yaml

from budgetgate.platforms.kueue import CONTROLLER_NAME

KUEUE = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes" / "kueue"


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
