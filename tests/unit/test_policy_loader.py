"""Policy files: the example repository, line-level errors, label strings, scope ids, rate cards."""

from __future__ import annotations

import json
import textwrap
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path
from zoneinfo import ZoneInfo

import pytest

from budgetgate.core.loader import (
    PolicyError,
    PolicyValidationError,
    SourceDocument,
    bundle_from_json,
    build_bundle,
    documents_to_json,
    load_directory,
    parse_text,
)
from budgetgate.core.policy import BudgetPolicy, Enforcement, OnExhausted, PolicyBundle, Rate, RateCard, Scope, Source
from budgetgate.core.units import Unit, to_amount
from budgetgate.core.windows import WindowSpec

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "policies"

POLICY = """\
apiVersion: budgetgate/v1
kind: BudgetPolicy
metadata:
  id: {id}
spec:
  scope:
    namespace: {namespace}
  window:
    calendar: month
  limit:
    gpu_hours: 100
"""

RATES = """\
apiVersion: budgetgate/v1
kind: RateCard
metadata:
  id: rates/test
spec:
  currency: USD
  rates:
    - {flavor: h100, rate_per_gpu_hour: 3.933}
"""


def write(root: Path, name: str, text: str) -> Path:
    path = root / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


def load(root: Path) -> PolicyBundle:
    bundle, _ = load_directory(root, git_sha="0" * 40)
    return bundle


def errors(root: Path) -> tuple[PolicyError, ...]:
    with pytest.raises(PolicyValidationError) as info:
        load_directory(root, git_sha="0" * 40)
    return info.value.errors


def only_error(root: Path) -> PolicyError:
    found = errors(root)
    assert len(found) == 1, found
    return found[0]


def policy(bundle: PolicyBundle, policy_id: str) -> BudgetPolicy:
    return next(p for p in bundle.policies if p.id == policy_id)


# --- the example repository ---------------------------------------------------------------------


def test_example_repository_loads() -> None:
    bundle, documents = load_directory(EXAMPLES, git_sha="abc123")
    assert bundle.git_sha == "abc123"
    assert sorted(p.id for p in bundle.policies) == [
        "cost/cc-1042",
        "gpu-budget/org-dry-run",
        "gpu-budget/team-nlp",
        "gpu-budget/team-vision-prod",
        "gpu-budget/team-vision-research",
        "node-budget/team-nlp-preprocessing",
    ]
    assert [card.id for card in bundle.rate_cards] == ["rates/2026"]
    assert sorted(bundle.accounts.accounts) == ["acme", "nlp", "platform", "research", "sandbox", "vision"]
    assert len(documents) == 13


def test_example_policies_are_read_as_written() -> None:
    bundle = load(EXAMPLES)
    vision = policy(bundle, "gpu-budget/team-vision-prod")
    assert vision.scope == Scope(namespaces=frozenset({"vision-prod"}), labels={"cost-center": "1042", "team": "vision"})
    assert vision.scope.scope_id == "ns=vision-prod;cost-center=1042;team=vision"
    assert vision.window == WindowSpec(calendar="month", timezone="UTC")
    assert vision.limit.unit is Unit.GPU_HOURS
    assert vision.limit.amount == 500 * 3_600_000
    assert vision.enforcement is Enforcement.HARD
    assert vision.on_exhausted is OnExhausted.DENY
    assert vision.source == Source("teams/vision.yaml", 2)

    research = policy(bundle, "gpu-budget/team-vision-research")
    assert research.window == WindowSpec(calendar="week", timezone="Europe/Berlin")
    assert research.on_exhausted is OnExhausted.DELAY
    assert research.source == Source("teams/vision.yaml", 22)

    nlp = policy(bundle, "gpu-budget/team-nlp")
    assert nlp.window == WindowSpec(rolling_days=30)
    assert nlp.scope.scope_id == "ns=nlp-dev,nlp-prod;environment=*;team=nlp"

    cost = policy(bundle, "cost/cc-1042")
    assert (cost.limit.unit, cost.limit.amount, cost.limit.currency) == (Unit.COST, 5_000_000_000, "USD")
    assert cost.scope.scope_id == "cost-center=1042"

    assert policy(bundle, "gpu-budget/org-dry-run").enforcement is Enforcement.DRY_RUN
    # on_exhausted defaults to deny when not written.
    assert policy(bundle, "gpu-budget/org-dry-run").on_exhausted is OnExhausted.DENY
    assert policy(bundle, "node-budget/team-nlp-preprocessing").enforcement is Enforcement.SOFT
    assert policy(bundle, "node-budget/team-nlp-preprocessing").limit.unit is Unit.NODE_HOURS


def test_example_rates_are_exact_decimals() -> None:
    card = load(EXAMPLES).rate_cards[0]
    assert card.currency == "USD"
    assert card.source == Source("finance/cost-centers.yaml", 33)
    h100 = [r for r in card.rates if r.flavor == "h100"]
    assert h100[0].rate_per_gpu_hour == Decimal("3.933")
    assert isinstance(h100[0].rate_per_gpu_hour, Decimal)
    assert str(h100[0].rate_per_gpu_hour) == "3.933"  # not 3.93299999999999982946974341757595539093017578125
    assert h100[1].region == "eu-west-1"


def test_enforcement_defaults_to_hard(tmp_path: Path) -> None:
    write(tmp_path, "p.yaml", POLICY.format(id="p", namespace="ns-a"))
    only = load(tmp_path).policies[0]
    assert only.enforcement is Enforcement.HARD
    assert only.on_exhausted is OnExhausted.DENY


def test_empty_directory_is_an_empty_bundle(tmp_path: Path) -> None:
    write(tmp_path, "README.md", "not a policy")
    assert load(tmp_path) == PolicyBundle(git_sha="0" * 40)


def test_missing_directory_is_an_error(tmp_path: Path) -> None:
    error = only_error(tmp_path / "nope")
    assert error.message == "no such file or directory"


def test_yml_files_and_subdirectories_are_read_and_git_is_skipped(tmp_path: Path) -> None:
    write(tmp_path, "a/b/one.yml", POLICY.format(id="one", namespace="ns-a"))
    write(tmp_path, ".git/config.yaml", "this: is not: valid: yaml")
    bundle = load(tmp_path)
    assert [p.id for p in bundle.policies] == ["one"]
    assert bundle.policies[0].source.file == "a/b/one.yml"


# --- errors, each with file and line ------------------------------------------------------------


def test_bad_yaml_syntax_names_file_and_line(tmp_path: Path) -> None:
    write(
        tmp_path,
        "bad.yaml",
        """\
        apiVersion: budgetgate/v1
        kind: BudgetPolicy
        metadata:
          id: x
        spec:
          scope: {namespace: a
          window: {calendar: month}
        """,
    )
    error = only_error(tmp_path)
    assert error.file == "bad.yaml"
    assert error.line in (6, 7)
    assert error.message.startswith("invalid YAML")


