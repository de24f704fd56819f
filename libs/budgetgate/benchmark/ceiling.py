"""The ceiling: a FastAPI endpoint that validates the same submission body as admission (its
pydantic model) and returns a fixed answer. What any FastAPI service on this machine, with this
load generator, can reach at most; admission is measured against it in the same run.

Run it as `python -m budgetgate.benchmark.ceiling --port P`.
"""

from __future__ import annotations

import argparse

import uvicorn
from fastapi import FastAPI

from budgetgate.contracts.admission import AdmissionRequest

ANSWER = {"decision": "ALLOW", "replayed": False}


def create_app() -> FastAPI:
    app = FastAPI(title="ceiling")

    @app.post("/v1/admissions")
    async def submit(body: AdmissionRequest) -> dict:
        return {"run_id": body.run_id, **ANSWER}

    @app.get("/readyz")
    async def readyz() -> dict:
        return {"ready": True}

    return app


def main() -> None:
    parser = argparse.ArgumentParser(prog="budgetgate-ceiling")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8091)
    args = parser.parse_args()
    uvicorn.run(create_app(), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
