"""W3C trace context in Kafka headers: what the wire contract promises every message carries
(traceparent, tracestate, nothing else), injected by producers and extracted by consumers."""

from __future__ import annotations

from collections.abc import Iterable

from opentelemetry.context import Context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

# The contract is W3C trace context and nothing else, so the propagator is fixed here rather
# than read from OTEL_PROPAGATORS.
_PROPAGATOR = TraceContextTextMapPropagator()
TRACE_HEADERS = frozenset(_PROPAGATOR.fields)

Headers = Iterable[tuple[str, bytes | str | None]]


def inject_headers(context: Context | None = None) -> list[tuple[str, bytes]]:
    """W3C trace context of `context` (default: the current one) as Kafka headers.

    Empty when there is no valid span to continue.
    """
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=context)
    return [(name, value.encode("ascii")) for name, value in carrier.items()]


def extract_context(headers: Headers | None) -> Context:
    """The trace context carried by Kafka headers, for starting a consumer's span under it.

    Without a valid `traceparent` the result is an empty context, so the consumer's span starts
    a new trace instead of joining whatever happens to be current.
    """
    carrier: dict[str, str] = {}
    for name, value in headers or ():
        key = name.lower()
        if key in TRACE_HEADERS and value is not None:
            carrier[key] = value.decode("latin-1") if isinstance(value, bytes) else value
    return _PROPAGATOR.extract(carrier, context=Context())
