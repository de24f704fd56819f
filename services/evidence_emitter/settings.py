"""Settings of the evidence-emitter (BUDGETGATE_ variables).

Where events go is openlineage-python's own configuration (OPENLINEAGE_URL, OPENLINEAGE_CONFIG
or openlineage.yml, OPENLINEAGE__TRANSPORT__* variables); with none of it, events are appended
to `evidence_file`, which is what the local stack does unless Marquez is configured.
"""

from __future__ import annotations

from pydantic import Field

from budgetgate.runtime.settings import ServingSettings


class EvidenceSettings(ServingSettings):
    service_name: str = "budgetgate-evidence-emitter"
    # /healthz, /readyz and /metrics (the backlog gauges) are served here.
    host: str = "127.0.0.1"
    port: int = 8081
    pg_pool_min: int = 1
    pg_pool_max: int = 4
    evidence_file: str = ".budgetgate/evidence/openlineage.jsonl"
    # Delivery retries: the first wait, doubled per consecutive failure up to the cap.
    evidence_initial_backoff_seconds: float = 0.5
    evidence_max_backoff_seconds: float = 60.0
    evidence_batch: int = 100
    # A reconciliation consumed before its decision waits this long for it, then goes out with
    # the decision inferred from its charges.
    evidence_decision_wait_seconds: float = 600.0
    evidence_idle_seconds: float = 0.5
    # An event answered with a 5xx this many times, each after the receiver had accepted another
    # event since its previous try, is dead-lettered (`budgetgate evidence resend` sends it again).
    # By the default backoff (0.5 s doubled up to 60 s), 10 strikes take at least four minutes.
    evidence_server_error_limit: int = Field(default=10, ge=1)
    # Records per poll: one poll is stored in one transaction.
    consumer_max_records: int = 500

    @property
    def consumer_group(self) -> str:
        return f"{self.topic_prefix}budgetgate-evidence-emitter"
