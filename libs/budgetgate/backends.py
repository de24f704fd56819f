"""The one classification of backend failures every service shares: errors meaning Postgres or
Redis is unreachable or failed mid-call, so the answer is 503 (or a retry), never a 500."""

from __future__ import annotations

import asyncpg
import redis.exceptions

BACKEND_ERRORS: tuple[type[BaseException], ...] = (
    OSError,
    TimeoutError,
    asyncpg.PostgresConnectionError,
    asyncpg.InterfaceError,
    asyncpg.InternalClientError,
    # SQLSTATE class 57, operator intervention: admin shutdown (57P01, a terminated backend or
    # a server stopping), crash shutdown (57P02), cannot connect now (57P03).
    asyncpg.exceptions.OperatorInterventionError,
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
)