def test_tab_indentation_error_has_its_line(tmp_path: Path) -> None:
    write(tmp_path, "tabs.yaml", "apiVersion: budgetgate/v1\nkind: BudgetPolicy\nmetadata:\n\tid: x\n")
    error = only_error(tmp_path)
    assert (error.file, error.line) == ("tabs.yaml", 4)
    assert "invalid YAML" in error.message


def test_unknown_kind(tmp_path: Path) -> None:
    write(tmp_path, "k.yaml", "# a comment\napiVersion: budgetgate/v1\nkind: Budget\nmetadata: {id: x}\nspec: {}\n")
    error = only_error(tmp_path)
    assert (error.file, error.line) == ("k.yaml", 3)
    assert "unknown kind 'Budget'" in error.message
    assert "BudgetPolicy" in error.message and "RateCard" in error.message


@pytest.mark.parametrize("kind", ["Quota", "ResourcePool"])
def test_concurrency_kinds_reject_unknown_fields_at_their_line(tmp_path: Path, kind: str) -> None:
    write(tmp_path, "q.yaml", f"apiVersion: budgetgate/v1\nkind: {kind}\nmetadata: {{id: q}}\nspec:\n  hard: {{gpus: 8}}\n")
    found = errors(tmp_path)
    assert any(e.line == 5 and "spec.hard" in e.message for e in found), found


def test_wrong_api_version(tmp_path: Path) -> None:
    write(tmp_path, "v.yaml", "apiVersion: budgetgate/v2\nkind: BudgetPolicy\nmetadata: {id: x}\nspec: {}\n")
    error = only_error(tmp_path)
    assert error.line == 1
    assert error.message.startswith("apiVersion:")
    assert "budgetgate/v1" in error.message


def test_document_that_is_not_a_mapping(tmp_path: Path) -> None:
    write(tmp_path, "list.yaml", "apiVersion: budgetgate/v1\n---\n- just\n- a list\n")
    found = errors(tmp_path)
    assert {e.message for e in found if e.line == 1} == {"kind: Field required", "metadata: Field required", "spec: Field required"}
    [not_mapping] = [e for e in found if e.line == 3]
    assert not_mapping.message.startswith("a policy document must be a mapping")


def test_missing_fields_are_named_with_the_line_of_their_parent(tmp_path: Path) -> None:
    write(
        tmp_path,
        "m.yaml",
        """\
        apiVersion: budgetgate/v1
        kind: BudgetPolicy
        metadata:
          id: missing
        spec:
          scope:
            namespace: a
          limit:
            gpu_hours: 10
        """,
    )
    error = only_error(tmp_path)
    assert (error.file, error.line) == ("m.yaml", 5)
    assert error.message == "spec.window: Field required"


def test_missing_metadata_id(tmp_path: Path) -> None:
    write(tmp_path, "m.yaml", "apiVersion: budgetgate/v1\nkind: BudgetPolicy\nmetadata:\n  owner: me\nspec: {}\n")
    error = only_error(tmp_path)
    assert error.line == 3
    assert error.message == "metadata.id: Field required"


def test_unknown_field_is_rejected_at_its_line(tmp_path: Path) -> None:
    text = POLICY.format(id="p", namespace="a") + "  enforcment: soft\n"
    write(tmp_path, "typo.yaml", text)
    error = only_error(tmp_path)
    assert error.line == 12
    assert error.message.startswith("spec.enforcment:")


@pytest.mark.parametrize(
    ("field", "value", "expect"),
    [
        ("enforcement", "strict", "'hard', 'soft' or 'dry-run'"),
        ("on_exhausted", "retry", "'deny', 'delay', 'hold' or 'hold-and-drain'"),
    ],
)
def test_wrong_enum_value(tmp_path: Path, field: str, value: str, expect: str) -> None:
    write(tmp_path, "e.yaml", POLICY.format(id="p", namespace="a") + f"  {field}: {value}\n")
    error = only_error(tmp_path)
    assert (error.file, error.line) == ("e.yaml", 12)
    assert error.message.startswith(f"spec.{field}:")
    assert expect in error.message


def test_wrong_calendar_value(tmp_path: Path) -> None:
    write(tmp_path, "c.yaml", POLICY.format(id="p", namespace="a").replace("calendar: month", "calendar: year"))
    error = only_error(tmp_path)
    assert error.line == 9
    assert error.message.startswith("spec.window.calendar:")


@pytest.mark.parametrize("value", ["-5", "0", ".inf", ".nan", "-.inf"])
def test_non_positive_or_non_finite_limit(tmp_path: Path, value: str) -> None:
    write(tmp_path, "n.yaml", POLICY.format(id="p", namespace="a").replace("gpu_hours: 100", f"gpu_hours: {value}"))
    error = only_error(tmp_path)
    assert (error.file, error.line) == ("n.yaml", 11)
    assert error.message.startswith("spec.limit.gpu_hours:")


def test_negative_limit_message(tmp_path: Path) -> None:
    write(tmp_path, "n.yaml", POLICY.format(id="p", namespace="a").replace("gpu_hours: 100", "gpu_hours: -5"))
    assert only_error(tmp_path).message == "spec.limit.gpu_hours: Input should be greater than 0"


def test_two_units_in_one_limit(tmp_path: Path) -> None:
    write(tmp_path, "two.yaml", POLICY.format(id="p", namespace="a") + "    node_hours: 50\n")
    error = only_error(tmp_path)
    assert (error.file, error.line) == ("two.yaml", 10)
    assert error.message == "spec.limit: give exactly one of gpu_hours, node_hours, wall_hours or cost"


def test_cost_without_currency(tmp_path: Path) -> None:
    write(tmp_path, "rates.yaml", RATES)
    write(tmp_path, "c.yaml", POLICY.format(id="p", namespace="a").replace("gpu_hours: 100", "cost: 100"))
    error = only_error(tmp_path)
    assert (error.file, error.line) == ("c.yaml", 10)
    assert "a cost limit needs a currency" in error.message


def test_currency_without_cost(tmp_path: Path) -> None:
    write(tmp_path, "c.yaml", POLICY.format(id="p", namespace="a") + "    currency: USD\n")
    assert "currency goes only with a cost limit" in only_error(tmp_path).message


def test_bad_currency_code_is_explained(tmp_path: Path) -> None:
    write(tmp_path, "c.yaml", POLICY.format(id="p", namespace="a").replace("gpu_hours: 100", "cost: 100\n    currency: usd"))
    error = only_error(tmp_path)
    assert error.line == 12
    assert "'usd' is not a three-letter ISO 4217 currency code" in error.message


def test_unknown_time_zone(tmp_path: Path) -> None:
    write(tmp_path, "tz.yaml", POLICY.format(id="p", namespace="a").replace("calendar: month", "calendar: month\n    timezone: Europe/Atlantis"))
    error = only_error(tmp_path)
    assert (error.file, error.line) == ("tz.yaml", 10)
    assert error.message == "spec.window.timezone: unknown time zone 'Europe/Atlantis'"


def test_bad_namespace_name_is_explained(tmp_path: Path) -> None:
    write(tmp_path, "ns.yaml", POLICY.format(id="p", namespace="Vision_Prod"))
    error = only_error(tmp_path)
    assert error.line == 7
    assert "'Vision_Prod' is not a Kubernetes namespace name" in error.message


