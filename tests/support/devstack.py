"""The local stack's command (`budgetgate dev ...`) run as a user runs it, in folders of its own,
for the tests of the stack (tests/integration/test_devstack.py, test_redis_cluster.py)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

NO_BACKEND_ENV = ("BUDGETGATE_POSTGRES_DSN", "BUDGETGATE_REDIS_URL", "BUDGETGATE_KAFKA_BOOTSTRAP",
                  "BUDGETGATE_REDIS_PREFIX", "BUDGETGATE_TOPIC_PREFIX", "BUDGETGATE_HOME")  # fmt: skip


def dev(root: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run `budgetgate dev ARGS` in `root`, with no BUDGETGATE_* servers unless `env` names some.

    The `dev` group is invoked directly: the whole CLI imports every command group, which costs
    most of a second per call; tests/e2e goes through the `budgetgate` entry point.
    """
    base = {k: v for k, v in os.environ.items() if k not in NO_BACKEND_ENV}
    cmd = [sys.executable, "-c", "from budgetgate.cli.dev import dev; dev()", *args]
    return subprocess.run(cmd, cwd=root, env={**base, **(env or {})}, capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, timeout=120)  # fmt: skip


def status(root: Path) -> dict:  # type: ignore[type-arg]
    result = dev(root, "status", "--json")
    return json.loads(result.stdout)


@pytest.fixture
def new_checkout():  # type: ignore[no-untyped-def]
    """Makes directories to run stacks in; whatever is left up there is taken down afterwards.

    Under the system temp dir rather than tmp_path: the embedded Postgres runs as another user
    that must traverse every parent, and pytest resets its own base directory to mode 0700
    whenever a session starts (another one may start while this one runs).
    """
    roots: list[Path] = []

    def make() -> Path:
        roots.append(Path(tempfile.mkdtemp(prefix="budgetgate-checkout-")))
        return roots[-1]

    yield make
    for root in roots:
        dev(root, "down")
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def checkout(new_checkout) -> Path:  # type: ignore[no-untyped-def]
    return new_checkout()


def alive_pids(info: dict) -> dict[str, int]:  # type: ignore[type-arg]
    return {p["name"]: p["pid"] for p in info["processes"] if p["alive"]}


def not_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
