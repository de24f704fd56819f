"""`budgetgate policy apply|diff` against a real Postgres: what Git holds at the SHA, the plan,
refusing bundles that leave nothing enforced, and one-line errors about the backend."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import asyncpg
import pytest
from click.testing import CliRunner, Result

from budgetgate.cli.main import cli
from budgetgate.core.loader import build_bundle, parse_text
from budgetgate.devstack.isolation import with_database
from budgetgate.ledger.queries import sql
from budgetgate.core.policy_files import directory_files
from budgetgate.policies.repository import RepositoryError, apply_bundle, policy_files, revision
from tests.support.admission import budget_yaml
from tests.support.databases import _execute, run_async
from tests.support.policy_repos import commit
from tests.support.policy_repos import repo  # noqa: F401 - pytest fixtures

RATES = """\
apiVersion: budgetgate/v1
kind: RateCard
metadata: {id: rates}
spec:
  currency: USD
  rates: [{flavor: h100, rate_per_gpu_hour: 3.933}]
"""


def run(dsn: str, *args: str) -> Result:
    return CliRunner().invoke(cli, list(args), env={"BUDGETGATE_POSTGRES_DSN": dsn})


async def active(dsn: str) -> tuple[str, str]:
    conn = await asyncpg.connect(dsn)
    try:
        row = await conn.fetchrow(sql("active_bundle"))
        return row["git_sha"], row["documents"]
    finally:
        await conn.close()


def test_apply_reads_the_commit_not_ignored_files(repo: Path, pg_dsn: str) -> None:
    sha = commit(repo, {".gitignore": "local.yaml\n", "team.yaml": budget_yaml("team")})
    (repo / "local.yaml").write_text(budget_yaml("sneaky", namespace="other"))
    result = run(pg_dsn, "policy", "apply", str(repo))
    assert result.exit_code == 0, result.output
    stored_sha, documents = asyncio.run(active(pg_dsn))
    assert stored_sha == sha
    assert "sneaky" not in documents and "team" in documents
    assert "+ budget team: 100 gpu-hours per month" in result.output


def test_uncommitted_edits_are_not_applied_under_the_head_sha(repo: Path, pg_dsn: str) -> None:
    commit(repo, {"team.yaml": budget_yaml("team")})
    (repo / "team.yaml").write_text(budget_yaml("team", limit="gpu_hours: 999"))
    result = run(pg_dsn, "policy", "apply", str(repo))
    assert result.exit_code == 1 and "uncommitted changes" in result.output


def test_a_symlink_leaving_the_repository_is_refused(repo: Path, pg_dsn: str, tmp_path: Path) -> None:
    outside = tmp_path / "outside.yaml"
    outside.write_text(budget_yaml("outside"))
    (repo / "linked.yaml").symlink_to(outside)
    commit(repo, {"team.yaml": budget_yaml("team")})
    result = run(pg_dsn, "policy", "apply", str(repo))
    assert result.exit_code == 1
    assert "linked.yaml:0: cannot read file: a symlink to a file outside the repository" in result.output


def test_a_symlink_inside_the_repository_is_read_from_the_commit(repo: Path, pg_dsn: str) -> None:
    (repo / "policies").mkdir()
    (repo / "policies" / "team.yaml").symlink_to("../common/team.txt")
    commit(repo, {"common/team.txt": budget_yaml("team")})
    # An edit outside the policy folder leaves it clean, but is not in the commit: not applied.
    (repo / "common" / "team.txt").write_text(budget_yaml("team", limit="gpu_hours: 999"))
    result = run(pg_dsn, "policy", "apply", str(repo / "policies"))
    assert result.exit_code == 0, result.output
    documents = asyncio.run(active(pg_dsn))[1]
    assert '"gpu_hours": 100' in documents and "999" not in documents


def test_a_commit_is_read_in_path_order_as_a_folder_is(repo: Path) -> None:
    # ls-tree lines start with the mode and the blob id: sorted as they come, the files (so the
    # policies, so a tie between budgets) would be in the order of their contents' hashes.
    names = ["a.yaml", "a-b/x.yaml", "a/x.yaml", "b.yaml", "c.yml", "d/e/f.yaml", "e.yaml", "z.yaml"]
    commit(repo, {name: budget_yaml(f"p{i}", namespace=f"ns{i}") for i, name in enumerate(names)})
    expected = [name for name, _ in directory_files(repo)]
    assert expected == ["a/x.yaml", "a-b/x.yaml", "a.yaml", "b.yaml", "c.yml", "d/e/f.yaml", "e.yaml", "z.yaml"]  # folder by folder
    assert [name for name, _ in policy_files(repo, revision(repo, allow_dirty=False))] == expected
    (repo / "a.yaml").write_text(budget_yaml("p0", namespace="ns0", limit="gpu_hours: 7"))  # dirty: the work tree
    assert [name for name, _ in policy_files(repo, revision(repo, allow_dirty=True))] == expected


async def test_reapplying_a_sha_with_other_content_is_an_error(pg_dsn: str) -> None:
    first = parse_text(budget_yaml("team"), "b.yaml")
    other = parse_text(budget_yaml("team", limit="gpu_hours: 5"), "b.yaml")
    conn = await asyncpg.connect(pg_dsn)
    try:
        await apply_bundle(conn, bundle=build_bundle(first, git_sha="s" * 40), documents=first, source="t", applied_by="t")
        await apply_bundle(conn, bundle=build_bundle(first, git_sha="s" * 40), documents=first, source="t", applied_by="t")
        with pytest.raises(RepositoryError, match="applied before with other documents"):
            await apply_bundle(conn, bundle=build_bundle(other, git_sha="s" * 40), documents=other, source="t", applied_by="t")
        assert await conn.fetchval("SELECT count(*) FROM policy_activations") == 2
    finally:
        await conn.close()


def test_diff_prints_the_plan_against_the_active_bundle(repo: Path, pg_dsn: str) -> None:
    commit(repo, {"team.yaml": budget_yaml("team"), "old.yaml": budget_yaml("old", namespace="old"), "rates.yaml": RATES})
    assert run(pg_dsn, "policy", "apply", str(repo)).exit_code == 0
    (repo / "old.yaml").unlink()
    commit(
        repo,
        {
            "team.yaml": budget_yaml("team", limit="gpu_hours: 250"),
            "new.yaml": budget_yaml("new", namespace="new"),
            "rates.yaml": RATES.replace("3.933", "4.1"),
        },
    )
    result = run(pg_dsn, "policy", "diff", str(repo))
    assert result.exit_code == 0, result.output
    lines = [line.strip() for line in result.stdout.splitlines()]
    assert "+ budget new: 100 gpu-hours per month (UTC) on ns=new;team=vision, hard, on exhausted deny" in lines
    assert "- budget old: 100 gpu-hours per month (UTC) on ns=old;team=vision, hard, on exhausted deny" in lines
    assert "~ budget team: limit 100 gpu-hours -> limit 250 gpu-hours" in lines
    assert "~ rate h100: rate 3.933 USD/GPU-hour -> rate 4.1 USD/GPU-hour" in lines
    assert "budgetgate: postgres at" in result.stderr


def test_apply_refuses_a_bundle_that_removes_every_budget(repo: Path, pg_dsn: str) -> None:
    sha = commit(repo, {"team.yaml": budget_yaml("team"), "rates.yaml": RATES})
    assert run(pg_dsn, "policy", "apply", str(repo)).exit_code == 0
    (repo / "team.yaml").unlink()
    commit(repo, {})
    result = run(pg_dsn, "policy", "apply", str(repo))
    assert result.exit_code == 1 and "removes every budget (1 active)" in result.output
    assert asyncio.run(active(pg_dsn))[0] == sha
    assert run(pg_dsn, "policy", "apply", str(repo), "--allow-empty").exit_code == 0
    assert asyncio.run(active(pg_dsn))[0] != sha


def test_apply_refuses_an_empty_bundle(repo: Path, pg_dsn: str) -> None:
    commit(repo, {"kueue.yaml": "apiVersion: kueue.x-k8s.io/v1beta1\nkind: LocalQueue\nmetadata: {name: q}\n"})
    result = run(pg_dsn, "policy", "apply", str(repo))
    assert result.exit_code == 1 and "no budgetgate documents" in result.output
    assert "skipped: kueue.yaml:1" in result.output


@pytest.fixture
def blank_dsn(postgres_admin_dsn: str) -> Iterator[str]:
    name = f"bg_t_blank_{uuid.uuid4().hex[:10]}"
    run_async(lambda: _execute(postgres_admin_dsn, f'CREATE DATABASE "{name}"'))
    yield with_database(postgres_admin_dsn, name)
    run_async(lambda: _execute(postgres_admin_dsn, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


def test_a_database_without_budgetgate_tables_is_one_line_with_the_fix(repo: Path, blank_dsn: str) -> None:
    commit(repo, {"team.yaml": budget_yaml("team")})
    result = run(blank_dsn, "policy", "apply", str(repo))
    assert result.exit_code == 1 and "Traceback" not in result.output
    error = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert len(error) == 1 and "has no budgetgate tables" in error[0] and "run `budgetgate db migrate`" in error[0]


def test_an_unreachable_postgres_is_one_line_with_the_fix(repo: Path) -> None:
    commit(repo, {"team.yaml": budget_yaml("team")})
    result = run("postgresql://postgres@127.0.0.1:1/none", "usage", "--scope", "x")
    assert result.exit_code == 1 and "Traceback" not in result.output
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and errors[0].startswith("Error: cannot reach Postgres at postgresql://postgres@127.0.0.1:1/none")
    assert "budgetgate dev up" in errors[0]


def test_without_a_stack_or_variable_nothing_falls_back_to_the_default_port(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("BUDGETGATE_HOME", raising=False)
    monkeypatch.delenv("BUDGETGATE_POSTGRES_DSN", raising=False)
    result = CliRunner().invoke(cli, ["usage", "--scope", "x"])
    assert result.exit_code == 1
    assert "no local stack found from" in result.stderr and "budgetgate dev up" in result.stderr


def test_diff_reads_the_working_tree_with_uncommitted_edits_as_what_if_does(repo: Path, pg_dsn: str) -> None:
    sha = commit(repo, {".gitignore": "local.yaml\n", "team.yaml": budget_yaml("team")})
    assert run(pg_dsn, "policy", "apply", str(repo)).exit_code == 0
    clean = run(pg_dsn, "policy", "diff", str(repo))
    assert clean.exit_code == 0, clean.output
    assert f"candidate: {repo}, working tree at commit {sha[:12]} (no uncommitted changes)" in clean.stdout and "no changes" in clean.stdout

    # Edited, one file new and untracked, one ignored: the edit -> diff -> what-if loop, before a commit.
    (repo / "team.yaml").write_text(budget_yaml("team", limit="gpu_hours: 250"))
    (repo / "new.yaml").write_text(budget_yaml("new", namespace="new"))
    (repo / "local.yaml").write_text(budget_yaml("sneaky", namespace="other"))
    dirty = run(pg_dsn, "policy", "diff", str(repo))
    assert dirty.exit_code == 0, dirty.output
    lines = [line.strip() for line in dirty.stdout.splitlines()]
    assert f"candidate: {repo}, working tree (uncommitted changes)" in lines
    assert "~ budget team: limit 100 gpu-hours -> limit 250 gpu-hours" in lines
    assert any(line.startswith("+ budget new:") for line in lines) and "sneaky" not in dirty.stdout
    [target] = [line.rsplit(" -> ", 1)[1] for line in lines if line.startswith("plan against active bundle")]
    assert target.startswith(f"{sha}-dirty.")
    assert run(pg_dsn, "policy", "diff", "--allow-dirty", str(repo)).stdout == dirty.stdout  # older scripts keep working

    what_if = run(pg_dsn, "policy", "what-if", str(repo), "--since", "1d", "--json")
    assert what_if.exit_code == 0, what_if.output
    report = json.loads(what_if.stdout)
    assert report["candidate"] == {"directory": str(repo), "source": "working tree (uncommitted changes)", "git_sha": target}
    assert sorted(b["policy_id"] for b in report["by_budget"]) == ["new", "team"]  # the documents diff compared

    committed = run(pg_dsn, "policy", "diff", "--committed", str(repo))
    assert committed.exit_code == 0, committed.output
    assert f"candidate: {repo}, commit {sha[:12]} (committed only: uncommitted changes left out)" in committed.stdout
    assert "no changes" in committed.stdout and f"-> {sha}" in committed.stdout
    both = run(pg_dsn, "policy", "diff", "--committed", "--allow-dirty", str(repo))
    assert both.exit_code == 2 and "--committed leaves uncommitted changes out" in both.output
    # Applying still takes a commit: the loop ends with one.
    assert "uncommitted changes" in run(pg_dsn, "policy", "apply", str(repo)).output


def test_diff_reads_a_folder_outside_git_as_it_is(tmp_path: Path, pg_dsn: str, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "loose"
    folder.mkdir()
    (folder / "team.yaml").write_text(budget_yaml("team"))
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    result = run(pg_dsn, "policy", "diff", str(folder))
    assert result.exit_code == 0, result.output
    assert f"candidate: {folder}, working tree (not in a Git repository with a commit)" in result.stdout
    assert any(line.strip().startswith("+ budget team:") for line in result.stdout.splitlines())
    committed = run(pg_dsn, "policy", "diff", "--committed", str(folder))
    assert committed.exit_code == 1 and "is not in a Git repository with a commit" in committed.output
