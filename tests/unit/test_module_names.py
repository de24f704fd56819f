"""Two modules with one name hold one role (docs/architecture.md, "Names").

A name may repeat only where the modules play the same role:
- the service skeleton's files, one per service (`__main__`, `settings`, `service`, `app`,
  `consumers`, `store`) and the per-service roles beside them (`access`: what a caller may
  touch in that service's terms; `metrics`: what that service counts);
- a route module (`services/<service>/routes/<resource>.py`) or a command module
  (`cli/<command>.py`), named for the resource or command it serves, beside the module that
  does the work under the same name.
Any other repeat is two jobs under one name, and this test names them."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LIBRARY = ROOT / "libs" / "budgetgate"
SERVICES = ROOT / "services"
SKELETON_ROLES = {"__init__", "__main__", "settings", "service", "app", "consumers", "store", "access", "metrics"}


def _modules() -> list[Path]:
    found = [p for p in LIBRARY.rglob("*.py") if "services" not in p.relative_to(LIBRARY).parts[:1]]
    found += list(SERVICES.rglob("*.py"))
    return [p for p in found if "__pycache__" not in p.parts]


def _surface(path: Path) -> bool:
    """A route or command module: named for what it serves, by convention."""
    parts = path.relative_to(ROOT).parts
    return parts[:3] == ("libs", "budgetgate", "cli") or (parts[0] == "services" and "routes" in parts[2:-1])


def _repeats(modules: list[Path]) -> dict[str, list[str]]:
    by_name: dict[str, list[Path]] = defaultdict(list)
    for path in modules:
        if path.stem not in SKELETON_ROLES:
            by_name[path.stem].append(path)
    repeats = {}
    for name, paths in by_name.items():
        doers = [p for p in paths if not _surface(p)]
        surfaces = [p for p in paths if _surface(p)]
        clash = len(doers) > 1 or len({p.relative_to(ROOT).parts[:2] for p in surfaces}) < len(surfaces)
        if clash:
            repeats[name] = sorted(str(p.relative_to(ROOT)) for p in paths)
    return repeats


def test_no_two_modules_share_a_name_unless_they_share_a_role() -> None:
    assert _repeats(_modules()) == {}


def test_skeleton_roles_repeat_only_inside_services() -> None:
    """`store`, `access` and `metrics` are service roles: in the library, only the settings base and
    the packages' `__init__` share a skeleton name."""
    allowed_in_library = {"__init__", "settings", "__main__"}
    stray = []
    for path in _modules():
        rel = path.relative_to(ROOT)
        if rel.parts[0] == "libs" and path.stem in SKELETON_ROLES - allowed_in_library:
            stray.append(str(rel))
    assert stray == []


def test_the_check_names_a_clash_and_lets_a_surface_through() -> None:
    planted = [LIBRARY / "benchmark" / "whatif.py", LIBRARY / "core" / "usage.py", SERVICES / "reconciler" / "fairshare.py"]
    repeats = _repeats([*_modules(), *planted])
    assert repeats["whatif"] == ["libs/budgetgate/benchmark/whatif.py", "libs/budgetgate/cli/whatif.py", "libs/budgetgate/core/whatif.py"]
    assert "fairshare" in repeats
    assert repeats["usage"] == [
        "libs/budgetgate/cli/usage.py",
        "libs/budgetgate/core/usage.py",
        "libs/budgetgate/reports/usage.py",
        "services/admission/routes/usage.py",
    ]
    assert "budgets" not in repeats  # cli/budgets.py, reports/budgets.py and routes/budgets.py: one resource, each on its surface
