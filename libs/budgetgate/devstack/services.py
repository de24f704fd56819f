"""The budgetgate services the local stack runs, and how to tell when each is ready.

A service is started only once its package has a `__main__` module; a new service, or one that
starts serving HTTP, is one more row (or one changed flag) in SERVICES.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import httpx

from budgetgate.devstack.processes import log_tail, spawn


# The CommonSettings fields handed to every service as BUDGETGATE_* variables.
SETTINGS_ENV = ("postgres_dsn", "redis_url", "redis_prefix", "kafka_bootstrap", "topic_prefix")


@dataclass(frozen=True)
class Service:
    name: str
    module: str
    # Readiness checks (in the /readyz body) that wait for an operator, not for time: admission
    # stays unready, failing closed, until a policy bundle is applied. A fresh stack has none, so
    # `dev up` counts these as up and says what is missing rather than waiting for ever.
    awaits_operator: tuple[str, ...] = ()

    def runnable(self) -> bool:
        try:
            return importlib.util.find_spec(f"{self.module}.__main__") is not None
        except ModuleNotFoundError:
            return False

    def command(self, port: int) -> list[str]:
        """Every service serves HTTP: --host/--port, and GET /readyz answers 200 once it is ready."""
        return [sys.executable, "-m", self.module, "--host", "127.0.0.1", "--port", str(port)]


SERVICES: tuple[Service, ...] = (
    Service(name="admission", module="budgetgate.services.admission", awaits_operator=("policy_bundle",)),
    Service(name="metering_ingest", module="budgetgate.services.metering_ingest"),
    # Serves /readyz, /metrics and the operator's routes of dead-lettered settlements
    # (`budgetgate settlements`, which finds it as the state's `reconciler_url`).
    Service(name="reconciler", module="budgetgate.services.reconciler"),
    # Serves /readyz and /metrics (evidence backlog); events go to .budgetgate/evidence/ unless
    # OPENLINEAGE_URL (or openlineage-python's configuration) names Marquez.
    Service(name="evidence_emitter", module="budgetgate.services.evidence_emitter"),
)


class ServiceNotReady(RuntimeError):
    """A service exited or did not become ready; the message quotes its log."""


def service_env(service: Service, settings: Mapping[str, str | None]) -> dict[str, str]:
    env = dict(os.environ)
    for key in SETTINGS_ENV:
        value = settings.get(key)
        if value is not None:
            env[f"BUDGETGATE_{key.upper()}"] = value
    env["BUDGETGATE_SERVICE_NAME"] = service.name
    return env


def start_service(service: Service, *, settings: Mapping[str, str | None], port: int, log: Path, cwd: Path) -> subprocess.Popen[bytes]:
    return spawn(service.command(port), log=log, env=service_env(service, settings), cwd=cwd)


def wait_ready(service: Service, proc: subprocess.Popen[bytes], *, url: str, log: Path, log_offset: int, timeout: float) -> str:
    """Block until the service is ready; return a note on what it still awaits (or "").

    Raises ServiceNotReady, naming what failed and quoting the log, when the service exits or
    is not ready within `timeout` seconds.
    """
    deadline = time.monotonic() + timeout
    last = "no answer yet"
    while True:
        code = proc.poll()
        if code is not None:
            raise ServiceNotReady(f"{service.name} exited with code {code} while starting; last lines of {log}:\n{log_tail(log, since=log_offset)}")
        ready, last, awaiting = _probe_readyz(service, url)
        if ready:
            return ", ".join(f"{name}: {awaiting[name]}" for name in awaiting)
        if time.monotonic() >= deadline:
            raise ServiceNotReady(
                f"{service.name} was not ready within {timeout:.0f}s (GET {url}/readyz: {last}); last lines of {log}:\n{log_tail(log, since=log_offset)}"
            )
        time.sleep(0.2)


def _probe_readyz(service: Service, base_url: str) -> tuple[bool, str, dict[str, str]]:
    """(ready, what it answered, failing checks that await an operator)."""
    try:
        response = httpx.get(f"{base_url}/readyz", timeout=2.0)
    except httpx.HTTPError as exc:
        return False, f"{type(exc).__name__} {exc}".strip(), {}
    if response.status_code == 200:
        return True, "HTTP 200", {}
    failing = _failing_checks(response)
    answered = f"HTTP {response.status_code} {response.text[:300]}"
    awaiting = {k: v for k, v in failing.items() if k in service.awaits_operator}
    return bool(failing) and awaiting == failing, answered, awaiting


def _failing_checks(response: httpx.Response) -> dict[str, str]:
    try:
        checks = response.json().get("checks", {})
    except (ValueError, AttributeError):
        return {}
    return {str(k): str(v) for k, v in checks.items() if v != "ok"} if isinstance(checks, dict) else {}
