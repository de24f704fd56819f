"""The compose stack's `operator-token` and `policies` jobs, run without Docker: their own
commands from docker-compose.yml, run by sh as compose would, with the container's paths mapped
to folders of the test (the operator-token volume, the mounted Git checkout) and admission's
address to a test admission service on the test's database. The policies job gets only the
environment compose gives it: no database credentials."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import asyncpg
import yaml

from tests.support.admission import EXAMPLES
from tests.support.admission import admission_factory  # noqa: F401 - pytest fixtures
from tests.support.policy_repos import git
from tests.support.servers import free_port

ROOT = Path(__file__).resolve().parents[2]
INTERPOLATION = re.compile(r"\$\{(\w+)(?::?-([^}]*))?\}")


def job(name: str, mapped: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """A compose job's command (interpolated with no variable set, each of `mapped`'s container
    paths and addresses replaced) and the environment compose gives it."""
    service = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"][name]
    command = [INTERPOLATION.sub(lambda m: m.group(2) or "", part).replace("$$", "$") for part in service["command"]]
    text = "\n".join(command)
    for inside, outside in mapped.items():
        assert inside in text, f"the {name} job no longer uses {inside}"
        command = [part.replace(inside, outside) for part in command]
    return command, {k: str(v) for k, v in (service.get("environment") or {}).items()}


def run(command: list[str], environment: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    # Only what compose would give, plus where this venv's `budgetgate` is.
    env = {**environment, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}", "HOME": str(cwd)}
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=240)


async def test_the_policies_job_applies_the_examples_through_the_api_with_the_minted_token(tmp_path: Path, admission_factory: Any, pg_dsn: str) -> None:  # noqa: F811
    checkout = tmp_path / "checkout"  # what BUDGETGATE_POLICY_REPO mounts: a clean Git checkout
    shutil.copytree(EXAMPLES, checkout / "examples" / "policies")
    git("init", "-q", "-b", "main", cwd=checkout)
    git("add", "-A", cwd=checkout)
    git("-c", "user.email=t@example.com", "-c", "user.name=t", "commit", "-q", "-m", "policies", cwd=checkout)
    sha = git("rev-parse", "HEAD", cwd=checkout)
    volume = tmp_path / "operator-token"
    volume.mkdir(mode=0o700)
    port = free_port()
    mounted_token = {"/run/budgetgate/": f"{volume}/"}

    command, environment = job("operator-token", mounted_token)
    minted = await asyncio.to_thread(run, command, {**environment, "BUDGETGATE_POSTGRES_DSN": pg_dsn}, tmp_path)
    assert minted.returncode == 0, minted.stderr
    token = volume / "operator-token"
    secret = token.read_text().strip()
    assert secret.startswith("bg_") and secret not in minted.stdout + minted.stderr
    assert stat.S_IMODE(token.stat().st_mode) == 0o600 and not (volume / "operator-token.new").exists()

    command, environment = job("policies", {**mounted_token, "/policies/": f"{checkout}/", "http://admission:8080": f"http://127.0.0.1:{port}"})
    assert not any(k.startswith("BUDGETGATE_") for k in environment), environment
    # The job starts before admission answers at all (compose only waits for it to be live).
    applying = asyncio.create_task(asyncio.to_thread(run, command, environment, tmp_path))
    server = await admission_factory(port=port)
    applied = await applying
    assert applied.returncode == 0, applied.stdout + applied.stderr
    assert f"applied {sha}" in applied.stdout and "by token:compose-policies-" in applied.stdout, applied.stdout
    assert "waiting up to 300s for admission" in applied.stderr

    # It ended with admission ready on the bundle it applied, recorded as the token's.
    assert (await server.client.get("/readyz")).status_code == 200
    conn = await asyncpg.connect(pg_dsn)
    try:
        applied_by = await conn.fetchval("SELECT applied_by FROM policy_bundles WHERE git_sha = $1", sha)
        roles = await conn.fetchval("SELECT roles FROM api_tokens WHERE name = $1", applied_by.removeprefix("token:"))
    finally:
        await conn.close()
    assert applied_by.startswith("token:compose-policies-") and list(roles) == ["operator"]


async def test_the_policies_job_fails_without_its_token(tmp_path: Path) -> None:
    volume = tmp_path / "operator-token"
    volume.mkdir()
    command, environment = job("policies", {"/run/budgetgate/": f"{volume}/", "/policies/": f"{tmp_path}/", "http://admission:8080": "http://127.0.0.1:9"})
    refused = await asyncio.to_thread(run, command, environment, tmp_path)
    assert refused.returncode != 0 and "operator-token" in refused.stderr
