"""The named queries of ledger/sql/queries.sql: each defined once, and every name the code asks
for defined (a missing or doubled name otherwise shows up only when a service first runs it)."""

from __future__ import annotations

import re
from pathlib import Path

from budgetgate.ledger.queries import _all

ROOT = Path(__file__).resolve().parents[2]
ASKED = re.compile(r"""\bsql\(\s*["'](\w+)["']\s*\)""")


def test_every_query_is_defined_once() -> None:
    _all.cache_clear()
    assert _all(), "queries.sql has no named queries"


def test_every_query_the_code_asks_for_is_defined() -> None:
    asked = {
        (name, str(path.relative_to(ROOT)))
        for folder in ("libs", "services")
        for path in (ROOT / folder).rglob("*.py")
        if "from budgetgate.ledger.queries import sql" in path.read_text()  # the benchmarks have queries of their own
        for name in ASKED.findall(path.read_text())
    }  # fmt: skip
    assert asked, "no sql(...) call found: the pattern is out of date"
    missing = sorted((name, where) for name, where in asked if name not in _all())
    assert missing == []
