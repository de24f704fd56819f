"""The API token a benchmark's load generator sends: authentication is on in every measurement,
with a rate limit far above the offered load, so its cost is measured and never its refusals."""

from __future__ import annotations

import uuid

import asyncpg

from budgetgate.core.principals import Role
from budgetgate.access.tokens import create_token

# Added to the environment of every measured service.
SERVICE_ENV = {"BUDGETGATE_RATE_LIMIT": "10000000/second"}


async def bench_token(dsn: str) -> str:
    """A submitter and reader token in the benchmark's database; its secret."""
    conn = await asyncpg.connect(dsn)
    try:
        issued = await create_token(
            conn, name=f"bench-{uuid.uuid4().hex[:12]}", roles=[Role.SUBMITTER, Role.READER], namespaces=[], tenants=[], created_by="budgetgate bench"
        )
    finally:
        await conn.close()
    return issued.secret


def bearer(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}
