"""Run metering-ingest: python -m budgetgate.services.metering_ingest [--host H] [--port P]."""

from budgetgate.edge.serving import serve
from budgetgate.services.metering_ingest.app import create_app
from budgetgate.services.metering_ingest.settings import MeteringSettings

if __name__ == "__main__":
    serve(prog="budgetgate-metering-ingest", settings_cls=MeteringSettings, create_app=create_app)
