"""deploy/kubernetes/base without a cluster or kustomize: every resource the kustomization names,
rendered as plain YAML (its namespace and image applied), validated against the Kubernetes
OpenAPI schemas (kubernetes-validate, strict: unknown fields fail), and its references checked."""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import yaml

from budgetgate.devstack.services import SERVICES
from budgetgate.runtime.settings import CommonSettings

ROOT = Path(__file__).resolve().parents[2]
BASE = ROOT / "deploy" / "kubernetes" / "base"
KUBERNETES_VERSION = "1.30.0"  # the oldest minor still widely run; the manifests need nothing newer
CRDS = {"monitoring.coreos.com/v1"}


@pytest.fixture(scope="module")
def kustomization() -> dict[str, Any]:
    return yaml.safe_load((BASE / "kustomization.yaml").read_text())


@pytest.fixture(scope="module")
def docs(kustomization: dict[str, Any]) -> list[dict[str, Any]]:
    """The resources as `kustomize build` would print them (namespace and image applied)."""
    image = kustomization["images"][0]
    rendered = []
    for name in kustomization["resources"]:
        for doc in yaml.safe_load_all((BASE / name).read_text()):
            doc = copy.deepcopy(doc)
            if doc["kind"] != "Namespace":
                doc["metadata"]["namespace"] = kustomization["namespace"]
            for container in _containers(doc):
                if container["image"] == image["name"]:
                    container["image"] = f"{image['newName']}:{image['newTag']}"
            rendered.append(doc)
    return rendered


def _pod_spec(doc: dict[str, Any]) -> dict[str, Any] | None:
    if doc["kind"] in {"Deployment", "Job"}:
        return doc["spec"]["template"]["spec"]
    return None


def _containers(doc: dict[str, Any]) -> list[dict[str, Any]]:
    spec = _pod_spec(doc)
    return spec["containers"] if spec else []


def _of(docs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def _selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def test_the_kustomization_names_every_manifest_of_the_folder(kustomization: dict[str, Any]) -> None:
    files = {p.name for p in BASE.glob("*.yaml")} - {"kustomization.yaml"}
    assert sorted(kustomization["resources"]) == sorted(files)


def test_every_resource_is_valid_against_the_kubernetes_schemas(docs: list[dict[str, Any]]) -> None:
    checked = 0
    for doc in docs:
        if doc["apiVersion"] in CRDS:
            continue
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        checked += 1
    assert checked >= 15


def test_the_validator_rejects_a_broken_manifest(docs: list[dict[str, Any]]) -> None:
    deployment = copy.deepcopy(_of(docs, "Deployment")["budgetgate-admission"])
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["pathh"] = "/readyz"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)


def test_the_four_services_run_their_modules_with_probes_and_requests(docs: list[dict[str, Any]]) -> None:
    deployments = _of(docs, "Deployment")
    assert {f"budgetgate-{s.name.replace('_', '-')}" for s in SERVICES} == set(deployments)
    modules = {s.module for s in SERVICES}
    for name, deployment in deployments.items():
        spec = _pod_spec(deployment)
        assert spec["securityContext"]["runAsNonRoot"] is True, name
        (container,) = spec["containers"]
        command = container["command"]
        assert command[:2] == ["python", "-m"] and command[2] in modules, name
        assert importlib.util.find_spec(command[2]) is not None
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        if "--port" in command:
            assert int(command[command.index("--port") + 1]) in ports.values(), name
        for probe in ("readinessProbe", "livenessProbe"):
            assert container[probe]["httpGet"]["port"] in ports, f"{name}: {probe} on an unknown port"
        assert {"cpu", "memory"} <= set(container["resources"]["requests"]), name
        assert container["securityContext"]["readOnlyRootFilesystem"] is True, name


def test_admission_is_ready_only_when_it_can_decide_and_keeps_replicas_through_disruptions(docs: list[dict[str, Any]]) -> None:
    admission = _of(docs, "Deployment")["budgetgate-admission"]
    container = _pod_spec(admission)["containers"][0]
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert admission["spec"]["replicas"] >= 2
    (pdb,) = _of(docs, "PodDisruptionBudget").values()
    assert _selects(pdb["spec"]["selector"]["matchLabels"], admission["spec"]["template"]["metadata"]["labels"])
    assert pdb["spec"].get("maxUnavailable", 0) < admission["spec"]["replicas"]


def test_services_config_and_secrets_are_wired(docs: list[dict[str, Any]]) -> None:
    pods = [d for d in docs if _pod_spec(d)]
    config_maps, secrets = set(_of(docs, "ConfigMap")), set(_of(docs, "Secret"))
    for doc in pods:
        for container in _containers(doc):
            for source in container["envFrom"]:
                if "configMapRef" in source:
                    assert source["configMapRef"]["name"] in config_maps
                else:
                    assert source["secretRef"]["name"] in secrets
    for name, service in _of(docs, "Service").items():
        targets = [d for d in pods if _selects(service["spec"]["selector"], d["spec"]["template"]["metadata"]["labels"])]
        assert len(targets) == 1, f"Service {name} selects {len(targets)} workloads"
        port_names = {p["name"] for c in _containers(targets[0]) for p in c["ports"]}
        assert {p["targetPort"] for p in service["spec"]["ports"]} <= port_names, name


