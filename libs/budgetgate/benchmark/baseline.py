"""The baseline: the admission service a team would write first, with Postgres row locks.

Per submission, one transaction: lock the budget row (SELECT … FOR UPDATE), answer a retry from
its stored decision, check limit − reserved − consumed, add to reserved, store the decision,
commit, answer ALLOW or DENY. It takes the same request body as budgetgate's admission API.
With `--shared-budget` (the benchmark's `shared` scenario) every submission falls under one more
budget, the row `budgets.budget_id = SHARED_ID`, locked after the team's and charged with it.

Run it as `python -m budgetgate.benchmark.baseline --dsn DSN --port P`.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
from collections.abc import AsyncIterator

import asyncpg
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from budgetgate.benchmark import sql_blocks
from budgetgate.benchmark.workload import SHARED_ID

MILLI_PER_HOUR = 3_600_000
sql = functools.partial(sql_blocks.sql, "baseline.sql")


class Resources(BaseModel):
    model_config = ConfigDict(extra="forbid")
    gpus: int = Field(ge=1, le=1_000_000)
    nodes: int = Field(default=1, ge=1)
    flavor: str | None = None
    region: str | None = None


class Job(BaseModel):
    model_config = ConfigDict(extra="forbid")
    namespace: str
    name: str


class Submission(BaseModel):
    model_config = ConfigDict(extra="forbid")
    run_id: str = Field(min_length=1, max_length=256)
    attempt: int = Field(default=1, ge=1)
    namespace: str = Field(min_length=1, max_length=63)
    labels: dict[str, str] = Field(default_factory=dict)
    resources: Resources
    projected_runtime_hours: float = Field(gt=0, le=8784, allow_inf_nan=False)
    job: Job | None = None


class Answer(BaseModel):
    run_id: str
    decision: str
    replayed: bool
    budget_id: str | None
    projected_gpu_hours: float
    remaining_gpu_hours: float | None


class _Raced(Exception):
    """Another transaction stored a decision for this run id first."""


def create_app(dsn: str, *, pool_min: int = 2, pool_max: int = 20, shared: bool = False) -> FastAPI:
    """The baseline service on the database `dsn` (schema from `prepare`); `shared`: every
    submission falls under the budget SHARED_ID too."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.pool = await asyncpg.create_pool(dsn, min_size=pool_min, max_size=pool_max, command_timeout=10)
        try:
            yield
        finally:
            await app.state.pool.close()

    app = FastAPI(title="baseline admission", lifespan=lifespan)

    @app.post("/v1/admissions", response_model=Answer)
    async def submit(body: Submission, request: Request) -> dict:
        pool: asyncpg.Pool = request.app.state.pool
        try:
            return await _decide(pool, body, shared=shared)
        except _Raced:
            row = await pool.fetchrow(sql("prior_decision"), body.run_id)
            return {**json.loads(row["response"]), "replayed": True}

    @app.get("/readyz")
    async def readyz(request: Request) -> JSONResponse:
        await request.app.state.pool.fetchval("SELECT 1")
        return JSONResponse({"ready": True})

    return app


async def _decide(pool: asyncpg.Pool, body: Submission, *, shared: bool = False) -> dict:
    amount = round(body.resources.gpus * body.projected_runtime_hours * MILLI_PER_HOUR)
    async with pool.acquire() as conn, conn.transaction():
        budget = await conn.fetchrow(sql("lock_budget"), body.namespace)
        company = await conn.fetchrow(sql("lock_budget_id"), SHARED_ID) if shared else None  # always after the team's row
        prior = await conn.fetchrow(sql("prior_decision"), body.run_id)
        if prior is not None:
            return {**json.loads(prior["response"]), "replayed": True}
        remaining = None if budget is None else budget["limit_amount"] - budget["reserved"] - budget["consumed"]
        allow = remaining is None or amount <= remaining
        if company is not None:
            allow = allow and amount <= company["limit_amount"] - company["reserved"] - company["consumed"]
        if allow and budget is not None:
            await conn.execute(sql("reserve"), budget["budget_id"], amount)
        if allow and company is not None:
            await conn.execute(sql("reserve"), SHARED_ID, amount)
        answer = {
            "run_id": body.run_id,
            "decision": "ALLOW" if allow else "DENY",
            "replayed": False,
            "budget_id": budget["budget_id"] if budget else None,
            "projected_gpu_hours": amount / MILLI_PER_HOUR,
            "remaining_gpu_hours": remaining / MILLI_PER_HOUR if remaining is not None else None,
        }
        stored = await conn.fetchval(sql("insert_decision"), body.run_id, answer["budget_id"], answer["decision"], amount, json.dumps(answer))
        if stored is None:
            raise _Raced  # rolls back the reservation above
        return answer


async def prepare(conn: asyncpg.Connection, budgets: list[tuple[str, str, int]]) -> None:
    """Create the schema and one row per (budget_id, namespace, limit in milli-GPU-seconds)."""
    async with conn.transaction():
        await conn.execute(sql("schema"))
        await conn.executemany(sql("insert_budget"), budgets)


def main() -> None:
    parser = argparse.ArgumentParser(prog="budgetgate-baseline")
    parser.add_argument("--dsn", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8090)
    parser.add_argument("--pool-max", type=int, default=20)
    parser.add_argument("--shared-budget", action="store_true", help=f"every submission falls under the budget {SHARED_ID} too")
    args = parser.parse_args()
    uvicorn.run(create_app(args.dsn, pool_max=args.pool_max, shared=args.shared_budget), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
