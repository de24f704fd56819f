"""No test module imports another: what tests share (helpers, constants, fixtures) lives in
tests/support (or a conftest.py), so that a test module holds only its tests, and moving or
deleting one never breaks another."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).parents[1]


def module_name(path: Path, tests: Path) -> str:
    return ".".join(path.relative_to(tests.parent).with_suffix("").parts)


def is_test_module(name: str) -> bool:
    """A module of tests/ that holds tests: not in tests/support, not a conftest.py."""
    parts = name.split(".")
    return parts[0] == "tests" and len(parts) > 1 and parts[1] != "support" and parts[-1] != "conftest"


def imported_modules(source: str, importer: str) -> set[str]:
    """Every module `source` (the module `importer`) imports anywhere in its body, each name of
    a `from X import Y` counted as a possible module X.Y, relative imports resolved."""
    package = importer.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*package[: len(package) - node.level + 1], *([base] if base else [])])
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def cross_imports(tests: Path) -> tuple[int, list[str]]:
    """How many test modules there are under `tests`, and `importer -> imported` for every
    module there importing one of them."""
    names = {path: module_name(path, tests) for path in tests.rglob("*.py")}
    test_modules = {name for name in names.values() if is_test_module(name)}
    found = sorted(
        f"{importer} -> {imported}"
        for path, importer in names.items()
        for imported in imported_modules(path.read_text(), importer)
        if imported in test_modules and imported != importer
    )
    return len(test_modules), found


def test_no_module_under_tests_imports_a_test_module() -> None:
    count, found = cross_imports(TESTS)
    assert count > 100, f"the scan found {count} test modules: too few to mean anything"
    assert found == [], "move what these share to tests/support (or a conftest.py) and import it from there:\n" + "\n".join(found)


def test_the_scan_catches_every_form_of_import_and_spares_support_and_conftest(tmp_path: Path) -> None:
    tests = tmp_path / "tests"
    for folder in ("integration", "faults", "support"):
        (tests / folder).mkdir(parents=True)
    files = {
        "integration/test_shared.py": "def helper(): ...\n",
        "integration/conftest.py": "from tests.support.helpers import helper\n",
        "support/helpers.py": "def helper(): ...\n",
        "faults/test_a.py": "from tests.integration.test_shared import helper\n",
        "faults/test_b.py": "import tests.integration.test_shared as shared\n",
        "faults/test_c.py": "def later():\n    from tests.integration import test_shared\n",
        "integration/test_d.py": "from .test_shared import helper\n",
        "integration/test_e.py": "from tests.support.helpers import helper\nfrom tests.integration import conftest\n",
        "support/leaning.py": "from tests.faults.test_a import helper\n",
    }
    for name, text in files.items():
        (tests / name).write_text(text)
    assert cross_imports(tests) == (
        6,
        [
            "tests.faults.test_a -> tests.integration.test_shared",
            "tests.faults.test_b -> tests.integration.test_shared",
            "tests.faults.test_c -> tests.integration.test_shared",
            "tests.integration.test_d -> tests.integration.test_shared",
            "tests.support.leaning -> tests.faults.test_a",
        ],
    )
