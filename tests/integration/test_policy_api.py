"""Policies applied over HTTP by an operator: `budgetgate policy apply DIR --server URL` needs a
token, not the database's credentials, and Postgres records who applied which Git SHA."""

from __future__ import annotations

import asyncio
from pathlib import Path

import asyncpg
import pytest
from click.testing import CliRunner, Result

from budgetgate.cli.main import cli
from budgetgate.core.principals import Role
from tests.support.admission import budget_yaml
from tests.support.admission import admission_factory  # noqa: F401 - pytest fixtures
from tests.support.policy_repos import commit
from tests.support.policy_repos import repo  # noqa: F401 - pytest fixtures
from tests.support.principals import issue
from tests.support.servers import free_port


async def apply(repo: Path, url: str, token: str | None) -> Result:  # noqa: F811 - the fixture's name
    env = {"BUDGETGATE_TOKEN": token or "", "BUDGETGATE_HOME": str(repo / "no-stack")}
    return await asyncio.to_thread(CliRunner().invoke, cli, ["policy", "apply", str(repo), "--server", url], env=env)


@pytest.mark.usefixtures("repo")
async def test_an_operator_applies_policies_over_http_and_who_is_recorded(repo: Path, admission_factory, pg_dsn: str) -> None:  # noqa: F811
    sha = commit(repo, {"team.yaml": budget_yaml("team-vision")})
    server = await admission_factory()
    operator = await issue(pg_dsn, Role.OPERATOR, name="ci-deployer")

    for token in (None, await issue(pg_dsn, Role.SUBMITTER), "bg_unknown"):
        refused = await apply(repo, server.url, token)
        assert refused.exit_code != 0
        assert ("no token" if token is None else "refused the bundle (40") in refused.output, refused.output
    conn = await asyncpg.connect(pg_dsn)
    try:
        assert await conn.fetchval("SELECT count(*) FROM policy_bundles") == 0

        applied = await apply(repo, server.url, operator)
        assert applied.exit_code == 0, applied.output
        assert f"applied {sha}" in applied.output and "by token:ci-deployer" in applied.output and "+ budget team-vision" in applied.output
        assert await conn.fetchval("SELECT applied_by FROM policy_bundles WHERE git_sha = $1", sha) == "token:ci-deployer"
        logged = await conn.fetchrow("SELECT actor, action, subject FROM admin_log WHERE action = 'policy.apply'")
        assert tuple(logged) == ("token:ci-deployer", "policy.apply", sha)
    finally:
        await conn.close()
    await server.wait_ready()  # the instance that applied it switched to it


@pytest.mark.usefixtures("repo")
async def test_wait_gives_up_on_an_admission_that_never_answers(repo: Path, pg_dsn: str) -> None:  # noqa: F811
    commit(repo, {"team.yaml": budget_yaml("team-vision")})
    operator = await issue(pg_dsn, Role.OPERATOR)
    env = {"BUDGETGATE_TOKEN": operator, "BUDGETGATE_HOME": str(repo / "no-stack")}
    url = f"http://127.0.0.1:{free_port()}"
    waited = await asyncio.to_thread(CliRunner().invoke, cli, ["policy", "apply", str(repo), "--server", url, "--wait", "1"], env=env)
    assert waited.exit_code != 0 and f"admission at {url} is not ready after 1s" in waited.output, waited.output
    alone = await asyncio.to_thread(CliRunner().invoke, cli, ["policy", "apply", str(repo), "--wait", "1"], env=env)
    assert alone.exit_code == 2 and "--wait goes with --server" in alone.output


