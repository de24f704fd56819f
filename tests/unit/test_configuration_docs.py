"""The documentation cannot drift from the code it describes: docs/configuration.md is what
docs/configuration.py generates from the settings classes now, and every variable there says what
it means."""

from __future__ import annotations

import importlib.util
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
