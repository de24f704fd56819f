"""`budgetgate dev …`: the local stack (see budgetgate.devstack)."""

from __future__ import annotations

import click


@click.group()
def dev() -> None:
    """Run Postgres, Redis, Kafka and the services on this machine."""