def test_error_in_a_later_document_has_its_own_line(tmp_path: Path) -> None:
    text = POLICY.format(id="one", namespace="a") + "---\n" + POLICY.format(id="two", namespace="b").replace("gpu_hours: 100", "gpu_hours: -1")
    write(tmp_path, "multi.yaml", text)
    error = only_error(tmp_path)
    assert (error.file, error.line) == ("multi.yaml", 11 + 1 + 11)


def test_duplicate_id_across_files_names_both_places(tmp_path: Path) -> None:
    write(tmp_path, "a.yaml", POLICY.format(id="gpu-budget/dup", namespace="ns-a"))
    write(tmp_path, "b/c.yaml", "# second copy\n" + POLICY.format(id="gpu-budget/dup", namespace="ns-b"))
    error = only_error(tmp_path)
    assert (error.file, error.line) == ("b/c.yaml", 2)
    assert "'gpu-budget/dup'" in error.message
    assert "already defined at a.yaml:1" in error.message


def test_two_policies_on_one_scope_window_and_unit(tmp_path: Path) -> None:
    write(tmp_path, "a.yaml", POLICY.format(id="first", namespace="ns-a"))
    write(tmp_path, "b.yaml", POLICY.format(id="second", namespace="ns-a").replace("gpu_hours: 100", "gpu_hours: 200"))
    error = only_error(tmp_path)
    assert (error.file, error.line) == ("b.yaml", 1)
    assert "'second'" in error.message and "'first'" in error.message
    assert "a.yaml:1" in error.message


def test_same_scope_in_another_window_or_unit_is_fine(tmp_path: Path) -> None:
    write(tmp_path, "a.yaml", POLICY.format(id="monthly", namespace="ns-a"))
    write(tmp_path, "b.yaml", POLICY.format(id="weekly", namespace="ns-a").replace("calendar: month", "calendar: week"))
    write(tmp_path, "c.yaml", POLICY.format(id="nodes", namespace="ns-a").replace("gpu_hours", "node_hours"))
    assert len(load(tmp_path).policies) == 3


def test_cost_policy_needs_a_rate_card_in_its_currency(tmp_path: Path) -> None:
    write(tmp_path, "rates.yaml", RATES)
    write(tmp_path, "c.yaml", POLICY.format(id="eur-cap", namespace="a").replace("gpu_hours: 100", "cost: 100\n    currency: EUR"))
    error = only_error(tmp_path)
    assert (error.file, error.line) == ("c.yaml", 1)
    assert "'eur-cap'" in error.message and "no RateCard is in EUR" in error.message


def test_cost_policy_without_any_rate_card(tmp_path: Path) -> None:
    write(tmp_path, "c.yaml", POLICY.format(id="usd-cap", namespace="a").replace("gpu_hours: 100", "cost: 100\n    currency: USD"))
    assert "no RateCard is in USD" in only_error(tmp_path).message


def test_rate_cards_in_several_currencies(tmp_path: Path) -> None:
    write(tmp_path, "usd.yaml", RATES)
    write(tmp_path, "eur.yaml", RATES.replace("rates/test", "rates/eur").replace("USD", "EUR"))
    found = errors(tmp_path)
    assert {e.file for e in found} == {"usd.yaml", "eur.yaml"}
    assert all("several currencies (EUR, USD)" in e.message for e in found)


def test_rate_effective_from_needs_a_time_zone(tmp_path: Path) -> None:
    write(tmp_path, "r.yaml", RATES + '    - {flavor: a100, rate_per_gpu_hour: 2, effective_from: "2026-07-01T00:00:00"}\n')
    error = only_error(tmp_path)
    assert error.line == 9
    assert error.message.startswith("spec.rates.1.effective_from:")
    assert "effective_from needs a time zone" in error.message


def test_a_rate_takes_effect_on_a_quarter_hour(tmp_path: Path) -> None:
    # Metering knows usage exactly at quarter hours (UTC) only: a rate changing between two would
    # price the usage either side of it by how samples fell into polls. 09:37 in India is 04:07 UTC.
    write(tmp_path, "r.yaml", RATES + '    - {flavor: a100, rate_per_gpu_hour: 2, effective_from: "2026-07-01T09:37:00+05:30"}\n')
    error = only_error(tmp_path)
    assert error.message.startswith("spec.rates.1.effective_from:")
    assert "effective_from 2026-07-01T09:37:00+05:30 is not on a quarter hour (UTC)" in error.message
    assert "e.g. 2026-07-01T04:00:00Z" in error.message
    # 09:45 there is 04:15 UTC: a quarter hour.
    write(tmp_path, "r.yaml", RATES + '    - {flavor: a100, rate_per_gpu_hour: 2, effective_from: "2026-07-01T09:45:00+05:30"}\n')
    bundle, _ = load_directory(tmp_path, git_sha="s")
    assert bundle.rate_cards[0].rates[1].effective_from == datetime(2026, 7, 1, 4, 15, tzinfo=UTC)


def test_every_error_of_a_file_is_reported(tmp_path: Path) -> None:
    text = "\n---\n".join(
        [
            POLICY.format(id="neg", namespace="a").replace("gpu_hours: 100", "gpu_hours: -1"),
            "apiVersion: budgetgate/v1\nkind: Quota\nmetadata: {id: q}\nspec: {}\n",
            POLICY.format(id="tz", namespace="b").replace("calendar: month", "calendar: month\n    timezone: Nowhere/Land"),
        ]
    )
    write(tmp_path, "many.yaml", text)
    found = errors(tmp_path)
    assert len(found) == 3
    assert [e.file for e in found] == ["many.yaml"] * 3
    assert "greater than 0" in found[0].message
    assert "a Quota needs a tenant" in found[1].message
    assert "unknown time zone" in found[2].message


def test_every_error_of_a_directory_is_reported_at_once(tmp_path: Path) -> None:
    write(tmp_path, "a-syntax.yaml", "apiVersion: budgetgate/v1\nkind: [BudgetPolicy\n")
    write(tmp_path, "b-quota.yaml", "apiVersion: budgetgate/v1\nkind: Quota\nmetadata: {id: q}\nspec: {}\n")
    write(tmp_path, "c-negative.yaml", POLICY.format(id="neg", namespace="a").replace("gpu_hours: 100", "gpu_hours: -1"))
    write(tmp_path, "d-dup.yaml", POLICY.format(id="ok", namespace="b"))
    write(tmp_path, "e-dup.yaml", POLICY.format(id="ok", namespace="c"))
    found = errors(tmp_path)
    assert [e.file for e in found] == ["a-syntax.yaml", "b-quota.yaml", "c-negative.yaml", "e-dup.yaml"]


