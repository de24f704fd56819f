"""Run the reconciler: python -m budgetgate.services.reconciler [--host H] [--port P]."""

from budgetgate.edge.serving import serve
from budgetgate.services.reconciler.app import create_app
from budgetgate.services.reconciler.settings import ReconcilerSettings

if __name__ == "__main__":
    serve(prog="budgetgate-reconciler", settings_cls=ReconcilerSettings, create_app=create_app)
