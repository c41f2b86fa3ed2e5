"""The request's trace: a root span named by the GenAI conventions, a `speculate` span per round with `draft` and
`verify` children, whose contexts travel to the workers so that their spans join the same trace. Spans are started
and ended explicitly (never attached as the current context) because the request loop is an async generator that
yields between rounds."""

import contextlib

from opentelemetry import trace
from opentelemetry.context import Context

from common.telemetry import tracer
from coordinator.round import Phase


def span_context(span: trace.Span) -> Context:
    return trace.set_span_in_context(span)


@contextlib.contextmanager
def child_span(name: str, parent: Context, **attributes):
    """A span under parent; its context is what the worker calls of this phase carry."""
    span = tracer().start_span(name, context=parent, attributes=attributes or None)
    try:
        yield span_context(span)
    finally:
        span.end()


def phases_under(round_span: trace.Span) -> Phase:
    """The round's phases (draft, verify) as child spans of its `speculate` span."""
    parent = span_context(round_span)

    def phase(name: str, gamma: int, overlapped: bool):
        if not overlapped:
            return child_span(name, parent)
        return child_span(name, parent, **{"specdec.overlapped": True, "specdec.gamma": gamma})

    return phase