def test_validation_error_lists_errors_sorted_in_its_message(tmp_path: Path) -> None:
    write(tmp_path, "b.yaml", "apiVersion: budgetgate/v1\nkind: Quota\nmetadata: {id: q}\nspec: {}\n")
    write(tmp_path, "a.yaml", POLICY.format(id="neg", namespace="a").replace("gpu_hours: 100", "gpu_hours: -1"))
    with pytest.raises(PolicyValidationError) as info:
        load_directory(tmp_path, git_sha="x")
    lines = str(info.value).splitlines()
    assert lines[0].startswith("a.yaml:11: spec.limit.gpu_hours:")
    assert lines[1].startswith("b.yaml:4: spec: a Quota needs a tenant")


# --- label values are strings -------------------------------------------------------------------


def test_label_values_written_as_numbers_are_strings(tmp_path: Path) -> None:
    write(
        tmp_path,
        "labels.yaml",
        """\
        apiVersion: budgetgate/v1
        kind: BudgetPolicy
        metadata:
          id: 0123
        spec:
          scope:
            namespace: "1042"
            labels:
              cost-center: 1042
              project: 0123
              ratio: 1.50
              flag: true
              hex: 0x1F
              big: 1_000
          window: {calendar: month}
          limit: {gpu_hours: 10}
        """,
    )
    only = load(tmp_path).policies[0]
    assert only.id == "0123"
    assert only.scope.namespaces == frozenset({"1042"})
    assert dict(only.scope.labels) == {
        "cost-center": "1042",
        "project": "0123",
        "ratio": "1.50",
        "flag": "true",
        "hex": "0x1F",
        "big": "1_000",
    }
    assert all(isinstance(v, str) for v in only.scope.labels.values())


def test_null_label_value_is_an_error(tmp_path: Path) -> None:
    write(tmp_path, "n.yaml", POLICY.format(id="p", namespace="a").replace("namespace: a", "namespace: a\n    labels:\n      team:"))
    error = only_error(tmp_path)
    assert error.line == 9
    assert error.message.startswith("spec.scope.labels.team:")


def test_numbers_outside_names_stay_numbers(tmp_path: Path) -> None:
    write(tmp_path, "p.yaml", POLICY.format(id="p", namespace="a").replace("gpu_hours: 100", "gpu_hours: 1_000.5"))
    assert load(tmp_path).policies[0].limit.amount == to_amount(Unit.GPU_HOURS, "1000.5")


# --- scope ids ---------------------------------------------------------------------------------


def test_scope_id_is_canonical_and_sorted() -> None:
    scope = Scope(namespaces=frozenset({"vision-prod"}), labels={"team": "vision", "cost-center": "1042"})
    assert scope.scope_id == "ns=vision-prod;cost-center=1042;team=vision"
    assert Scope(namespaces=frozenset({"b", "a"})).scope_id == "ns=a,b"
    # Set order depends on string hashing; the id must not.
    names = [f"team-{c}" for c in "hgfedcba"]
    assert Scope(namespaces=frozenset(names)).scope_id == "ns=" + ",".join(sorted(names))
    assert Scope(labels={"environment": "*"}).scope_id == "environment=*"
    assert Scope().scope_id == "all"


def test_two_spellings_of_one_scope_have_one_scope_id(tmp_path: Path) -> None:
    write(
        tmp_path,
        "one.yaml",
        """\
        apiVersion: budgetgate/v1
        kind: BudgetPolicy
        metadata: {id: one}
        spec:
          scope:
            namespace: vision-prod
            labels: {team: vision, cost-center: 1042}
          window: {calendar: month}
          limit: {gpu_hours: 10}
        """,
    )
    write(
        tmp_path,
        "two.yaml",
        """\
        apiVersion: budgetgate/v1
        kind: BudgetPolicy
        metadata: {id: two}
        spec:
          scope:
            labels:
              cost-center: "1042"
              team: 'vision'
            namespaces: [vision-prod]
          window: {calendar: week}
          limit: {gpu_hours: 10}
        """,
    )
    one, two = load(tmp_path).policies
    assert one.scope.scope_id == two.scope.scope_id == "ns=vision-prod;cost-center=1042;team=vision"
    assert one.scope == two.scope


def test_two_spellings_of_one_scope_window_and_unit_collide(tmp_path: Path) -> None:
    write(tmp_path, "a.yaml", POLICY.format(id="a", namespace="x").replace("namespace: x", "namespaces: [y, x]"))
    write(
        tmp_path,
        "b.yaml",
        POLICY.format(id="b", namespace="x").replace("namespace: x", "namespaces: [x, y]").replace("calendar: month", "calendar: month\n    timezone: UTC"),
    )
    assert "same scope, window and unit" in only_error(tmp_path).message


# --- stored documents -------------------------------------------------------------------------


def test_documents_round_trip_through_json() -> None:
    bundle, documents = load_directory(EXAMPLES, git_sha="abc")
    text = documents_to_json(documents)
    assert isinstance(json.loads(text), list)
    assert bundle_from_json(text, git_sha="abc") == bundle


def test_json_round_trip_keeps_exact_rates_and_unquoted_timestamps(tmp_path: Path) -> None:
    write(
        tmp_path,
        "r.yaml",
        """\
        apiVersion: budgetgate/v1
        kind: RateCard
        metadata: {id: r}
        spec:
          currency: USD
          rates:
            - {flavor: a100, rate_per_gpu_hour: 1.85, effective_from: 2026-07-01T00:00:00Z}
            - {flavor: a100, rate_per_gpu_hour: 2.10}
            - {flavor: "1042", region: 0123, rate_per_gpu_hour: 0.1}
        """,
    )
    write(tmp_path, "p.yaml", POLICY.format(id="p", namespace="a").replace("gpu_hours: 100", "cost: 0.1\n    currency: USD"))
    bundle, documents = load_directory(tmp_path, git_sha="s")
    rebuilt = bundle_from_json(documents_to_json(documents), git_sha="s")
    assert rebuilt == bundle
    rates = rebuilt.rate_cards[0].rates
    assert rates[0].effective_from == datetime(2026, 7, 1, tzinfo=UTC)
    assert [r.rate_per_gpu_hour for r in rates] == [Decimal("1.85"), Decimal("2.10"), Decimal("0.1")]
    assert (rates[2].flavor, rates[2].region) == ("1042", "0123")
    assert rebuilt.policies[0].limit.amount == 100_000


def test_stored_documents_are_validated_again(tmp_path: Path) -> None:
    write(tmp_path, "p.yaml", POLICY.format(id="p", namespace="a"))
    _, documents = load_directory(tmp_path, git_sha="s")
    stored = json.loads(documents_to_json(documents))
    stored[0]["data"]["spec"]["limit"]["gpu_hours"] = -1
    with pytest.raises(PolicyValidationError) as info:
        bundle_from_json(json.dumps(stored), git_sha="s")
    assert info.value.errors[0].file == "p.yaml"
    assert "greater than 0" in info.value.errors[0].message


def test_build_bundle_from_parsed_text() -> None:
    documents = parse_text(POLICY.format(id="p", namespace="a"), "inline.yaml")
    bundle = build_bundle(documents, git_sha="s")
    assert bundle.policies[0].source == Source("inline.yaml", 1)


# --- rate cards -------------------------------------------------------------------------------


