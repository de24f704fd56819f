"""Which stack a command talks to, said in one line on stderr, and one-line errors with the fix
when it cannot be reached or is not a budgetgate database."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TypeVar
from urllib.parse import urlsplit, urlunsplit

import click

from budgetgate.settings import CommonSettings, find_dev_state

S = TypeVar("S", bound=CommonSettings)

_FIX = "start the local stack with `budgetgate dev up` (or point BUDGETGATE_HOME at the folder it runs in), or set BUDGETGATE_POSTGRES_DSN"


def stack_settings(cls: type[S] = CommonSettings, *, needs: str = "postgres") -> S:  # type: ignore[assignment]
    """Settings of the stack this command talks to; refuses to fall back silently on defaults.

    The stack is the one of `.budgetgate/dev.json` in this folder or a parent (or under
    BUDGETGATE_HOME), else what BUDGETGATE_* variables name."""
    variable = {"postgres": "BUDGETGATE_POSTGRES_DSN", "kafka": "BUDGETGATE_KAFKA_BOOTSTRAP"}[needs]
    state = find_dev_state()
    if state is None and not os.environ.get(variable):
        where = (
            f"BUDGETGATE_HOME={os.environ['BUDGETGATE_HOME']} holds no running stack"
            if os.environ.get("BUDGETGATE_HOME")
            else f"no local stack found from {Path.cwd()} (no .budgetgate/dev.json here or in a parent folder)"
        )
        raise click.ClickException(f"{where}; {_FIX.replace('BUDGETGATE_POSTGRES_DSN', variable)}")
    return cls()


def origin() -> str:
    state = find_dev_state()
    if state is not None:
        return f"stack in {state.parent.parent}"
    return "BUDGETGATE_* variables"


def announce(service: str, address: str) -> None:
    """`budgetgate: postgres at … (stack in /path)` on stderr, so the user knows what was touched."""
    click.echo(f"budgetgate: {service} at {redact(address)} ({origin()})", err=True)


def redact(address: str) -> str:
    """An address without its password."""
    parts = urlsplit(address)
    if parts.password is None:
        return address
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@")
    return urlunsplit(parts._replace(netloc=netloc))


@asynccontextmanager
async def postgres(dsn: str, *, schema: bool = True) -> AsyncIterator[object]:
    """A connection to the ledger, named on stderr; unreachable, or (with `schema`) without
    budgetgate's tables, is a one-line ClickException with the fix."""
    import asyncpg

    announce("postgres", dsn)
    try:
        conn = await asyncpg.connect(dsn, timeout=5)
    except (OSError, TimeoutError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
        raise click.ClickException(f"cannot reach Postgres at {redact(dsn)}: {_one_line(exc)}; {_FIX}") from None
    try:
        if schema and await conn.fetchval("SELECT to_regclass('policy_bundles') IS NULL"):
            raise click.ClickException(
                f"the database at {redact(dsn)} has no budgetgate tables: is this the right stack (`budgetgate dev status`)? If "
                "it is, run `budgetgate db migrate`"
            )
        yield conn
    finally:
        await conn.close()


def kafka(bootstrap: str) -> str:
    announce("kafka", bootstrap)
    return bootstrap


def _one_line(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return " ".join(text.split())
