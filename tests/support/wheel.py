"""The wheel as the image builds it, without Docker: the build context that .dockerignore leaves,
the files the Dockerfile's build stage copies from it, and `pip wheel` run on that layout.

Built once per test session (functools.cache); the unit and integration tiers share it.
"""

from __future__ import annotations

import atexit
import functools
import shlex
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from docker.utils.build import exclude_paths

ROOT = Path(__file__).resolve().parents[2]
# Source roots of the wheel, as pyproject.toml maps them: folder → import path inside the wheel.
PACKAGE_ROOTS = {"libs/budgetgate": "budgetgate", "services": "budgetgate/services"}


def dockerignore_patterns() -> list[str]:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]


@functools.cache
def build_context() -> frozenset[str]:
    """Every path (files and folders, relative to the repository) Docker would send as context."""
    return frozenset(exclude_paths(str(ROOT), dockerignore_patterns()))


def build_stage_copies() -> list[list[str]]:
    """The sources of each COPY of the first (build) stage, in order; later stages copy from it."""
    copies: list[list[str]] = []
    stage = 0
    for raw in (ROOT / "Dockerfile").read_text().splitlines():
        line = raw.strip()
        if line.upper().startswith("FROM "):
            stage += 1
        elif line.upper().startswith("COPY ") and stage == 1:
            args = [a for a in shlex.split(line)[1:] if not a.startswith("--")]
            copies.append(args[:-1])
    return copies


def image_layout_files() -> list[str]:
    """The files the build stage copies (after .dockerignore), relative to the repository."""
    context = build_context()
    files: set[str] = set()
    for sources in build_stage_copies():
        for source in sources:
            source = source.rstrip("/")
            if (ROOT / source).is_dir():
                files.update(p for p in context if p.startswith(source + "/") and (ROOT / p).is_file())
            elif source in context:
                files.add(source)
            else:
                raise FileNotFoundError(f"the Dockerfile copies {source}, which is not in the build context")
    return sorted(files)


def _scratch() -> Path:
    folder = Path(tempfile.mkdtemp(prefix="budgetgate-wheel-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder


@functools.cache
def image_wheel() -> Path:
    """`pip wheel` run on the image layout (no Docker, no downloads: the venv's setuptools)."""
    scratch = _scratch()
    layout = scratch / "src"
    for rel in image_layout_files():
        (layout / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, layout / rel)
    out = scratch / "dist"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--disable-pip-version-check", "-q", "-w", str(out), str(layout)],
        check=True,
        capture_output=True,
        text=True,
    )
    (wheel,) = out.glob("budgetgate-*.whl")
    return wheel


def wheel_files(wheel: Path) -> set[str]:
    with zipfile.ZipFile(wheel) as archive:
        return {name for name in archive.namelist() if not name.endswith("/")}


def expected_wheel_files() -> set[str]:
    """What the wheel must hold: every module and data file of the source roots (docs excluded)."""
    expected = set()
    for folder, target in PACKAGE_ROOTS.items():
        base = ROOT / folder
        for path in base.rglob("*"):
            if path.is_file() and "__pycache__" not in path.parts and path.suffix not in {".pyc", ".md"}:
                expected.add(f"{target}/{path.relative_to(base).as_posix()}")
    return expected
