"""Roles, namespace globs, tenants and JWT claim mapping, without any server."""

from __future__ import annotations

from datetime import timedelta

import click
import pytest
from click.testing import CliRunner

from budgetgate.cli.main import cli
from budgetgate.cli.token import parse_duration
from budgetgate.core.policy import Scope
from budgetgate.edge.oidc import ClaimMapping, principal_from_claims
from budgetgate.core.principals import Action, Forbidden, Principal, Role, Unauthenticated
from budgetgate.services.admission.access import require_budget_scope, sees_budget
from budgetgate.access.tokens import new_secret, secret_hash, well_formed


def test_each_role_may_do_exactly_its_actions() -> None:
    may = {role: {a for a in Action if Principal.of("p", [role]).may(a)} for role in Role}
    assert may[Role.SUBMITTER] == {Action.SUBMIT, Action.LOOKUP, Action.ALLOCATE, Action.RELEASE}
    assert may[Role.EXPORTER] == {Action.INGEST}
    assert may[Role.READER] == {Action.LOOKUP, Action.READ, Action.METRICS}
    assert may[Role.AUDITOR] == {Action.LOOKUP, Action.READ, Action.METRICS}  # reads everything, changes nothing
    assert may[Role.OPERATOR] == {Action.LOOKUP, Action.READ, Action.RELEASE, Action.ADMINISTER, Action.OVERRIDE, Action.GRANT, Action.METRICS}
    # An accounting system's service token: reads, overrides tenants' settings, grants to budgets.
    assert may[Role.ACCOUNTING] == {Action.READ, Action.OVERRIDE, Action.GRANT}


def test_a_refusal_names_the_role_and_the_namespace_missing() -> None:
    reader = Principal.of("token:ci", ["reader"], namespaces=["vision-*"], tenants=["vision"])
    with pytest.raises(Forbidden, match="needs role submitter"):
        reader.require(Action.SUBMIT)
    reader.require_namespace("vision-prod")
    with pytest.raises(Forbidden, match="namespace 'nlp-prod'"):
        reader.require_namespace("nlp-prod")
    with pytest.raises(Forbidden, match="tenant 'nlp'"):
        reader.require_tenant("nlp")
    with pytest.raises(Forbidden, match="no tenant"):
        reader.require_tenant(None)
    assert Principal.of("any", ["reader"]).covers_tenant(None)


def test_covers_needs_both_the_namespace_and_the_tenant_and_limits_are_named() -> None:
    exporter = Principal.of("token:dcgm", ["exporter"], namespaces=["team-*", "ml"], tenants=["team"])
    assert exporter.covers("team-a", "team")
    assert not exporter.covers("other-ns", "team") and not exporter.covers("team-a", "other") and not exporter.covers("team-a", None)
    assert exporter.limits == "namespaces team-*, ml and tenants team"
    assert Principal.of("t", ["exporter"], tenants=["team"]).limits == "tenants team"
    assert Principal.of("any", ["exporter"]).covers("anything", None) and Principal.of("any", ["exporter"]).limits == ""


def test_token_create_help_says_what_the_limits_mean_for_every_role() -> None:
    shown = CliRunner().invoke(cli, ["token", "create", "--help"])
    assert shown.exit_code == 0, shown.output
    # The help's table: each role leads a line of its own.
    leading = {line.split()[0].rstrip(",") for line in shown.output.splitlines() if line.strip()}
    assert set(Role) <= leading, sorted(set(Role) - leading)


def test_a_budget_over_every_namespace_is_hidden_from_a_namespace_limited_reader() -> None:
    limited = Principal.of("p", ["reader"], namespaces=["vision-*"])
    assert sees_budget(limited, Scope(frozenset({"vision-prod"}), {"team": "vision"}), tenant_label="team")
    assert not sees_budget(limited, Scope(frozenset(), {"cost-center": "1042"}), tenant_label="team")
    with pytest.raises(Forbidden, match="covers every namespace"):
        require_budget_scope(limited, Scope(frozenset(), {}), tenant_label="team")


def test_claims_map_to_a_principal_and_unknown_roles_are_refused() -> None:
    mapping = ClaimMapping(roles="groups", namespaces="kubernetes.io.namespaces")
    found = principal_from_claims({"sub": "sa", "groups": "submitter reader", "kubernetes.io": {"namespaces": ["a-*"]}}, mapping)
    assert found == Principal(name="jwt:sa", roles=frozenset({Role.SUBMITTER, Role.READER}), namespaces=("a-*",))
    with pytest.raises(Unauthenticated, match="groups"):
        principal_from_claims({"sub": "sa", "groups": ["root"]}, mapping)
    with pytest.raises(Unauthenticated, match="sub"):
        principal_from_claims({"groups": ["reader"]}, mapping)


def test_a_kubernetes_service_account_gets_its_roles_from_configuration() -> None:
    mapping = ClaimMapping(namespaces="kubernetes.io.namespace", subject_roles={"system:serviceaccount:flyte:flyte-admin": ("submitter",)})
    claims = {"sub": "system:serviceaccount:flyte:flyte-admin", "kubernetes.io": {"namespace": "flyte", "serviceaccount": {"name": "flyte-admin"}}}
    assert principal_from_claims(claims, mapping) == Principal(
        name="jwt:system:serviceaccount:flyte:flyte-admin", roles=frozenset({Role.SUBMITTER}), namespaces=("flyte",)
    )
    assert principal_from_claims({**claims, "sub": "system:serviceaccount:flyte:other"}, mapping).roles == frozenset()


def test_secrets_are_random_and_stored_as_a_hash() -> None:
    one, two = new_secret(), new_secret()
    assert one != two and one.startswith("bg_") and len(one) > 40
    assert secret_hash(one) == secret_hash(one) != secret_hash(two) and one.encode() not in secret_hash(one)


def test_only_secrets_shaped_like_new_ones_are_well_formed() -> None:
    assert all(well_formed(new_secret()) for _ in range(1000))
    made = new_secret()
    for bad in ("bg_not-a-token", made[:-1], made + "A", made.replace("bg_", "bg-", 1), "bg_" + "!" * 43, "bg_" + "é" * 43, made + "\n"):
        assert not well_formed(bad), bad


def test_durations() -> None:
    assert parse_duration("90d") == timedelta(days=90) and parse_duration("12h") == timedelta(hours=12)
    for bad in ("0d", "90", "1y", "-1d"):
        with pytest.raises(click.BadParameter):
            parse_duration(bad)


def test_subject_roles_are_read_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from budgetgate.edge.auth import AuthSettings

    monkeypatch.setenv("BUDGETGATE_OIDC_SUBJECT_ROLES", '{"system:serviceaccount:flyte:flyte-admin": ["submitter", "reader"]}')
    assert AuthSettings().oidc_subject_roles == {"system:serviceaccount:flyte:flyte-admin": ["submitter", "reader"]}