def card(*rates: Rate) -> RateCard:
    return RateCard(id="c", currency="USD", rates=rates, source=Source("c.yaml", 1))


def test_region_rate_beats_a_rate_without_region() -> None:
    generic = Rate("h100", Decimal("3.933"))
    eu = Rate("h100", Decimal("4.25"), region="eu-west-1")
    at = datetime(2026, 3, 1, tzinfo=UTC)
    assert card(eu, generic).rate_for("h100", "eu-west-1", at) == eu
    assert card(generic, eu).rate_for("h100", "eu-west-1", at) == eu
    assert card(generic, eu).rate_for("h100", "us-east-1", at) == generic
    assert card(generic, eu).rate_for("h100", None, at) == generic


def test_latest_effective_rate_not_after_the_instant_wins() -> None:
    old = Rate("a100", Decimal("2.10"))
    july = Rate("a100", Decimal("1.85"), effective_from=datetime(2026, 7, 1, tzinfo=UTC))
    october = Rate("a100", Decimal("1.50"), effective_from=datetime(2026, 10, 1, tzinfo=UTC))
    rates = card(october, old, july)
    assert rates.rate_for("a100", None, datetime(2026, 6, 30, 23, 59, tzinfo=UTC)) == old
    assert rates.rate_for("a100", None, datetime(2026, 7, 1, tzinfo=UTC)) == july  # effective at its first instant
    assert rates.rate_for("a100", None, datetime(2026, 9, 30, tzinfo=UTC)) == july
    assert rates.rate_for("a100", None, datetime(2027, 1, 1, tzinfo=UTC)) == october


def test_future_rates_are_ignored() -> None:
    future = Rate("l4", Decimal("0.50"), effective_from=datetime(2030, 1, 1, tzinfo=UTC))
    assert card(future).rate_for("l4", None, datetime(2026, 1, 1, tzinfo=UTC)) is None
    current = Rate("l4", Decimal("0.71"))
    assert card(future, current).rate_for("l4", None, datetime(2026, 1, 1, tzinfo=UTC)) == current


def test_region_rate_in_the_future_does_not_win() -> None:
    generic = Rate("h100", Decimal("3.933"))
    eu_later = Rate("h100", Decimal("4.25"), region="eu-west-1", effective_from=datetime(2027, 1, 1, tzinfo=UTC))
    assert card(generic, eu_later).rate_for("h100", "eu-west-1", datetime(2026, 6, 1, tzinfo=UTC)) == generic


def test_rate_lookup_with_an_instant_in_a_zone_ahead_of_utc() -> None:
    old = Rate("a100", Decimal("2.10"))
    july = Rate("a100", Decimal("1.85"), effective_from=datetime(2026, 7, 1, tzinfo=UTC))
    kolkata = ZoneInfo("Asia/Kolkata")
    # 05:29 in Kolkata on 1 July is still 30 June in UTC.
    assert card(old, july).rate_for("a100", None, datetime(2026, 7, 1, 5, 29, tzinfo=kolkata)) == old
    assert card(old, july).rate_for("a100", None, datetime(2026, 7, 1, 5, 30, tzinfo=kolkata)) == july


def test_unknown_flavor_has_no_rate() -> None:
    assert card(Rate("h100", Decimal(1))).rate_for("b200", None, datetime(2026, 1, 1, tzinfo=UTC)) is None


def test_bundle_rate_for_gives_the_currency() -> None:
    bundle = load(EXAMPLES)
    rate, currency = bundle.rate_for("h100", "eu-west-1", datetime(2026, 3, 1, tzinfo=UTC)) or (None, None)
    assert rate == Rate("h100", Decimal("4.25"), region="eu-west-1")
    assert currency == "USD"
    assert bundle.rate_for("a100", None, datetime(2026, 7, 1, tzinfo=UTC))[0].rate_per_gpu_hour == Decimal("1.85")  # type: ignore[index]
    assert bundle.rate_for("tpu", None, datetime(2026, 3, 1, tzinfo=UTC)) is None


def test_label_key_ns_is_reserved_for_namespaces(tmp_path: Path) -> None:
    write(tmp_path, "a.yaml", POLICY.format(id="a", namespace="x").replace("    namespace: x\n", "    labels: {ns: x}\n"))
    error = only_error(tmp_path)
    assert "reserved" in error.message and error.line == 7


def test_same_scope_and_calendar_in_equivalent_time_zones_is_one_ledger(tmp_path: Path) -> None:
    write(tmp_path, "a.yaml", POLICY.format(id="a", namespace="x"))
    write(tmp_path, "b.yaml", POLICY.format(id="b", namespace="x").replace("calendar: month", "calendar: month\n    timezone: Etc/UTC"))
    error = only_error(tmp_path)
    assert error.file == "b.yaml" and "same scope, window and unit" in error.message


def test_most_specific_rate_wins_across_rate_cards(tmp_path: Path) -> None:
    write(tmp_path, "rates-a.yaml", RATES)
    write(
        tmp_path,
        "rates-b.yaml",
        RATES.replace("rates/test", "rates/eu").replace(
            "{flavor: h100, rate_per_gpu_hour: 3.933}", "{flavor: h100, region: eu-west-1, rate_per_gpu_hour: 4.25}"
        ),
    )
    bundle = load(tmp_path)
    at = datetime(2026, 11, 1, tzinfo=UTC)
    assert bundle.rate_for("h100", "eu-west-1", at) == (Rate("h100", Decimal("4.25"), "eu-west-1"), "USD")
    assert bundle.rate_for("h100", "us-east-1", at) == (Rate("h100", Decimal("3.933")), "USD")


QUOTAS = """\
apiVersion: budgetgate/v1
kind: Quota
metadata: {id: tenant-physics}
spec: {tenant: physics, max_nodes: 200, max_gpus: 1600, max_concurrent_allocations: 50, fair_share_target: 0.25, burst_allowance: 1.5}
---
apiVersion: budgetgate/v1
kind: Cluster
metadata: {id: cluster}
spec: {gpus: 2048, nodes: 256}
---
apiVersion: budgetgate/v1
kind: Quota
metadata: {id: sensitive}
spec: {sensitive_pool_size: 64, sensitive_unit: nodes}
---
apiVersion: budgetgate/v1
kind: ResourcePool
metadata: {id: warehouse}
spec: {namespace: "snowflake:wh-1", quota: 50, project_cap: 10}
---
apiVersion: budgetgate/v1
kind: ResourcePool
metadata: {id: snowflake}
spec: {namespace: snowflake, quota: 80}
"""


def test_quota_cluster_and_pool_documents_load(tmp_path: Path) -> None:
    write(tmp_path, "q.yaml", QUOTAS)
    bundle = load(tmp_path)
    physics = bundle.quota_for("physics")
    assert physics is not None and (physics.max_gpus, physics.max_nodes, physics.max_concurrent_allocations) == (1600, 200, 50)
    assert physics.fair_share_target == 0.25 and physics.burst_allowance == 1.5
    assert bundle.quota_for("chemistry") is None and bundle.quota_for(None) is None
    assert bundle.cluster is not None and bundle.cluster.gpus == 2048
    assert bundle.sensitive is not None and (bundle.sensitive.size, bundle.sensitive.unit) == (64, "nodes")
    assert [p.namespace for p in bundle.pool_chain("snowflake:wh-1")] == ["snowflake:wh-1", "snowflake"]
    assert [p.namespace for p in bundle.pool_chain("snowflake:wh-9")] == ["snowflake"]
    assert bundle.pool_chain("qubole") == []


