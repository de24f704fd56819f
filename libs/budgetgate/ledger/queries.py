"""Named SQL blocks, so SQL stays out of Python: one file per owner. The shared ledger's are in
ledger/sql/queries.sql; a package with queries of its own keeps them in its `queries.sql`, and its
modules take them with `sql = owned_by("<package>")`, which falls back to the shared ledger's
(a query more than one package uses lives there)."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from functools import cache
from importlib import resources

_BLOCK = re.compile(r"^-- name: (\w+)\n(.*?)(?=^-- name: |\Z)", re.S | re.M)
LEDGER = "budgetgate.ledger"


def parse(text: str, *, where: str) -> dict[str, str]:
    """The named blocks of one query file, comments dropped; a name defined twice is an error."""
    queries: dict[str, str] = {}
    for name, body in _BLOCK.findall(text):
        sql = "\n".join(line for line in body.splitlines() if not line.lstrip().startswith("--")).strip()
        if name in queries:
            raise RuntimeError(f"query {name!r} is defined twice in {where}")
        queries[name] = sql.rstrip(";")
    return queries


@cache
def queries_of(package: str) -> Mapping[str, str]:
    """The named queries `package` owns (its queries.sql; the shared ledger's sql/queries.sql)."""
    path = resources.files(package).joinpath("sql", "queries.sql") if package == LEDGER else resources.files(package).joinpath("queries.sql")
    if package != LEDGER and not path.is_file():
        return {}
    return parse(path.read_text(), where=f"{package}'s queries")


@cache
def owned_by(package: str) -> Callable[[str], str]:
    """`sql(name)` for the modules of `package`: its own queries, then the shared ledger's."""
    if package == LEDGER:
        return sql

    def owned(name: str) -> str:
        found = queries_of(package).get(name)
        if found is not None:
            return found
        try:
            return sql(name)
        except KeyError:
            raise KeyError(f"no query named {name!r} in {package}'s queries or the shared ledger's") from None

    return owned


def sql(name: str) -> str:
    """The SQL of the shared ledger's named query; KeyError names it when missing."""
    try:
        return queries_of(LEDGER)[name]
    except KeyError:
        raise KeyError(f"no query named {name!r} in the shared ledger's queries (libs/budgetgate/ledger/sql/queries.sql)") from None