@pytest.mark.parametrize(
    ("window", "limit", "words"),
    [
        ({"calendar": "month", "timezone": "Europe"}, {"gpu_hours": 100}, "spec.window.timezone: unknown time zone 'Europe'"),
        ({"calendar": "month", "timezone": "x" * 300}, {"gpu_hours": 100}, "spec.window.timezone: unknown time zone"),
        ({"calendar": "month"}, {"gpu_hours": 0.0000001}, "spec.limit.gpu_hours: 0.0000001 is less than the ledger's unit"),
        ({"rolling_days": True}, {"gpu_hours": 100}, "spec.window.rolling_days: expected a number, not the boolean true"),
    ],
)
async def test_documents_that_do_not_validate_are_a_422_naming_the_field(admission_factory, pg_dsn: str, window, limit, words) -> None:  # noqa: F811
    server = await admission_factory()
    data = {
        "apiVersion": "budgetgate/v1",
        "kind": "BudgetPolicy",
        "metadata": {"id": "p"},
        "spec": {"scope": {"namespace": "a"}, "window": window, "limit": limit},
    }
    body = {"git_sha": "d" * 40, "source": "test", "documents": [{"file": "p.yaml", "line": 1, "data": data}]}
    answer = await server.client.post("/v1/policies", json=body)
    assert answer.status_code == 422, answer.text
    assert any(words in e["msg"] for e in answer.json()["errors"]), answer.text


@pytest.mark.parametrize(
    ("change", "field", "words"),
    [
        ({"documents": [{"data": {"k": "\u0000"}, "file": "a.yaml", "line": 1}]}, "documents", "a.yaml:1: k holds the NUL character"),
        ({"documents": [{"data": {"spec": {"\u0000": 1}}, "file": "b.yaml", "line": 4}]}, "documents", "b.yaml:4: a key of spec holds the NUL character"),
        ({"documents": [{"data": {"k": 1}, "file": "a\u0000.yaml", "line": 1}]}, "documents.0.file", "control character U+0000"),
        ({"source": "git@example.com:\u0000"}, "source", "control character U+0000"),
        ({"git_sha": "4f1c" + "0" * 35 + "\u0000"}, "git_sha", "String should match pattern"),
    ],
)
async def test_text_postgres_cannot_store_is_a_422_and_nothing_is_applied(admission_factory, pg_dsn: str, change, field, words) -> None:  # noqa: F811
    # A NUL reached Postgres inside apply_bundle's transaction: a 500 with nothing said.
    server = await admission_factory()
    body = {"git_sha": "4f1c" + "1" * 36, "source": "x", "documents": [], "allow_empty": True, **change}
    answer = await server.client.post("/v1/policies", json=body)
    assert answer.status_code == 422 and answer.headers["content-type"] == "application/problem+json", answer.text
    [error] = answer.json()["errors"]
    assert error["field"] == field and words in error["msg"], answer.text
    conn = await asyncpg.connect(pg_dsn)
    try:
        assert await conn.fetchval("SELECT count(*) FROM policy_bundles") == 0
    finally:
        await conn.close()


async def test_an_operator_limited_to_namespaces_or_tenants_applies_no_bundle(admission_factory, pg_dsn: str) -> None:  # noqa: F811
    # A bundle sets every namespace's budgets: a limited operator once applied one over all of them.
    server = await admission_factory()
    body = {"git_sha": "c" * 40, "source": "test", "documents": [], "allow_empty": True}
    for limits in ({"namespaces": ["vision-*"]}, {"tenants": ["vision"]}):
        token = await issue(pg_dsn, Role.OPERATOR, **limits)
        refused = await server.client.post("/v1/policies", json=body, headers={"Authorization": f"Bearer {token}"})
        assert refused.status_code == 403 and "needs a token without limits" in refused.json()["detail"], refused.text
    conn = await asyncpg.connect(pg_dsn)
    try:
        assert await conn.fetchval("SELECT count(*) FROM policy_bundles") == 0
    finally:
        await conn.close()
    applied = await server.client.post("/v1/policies", json=body, headers={"Authorization": f"Bearer {await issue(pg_dsn, Role.OPERATOR)}"})
    assert applied.status_code == 200, applied.text