@pytest.mark.parametrize(
    ("replace", "expect"),
    [
        ("spec: {gpus: 2048, nodes: 256}", "fair_share_target but no kind: Cluster"),
        ("spec: {sensitive_pool_size: 64, sensitive_unit: nodes}", "needs a tenant"),
        ("burst_allowance: 1.5}", "burst_allowance: 1.5, sensitive_pool_size: 3}"),
    ],
)
def test_quota_documents_explain_their_mistakes(tmp_path: Path, replace: str, expect: str) -> None:
    text = QUOTAS
    if replace.startswith("spec: {gpus"):
        text = text.replace("kind: Cluster", "kind: Quota").replace(replace, "spec: {tenant: chemistry, max_gpus: 8}")
    elif replace.startswith("spec: {sensitive"):
        text = text.replace(replace, "spec: {max_gpus: 4}")
    else:
        text = text.replace(replace, expect)
        expect = "sensitive_pool_size is system-wide"
    write(tmp_path, "q.yaml", text)
    assert any(expect in e.message for e in errors(tmp_path)), errors(tmp_path)


def test_two_quotas_for_one_tenant_are_an_error(tmp_path: Path) -> None:
    write(tmp_path, "q.yaml", QUOTAS)
    write(tmp_path, "r.yaml", QUOTAS.split("---")[0].replace("tenant-physics", "physics-again"))
    error = only_error(tmp_path)
    assert error.file == "r.yaml" and "tenant quota 'physics' is already defined at q.yaml:1" in error.message


# --- YAML read safely and bounded -----------------------------------------------------------

ALIAS_BOMB = """\
a: &a ["x","x","x","x","x","x","x","x","x"]
b: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]
c: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]
d: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c]
e: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d]
f: &f [*e,*e,*e,*e,*e,*e,*e,*e,*e]
g: &g [*f,*f,*f,*f,*f,*f,*f,*f,*f]
h: &h [*g,*g,*g,*g,*g,*g,*g,*g,*g]
i: &i [*h,*h,*h,*h,*h,*h,*h,*h,*h]
"""


@pytest.mark.timeout(5)
def test_an_alias_bomb_is_a_validation_error(tmp_path: Path) -> None:
    write(tmp_path, "bomb.yaml", ALIAS_BOMB)
    error = only_error(tmp_path)
    assert error.file == "bomb.yaml" and "alias bomb" in error.message


@pytest.mark.timeout(5)
def test_a_recursive_alias_is_a_validation_error(tmp_path: Path) -> None:
    write(tmp_path, "loop.yaml", "apiVersion: budgetgate/v1\nkind: BudgetPolicy\nmetadata: &m {id: x, owner: *m}\n")
    assert "recursive alias" in only_error(tmp_path).message


def test_duplicate_keys_are_errors_with_their_line(tmp_path: Path) -> None:
    write(tmp_path, "dup.yaml", POLICY.format(id="a", namespace="a") + "  enforcement: soft\n  enforcement: hard\n")
    error = only_error(tmp_path)
    assert (error.file, error.line) == ("dup.yaml", 13)
    assert "duplicate key 'enforcement' (first at line 12)" in error.message


def test_a_limit_beyond_the_ledgers_integers_fails_validation(tmp_path: Path) -> None:
    write(tmp_path, "big.yaml", POLICY.format(id="a", namespace="a").replace("gpu_hours: 100", "gpu_hours: 1e300"))
    error = only_error(tmp_path)
    assert error.line == 11 and "spec.limit.gpu_hours" in error.message and "at most" in error.message


def test_a_quota_beyond_the_counters_fails_validation(tmp_path: Path) -> None:
    write(tmp_path, "q.yaml", "apiVersion: budgetgate/v1\nkind: Quota\nmetadata: {id: q}\nspec: {tenant: t, max_gpus: 100000000000000000000}\n")
    assert "max_gpus" in only_error(tmp_path).message


# --- the policy folder ------------------------------------------------------------------------


def test_other_yaml_is_skipped_and_listed(tmp_path: Path) -> None:
    from budgetgate.core.loader import load_path

    write(tmp_path, "b.yaml", POLICY.format(id="a", namespace="a"))
    write(tmp_path, "kueue.yaml", "apiVersion: kueue.x-k8s.io/v1beta1\nkind: ClusterQueue\nmetadata: {name: q}\nspec: {cohort: x}\n")
    write(tmp_path, "grafana/datasources.yaml", "apiVersion: 1\ndatasources: []\n")
    loaded = load_path(tmp_path, git_sha="s")
    assert [p.id for p in loaded.bundle.policies] == ["a"]
    assert [(s.file, s.line) for s in loaded.skipped] == [("grafana/datasources.yaml", 1), ("kueue.yaml", 1)]
    assert "kind ClusterQueue" in loaded.skipped[1].what
    assert [d.file for d in loaded.documents] == ["b.yaml"]


def test_a_budgetgate_kind_without_api_version_is_still_an_error(tmp_path: Path) -> None:
    write(tmp_path, "b.yaml", POLICY.format(id="a", namespace="a").replace("apiVersion: budgetgate/v1\n", ""))
    assert "apiVersion" in only_error(tmp_path).message


def test_metadata_name_is_the_id(tmp_path: Path) -> None:
    write(tmp_path, "b.yaml", POLICY.format(id="a", namespace="a").replace("  id: a", "  name: team-a"))
    assert [p.id for p in load(tmp_path).policies] == ["team-a"]


@pytest.mark.parametrize(
    ("typo", "path", "suggestion"),
    [("enforcment: hard", "spec.enforcment", "enforcement"), ("windw: {calendar: month}", "spec.windw", "window")],
)
def test_unknown_keys_get_a_did_you_mean(tmp_path: Path, typo: str, path: str, suggestion: str) -> None:
    write(tmp_path, "b.yaml", POLICY.format(id="a", namespace="a") + f"  {typo}\n")
    error = only_error(tmp_path)
    assert error.line == 12 and error.message == f"{path}: unknown key; did you mean {suggestion!r}?"


def test_unknown_nested_key_suggests_from_its_own_mapping(tmp_path: Path) -> None:
    write(tmp_path, "b.yaml", POLICY.format(id="a", namespace="a").replace("gpu_hours: 100", "gpu_hour: 100"))
    assert only_error(tmp_path).message == "spec.limit.gpu_hour: unknown key; did you mean 'gpu_hours'?"


def test_a_soft_budget_cannot_delay(tmp_path: Path) -> None:
    write(tmp_path, "b.yaml", POLICY.format(id="a", namespace="a") + "  enforcement: soft\n  on_exhausted: delay\n")
    error = only_error(tmp_path)
    assert error.line == 13 and "soft budget never blocks" in error.message


