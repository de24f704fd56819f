"""docs/architecture.md stays true: every path it names exists, each walk has at most eight
stops (each a file), its layers are import-linter's, and every table has a writer."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGE = (ROOT / "docs" / "architecture.md").read_text()
PATH = re.compile(r"`((?:libs|services|schemas|docs|deploy|tests|proto)/[\w./-]+)`")


def sections(level: str) -> dict[str, str]:
    parts = re.split(rf"(?m)^{level} ", PAGE)
    return {part.splitlines()[0].strip(): part for part in parts[1:]}


def test_every_path_the_page_names_exists() -> None:
    named = set(PATH.findall(PAGE))
    assert len(named) > 20, "the pattern finds no paths: it is out of date"
    assert sorted(p for p in named if not (ROOT / p).exists()) == []


def test_each_walk_is_at_most_eight_stops_each_a_file() -> None:
    walks = {title: text for title, text in sections("###").items() if title.startswith("Walk:")}
    assert len(walks) == 3, list(walks)
    for title, text in walks.items():
        stops = re.findall(r"(?m)^\d+\. `([^`]+)`", text)
        numbered = re.findall(r"(?m)^\d+\. ", text)
        assert len(stops) == len(numbered), f"{title}: every stop starts with the file it is"
        assert 3 <= len(stops) <= 8, f"{title}: {len(stops)} stops"
        assert all((ROOT / stop).is_file() for stop in stops), title


def test_the_layers_are_the_ones_import_linter_holds() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    [layers] = [c for c in config["contracts"] if c["type"] == "layers"]
    packages = {p.strip() for layer in layers["layers"] for p in re.split(r"[|:]", layer)}
    table = sections("##")["The layers"]
    documented = set(re.findall(r"`(budgetgate\.[a-z0-9_]+)(?:\.\*)?`", table)) - {"budgetgate.services"}
    assert documented == packages - {"budgetgate.services"}


def test_every_table_has_one_writer_row() -> None:
    schema = (ROOT / "libs" / "budgetgate" / "ledger" / "sql" / "schema.sql").read_text()
    tables = set(re.findall(r"(?m)^CREATE TABLE (\w+)", schema)) - {"schema_migrations"}
    rows = sections("##")["Who writes which table"]
    listed = re.findall(r"`([a-z_]+)`", "\n".join(line.split("|")[2] for line in rows.splitlines() if line.startswith("| ") and "---" not in line))
    assert sorted(tables - set(listed)) == [] and sorted(set(listed) - tables) == []
    assert len(listed) == len(set(listed)), "a table has two writer rows"
