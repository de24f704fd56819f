"""Named queries by owner: the shared ledger's in ledger/sql/queries.sql, and a package's own in
its queries.sql. Each name is defined once across all of them; every name a module asks for is
its package's or the shared ledger's; a package's own queries are asked for by that package
alone (a query two packages use lives with the shared ledger's); none is left unused."""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

from budgetgate.ledger.queries import LEDGER, parse, queries_of

ROOT = Path(__file__).resolve().parents[2]
ASKED = re.compile(r"""\bsql\(\s*["'](\w+)["']\s*\)""")


def owner(path: Path) -> str:
    """The package a module belongs to, as its queries are owned: budgetgate.<top> in libs, the
    service in services."""
    parts = path.relative_to(ROOT).parts
    return f"budgetgate.services.{parts[1]}" if parts[0] == "services" else f"budgetgate.{parts[2]}"


def query_files() -> dict[str, Path]:
    found = {LEDGER: ROOT / "libs" / "budgetgate" / "ledger" / "sql" / "queries.sql"}
    for path in [*(ROOT / "libs" / "budgetgate").glob("*/queries.sql"), *(ROOT / "services").glob("*/queries.sql")]:
        found[owner(path)] = path
    return found


def asked() -> dict[str, set[str]]:
    """Query name -> the packages whose modules ask for it (the benchmarks keep queries of their own)."""
    found: dict[str, set[str]] = defaultdict(set)
    for folder in (ROOT / "libs" / "budgetgate", ROOT / "services"):
        for path in folder.rglob("*.py"):
            text = path.read_text()
            if "budgetgate.ledger.queries import" not in text or path.is_relative_to(ROOT / "libs" / "budgetgate" / "services"):
                continue
            for name in ASKED.findall(text):
                found[name].add(owner(path))
    return found


def test_each_name_is_defined_once_across_every_owner() -> None:
    files = query_files()
    assert len(files) > 5, "owners' query files not found: the layout is out of date"
    seen: dict[str, str] = {}
    for package, path in files.items():
        for name in parse(path.read_text(), where=str(path)):
            assert name not in seen, f"{name} is defined by {seen[name]} and {package}"
            seen[name] = package
        queries_of.cache_clear()
        assert queries_of(package), f"{package}'s queries cannot be read as package data"


def test_every_name_asked_is_the_packages_own_or_the_shared_ledgers() -> None:
    uses = asked()
    assert uses, "no sql(...) call found: the pattern is out of date"
    files = query_files()
    defined = {package: set(parse(path.read_text(), where=str(path))) for package, path in files.items()}
    wrong = sorted((name, p) for name, packages in uses.items() for p in packages if name not in defined.get(p, set()) | defined[LEDGER])
    assert wrong == []


def test_a_packages_own_queries_are_asked_for_by_it_alone_and_none_is_unused() -> None:
    uses = asked()
    for package, path in query_files().items():
        for name in parse(path.read_text(), where=str(path)):
            assert uses.get(name), f"{name} ({package}) is asked for by no module"
            if package != LEDGER:
                assert uses[name] == {package}, f"{name} is {package}'s but {sorted(uses[name])} ask for it: it belongs with the shared ledger's"
