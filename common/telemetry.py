"""OpenTelemetry set-up shared by the three services: traces and metrics over OTLP, Prometheus scraping, gRPC
instrumentation, and the W3C trace context that travels inside every stream message.

Configuration is the standard OTEL_* environment: OTEL_SERVICE_NAME, OTEL_EXPORTER_OTLP_ENDPOINT (or the
_TRACES_/_METRICS_ variants), OTEL_TRACES_SAMPLER(_ARG), OTEL_SDK_DISABLED. Without an endpoint nothing is
exported and no exporter is created; with OTEL_SDK_DISABLED=true every span and instrument is a no-op.
"""

import asyncio
import functools
import logging
import os

from opentelemetry import context as otel_context
from opentelemetry import metrics, propagate, trace
from opentelemetry.context import Context

log = logging.getLogger("specdec.telemetry")

TRACER_NAME = "specdec"
_configured = False


def sdk_disabled() -> bool:
    return os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true"


def otlp_configured(signal: str) -> bool:
    """True when OTLP export of signal ("TRACES" or "METRICS") was asked for through the environment."""
    endpoint = os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get(f"OTEL_EXPORTER_OTLP_{signal}_ENDPOINT")
    exporter = os.environ.get(f"OTEL_{signal}_EXPORTER", "")
    return bool(endpoint) or exporter == "otlp"


def setup_telemetry(default_service_name: str, metrics_port: int | None = None) -> None:
    """Installs the tracer and meter providers of this process and instruments gRPC (health and reflection excluded).

    Call before any gRPC server or channel is created: the instrumentation patches their constructors.
    """
    global _configured
    if _configured:
        return
    _configured = True
    if sdk_disabled():
        log.info("OpenTelemetry disabled (OTEL_SDK_DISABLED=true)")
        return
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider

    attributes = {} if os.environ.get("OTEL_SERVICE_NAME") else {"service.name": default_service_name}
    resource = Resource.create(attributes)
    if otlp_configured("TRACES"):
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        tracer_provider = TracerProvider(resource=resource)
        tracer_provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        trace.set_tracer_provider(tracer_provider)
    # Else the API's no-op tracer: spans nobody exports would cost every round their recording (several spans
    # and a few dozen attributes); a caller's trace context still passes through to the workers.

    readers = []
    if otlp_configured("METRICS"):
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
        from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

        readers.append(PeriodicExportingMetricReader(OTLPMetricExporter()))
    if metrics_port:
        from opentelemetry.exporter.prometheus import PrometheusMetricReader
        from prometheus_client import start_http_server

        start_http_server(metrics_port)
        readers.append(PrometheusMetricReader())
    if readers:  # else the API's no-op meter: measurements nobody reads would cost every round their recording
        metrics.set_meter_provider(MeterProvider(resource=resource, metric_readers=readers))
    instrument_grpc()


def instrument_grpc() -> None:
    from opentelemetry.instrumentation.grpc import GrpcAioInstrumentorServer, filters

    # Left out on the server side, on purpose:
    # - GenerationService: the coordinator opens the request's root span itself, named and attributed by the GenAI
    #   conventions, continuing the client's trace context from the call's metadata.
    # - the workers' session streams (Draft, Verify): one span would cover a whole request, the per-message spans
    #   (prefill, draft.propose, target.verify, kv.rollback) carry the worker side, and grpc.aio finalizes a
    #   cancelled stream's handler in another context, which makes the interceptor log "Failed to detach context"
    #   (open-telemetry/opentelemetry-python-contrib#2357).
    # The coordinator's channels to the workers are not instrumented either: grpc.aio's interceptor wrapper sends
    # every message of a stream through a queue and a task of its own (two more event-loop hand-offs per message,
    # on the path of every round), and the round's `draft` and `verify` spans already cover each exchange.
    untraced = filters.any_of(
        filters.health_check(),
        filters.service_prefix("grpc.reflection"),
        filters.service_name("specdec.v1.GenerationService"),
        filters.full_method_name("/specdec.v1.DraftService/Draft"),
        filters.full_method_name("/specdec.v1.TargetService/Verify"),
    )
    GrpcAioInstrumentorServer(filter_=filters.negate(untraced)).instrument()


def shutdown_telemetry() -> None:
    """Flushes what is still buffered (spans of the last requests) before the process exits."""
    for provider in (trace.get_tracer_provider(), metrics.get_meter_provider()):
        shutdown = getattr(provider, "shutdown", None)
        if shutdown:
            try:
                shutdown()
            except Exception:  # noqa: BLE001 - an exporter that cannot flush must not block the exit
                log.warning("telemetry shutdown failed", exc_info=True)


# A proxy that follows the provider setup_telemetry installs later: spans on the hot path need no look-up each time.
_TRACER = trace.get_tracer(TRACER_NAME)


def tracer() -> trace.Tracer:
    return _TRACER


def meter() -> metrics.Meter:
    return metrics.get_meter(TRACER_NAME)


def current_trace_context() -> dict[str, str]:
    """The W3C trace context (traceparent, tracestate) of the current span, to put in a stream message."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return carrier


def context_from(carrier) -> Context:
    return propagate.extract(dict(carrier))


def call_in_context(parent: Context | None, fn, *args):
    """Runs fn with parent as the current trace context, so that the spans it opens are parent's children."""
    token = otel_context.attach(parent) if parent is not None else None
    try:
        return fn(*args)
    finally:
        if token is not None:
            otel_context.detach(token)


async def run_traced(executor, carrier, fn, *args):
    """Runs fn on the executor thread under the trace context a stream message carried."""
    parent = context_from(carrier) if carrier else None
    return await asyncio.get_running_loop().run_in_executor(executor, functools.partial(call_in_context, parent, fn, *args))
