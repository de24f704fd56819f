"""docker-compose.yml cannot run here (no Docker engine), so check what can be checked without one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from budgetgate.devstack.services import SERVICES

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def _depends_on(service: dict[str, Any]) -> list[str]:
    deps = service.get("depends_on", [])
    return list(deps) if isinstance(deps, (list, dict)) else []


def test_every_dependency_names_a_service(compose: dict[str, Any]) -> None:
    services = compose["services"]
    for name, service in services.items():
        for dep in _depends_on(service):
            assert dep in services, f"{name} depends on unknown service {dep}"
            assert dep != name, f"{name} depends on itself"


def test_every_service_has_an_image_or_a_build(compose: dict[str, Any]) -> None:
    for name, service in compose["services"].items():
        assert "image" in service or "build" in service, name


def test_each_budgetgate_service_runs_its_module(compose: dict[str, Any]) -> None:
    for service in SERVICES:
        command = compose["services"][service.name]["command"]
        assert command[:3] == ["python", "-m", service.module], service.name
        deps = compose["services"][service.name]["depends_on"]
        assert deps["migrate"]["condition"] == "service_completed_successfully"


def test_one_shot_jobs_migrate_and_create_topics(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert services["migrate"]["command"] == ["budgetgate", "db", "migrate"]
    assert "ensure_topics" in "".join(services["topics"]["command"])
    for job in ("migrate", "topics"):
        assert services[job]["restart"] == "no"


def test_kafka_runs_in_kraft_mode(compose: dict[str, Any]) -> None:
    kafka = compose["services"]["kafka"]
    assert kafka["image"].startswith("apache/kafka:")
    assert "controller" in kafka["environment"]["KAFKA_PROCESS_ROLES"]
    assert not any(name.startswith("zookeeper") for name in compose["services"])


def test_prometheus_scrapes_admission_metrics(compose: dict[str, Any]) -> None:
    mounted = [v.split(":")[0] for v in compose["services"]["prometheus"]["volumes"]]
    assert "./deploy/prometheus.yml" in mounted
    config = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())
    targets = [t for job in config["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]]
    assert "admission:8080" in targets
    admission_port = compose["services"]["admission"]["command"][-1]
    assert admission_port == "8080"


def test_files_mounted_from_the_repository_exist(compose: dict[str, Any]) -> None:
    for name, service in compose["services"].items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("./") and "grafana" not in source:  # deploy/grafana/ comes later
                assert (ROOT / source).exists(), f"{name} mounts missing {source}"
