"""Named SQL blocks from sql/queries.sql, so SQL stays out of Python."""

from __future__ import annotations

import re
from functools import cache
from importlib import resources

_BLOCK = re.compile(r"^-- name: (\w+)\n(.*?)(?=^-- name: |\Z)", re.S | re.M)


@cache
def _all() -> dict[str, str]:
    text = resources.files("budgetgate.ledger").joinpath("sql", "queries.sql").read_text()
    queries = {}
    for name, body in _BLOCK.findall(text):
        sql = "\n".join(line for line in body.splitlines() if not line.lstrip().startswith("--")).strip()
        if name in queries:
            raise RuntimeError(f"query {name!r} is defined twice in queries.sql")
        queries[name] = sql.rstrip(";")
    return queries


def sql(name: str) -> str:
    """The SQL of the named query; KeyError names it when missing."""
    try:
        return _all()[name]
    except KeyError:
        raise KeyError(f"no query named {name!r} in queries.sql") from None
