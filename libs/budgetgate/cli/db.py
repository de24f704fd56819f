"""`budgetgate db …`: schema migrations."""

from __future__ import annotations

import asyncio

import click

from budgetgate.cli import backend


@click.group()
def db() -> None:
    """Postgres ledger schema."""


@db.command()
def migrate() -> None:
    """Apply every numbered migration not yet applied."""
    import asyncpg

    from budgetgate.ledger.migrations import migrate_dsn

    dsn = backend.stack_settings().postgres_dsn
    backend.announce("postgres", dsn)
    try:
        applied = asyncio.run(migrate_dsn(dsn))
    except (OSError, TimeoutError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
        raise click.ClickException(
            f"cannot reach Postgres at {backend.redact(dsn)}: {exc}; start the local stack with `budgetgate dev up`, or set BUDGETGATE_POSTGRES_DSN"
        ) from None
    click.echo(f"applied {len(applied)} migration(s)" + (": " + ", ".join(applied) if applied else ""))
