"""Named SQL blocks of the benchmark's .sql files (same format as the ledger's queries.sql)."""

from __future__ import annotations

import re
from functools import cache
from importlib import resources

_BLOCK = re.compile(r"^-- name: (\w+)\n(.*?)(?=^-- name: |\Z)", re.S | re.M)


@cache
def _blocks(file: str) -> dict[str, str]:
    text = resources.files("budgetgate.benchmark").joinpath("sql", file).read_text()
    return {name: body.strip().rstrip(";") for name, body in _BLOCK.findall(text)}


def sql(file: str, name: str) -> str:
    """The SQL of block `name` in sql/`file`."""
    try:
        return _blocks(file)[name]
    except KeyError:
        raise KeyError(f"no query named {name!r} in benchmark sql/{file}") from None
