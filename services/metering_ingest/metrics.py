"""What metering-ingest counts: samples by outcome, rejections by reason, samples pending.

On /metrics (Prometheus) these read `budgetgate_metering_samples_total{outcome,source}`,
`budgetgate_metering_rejections_total{reason,source}` and `budgetgate_metering_pending`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from opentelemetry.metrics import CallbackOptions, Meter, Observation

from budgetgate.core.metering import Accepted, Duplicate, Rejection, reason_code
from budgetgate.services.metering_ingest.ingest import Folded, Outcome, Pending


class MeteringMetrics:
    """The instruments of one service instance."""

    def __init__(self, meter: Meter) -> None:
        self._samples = meter.create_counter(
            "budgetgate_metering_samples",
            description="metering samples taken care of, by outcome (accepted, late, duplicate, pending, rejected) and source (kafka, http)",
        )
        self._rejections = meter.create_counter("budgetgate_metering_rejections", description="metering samples rejected, by reason and source")
        self.pending = 0  # refreshed by the pending re-check
        meter.create_observable_gauge(
            "budgetgate_metering_pending",
            callbacks=[self._observe_pending],
            description="samples of runs without a decision, kept until one appears or their grace ends",
        )

    def outcome(self, outcome: Outcome, *, source: str) -> None:
        """Count one sample that was recorded, found a duplicate, or kept pending."""
        self._samples.add(1, {"outcome": _name(outcome), "source": source})

    def outcomes(self, outcomes: Iterable[Outcome | Folded], *, source: str, folded: int = 0) -> None:
        """Count many samples at once (one addition per outcome name); `folded`: accepted samples
        folded into their span's point, counted apart by the caller."""
        counts = Counter(_name(o) for o in outcomes)
        if folded:
            counts["accepted"] += folded
        for name, count in counts.items():
            self._samples.add(count, {"outcome": name, "source": source})

    def rejected(self, reason: Rejection, *, source: str) -> None:
        """Count one rejected sample under its (first) reason."""
        self._samples.add(1, {"outcome": "rejected", "source": source})
        self._rejections.add(1, {"reason": str(reason), "source": source})

    def dead_lettered(self, _topic: str, reason: str) -> None:
        """The inbox's on_dead_letter: every Kafka sample it parks on the DLQ."""
        self.rejected(reason_code(reason), source="kafka")

    def _observe_pending(self, _options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(self.pending)]


def _name(outcome: Outcome | Folded) -> str:
    if isinstance(outcome, Folded):
        return "accepted"  # (neither late nor its span's point: a late sample keeps its row)
    if isinstance(outcome, Accepted):
        return "late" if outcome.late else "accepted"
    if isinstance(outcome, Duplicate):
        return "duplicate"
    assert isinstance(outcome, Pending)
    return "pending"
