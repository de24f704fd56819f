"""A fresh Postgres database per test, copied from a template migrated once per session.

`CREATE DATABASE … TEMPLATE` copies files, which is much faster than running every migration
again for each test. Template and test databases carry random names, so sessions (and pytest-xdist
workers) sharing one server never meet.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import asyncpg

from budgetgate.devstack.isolation import with_database

T = TypeVar("T")


def run_async(make: Callable[[], Awaitable[T]]) -> T:
    """Run a coroutine to completion from sync code, even while a test's event loop exists.

    A worker thread has no event loop of its own, so asyncio.run there touches neither the loop
    pytest-asyncio manages for the test nor the main thread's current-loop setting.
    """

    async def main() -> T:
        return await make()

    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, main()).result()


async def _execute(dsn: str, *statements: str) -> None:
    conn = await asyncpg.connect(dsn, timeout=10)
    try:
        for statement in statements:
            await conn.execute(statement)
    finally:
        await conn.close()


async def empty_database(admin_dsn: str, *, prefix: str = "bg") -> tuple[str, str]:
    """A new database with nothing in it (no migration) on the server of `admin_dsn`: its name
    and DSN. Drop it with `drop_database`."""
    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    await _execute(admin_dsn, f'CREATE DATABASE "{name}"')
    return name, with_database(admin_dsn, name)


async def private_database(admin_dsn: str) -> str:
    """The DSN of a new, migrated database on the server of `admin_dsn` (a private server a
    fault test kills): not dropped afterwards, it goes with its server."""
    _, dsn = await empty_database(admin_dsn)
    await _migrate(dsn)
    return dsn


async def drop_database(admin_dsn: str, name: str) -> None:
    await _execute(admin_dsn, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


async def _migrate(dsn: str) -> None:
    try:
        from budgetgate.ledger.migrations import migrate_dsn
    except ModuleNotFoundError as exc:
        if exc.name != "budgetgate.ledger.migrations":
            raise
        return  # a checkout without migrations yet: the template stays empty
    await migrate_dsn(dsn)


class DatabaseFactory:
    """Creates and drops per-test databases on the server of `admin_dsn`."""

    def __init__(self, admin_dsn: str) -> None:
        self.admin_dsn = admin_dsn
        self.template = f"bg_tpl_{uuid.uuid4().hex[:12]}"
        self._template_ready = False

    def _ensure_template(self) -> None:
        if self._template_ready:
            return
        run_async(lambda: _execute(self.admin_dsn, f'CREATE DATABASE "{self.template}"'))
        run_async(lambda: _migrate(with_database(self.admin_dsn, self.template)))
        self._template_ready = True

    def create(self) -> tuple[str, str]:
        """A new migrated database: (name, dsn)."""
        self._ensure_template()
        name = f"bg_t_{uuid.uuid4().hex[:12]}"
        run_async(lambda: _execute(self.admin_dsn, f'CREATE DATABASE "{name}" TEMPLATE "{self.template}"'))
        return name, with_database(self.admin_dsn, name)

    def drop(self, name: str) -> None:
        # FORCE: a test that left a pool open must not keep its database (or fail the next test).
        run_async(lambda: _execute(self.admin_dsn, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))

    def close(self) -> None:
        if self._template_ready:
            self.drop(self.template)


async def fetch(dsn: str, query: str, *args: object) -> list[asyncpg.Record]:
    """The rows of one query, on a connection of its own."""
    conn = await asyncpg.connect(dsn)
    try:
        return await conn.fetch(query, *args)
    finally:
        await conn.close()