def test_two_rates_for_one_flavor_region_and_date_are_an_error(tmp_path: Path) -> None:
    write(tmp_path, "r.yaml", RATES + "    - {flavor: a100, rate_per_gpu_hour: 2}\n    - {flavor: h100, rate_per_gpu_hour: 4}\n")
    error = only_error(tmp_path)
    assert (error.file, error.line) == ("r.yaml", 10)
    assert "second rate for flavor 'h100'" in error.message and "r.yaml:8" in error.message


def test_a_single_file_can_be_validated(tmp_path: Path) -> None:
    from budgetgate.core.loader import load_path

    cost = POLICY.format(id="c", namespace="a").replace("gpu_hours: 100", "cost: 100\n    currency: USD")
    write(tmp_path, "cost.yaml", cost)
    write(tmp_path, "other.yaml", "not: [valid")
    loaded = load_path(tmp_path / "cost.yaml", git_sha="s")
    assert [p.id for p in loaded.bundle.policies] == ["c"]
    assert [e.file for e in errors(tmp_path)] == ["cost.yaml", "other.yaml"]


@pytest.mark.timeout(5)
def test_deep_nesting_is_a_validation_error_not_a_stack_overflow(tmp_path: Path) -> None:
    write(tmp_path, "deep.yaml", "a: " + "[" * 20000 + "]" * 20000 + "\n")
    assert "nested more than 64 levels deep" in only_error(tmp_path).message


def test_an_unknown_kind_gets_a_did_you_mean(tmp_path: Path) -> None:
    write(tmp_path, "b.yaml", POLICY.format(id="a", namespace="a").replace("kind: BudgetPolicy", "kind: BudgetPolicie"))
    assert only_error(tmp_path).message.startswith("unknown kind 'BudgetPolicie'; did you mean 'BudgetPolicy'? expected one of")


def test_a_misspelt_metadata_name_suggests_name(tmp_path: Path) -> None:
    write(tmp_path, "b.yaml", POLICY.format(id="a", namespace="a").replace("  id: a", "  id: a\n  nmae: team-a"))
    assert only_error(tmp_path).message == "metadata.nmae: unknown key; did you mean 'name'?"


# --- numbers mean what they say --------------------------------------------------------------


@pytest.mark.parametrize(("value", "yaml_11"), [("010", "8"), ("1:30", "90"), ("0x10", "16"), ("0b101", "5"), ("-010", "-8"), ("1:30.5", "90.5")])
def test_a_number_yaml_reads_in_another_base_is_an_error(tmp_path: Path, value: str, yaml_11: str) -> None:
    write(tmp_path, "n.yaml", POLICY.format(id="p", namespace="a").replace("gpu_hours: 100", f"gpu_hours: {value}"))
    error = only_error(tmp_path)
    assert (error.file, error.line) == ("n.yaml", 11)
    assert error.message.startswith(f"spec.limit.gpu_hours: '{value}' is not a plain decimal number (YAML 1.1 reads it as {yaml_11}")


@pytest.mark.parametrize(
    ("text", "field", "line"),
    [
        (POLICY.format(id="p", namespace="a").replace("calendar: month", "rolling_days: yes"), "spec.window.rolling_days", 9),
        (POLICY.format(id="p", namespace="a").replace("gpu_hours: 100", "gpu_hours: true"), "spec.limit.gpu_hours", 11),
        ("apiVersion: budgetgate/v1\nkind: Quota\nmetadata: {id: q}\nspec:\n  tenant: t\n  max_gpus: on\n", "spec.max_gpus", 6),
        ("apiVersion: budgetgate/v1\nkind: Quota\nmetadata: {id: q}\nspec:\n  sensitive_pool_size: no\n", "spec.sensitive_pool_size", 5),
        ("apiVersion: budgetgate/v1\nkind: Quota\nmetadata: {id: q}\nspec:\n  tenant: t\n  max_gpus: 0o10\n  fair_share_target: off\n", "spec.", 6),
        ("apiVersion: budgetgate/v1\nkind: Cluster\nmetadata: {id: c}\nspec:\n  gpus: 0x800\n", "spec.gpus", 5),
    ],
)
def test_a_boolean_or_an_odd_base_where_a_number_belongs_is_an_error(tmp_path: Path, text: str, field: str, line: int) -> None:
    write(tmp_path, "b.yaml", text)
    found = errors(tmp_path)
    assert found and all(e.message.startswith(field) for e in found), found
    assert found[0].line == line


def test_a_boolean_number_is_named_as_one(tmp_path: Path) -> None:
    write(tmp_path, "b.yaml", POLICY.format(id="p", namespace="a").replace("calendar: month", "rolling_days: yes"))
    expected = "spec.window.rolling_days: expected a number, not the boolean true (YAML reads true/false, yes/no and on/off as booleans)"
    assert only_error(tmp_path).message == expected


def test_decimal_numbers_and_names_that_look_like_octal_still_load(tmp_path: Path) -> None:
    text = POLICY.format(id="p", namespace="a").replace("gpu_hours: 100", "gpu_hours: 1_000").replace("id: p", "id: p\n  owner: 010")
    write(tmp_path, "p.yaml", text.replace("calendar: month", "rolling_days: 30"))
    write(tmp_path, "q.yaml", "apiVersion: budgetgate/v1\nkind: Quota\nmetadata: {id: q}\nspec: {tenant: t, max_gpus: 0, max_nodes: +8}\n")
    bundle = load(tmp_path)
    assert bundle.policies[0].limit.amount == to_amount(Unit.GPU_HOURS, 1000) and bundle.policies[0].window.rolling_days == 30
    quota = bundle.quota_for("t")
    assert quota is not None and (quota.max_gpus, quota.max_nodes) == (0, 8)


def test_other_yaml_in_the_folder_may_write_numbers_its_own_way(tmp_path: Path) -> None:
    # A Grafana file's `mode: 0644` is not a budgetgate document: skipped, not an error.
    write(tmp_path, "p.yaml", POLICY.format(id="p", namespace="a"))
    write(tmp_path, "grafana.yaml", "apiVersion: 1\nproviders: [{name: x, mode: 0644, at: 1:30}]\n")
    assert [p.id for p in load(tmp_path).policies] == ["p"]


# --- time zones that are folders, limits that round to nothing ---------------------------------


@pytest.mark.parametrize("name", ["Europe", "America", "Etc", "z" * 300])
def test_a_time_zone_folder_is_an_unknown_time_zone_at_its_line(tmp_path: Path, name: str) -> None:
    write(tmp_path, "tz.yaml", POLICY.format(id="p", namespace="a").replace("calendar: month", f"calendar: month\n    timezone: {name}"))
    error = only_error(tmp_path)
    assert (error.file, error.line) == ("tz.yaml", 10)
    assert error.message == f"spec.window.timezone: unknown time zone {name!r}"


