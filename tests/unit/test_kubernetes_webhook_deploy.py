"""deploy/kubernetes/webhook: the webhook's own resources valid against the Kubernetes schemas
(cert-manager's kinds aside), and wired together: the configuration calls the route admission
serves, on the Service of the TLS Deployment, with the certificate cert-manager issues for it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from budgetgate.services.admission.app import create_app
from budgetgate.services.admission.settings import AdmissionSettings

WEBHOOK = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes" / "webhook"
KUBERNETES_VERSION = "1.30.0"


@pytest.fixture(scope="module")
def docs() -> dict[str, dict[str, Any]]:
    kustomization = yaml.safe_load((WEBHOOK / "kustomization.yaml").read_text())
    assert "../base" in kustomization["resources"]
    found = {}
    for name in kustomization["resources"]:
        if name.startswith(".."):
            continue
        for doc in yaml.safe_load_all((WEBHOOK / name).read_text()):
            if doc["kind"] not in ("ValidatingWebhookConfiguration", "MutatingWebhookConfiguration"):  # cluster-scoped: kustomize leaves them be
                doc["metadata"]["namespace"] = kustomization["namespace"]
            found[f"{doc['kind']}/{doc['metadata']['name']}"] = doc
    return found


def test_every_manifest_is_named_and_valid(docs: dict[str, dict[str, Any]]) -> None:
    kustomization = yaml.safe_load((WEBHOOK / "kustomization.yaml").read_text())
    assert sorted(r for r in kustomization["resources"] if not r.startswith("..")) == sorted(
        p.name for p in WEBHOOK.glob("*.yaml") if p.name != "kustomization.yaml"
    )
    checked = 0
    for doc in docs.values():
        if doc["apiVersion"].startswith("cert-manager.io/"):
            continue
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        checked += 1
    assert checked == 6


def test_the_configuration_calls_the_route_on_the_tls_service(docs: dict[str, dict[str, Any]]) -> None:
    (hook,) = docs["ValidatingWebhookConfiguration/budgetgate"]["webhooks"]
    target = hook["clientConfig"]["service"]
    paths = create_app(AdmissionSettings()).openapi()["paths"]
    assert "post" in paths[target["path"]]
    service = docs[f"Service/{target['name']}"]
    assert service["metadata"]["namespace"] == target["namespace"] and [p["port"] for p in service["spec"]["ports"]] == [target["port"]]
    deployment = docs["Deployment/budgetgate-admission-webhook"]
    pod = deployment["spec"]["template"]
    assert all(pod["metadata"]["labels"].get(k) == v for k, v in service["spec"]["selector"].items())
    (container,) = pod["spec"]["containers"]
    assert {p["name"] for p in container["ports"]} == {service["spec"]["ports"][0]["targetPort"]}
    assert container["readinessProbe"]["httpGet"]["scheme"] == "HTTPS"
    assert hook["sideEffects"] == "NoneOnDryRun" and hook["admissionReviewVersions"] == ["v1"]
    assert {(tuple(r["apiGroups"]), tuple(r["resources"])) for r in hook["rules"]} == {
        (("",), ("pods",)), (("batch",), ("jobs",)), (("jobset.x-k8s.io",), ("jobsets",)), (("ray.io",), ("rayjobs",)), (("ray.io",), ("rayclusters",)),
        (("flyte.lyft.com",), ("flyteworkflows",)),
    }  # fmt: skip
    # UPDATE of what may raise its GPUs after admission (parallelism, replicas), and of a Pod's run
    # id label (a match condition sends only those: a Pod's GPUs are fixed). A FlyteWorkflow on
    # CREATE only: flytepropeller writes its status into the object, many times per execution.
    assert {r["resources"][0]: r["operations"] for r in hook["rules"]} == {
        **{resource: ["CREATE", "UPDATE"] for resource in ("pods", "jobs", "jobsets", "rayjobs", "rayclusters")},
        "flyteworkflows": ["CREATE"],
    }


def test_the_mutating_webhook_names_runs_on_create_on_the_same_service_and_selection(docs: dict[str, dict[str, Any]]) -> None:
    (validating,) = docs["ValidatingWebhookConfiguration/budgetgate"]["webhooks"]
    mutating_config = docs["MutatingWebhookConfiguration/budgetgate"]
    (hook,) = mutating_config["webhooks"]
    paths = create_app(AdmissionSettings()).openapi()["paths"]
    assert hook["clientConfig"]["service"]["path"] == "/v1/kubernetes/mutate" and "post" in paths["/v1/kubernetes/mutate"]
    assert {k: v for k, v in hook["clientConfig"]["service"].items() if k != "path"} == {
        k: v for k, v in validating["clientConfig"]["service"].items() if k != "path"
    }
    assert mutating_config["metadata"]["annotations"] == docs["ValidatingWebhookConfiguration/budgetgate"]["metadata"]["annotations"]
    # Quoting holds and records nothing: no side effects, dry run or not; a run is named once, on
    # CREATE, and named again (keeping its id) when a later webhook changed the object.
    assert hook["sideEffects"] == "None" and hook["reinvocationPolicy"] == "IfNeeded" and hook["admissionReviewVersions"] == ["v1"]
    assert hook["failurePolicy"] == validating["failurePolicy"] == "Fail"
    assert {(tuple(r["apiGroups"]), tuple(r["resources"])) for r in hook["rules"]} == {
        (tuple(r["apiGroups"]), tuple(r["resources"])) for r in validating["rules"]
    } and all(r["operations"] == ["CREATE"] for r in hook["rules"])
    assert hook["namespaceSelector"] == validating["namespaceSelector"]
    gpus = [c for c in validating["matchConditions"] if c["name"].endswith("-asking-for-gpus")]
    assert len(gpus) == 5 and hook["matchConditions"] == gpus


def test_the_certificate_covers_the_service_and_is_mounted_and_injected(docs: dict[str, dict[str, Any]]) -> None:
    certificate = docs["Certificate/budgetgate-webhook"]
    config = docs["ValidatingWebhookConfiguration/budgetgate"]
    assert config["metadata"]["annotations"]["cert-manager.io/inject-ca-from"] == f"{certificate['metadata']['namespace']}/{certificate['metadata']['name']}"
    target = config["webhooks"][0]["clientConfig"]["service"]
    assert f"{target['name']}.{target['namespace']}.svc" in certificate["spec"]["dnsNames"]
    assert f"Issuer/{certificate['spec']['issuerRef']['name']}" in docs
    pod = docs["Deployment/budgetgate-admission-webhook"]["spec"]["template"]["spec"]
    (tls,) = [v for v in pod["volumes"] if "secret" in v]
    assert tls["secret"]["secretName"] == certificate["spec"]["secretName"]
    command = pod["containers"][0]["command"]
    mount = next(m["mountPath"] for m in pod["containers"][0]["volumeMounts"] if m["name"] == tls["name"])
    assert command[command.index("--ssl-certfile") + 1] == f"{mount}/tls.crt" and command[command.index("--ssl-keyfile") + 1] == f"{mount}/tls.key"


def test_the_deployment_trusts_the_controllers_the_settings_trust_by_default(docs: dict[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch) -> None:
    from budgetgate.services.admission.routes.kubernetes import TRUSTED_CREATORS, KubernetesWebhookSettings

    container = docs["Deployment/budgetgate-admission-webhook"]["spec"]["template"]["spec"]["containers"][0]
    value = next(e["value"] for e in container["env"] if e["name"] == "BUDGETGATE_KUBERNETES_TRUSTED_CREATORS")
    monkeypatch.setenv("BUDGETGATE_KUBERNETES_TRUSTED_CREATORS", value)
    settings = KubernetesWebhookSettings()
    assert settings.trusted_creators == list(TRUSTED_CREATORS)
    assert settings.trusts("system:serviceaccount:kube-system:job-controller") and settings.trusts("system:kube-controller-manager")
    # A pattern matches whole names: a tenant's account named like a controller is no controller.
    assert not settings.trusts("system:serviceaccount:vision-prod:job-controller")
    assert not settings.trusts("system:serviceaccount:kube-system-evil:x") and not settings.trusts("alice@example.com")
    # FlyteAdmin creates FlyteWorkflows (let through on their run's decision), flytepropeller their pods.
    assert settings.trusts("system:serviceaccount:flyte:flyteadmin") and settings.trusts("system:serviceaccount:flyte:flytepropeller")
    assert not settings.trusts("system:serviceaccount:vision-prod:flyteadmin")
