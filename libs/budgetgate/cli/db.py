"""`budgetgate db …`: schema migrations."""

from __future__ import annotations

import asyncio

import click

from budgetgate.settings import CommonSettings


@click.group()
def db() -> None:
    """Postgres ledger schema."""


@db.command()
def migrate() -> None:
    """Apply every numbered migration not yet applied."""
    from budgetgate.ledger.migrations import migrate_dsn

    applied = asyncio.run(migrate_dsn(CommonSettings().postgres_dsn))
    click.echo(f"applied {len(applied)} migration(s)" + (": " + ", ".join(applied) if applied else ""))
