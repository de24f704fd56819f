"""docker-compose.yml cannot run here (no Docker engine), so check everything that can be checked
without one: the compose specification's JSON schema (vendored in deploy/schemas/, from the
check-jsonschema package), and every reference — services, builds, images, ports, healthchecks,
volumes, mounted files, Prometheus targets and the files comments point to."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from budgetgate.devstack.services import SERVICES

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = ROOT / "deploy" / "schemas" / "compose-spec.json"
# Host ports a developer's own servers use (Postgres, Redis, Kafka): never published.
DEVELOPER_PORTS = {5432, 6379, 9092, 9093, 29092}
# What the stack publishes: the admission API, the UIs, and Marquez's API (for `audit --marquez`).
PUBLISHED = {"admission": {8080}, "marquez": {5000}, "marquez-web": {3000}, "grafana": {3001}, "prometheus": {9090}}
INTERPOLATION = re.compile(r"\$\{(\w+)(?::?-([^}]*))?\}")


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


@pytest.fixture(scope="module")
def services(compose: dict[str, Any]) -> dict[str, Any]:
    return compose["services"]


def _defaults(text: str) -> str:
    """Compose's ${VAR:-default} interpolation with no variable set."""
    return INTERPOLATION.sub(lambda m: m.group(2) or "", text)


def _is_job(service: dict[str, Any]) -> bool:
    return service.get("restart") == "no"


def _binds(service: dict[str, Any]) -> list[tuple[str, str]]:
    """(host path, container path) of each bind mount, interpolated with defaults."""
    binds = []
    for volume in service.get("volumes", []):
        source, target = _defaults(volume).split(":")[:2]
        if source.startswith((".", "/")):
            binds.append((source, target))
    return binds


def test_the_file_follows_the_compose_specification(compose: dict[str, Any]) -> None:
    schema = json.loads(SCHEMA.read_text())
    errors = sorted(jsonschema.Draft202012Validator(schema).iter_errors(compose), key=lambda e: list(e.absolute_path))
    assert [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in errors] == []


def test_the_schema_check_catches_a_mistake(compose: dict[str, Any]) -> None:
    schema = json.loads(SCHEMA.read_text())
    broken = {**compose, "services": {**compose["services"], "redis": {**compose["services"]["redis"], "healthcheck": {"test": 5}}}}
    assert not jsonschema.Draft202012Validator(schema).is_valid(broken)


def test_every_dependency_names_a_service_in_the_state_it_waits_for(services: dict[str, Any]) -> None:
    for name, service in services.items():
        deps = service.get("depends_on", {})
        deps = {d: {"condition": "service_started"} for d in deps} if isinstance(deps, list) else deps
        for dep, how in deps.items():
            assert dep in services and dep != name, f"{name} depends on {dep}"
            assert "profiles" not in services[dep], f"{name} depends on {dep}, which `up` does not start"
            condition = how["condition"]
            if condition == "service_healthy":
                check = services[dep].get("healthcheck", {})
                assert check and not check.get("disable"), f"{name} waits for {dep} to be healthy, but {dep} has no healthcheck"
            if condition == "service_completed_successfully":
                assert _is_job(services[dep]), f"{name} waits for {dep} to complete, but {dep} restarts"


def test_every_service_has_a_pinned_image_or_a_build(services: dict[str, Any]) -> None:
    for name, service in services.items():
        assert "image" in service or "build" in service, name
        if "build" in service:
            context = service["build"] if isinstance(service["build"], str) else service["build"]["context"]
            assert (ROOT / context / "Dockerfile").is_file(), f"{name} builds from {context}, which has no Dockerfile"
        else:
            tag = service["image"].rpartition(":")[2]
            assert "/" not in tag and tag not in {"", "latest"}, f"{name} runs an unpinned image {service['image']}"


def test_only_the_api_and_the_uis_are_published_on_loopback(services: dict[str, Any]) -> None:
    published: dict[str, set[int]] = {}
    for name, service in services.items():
        for port in service.get("ports", []):
            host_ip, host, _container = str(port).split(":")
            assert host_ip == "127.0.0.1", f"{name} publishes {port} on every interface"
            assert int(host) not in DEVELOPER_PORTS, f"{name} takes host port {host}, which a developer's own server uses"
            published.setdefault(name, set()).add(int(host))
    assert published == PUBLISHED
    hosts = [p for ports in published.values() for p in ports]
    assert len(hosts) == len(set(hosts)), "two services publish the same host port"


