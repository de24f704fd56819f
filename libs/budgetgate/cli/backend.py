"""Which stack a command talks to, said in one line on stderr, and one-line errors with the fix
when it cannot be reached or is not a budgetgate database."""

from __future__ import annotations

import getpass
import os
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import TypeVar
from urllib.parse import urlsplit, urlunsplit

import click

from budgetgate.runtime.settings import CommonSettings, find_dev_state

S = TypeVar("S", bound=CommonSettings)

_FIX = "start the local stack with `budgetgate dev up` (or point BUDGETGATE_HOME at the folder it runs in), or set BUDGETGATE_POSTGRES_DSN"


_VARIABLES = {"postgres": "BUDGETGATE_POSTGRES_DSN", "kafka": "BUDGETGATE_KAFKA_BOOTSTRAP", "redis": "BUDGETGATE_REDIS_URL"}


def stack_settings(cls: type[S] = CommonSettings, *, needs: str | tuple[str, ...] = "postgres") -> S:  # type: ignore[assignment]
    """Settings of the stack this command talks to; refuses to fall back silently on defaults.

    The stack is the one of `.budgetgate/dev.json` in this folder or a parent (or under
    BUDGETGATE_HOME), else what BUDGETGATE_* variables name: each service of `needs` its own."""
    missing = [_VARIABLES[need] for need in ((needs,) if isinstance(needs, str) else needs) if not os.environ.get(_VARIABLES[need])]
    state = find_dev_state()
    if state is None and missing:
        where = (
            f"BUDGETGATE_HOME={os.environ['BUDGETGATE_HOME']} holds no running stack"
            if os.environ.get("BUDGETGATE_HOME")
            else f"no local stack found from {Path.cwd()} (no .budgetgate/dev.json here or in a parent folder)"
        )
        raise click.ClickException(f"{where}; {_FIX.replace('BUDGETGATE_POSTGRES_DSN', ' and '.join(missing))}")
    try:
        return cls()
    except ValueError as exc:  # a pydantic ValidationError: a variable that does not parse
        raise click.ClickException(f"invalid settings: {_one_line(exc)}") from None


def actor() -> str:
    """Who runs this command, for the admin log: `cli:<login name>`."""
    return f"cli:{getpass.getuser()}"


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
    with _reaching("Postgres", dsn):
        conn = await asyncpg.connect(dsn, timeout=5)
    try:
        if schema:
            await _require_schema(conn, dsn)
        yield conn
    finally:
        await conn.close()


@asynccontextmanager
async def postgres_pool(dsn: str, *, max_size: int = 2) -> AsyncIterator[object]:
    """A small pool on the ledger (for code that takes one), checked as `postgres` checks a connection."""
    import asyncpg

    announce("postgres", dsn)
    with _reaching("Postgres", dsn):
        pool = await asyncpg.create_pool(dsn, min_size=1, max_size=max_size, command_timeout=60, timeout=5)
    try:
        async with pool.acquire() as conn:
            await _require_schema(conn, dsn)
        yield pool
    finally:
        await pool.close()


@asynccontextmanager
async def redis(url: str) -> AsyncIterator[object]:
    """A Redis client, named on stderr; an address that is malformed or does not answer is a
    one-line ClickException."""
    from budgetgate.runtime import redis_client

    announce("redis", url)
    with _reaching("Redis", url):
        client = redis_client.connect(url, socket_connect_timeout=5)
    try:
        with _reaching("Redis", url):
            await client.ping()
        yield client
    finally:
        await client.aclose()


@contextmanager
def _reaching(service: str, address: str) -> Iterator[None]:
    import asyncpg
    import redis.exceptions

    try:
        yield
    except (ValueError, OverflowError) as exc:  # a port that is no number, or out of range
        raise click.ClickException(f"invalid {service} address {redact(address)}: {_one_line(exc)}") from None
    except (OSError, TimeoutError, asyncpg.PostgresError, asyncpg.InterfaceError, redis.exceptions.RedisError) as exc:
        fix = _FIX.replace("BUDGETGATE_POSTGRES_DSN", _VARIABLES[service.lower()])
        raise click.ClickException(f"cannot reach {service} at {redact(address)}: {_one_line(exc)}; {fix}") from None


async def _require_schema(conn: object, dsn: str) -> None:
    if await conn.fetchval("SELECT to_regclass('policy_bundles') IS NULL"):  # type: ignore[attr-defined]
        raise click.ClickException(
            f"the database at {redact(dsn)} has no budgetgate tables: is this the right stack (`budgetgate dev status`)? If it is, run `budgetgate db migrate`"
        )


def kafka(bootstrap: str) -> str:
    announce("kafka", bootstrap)
    return bootstrap


def _one_line(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return " ".join(text.split())
