"""OpenTelemetry for one budgetgate process: traces, metrics, and W3C trace context in headers.

`setup_telemetry` builds the providers once at startup and returns them in a `Telemetry` that
the service passes to whatever needs a tracer or a meter. Metrics are always readable in the
Prometheus text format (for `/metrics`); spans and metrics are pushed over OTLP/HTTP only when
an endpoint is given.
"""

from __future__ import annotations

import os

from dataclasses import dataclass

from opentelemetry import metrics, trace
from opentelemetry.metrics import Observation
from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricReader, PeriodicExportingMetricReader
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ParentBased
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from budgetgate.runtime import garbage


@dataclass(frozen=True)
class Telemetry:
    """The tracer and meter providers of one process, and the registry `/metrics` serves."""

    service_name: str
    tracer_provider: TracerProvider
    meter_provider: MeterProvider
    registry: CollectorRegistry
    # Whether these providers are also OpenTelemetry's process-wide ones (see setup_telemetry).
    installed_globally: bool

    metrics_content_type = CONTENT_TYPE_LATEST

    def tracer(self, name: str) -> trace.Tracer:
        """A tracer from this process's provider."""
        return self.tracer_provider.get_tracer(name)

    def meter(self, name: str) -> metrics.Meter:
        """A meter from this process's provider."""
        return self.meter_provider.get_meter(name)

    def metrics_text(self) -> bytes:
        """Current metrics in the Prometheus text format, the body of a `/metrics` answer."""
        return generate_latest(self.registry)

    def shutdown(self) -> None:
        """Flush what is pending to the exporters and stop them."""
        self.tracer_provider.shutdown()
        self.meter_provider.shutdown()


def setup_telemetry(*, service_name: str, otlp_endpoint: str | None) -> Telemetry:
    """Build tracing and metrics for a process named `service_name`.

    `otlp_endpoint` is the OTLP/HTTP base URL (as in OTEL_EXPORTER_OTLP_ENDPOINT, e.g.
    `http://collector:4318`); `/v1/traces` and `/v1/metrics` are appended. With None nothing is
    pushed anywhere, whatever the OTEL_* environment says.

    The first call in a process also installs the providers as OpenTelemetry's global ones, so
    instrumentation that reads the globals reports here. OpenTelemetry lets the globals be set
    only once, so later calls (tests build several) leave them alone and return providers that
    work only through the returned `Telemetry`; `installed_globally` says which case applied.
    """
    resource = Resource.create({SERVICE_NAME: service_name})
    # A registry of our own rather than prometheus_client's default one: a second setup in the
    # same process would otherwise register a second collector next to the first.
    registry = CollectorRegistry(auto_describe=True)
    readers: list[MetricReader] = [PrometheusMetricReader(registry=registry)]
    # With nowhere to send spans, a request's own span is not recorded (ParentBased(ALWAYS_OFF)):
    # its trace and span ids still propagate (outbox headers, evidence), and a caller's sampled
    # trace is still followed. Recording spans for nobody was about 5% of admission's CPU.
    # OTEL_TRACES_SAMPLER, when set, decides instead, as OpenTelemetry's SDK reads it.
    quiet = not otlp_endpoint and not os.environ.get("OTEL_TRACES_SAMPLER")
    tracer_provider = TracerProvider(resource=resource, sampler=ParentBased(ALWAYS_OFF) if quiet else None)
    if otlp_endpoint:
        base = otlp_endpoint.rstrip("/")
        tracer_provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=f"{base}/v1/traces")))
        readers.append(PeriodicExportingMetricReader(OTLPMetricExporter(endpoint=f"{base}/v1/metrics")))
    meter_provider = MeterProvider(resource=resource, metric_readers=readers)
    _count_collections(meter_provider.get_meter("budgetgate.process"))

    # Checked explicitly instead of calling the setters every time: a second set is refused
    # with only a log line, which would hide which providers are really global.
    install = isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)
    if install:
        trace.set_tracer_provider(tracer_provider)
        metrics.set_meter_provider(meter_provider)
    return Telemetry(
        service_name=service_name,
        tracer_provider=tracer_provider,
        meter_provider=meter_provider,
        registry=registry,
        installed_globally=install,
    )


def _count_collections(meter: metrics.Meter) -> None:
    """The garbage collector's passes and their seconds, per generation (budgetgate.runtime.garbage)."""
    counted = garbage.collections()

    def observe(figures: list[int] | list[float]) -> list[Observation]:
        return [Observation(figure, {"generation": generation}) for generation, figure in enumerate(figures)]

    meter.create_observable_counter(
        "budgetgate_gc_collections", callbacks=[lambda _o: observe(counted.passes)], description="the garbage collector's passes, by generation"
    )
    meter.create_observable_counter(
        "budgetgate_gc_pause",
        unit="s",
        callbacks=[lambda _o: observe(counted.seconds)],
        description="seconds the process stood still in the garbage collector's passes, by generation",
    )