def test_every_long_running_service_has_a_healthcheck(services: dict[str, Any]) -> None:
    for name, service in services.items():
        check = service.get("healthcheck")
        assert check is not None, f"{name} has no healthcheck"
        if _is_job(service):
            assert check.get("disable") is True, f"{name} is a one-shot job: its health is its exit code"
        else:
            assert check["test"][0] in {"CMD", "CMD-SHELL"} and not check.get("disable"), name


def test_each_budgetgate_service_runs_its_module_and_checks_its_own_port(services: dict[str, Any]) -> None:
    for service in SERVICES:
        compose_service = services[service.name]
        command = compose_service["command"]
        assert command[:3] == ["python", "-m", service.module], service.name
        deps = compose_service["depends_on"]
        assert deps["migrate"]["condition"] == "service_completed_successfully"
        port = _listen_port(compose_service)
        assert f"127.0.0.1:{port}/" in " ".join(compose_service["healthcheck"]["test"]), f"{service.name} checks another port than {port}"


def _listen_port(service: dict[str, Any]) -> str:
    command = service["command"]
    assert "--port" in command, f"{command} names no port"
    return command[command.index("--port") + 1]


def test_one_shot_jobs_migrate_create_topics_and_apply_policies(services: dict[str, Any]) -> None:
    assert services["migrate"]["command"] == ["budgetgate", "db", "migrate"]
    assert "ensure_topics" in "".join(services["topics"]["command"])
    policies = services["policies"]
    assert "budgetgate policy apply " in _script(policies)
    ((repo, target),) = _binds(policies)
    directory = _defaults(policies["command"][-1])  # the script's $1
    assert directory.startswith(target + "/") and '"$1"' in _script(policies)
    policy_dir = ROOT / repo / directory.removeprefix(target + "/")
    assert any(policy_dir.rglob("*.yaml")), f"no policies in {policy_dir}"
    for job in ("migrate", "topics", "operator-token", "policies"):
        assert _is_job(services[job])


def _script(service: dict[str, Any]) -> str:
    """The shell script of a `sh -c SCRIPT [NAME ARG…]` command, as compose hands it to sh."""
    command = service["command"]
    assert command[:2] == ["sh", "-c"], f"not a shell script: {command}"
    return _defaults(command[2]).replace("$$", "$")


def _named_volumes(service: dict[str, Any]) -> dict[str, tuple[str, bool]]:
    """Named volume -> (container path, read-only) of a service's mounts."""
    found = {}
    for volume in service.get("volumes", []):
        source, target, *mode = _defaults(volume).split(":")
        if not source.startswith((".", "/")):
            found[source] = (target, mode == ["ro"])
    return found


def test_the_policies_job_applies_through_the_api_without_database_credentials(services: dict[str, Any]) -> None:
    policies = services["policies"]
    script = _script(policies)
    apply = re.search(r"exec budgetgate policy apply \S+ --server (\S+) --wait (\d+)", script)
    assert apply, f"the policies job does not apply through admission's API, waiting for it: {script}"
    server = apply.group(1)
    assert server == f"http://admission:{_listen_port(services['admission'])}", f"{server} is not admission's address inside the network"
    # Admission is unready until a bundle exists: the job starts once it is live, and --wait
    # covers readiness (a healthcheck on /readyz would never pass before the first bundle).
    assert policies["depends_on"]["admission"]["condition"] == "service_healthy"
    assert "/healthz" in " ".join(services["admission"]["healthcheck"]["test"])
    # No credentials of the ledger's backends, in any form compose passes them.
    assert "env_file" not in policies
    assert policies["environment"] == {}, "the policies job inherits the services' environment"
    text = json.dumps(policies)
    for secret in ("BUDGETGATE_POSTGRES_DSN", "postgresql://", "BUDGETGATE_REDIS_URL", "redis://", "POSTGRES_PASSWORD"):
        assert secret not in text, f"the policies job carries {secret}"


