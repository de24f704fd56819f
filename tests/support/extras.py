"""Optional extras in tests. Outside CI, a test of an extra that is not installed is skipped; CI
installs every extra (.ci/run, pinned by constraints/dev-flyte.txt), so there the same absence
is an error, never a silent skip."""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest


def in_ci() -> bool:
    """Whether this run is CI's (`CI=true`, as .ci/run is started)."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def import_extra(module: str, *, extra: str) -> ModuleType:
    """`module`, which the `extra` extra installs; without it, the calling test (or test module)
    is skipped outside CI and fails in CI."""
    try:
        return importlib.import_module(module)
    except ImportError as missing:
        if in_ci():
            raise ImportError(f"CI installs the `{extra}` extra (.ci/run), but {module} does not import: {missing}") from missing
        pytest.skip(f"{module} comes with the `{extra}` extra: pip install -e '.[dev,{extra}]' -c constraints/dev-flyte.txt", allow_module_level=True)
