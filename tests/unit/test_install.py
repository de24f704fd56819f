"""What CI and `just setup` install: the dev and flyte extras at the versions pinned in
constraints/dev-flyte.txt (so pip never backtracks through flytekit's dependency tree), and a
missing extra fails CI instead of skipping its tests."""

from __future__ import annotations

import re
import tomllib
from importlib.metadata import version
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.support.extras import import_extra, in_ci

ROOT = Path(__file__).resolve().parents[2]
CONSTRAINTS = ROOT / "constraints" / "dev-flyte.txt"
INSTALL = "-e '.[dev,flyte]' -c constraints/dev-flyte.txt"


def pins() -> dict[str, str]:
    """The constraints file's pinned version of each package that applies to this interpreter."""
    found = {}
    for line in CONSTRAINTS.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            pin = Requirement(line)
            if pin.marker is None or pin.marker.evaluate():
                (spec,) = pin.specifier
                assert spec.operator == "==", f"{line!r} is not a pin"
                found[canonicalize_name(pin.name)] = spec.version
    return found


def requirements(*extras: str) -> list[Requirement]:
    """pyproject.toml's requirements and those of `extras`, the project's own extras expanded."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted, seen, found = list(extras), set(), [Requirement(r) for r in project["dependencies"]]
    while wanted:
        extra = wanted.pop()
        if extra in seen:
            continue
        seen.add(extra)
        for text in project["optional-dependencies"][extra]:
            requirement = Requirement(text)
            if canonicalize_name(requirement.name) == canonicalize_name(project["name"]):
                wanted.extend(requirement.extras)
            else:
                found.append(requirement)
    return found


def test_the_constraints_pin_every_requirement_within_its_range() -> None:
    pinned = pins()
    assert canonicalize_name("flytekit") in pinned
    environment = {**default_environment(), "extra": ""}
    applicable = [r for r in requirements("dev", "flyte") if r.marker is None or r.marker.evaluate(environment)]
    unpinned = [str(r) for r in applicable if canonicalize_name(r.name) not in pinned]
    assert unpinned == [], f"not pinned in {CONSTRAINTS.name} (run `just lock`): {unpinned}"
    outside = [
        f"{r} (pinned {pinned[canonicalize_name(r.name)]})" for r in applicable if not r.specifier.contains(pinned[canonicalize_name(r.name)], prereleases=True)
    ]
    assert outside == [], f"pins outside pyproject.toml's ranges (run `just lock`): {outside}"


@pytest.mark.parametrize(("path", "section"), [(".ci/run", None), ("justfile", "setup")])
def test_ci_and_setup_install_the_flyte_extra_with_the_constraints(path: str, section: str | None) -> None:
    text = (ROOT / path).read_text()
    if section is not None:  # the recipe's lines, up to the next blank line
        text = re.search(rf"^{section}:\n((?:[ \t]+.*\n)+)", text, re.MULTILINE).group(1)  # type: ignore[union-attr]
    lines = [line for line in text.splitlines() if "pip install" in line and not line.lstrip().startswith("#")]
    installs = [line for line in lines if not line.split("||")[0].rstrip().endswith(" uv")]  # (uv, which CI installs the project with)
    assert installs, f"{path} installs nothing with pip"
    assert all(INSTALL in line for line in installs), f"{path}: every pip install should be `{INSTALL}`: {installs}"


def test_the_flyte_extra_is_installed_in_ci_at_its_pinned_version() -> None:
    import_extra("flytekit", extra="flyte")  # skipped only outside CI
    if in_ci():
        assert version("flytekit") == pins()[canonicalize_name("flytekit")], "CI installed flytekit without constraints/dev-flyte.txt"


def test_a_missing_extra_fails_in_ci_and_is_skipped_elsewhere(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CI", "true")
    with pytest.raises(ImportError, match="CI installs the `nothing` extra"):
        import_extra("budgetgate_no_such_module", extra="nothing")
    monkeypatch.setenv("CI", "false")
    with pytest.raises(pytest.skip.Exception, match="comes with the `nothing` extra"):
        import_extra("budgetgate_no_such_module", extra="nothing")


def test_the_image_installs_with_the_constraints_ci_installs_with() -> None:
    # Unconstrained, the image gets whatever is newest on the day it is built: versions CI never ran.
    ci_constraints = re.search(r"pip install [^\n]* -c (\S+)", (ROOT / ".ci" / "run").read_text()).group(1)  # type: ignore[union-attr]
    dockerfile = (ROOT / "Dockerfile").read_text()
    installs = [line for line in dockerfile.splitlines() if "pip install" in line and not line.lstrip().startswith("#")]
    assert installs and all(f" -c {ci_constraints} ." in line for line in installs), installs
    assert re.search(rf"^COPY {re.escape(ci_constraints)} ", dockerfile, re.MULTILINE), "the build stage must copy the constraints file"


def test_the_lower_bounds_admit_no_version_without_what_the_code_imports() -> None:
    # budgetgate.messaging.subscriber imports faststream.middlewares.AckPolicy, which FastStream 0.6 introduced.
    (faststream,) = [r for r in requirements() if canonicalize_name(r.name) == "faststream"]
    assert not faststream.specifier.contains("0.5.48") and faststream.specifier.contains("0.6.0")
    assert "from faststream.middlewares import AckPolicy" in (ROOT / "libs" / "budgetgate" / "messaging" / "subscriber.py").read_text()
