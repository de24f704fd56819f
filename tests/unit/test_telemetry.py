"""Telemetry setup: Prometheus text always, OTLP only when asked, safe to build twice."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from opentelemetry import trace

from budgetgate.runtime.telemetry import Telemetry, setup_telemetry
from budgetgate.contracts.trace_context import extract_context, inject_headers


class _Collector(BaseHTTPRequestHandler):
    """Stands in for an OTLP/HTTP collector: records which paths were posted to."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.server.paths.append(self.path)  # type: ignore[attr-defined]
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - stdlib signature
        pass


@pytest.fixture
def collector() -> Iterator[tuple[str, list[str]]]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Collector)
    server.paths = []  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", server.paths  # type: ignore[attr-defined]
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


@pytest.fixture
def telemetry(monkeypatch: pytest.MonkeyPatch) -> Iterator[Telemetry]:
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "always_on")  # spans recorded, as with an exporter
    t = setup_telemetry(service_name="test-service", otlp_endpoint=None)
    yield t
    t.shutdown()


def test_metrics_are_served_in_prometheus_text(telemetry: Telemetry) -> None:
    counter = telemetry.meter("test").create_counter("budgetgate_test_decisions")
    counter.add(3, {"outcome": "ALLOW"})

    text = telemetry.metrics_text().decode()

    assert "budgetgate_test_decisions_total{" in text
    line = next(l for l in text.splitlines() if l.startswith("budgetgate_test_decisions_total{"))
    assert 'outcome="ALLOW"' in line
    assert line.endswith(" 3.0")
    assert telemetry.metrics_content_type.startswith("text/plain")


def test_two_setups_in_one_process_keep_their_own_metrics_and_spans(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "always_on")
    first = setup_telemetry(service_name="first", otlp_endpoint=None)
    second = setup_telemetry(service_name="second", otlp_endpoint=None)
    try:
        first.meter("m").create_counter("budgetgate_first_only").add(1)
        second.meter("m").create_counter("budgetgate_second_only").add(1)

        assert b"budgetgate_first_only" in first.metrics_text()
        assert b"budgetgate_first_only" not in second.metrics_text()
        assert b"budgetgate_second_only" in second.metrics_text()
        # OpenTelemetry's globals can be set once: at most one of the two may claim them.
        assert not (first.installed_globally and second.installed_globally)
        with second.tracer("t").start_as_current_span("work") as span:
            assert span.get_span_context().is_valid
            assert span.resource.attributes["service.name"] == "second"  # type: ignore[attr-defined]
    finally:
        first.shutdown()
        second.shutdown()


def test_with_nowhere_to_send_spans_none_is_recorded_but_the_trace_still_travels(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OTEL_TRACES_SAMPLER", raising=False)
    t = setup_telemetry(service_name="quiet", otlp_endpoint=None)
    try:
        tracer = t.tracer("t")
        with tracer.start_as_current_span("producer") as producer:
            headers = inject_headers()
        assert not producer.is_recording() and producer.get_span_context().is_valid
        with tracer.start_as_current_span("consumer", context=extract_context(headers)) as consumer:
            pass
        assert consumer.get_span_context().trace_id == producer.get_span_context().trace_id
        # A caller's sampled trace is still followed (recorded) here.
        sampled = [("traceparent", b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")]
        with tracer.start_as_current_span("server", context=extract_context(sampled)) as server:
            assert server.is_recording() and server.get_span_context().trace_id == 0x0AF7651916CD43DD8448EB211C80319C
    finally:
        t.shutdown()


def test_globals_are_installed_by_the_first_setup_only() -> None:
    t = setup_telemetry(service_name="globals", otlp_endpoint=None)
    try:
        if t.installed_globally:
            assert trace.get_tracer_provider() is t.tracer_provider
        else:
            assert trace.get_tracer_provider() is not t.tracer_provider
        assert not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)
    finally:
        t.shutdown()


def test_otlp_endpoint_receives_spans_and_metrics(collector: tuple[str, list[str]]) -> None:
    endpoint, paths = collector
    t = setup_telemetry(service_name="exporting", otlp_endpoint=endpoint + "/")
    try:
        with t.tracer("t").start_as_current_span("exported"):
            pass
        t.meter("m").create_counter("budgetgate_exported").add(1)
        assert t.tracer_provider.force_flush(5_000)
        assert t.meter_provider.force_flush(5_000)
    finally:
        t.shutdown()

    assert "/v1/traces" in paths
    assert "/v1/metrics" in paths


def test_without_endpoint_nothing_is_pushed_even_if_environment_names_one(collector: tuple[str, list[str]], monkeypatch: pytest.MonkeyPatch) -> None:
    endpoint, paths = collector
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)
    t = setup_telemetry(service_name="quiet", otlp_endpoint=None)
    with t.tracer("t").start_as_current_span("not exported"):
        pass
    t.meter("m").create_counter("budgetgate_not_exported").add(1)
    t.tracer_provider.force_flush(5_000)
    t.meter_provider.force_flush(5_000)
    t.shutdown()

    assert paths == []


def test_inject_then_extract_continues_the_trace(telemetry: Telemetry) -> None:
    tracer = telemetry.tracer("t")
    with tracer.start_as_current_span("producer") as producer:
        headers = inject_headers()

    names = [name for name, _ in headers]
    assert "traceparent" in names
    with tracer.start_as_current_span("consumer", context=extract_context(headers)) as consumer:
        pass

    assert consumer.parent is not None  # type: ignore[attr-defined]
    assert consumer.parent.span_id == producer.get_span_context().span_id  # type: ignore[attr-defined]
    assert consumer.get_span_context().trace_id == producer.get_span_context().trace_id


def test_tracestate_travels_with_the_traceparent() -> None:
    parent = trace.SpanContext(
        trace_id=0x0AF7651916CD43DD8448EB211C80319C,
        span_id=0xB7AD6B7169203331,
        is_remote=True,
        trace_flags=trace.TraceFlags(trace.TraceFlags.SAMPLED),
        trace_state=trace.TraceState([("vendor", "abc")]),
    )
    headers = dict(inject_headers(trace.set_span_in_context(trace.NonRecordingSpan(parent))))

    assert headers["traceparent"] == b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    assert headers["tracestate"] == b"vendor=abc"
    restored = trace.get_current_span(extract_context(headers.items())).get_span_context()
    assert restored.trace_id == parent.trace_id
    assert restored.span_id == parent.span_id
    assert restored.trace_state == parent.trace_state


def test_no_current_span_injects_nothing_and_missing_headers_start_a_new_trace() -> None:
    assert inject_headers() == []
    ctx = extract_context([("content-type", b"application/x-protobuf")])
    assert not trace.get_current_span(ctx).get_span_context().is_valid
    assert not trace.get_current_span(extract_context(None)).get_span_context().is_valid


def test_header_names_are_matched_without_case_and_str_values_accepted() -> None:
    ctx = extract_context([("TraceParent", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")])
    assert trace.get_current_span(ctx).get_span_context().span_id == 0xB7AD6B7169203331


def test_malformed_traceparent_is_ignored() -> None:
    ctx = extract_context([("traceparent", b"not-a-traceparent")])
    assert not trace.get_current_span(ctx).get_span_context().is_valid
