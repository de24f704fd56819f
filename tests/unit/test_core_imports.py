"""The pure core's modules form no import cycle, not even one hidden behind a local import or a
TYPE_CHECKING block, and import no I/O library."""

from __future__ import annotations

import ast
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

import budgetgate.core

CORE = Path(budgetgate.core.__file__).parent
IO_LIBRARIES = ("asyncpg", "redis", "aiokafka", "faststream", "httpx")


def imports_of(path: Path) -> set[str]:
    """Every module `path` imports anywhere in its body (top level, functions, TYPE_CHECKING)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


def test_core_has_no_import_cycle() -> None:
    modules = {f"budgetgate.core.{p.stem}": p for p in CORE.glob("*.py") if p.stem != "__init__"}
    graph = {name: {m for m in imports_of(path) if m in modules and m != name} for name, path in modules.items()}
    assert graph["budgetgate.core.policy"], "the import scan found nothing"
    try:
        tuple(TopologicalSorter(graph).static_order())
    except CycleError as exc:
        raise AssertionError(f"import cycle in budgetgate.core: {' -> '.join(exc.args[1])}") from None


def test_core_imports_no_io_library() -> None:
    for path in CORE.glob("*.py"):
        used = {m.split(".")[0] for m in imports_of(path)}
        assert not used & set(IO_LIBRARIES), f"{path.name} imports {sorted(used & set(IO_LIBRARIES))}"
