"""Run the evidence-emitter: python -m budgetgate.services.evidence_emitter [--host H] [--port P]."""

from budgetgate.edge.serving import serve
from budgetgate.services.evidence_emitter.app import create_app
from budgetgate.services.evidence_emitter.settings import EvidenceSettings

if __name__ == "__main__":
    serve(prog="budgetgate-evidence-emitter", settings_cls=EvidenceSettings, create_app=create_app)