def test_the_operator_token_comes_from_a_job_that_mints_it(services: dict[str, Any]) -> None:
    policies = services["policies"]
    (token_path,) = re.findall(r"BUDGETGATE_TOKEN=\$\(cat (\S+)\)", _script(policies))
    mounted = [(volume, target) for volume, (target, read_only) in _named_volumes(policies).items() if token_path.startswith(target + "/") and read_only]
    assert mounted, f"{token_path} is on no named volume mounted read-only in the policies job"
    ((volume, target),) = mounted
    writers = [name for name, service in services.items() if name != "policies" and volume in _named_volumes(service)]
    assert len(writers) == 1, f"{volume} should be written by one job, not {writers}"
    (writer,) = writers
    minter = services[writer]
    assert _is_job(minter), f"{writer} restarts: it is not the job that mints the token"
    waits = policies["depends_on"].get(writer, {}).get("condition")
    assert waits == "service_completed_successfully", f"the policies job does not wait for {writer} to write the token"
    writer_target, read_only = _named_volumes(minter)[volume]
    assert writer_target == target and not read_only
    script = _script(minter)
    assert re.search(r'budgetgate token create --name (?:"[^"]+"|\S+) --role operator --expires \w+ > ', script), script
    assert script.startswith("umask 077 ") and re.search(rf"mv \S+ {re.escape(token_path)}$", script), f"{writer} does not write {token_path} privately"
    # Tokens are rows in the ledger database: the minter needs its tables.
    assert minter["environment"]["BUDGETGATE_POSTGRES_DSN"].startswith("postgresql://")
    assert minter["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
    # A new volume takes the owner of the image's folder it is mounted on: the image's user's.
    dockerfile = (ROOT / "Dockerfile").read_text()
    user = re.findall(r"^USER (\d+):(\d+)$", dockerfile, re.MULTILINE)[-1]
    assert f"install -d -o {user[0]} -g {user[1]} -m 0700 {target}" in dockerfile, f"the image does not give {target} to its user"


def test_kafka_runs_in_kraft_mode(services: dict[str, Any]) -> None:
    kafka = services["kafka"]
    assert kafka["image"].startswith("apache/kafka:")
    assert "controller" in kafka["environment"]["KAFKA_PROCESS_ROLES"]
    assert not any(name.startswith("zookeeper") for name in services)


def test_prometheus_scrapes_every_budgetgate_service_and_loads_the_alert_rules(services: dict[str, Any]) -> None:
    binds = dict(_binds(services["prometheus"]))
    assert binds == {"./deploy/prometheus": "/etc/prometheus"}
    config = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    targets = {t for job in config["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]}
    for service in SERVICES:
        assert f"{service.name}:{_listen_port(services[service.name])}" in targets, f"Prometheus does not scrape {service.name}"
    assert config["rule_files"] == ["/etc/prometheus/alerts.yml"]
    for rule_file in config["rule_files"]:
        assert (ROOT / "deploy/prometheus" / Path(rule_file).relative_to("/etc/prometheus")).is_file()
    command = services["prometheus"]["command"]
    assert "--config.file=/etc/prometheus/prometheus.yml" in command


def test_volumes_are_declared_and_mounted_files_exist(compose: dict[str, Any], services: dict[str, Any]) -> None:
    declared = set(compose.get("volumes", {}))
    used = set()
    for name, service in services.items():
        for volume in service.get("volumes", []):
            source = _defaults(volume).split(":")[0]
            if source.startswith((".", "/")):
                assert (ROOT / source).exists(), f"{name} mounts missing {source}"
            else:
                assert source in declared, f"{name} mounts undeclared volume {source}"
                used.add(source)
    assert declared == used, f"declared but unused volumes: {sorted(declared - used)}"


def test_paths_inside_containers_point_to_mounted_files(services: dict[str, Any]) -> None:
    grafana = services["grafana"]
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    marquez_config = services["marquez"]["environment"]["MARQUEZ_CONFIG"]
    for service, path in ((grafana, home), (services["marquez"], marquez_config)):
        host = _host_path(service, path)
        assert host is not None and host.is_file(), f"{path} is not a mounted file"


def _host_path(service: dict[str, Any], container_path: str) -> Path | None:
    for source, target in _binds(service):
        if container_path == target or container_path.startswith(target + "/"):
            return ROOT / source / container_path.removeprefix(target).lstrip("/")
    return None


def test_files_named_in_comments_exist() -> None:
    text = (ROOT / "docker-compose.yml").read_text()
    comments = "\n".join(line.split("#", 1)[1] for line in text.splitlines() if "#" in line)
    named = set(re.findall(r"[\w./-]+\.(?:md|yml|yaml|py|json)\b", comments))
    assert named, "the comments name no files (the pattern is broken)"
    for name in named:
        # Repository paths, or paths inside a mounted folder of deploy/ (datasources/budgetgate.yaml).
        found = (ROOT / name).exists() or any((ROOT / "deploy").glob(f"*/{name}"))
        assert found, f"docker-compose.yml's comments point to {name}, which does not exist"
