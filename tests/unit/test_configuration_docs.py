"""The documentation cannot drift from the code it describes: docs/configuration.md is what
docs/configuration.py generates from the settings classes now, every variable there says what it
means, and README.md's relative links lead to files that exist (mkdocs --strict checks docs/)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "configuration.md"
SCRIPT = ROOT / "docs" / "configuration.py"
REGENERATE = "run `python docs/configuration.py` and commit docs/configuration.md"


def generator() -> ModuleType:
    # Loaded from its file: docs/ is not a package, and the script stays outside the library.
    spec = importlib.util.spec_from_file_location("budgetgate_configuration_docs", SCRIPT)
    assert spec is not None and spec.loader is not None, f"{SCRIPT} is missing"
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_committed_configuration_page_is_what_the_settings_classes_generate() -> None:
    committed = PAGE.read_text() if PAGE.is_file() else ""
    assert committed == generator().render(), f"docs/configuration.md differs from the settings classes: {REGENERATE}"


def test_every_variable_on_the_page_says_what_it_means() -> None:
    variables = generator().variables()
    names = {v.env for v in variables}
    # A few every deployment sets, from each kind of settings class: shared, a service's own, a webhook's own prefix.
    assert {"BUDGETGATE_POSTGRES_DSN", "BUDGETGATE_OIDC_ISSUER", "BUDGETGATE_SETTLE_TRIES", "BUDGETGATE_KUBERNETES_FAIL_OPEN"} <= names
    unexplained = sorted(v.env for v in variables if not v.meaning)
    assert unexplained == [], f"say what these mean (a comment above the field, or Field(description=...)), then {REGENERATE}"


LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def relative_links(markdown: str) -> list[str]:
    """Targets of the Markdown links that point into the repository (not URLs, not anchors alone)."""
    text = re.sub(r"```.*?```", "", markdown, flags=re.S)  # links inside code blocks are not links
    return [t for t in LINK.findall(text) if not re.match(r"[a-z][a-z0-9+.-]*:", t) and not t.startswith("#")]


def test_the_readme_links_to_files_that_exist() -> None:
    links = relative_links((ROOT / "README.md").read_text())
    assert "docs/quickstart.md" in links, "the README links to the quick start page"
    missing = [t for t in links if not (ROOT / t.split("#")[0]).exists()]
    assert missing == [], f"README.md links to files that do not exist: {missing}"


def test_the_link_check_sees_a_broken_link() -> None:
    links = relative_links('[ok](docs/index.md) [gone](docs/nowhere.md#x "title") [web](https://example.org) [here](#top)\n```\n[code](x.md)\n```')
    assert links == ["docs/index.md", "docs/nowhere.md#x"]