def test_validate_prints_a_time_zone_folder_as_an_error_not_a_traceback(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from budgetgate.cli.main import cli

    write(tmp_path, "tz.yaml", POLICY.format(id="p", namespace="a").replace("calendar: month", "calendar: month\n    timezone: Europe"))
    result = CliRunner().invoke(cli, ["policy", "validate", str(tmp_path)])
    assert result.exit_code == 1, result.output
    assert isinstance(result.exception, SystemExit) and "Traceback" not in result.output
    assert "tz.yaml:10: spec.window.timezone: unknown time zone 'Europe'" in result.output


@pytest.mark.parametrize(("limit", "words"), [("gpu_hours: 0.0000001", "a thousandth of a GPU-second"), ("node_hours: 0.0000002", "node-second")])
def test_a_positive_limit_that_rounds_to_nothing_is_an_error(tmp_path: Path, limit: str, words: str) -> None:
    write(tmp_path, "t.yaml", POLICY.format(id="p", namespace="a").replace("gpu_hours: 100", limit))
    error = only_error(tmp_path)
    assert error.line == 11 and "less than the ledger's unit" in error.message and words in error.message and "limit of 0" in error.message


def test_a_tiny_cost_limit_is_an_error_too(tmp_path: Path) -> None:
    write(tmp_path, "rates.yaml", RATES)
    write(tmp_path, "c.yaml", POLICY.format(id="p", namespace="a").replace("gpu_hours: 100", "cost: 0.0000004\n    currency: USD"))
    assert "less than the ledger's unit (a millionth of the currency)" in only_error(tmp_path).message


@pytest.mark.parametrize(("limit", "amount"), [("0.0000003", 1), ("0.00000055", 1), ("1.9999999999", 7_199_999), ("2.5", 9_000_000)])
def test_limits_are_rounded_down_never_generous(tmp_path: Path, limit: str, amount: int) -> None:
    write(tmp_path, "p.yaml", POLICY.format(id="p", namespace="a").replace("gpu_hours: 100", f"gpu_hours: {limit}"))
    assert load(tmp_path).policies[0].limit.amount == amount


# --- aliases nest too ---------------------------------------------------------------------------


@pytest.mark.timeout(10)
def test_anchors_nesting_each_other_deeper_than_the_limit_are_an_error_not_a_crash(tmp_path: Path) -> None:
    # Each anchor is nested 60 deep (under the literal limit) around an alias of the one before.
    lines = ["a0: &a0 x"] + [f"a{k}: &a{k} " + "[" * 60 + f"*a{k - 1}" + "]" * 60 for k in range(1, 41)]
    write(tmp_path, "chain.yaml", "\n".join(lines) + "\n")
    write(tmp_path, "p.yaml", POLICY.format(id="p", namespace="a").replace("gpu_hours: 100", "gpu_hours: true"))
    found = errors(tmp_path)  # the other file's problems are still reported
    assert [(e.file, e.line) for e in found] == [("chain.yaml", 3), ("p.yaml", 11)]
    assert found[0].message == "nested more than 64 levels deep (aliases expanded)"


def test_aliases_within_the_depth_limit_still_load(tmp_path: Path) -> None:
    text = POLICY.format(id="p", namespace="a").replace("id: p", "id: p\n  labels: &l {a: b}\n  annotations: *l")
    write(tmp_path, "p.yaml", text)
    assert [p.id for p in load(tmp_path).policies] == ["p"]


def test_a_nul_character_anywhere_is_an_error_with_file_and_line() -> None:
    # Postgres cannot store it; applying such a bundle failed inside the transaction (a 500).
    labelled = '    namespace: vision-prod\n    labels: {team: "vis\\0ion"}\n'
    text = POLICY.format(id="team", namespace="vision-prod").replace("    namespace: vision-prod\n", labelled)
    with pytest.raises(PolicyValidationError) as refused:
        build_bundle(parse_text(text, "team.yaml"), git_sha="a" * 40)
    # (The label's own rule refuses it too, but that alone would not cover text without a rule.)
    assert PolicyError("team.yaml", 8, "spec.scope.labels.team holds the NUL character (\\u0000); remove it") in refused.value.errors
    # Documents that are not budgetgate's are checked too: an HTTP bundle stores every document.
    other = SourceDocument("queues.yaml", 7, {"kind": "ClusterQueue", "spec": {"a\x00b": ["x", "y\x00"]}}, {})
    errors = {str(e) for e in PolicyValidationError(build_errors(other)).errors}
    assert errors == {
        "queues.yaml:7: a key of spec holds the NUL character (\\u0000): 'a\\x00b'",
        "queues.yaml:7: spec.a\\u0000b.1 holds the NUL character (\\u0000); remove it",
    }


def build_errors(*documents) -> list[PolicyError]:  # type: ignore[no-untyped-def]
    try:
        build_bundle(list(documents), git_sha="b" * 40)
    except PolicyValidationError as exc:
        return list(exc.errors)
    return []


def test_a_rate_card_says_what_an_unknown_flavor_gets(tmp_path: Path) -> None:
    write(tmp_path, "rates.yaml", RATES)
    assert not load(tmp_path).rejects_unknown_flavors  # a warning in the answer, by default
    write(tmp_path, "rates.yaml", RATES.replace("  currency: USD\n", "  currency: USD\n  unknown_flavor: reject\n"))
    assert load(tmp_path).rejects_unknown_flavors
    write(tmp_path, "rates.yaml", RATES.replace("  currency: USD\n", "  currency: USD\n  unknown_flavor: ignore\n"))
    error = only_error(tmp_path)
    assert "unknown_flavor" in error.message and "'warn'" in error.message and "'reject'" in error.message, error.message


def test_a_fiscal_year_window_is_read_with_its_start_month_and_zone(tmp_path: Path) -> None:
    text = POLICY.format(id="p", namespace="a").replace("calendar: month", "fiscal_year: {start_month: 4}\n    timezone: Europe/London")
    write(tmp_path, "f.yaml", text)
    window = policy(load(tmp_path), "p").window
    assert window == WindowSpec(calendar="fiscal_year", timezone="Europe/London", start_month=4)


@pytest.mark.parametrize(
    ("window", "expect"),
    [
        ("fiscal_year: {start_month: 13}", "spec.window.fiscal_year.start_month: Input should be less than or equal to 12"),
        ("fiscal_year: {start_month: 0}", "spec.window.fiscal_year.start_month: Input should be greater than or equal to 1"),
        ("fiscal_year: {}", "spec.window.fiscal_year.start_month: Field required"),
        ("fiscal_year: {start_month: 4, start_monht: 5}", "spec.window.fiscal_year.start_monht: unknown key; did you mean 'start_month'?"),
        ("fiscal_year: {start_month: 4}\n    calendar: month", "spec.window: give exactly one of calendar"),
    ],
)
def test_a_bad_fiscal_year_is_an_error_at_its_line(tmp_path: Path, window: str, expect: str) -> None:
    write(tmp_path, "f.yaml", POLICY.format(id="p", namespace="a").replace("calendar: month", window))
    error = only_error(tmp_path)
    assert error.file == "f.yaml" and error.line is not None and error.line >= 8
    assert error.message.startswith(expect), error.message
