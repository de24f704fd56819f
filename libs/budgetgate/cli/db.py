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

    from budgetgate.ledger.migrations import MigrationLockTimeout, migrate_dsn

    settings = backend.stack_settings()
    dsn = settings.postgres_dsn
    backend.announce("postgres", dsn)
    try:
        applied = asyncio.run(migrate_dsn(dsn, lock_timeout_seconds=settings.migration_lock_timeout_seconds))
    except MigrationLockTimeout as exc:
        raise click.ClickException(str(exc)) from None
    except (OSError, TimeoutError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
        raise click.ClickException(
            f"cannot reach Postgres at {backend.redact(dsn)}: {exc}; start the local stack with `budgetgate dev up`, or set BUDGETGATE_POSTGRES_DSN"
        ) from None
    click.echo(f"applied {len(applied)} migration(s)" + (": " + ", ".join(applied) if applied else ""))
