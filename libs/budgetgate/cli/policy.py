"""`budgetgate policy …`: validate and apply a policy repository."""

from __future__ import annotations

import asyncio
import getpass
from pathlib import Path

import asyncpg
import click

from budgetgate.core.loader import PolicyValidationError, load_directory
from budgetgate.policy_repo import RepositoryError, apply_bundle, revision
from budgetgate.settings import CommonSettings


@click.group()
def policy() -> None:
    """Budgets as code: YAML policy documents in Git."""


def _load(directory: Path, git_sha: str):  # type: ignore[no-untyped-def]
    try:
        return load_directory(directory, git_sha=git_sha)
    except PolicyValidationError as exc:
        for error in exc.errors:
            click.echo(f"error: {error}", err=True)
        raise SystemExit(f"{len(exc.errors)} error(s) in {directory}") from None


@policy.command()
@click.argument("directory", type=click.Path(path_type=Path))
def validate(directory: Path) -> None:
    """Check every document; print each error with file and line."""
    bundle, documents = _load(directory, "validate")
    click.echo(f"ok: {len(documents)} document(s), {len(bundle.policies)} budget(s), {len(bundle.rate_cards)} rate card(s)")


@policy.command()
@click.argument("directory", type=click.Path(path_type=Path))
@click.option("--allow-dirty", is_flag=True, help="apply uncommitted changes (the SHA gets a -dirty suffix)")
def apply(directory: Path, allow_dirty: bool) -> None:
    """Validate, then store the bundle at its Git SHA and make it active everywhere."""
    _, documents = _load(directory, "validate")
    try:
        sha = revision(directory, allow_dirty=allow_dirty, documents=documents)
    except RepositoryError as exc:
        raise SystemExit(f"error: {exc}") from None
    bundle, documents = _load(directory, sha)
    seq = asyncio.run(_apply(bundle, documents, str(directory.resolve())))
    click.echo(f"applied {sha} ({len(bundle.policies)} budget(s)) as activation {seq}")


async def _apply(bundle, documents, source: str) -> int:  # type: ignore[no-untyped-def]
    conn = await asyncpg.connect(CommonSettings().postgres_dsn)
    try:
        return await apply_bundle(conn, bundle=bundle, documents=documents, source=source, applied_by=getpass.getuser())
    finally:
        await conn.close()
