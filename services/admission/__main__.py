"""Run the admission service: python -m budgetgate.services.admission [--host H] [--port P]."""

from budgetgate.edge.serving import serve
from budgetgate.services.admission.app import create_app
from budgetgate.services.admission.settings import AdmissionSettings

if __name__ == "__main__":
    serve(prog="budgetgate-admission", settings_cls=AdmissionSettings, create_app=create_app)
