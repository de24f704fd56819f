"""Run metering-ingest: python -m budgetgate.services.metering_ingest [--host H] [--port P]."""

from __future__ import annotations

import argparse
import logging

import uvicorn

from budgetgate.services.metering_ingest.app import create_app
from budgetgate.services.metering_ingest.settings import MeteringSettings


def main() -> None:
    parser = argparse.ArgumentParser(prog="budgetgate-metering-ingest")
    parser.add_argument("--host")
    parser.add_argument("--port", type=int)
    args = parser.parse_args()
    overrides = {k: v for k, v in {"host": args.host, "port": args.port}.items() if v is not None}
    settings = MeteringSettings(**overrides)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_level="warning")


if __name__ == "__main__":
    main()
