"""metering-ingest's sample counts: a Kafka poll's folded samples (accepted, folded into their span's
point, handed over as a number) count as accepted beside the outcomes it looked at."""

from __future__ import annotations

from datetime import UTC, datetime

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from budgetgate.core.metering import Accepted, Counters, Duplicate, Sample
from budgetgate.services.metering_ingest.metrics import MeteringMetrics


def _counts(reader: InMemoryMetricReader) -> dict[tuple[str, str], int]:
    data = reader.get_metrics_data()
    return {
        (str(point.attributes["outcome"]), str(point.attributes["source"])): int(point.value)
        for resource in data.resource_metrics
        for scope in resource.scope_metrics
        for metric in scope.metrics
        if metric.name == "budgetgate_metering_samples"
        for point in metric.data.data_points
    }


def test_folded_samples_count_as_accepted_beside_the_others() -> None:
    reader = InMemoryMetricReader()
    metrics = MeteringMetrics(MeterProvider(metric_readers=[reader]).get_meter("test"))
    sample = Sample("run-1", "s-1", datetime(2026, 12, 1, tzinfo=UTC), Counters(1000, 10))
    point = Accepted(sample, cumulative=Counters(1000, 10), delta=Counters(1000, 10), late=False)
    late = Accepted(sample, cumulative=Counters(1000, 10), delta=Counters(), late=True)
    metrics.outcomes([point, late, Duplicate(sample, of="s-0")], source="kafka", folded=3)
    metrics.outcomes([point], source="http")
    assert _counts(reader) == {("accepted", "kafka"): 4, ("late", "kafka"): 1, ("duplicate", "kafka"): 1, ("accepted", "http"): 1}