def test_every_service_is_scraped_and_the_alert_rules_match_compose(docs: list[dict[str, Any]]) -> None:
    services = _of(docs, "Service")
    monitors = _of(docs, "ServiceMonitor")
    scraped = set()
    for name, monitor in monitors.items():
        matched = [s for s in services.values() if _selects(monitor["spec"]["selector"]["matchLabels"], s["metadata"]["labels"])]
        assert len(matched) == 1, f"ServiceMonitor {name} matches {len(matched)} Services"
        port_names = {p["name"] for p in matched[0]["spec"]["ports"]}
        assert all(e["port"] in port_names and e["path"] == "/metrics" for e in monitor["spec"]["endpoints"]), name
        scraped.add(matched[0]["metadata"]["name"])
    assert scraped == set(services)

    spec = importlib.util.spec_from_file_location("sync_rules", ROOT / "deploy/kubernetes/sync_rules.py")
    assert spec and spec.loader
    sync_rules = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sync_rules)
    assert (BASE / "prometheusrule.yaml").read_text() == sync_rules.render(), "run python deploy/kubernetes/sync_rules.py"


def test_network_policies_let_in_only_the_api_callers_and_the_scraper(docs: list[dict[str, Any]]) -> None:
    policies = _of(docs, "NetworkPolicy")
    deny = policies["budgetgate-default-deny-ingress"]["spec"]
    assert deny["podSelector"] == {} and "ingress" not in deny
    open_ports = {name: {p["port"] for rule in pol["spec"].get("ingress", []) for p in rule["ports"]} for name, pol in policies.items()}
    assert open_ports["budgetgate-admission-api"] == {8080}
    assert open_ports["budgetgate-metering-api"] == {8082}
    metrics_ports = {c["ports"][0]["containerPort"] for d in _of(docs, "Deployment").values() for c in _containers(d)}
    assert metrics_ports <= open_ports["budgetgate-metrics-scrape"]
    egress = {p["port"] for rule in policies["budgetgate-egress"]["spec"]["egress"] for p in rule["ports"]}
    assert {53, 5432, 6379, 9092} <= egress


def test_the_egress_policy_opens_every_port_the_configuration_points_at(docs: list[dict[str, Any]]) -> None:
    # budgetgate-egress selects every pod of the namespace: a server the services are configured
    # to reach on a port it does not open is unreachable (deploy/kubernetes/kueue adds the
    # controller's own ports beside it).
    egress = _of(docs, "NetworkPolicy")["budgetgate-egress"]["spec"]
    assert egress["podSelector"] == {} and egress["policyTypes"] == ["Egress"]
    opened = {(p.get("protocol", "TCP"), p["port"]) for rule in egress["egress"] for p in rule["ports"]}
    settings = {**next(iter(_of(docs, "ConfigMap").values()))["data"], **next(iter(_of(docs, "Secret").values()))["stringData"]}
    addresses = {
        k: v if "://" in v else f"tcp://{v}"
        for k, v in settings.items()
        if k in {"BUDGETGATE_KAFKA_BOOTSTRAP", "OPENLINEAGE_URL", "BUDGETGATE_POSTGRES_DSN", "BUDGETGATE_REDIS_URL"}
    }
    assert len(addresses) == 4
    for name, address in addresses.items():
        assert ("TCP", urlsplit(address).port) in opened, name
    assert {("UDP", 53), ("TCP", 53)} <= opened


def test_pods_run_as_the_images_own_user(docs: list[dict[str, Any]]) -> None:
    users = [line.split()[1] for line in (ROOT / "Dockerfile").read_text().splitlines() if line.startswith("USER ")]
    uid, gid = users[-1].split(":")
    for doc in docs:
        spec = _pod_spec(doc)
        if spec:
            context = spec["securityContext"]
            assert (str(context["runAsUser"]), str(context["runAsGroup"])) == (uid, gid), doc["metadata"]["name"]


def test_a_topics_job_creates_the_topics_as_compose_does_with_the_configured_sizes(docs: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch) -> None:
    (container,) = _containers(_of(docs, "Job")["budgetgate-topics"])
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]["topics"]
    assert container["command"] == compose["command"]
    assert "partitions=s.topic_partitions" in container["command"][-1] and "replication_factor=s.topic_replication_factor" in container["command"][-1]
    config = next(iter(_of(docs, "ConfigMap").values()))["data"]
    for key, value in config.items():
        monkeypatch.setenv(key, value)
    settings = CommonSettings()
    # Production brokers: every topic on three of them (the local stack's default is one).
    assert (settings.topic_partitions, settings.topic_replication_factor) == (3, 3)


def test_services_start_only_once_the_migrations_of_their_image_are_applied(docs: list[dict[str, Any]]) -> None:
    # A rollout applied before the migration Job finished must not run the new code on the old
    # schema: until the startup probe passes, a pod is neither ready nor liveness-checked.
    for name, deployment in _of(docs, "Deployment").items():
        (container,) = _containers(deployment)
        command = container["startupProbe"]["exec"]["command"]
        assert command == ["python", "-m", "budgetgate.ledger.migrations"], name
        assert importlib.util.find_spec(command[2]) is not None
        probe = container["startupProbe"]
        assert probe["periodSeconds"] * probe["failureThreshold"] >= 1800, f"{name}: a long migration must not get its pods restarted"
