"""OpenTelemetry tracing setup and W3C trace-context propagation through gRPC metadata.

No gRPC import at module level: the OTLP exporter (which pulls in grpc) is imported only when
it is chosen. Each call to :func:`setup_tracing` builds its own ``TracerProvider`` and returns
it; callers take tracers from that provider (``provider.get_tracer(...)``) rather than from
the global one, because OpenTelemetry refuses to replace a global provider once set (tests
build several providers in one process).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping
from typing import Any

from opentelemetry import trace
from opentelemetry.baggage.propagation import W3CBaggagePropagator
from opentelemetry.context import Context
from opentelemetry.propagators.composite import CompositePropagator
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    SimpleSpanProcessor,
    SpanExporter,
)
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

log = logging.getLogger(__name__)

EXPORTERS = ("otlp", "console", "none")

# Explicit propagator (not the global one), so propagation works whatever OTEL_PROPAGATORS says.
_PROPAGATOR = CompositePropagator([TraceContextTextMapPropagator(), W3CBaggagePropagator()])


def choose_exporters(env: Mapping[str, str] | None = None) -> list[str]:
    """Exporter names from OTEL_TRACES_EXPORTER (comma-separated), or the default.

    The default is "otlp" when OTEL_EXPORTER_OTLP_ENDPOINT or OTEL_EXPORTER_OTLP_TRACES_ENDPOINT
    is set, else none. Unknown names are logged and skipped. Returns [] for "none".
    """
    env = os.environ if env is None else env
    raw = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if not raw:
        has_endpoint = env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get(
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
        )
        return ["otlp"] if has_endpoint else []
    parts = [part.strip() for part in raw.split(",") if part.strip()]
    if "none" in parts:
        return []
    names: list[str] = []
    for name in parts:
        if name not in EXPORTERS:
            log.warning("OTEL_TRACES_EXPORTER: unsupported exporter %r ignored", name)
        elif name not in names:
            names.append(name)
    return names


def setup_tracing(
    service_name: str,
    exporter: SpanExporter | None = None,
    *,
    set_global: bool = True,
    env: Mapping[str, str] | None = None,
) -> TracerProvider:
    """Build a TracerProvider for ``service_name`` (OTEL_SERVICE_NAME wins when set).

    With ``exporter`` (tests: an InMemorySpanExporter) spans go to it synchronously. Otherwise
    the exporters come from :func:`choose_exporters`: "otlp" = OTLP/gRPC exporter (configured by
    the OTEL_EXPORTER_OTLP_* variables) behind a BatchSpanProcessor, "console" = stdout.
    With ``set_global`` the provider becomes the global one unless one was already set.
    """
    env = os.environ if env is None else env
    name = env.get("OTEL_SERVICE_NAME") or service_name
    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: name}))
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    else:
        for kind in choose_exporters(env):
            if kind == "otlp":
                # Imported here: it pulls in grpc, which this module must not import eagerly.
                from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
                    OTLPSpanExporter,
                )

                provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
            elif kind == "console":
                from opentelemetry.sdk.trace.export import ConsoleSpanExporter

                provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter()))
    if set_global:
        if isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
            trace.set_tracer_provider(provider)
        else:
            log.debug("a global TracerProvider is already set; %s uses its own", name)
    return provider


def get_tracer(provider: trace.TracerProvider | None, name: str = "crossdraft") -> trace.Tracer:
    """A tracer from ``provider`` (or from the global provider when None)."""
    if provider is None:
        return trace.get_tracer(name)
    return provider.get_tracer(name)


def inject_metadata(context: Context | None = None) -> list[tuple[str, str]]:
    """W3C traceparent/tracestate/baggage of ``context`` (default: current) as gRPC metadata."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=context)
    return [(key.lower(), value) for key, value in carrier.items()]


def _metadata_items(metadata: Any) -> Iterable[tuple[str, Any]]:
    if metadata is None:
        return ()
    if isinstance(metadata, Mapping):
        return metadata.items()
    items = []
    for item in metadata:
        # grpc's invocation_metadata() yields _Metadatum named tuples (key, value)
        key = getattr(item, "key", None)
        value = getattr(item, "value", None)
        if key is None:
            key, value = item
        items.append((key, value))
    return items


def extract_context(metadata: Any, context: Context | None = None) -> Context:
    """The OTel context carried by gRPC ``metadata`` (pairs, _Metadatum objects or a dict).

    Binary (``-bin``) entries are ignored. Without trace headers the result has no parent span.
    """
    carrier: dict[str, str] = {}
    for key, value in _metadata_items(metadata):
        if isinstance(value, bytes) or str(key).endswith("-bin"):
            continue
        carrier[str(key).lower()] = value
    return _PROPAGATOR.extract(carrier, context=context)
