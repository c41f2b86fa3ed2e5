"""The request's trace: a root span named by the GenAI conventions, a `speculate` span per round with `draft` and
`verify` children, whose contexts travel to the workers so that their spans join the same trace. Spans are started
and ended explicitly (never attached as the current context) because the request loop is an async generator that
yields between rounds."""

import contextlib

from opentelemetry import trace
from opentelemetry.context import Context

from specdec.common.telemetry import tracer
from specdec.coordinator.finish_reasons import FINISH_REASON_NAMES
from specdec.coordinator.round import Phase
from specdec.coordinator.types import GenerationParams, GenerationResult
from specdec.coordinator.workers import WorkerInfo

PROVIDER = "specdec"


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


def request_attributes(params: GenerationParams, target: WorkerInfo, draft: WorkerInfo | None, address: str, port: int) -> dict:
    """The root span's attributes of a request as it starts (address, port: where the server reaches clients)."""
    sampling = params.sampling
    attributes = {
        "gen_ai.operation.name": params.operation,
        "gen_ai.provider.name": PROVIDER,
        "gen_ai.request.model": target.model_name,
        "gen_ai.request.temperature": sampling.temperature,
        "gen_ai.request.top_p": sampling.top_p,
        "gen_ai.request.top_k": sampling.top_k,
        "gen_ai.request.max_tokens": params.max_new_tokens,
        "gen_ai.usage.input_tokens": len(params.prompt_token_ids),
        "server.address": address,
        "server.port": port,
        "specdec.draft.model": draft.model_name if draft else "",
        "specdec.gamma": params.num_speculative_tokens,
    }
    if sampling.seed is not None:
        attributes["gen_ai.request.seed"] = sampling.seed
    return attributes


def finished_attributes(result: GenerationResult, model_name: str, reopened_sessions: int) -> dict:
    """The root span's attributes of the finished request (reopened_sessions: of the target, after failures)."""
    return {
        "gen_ai.usage.output_tokens": len(result.token_ids),
        "specdec.cached_prompt_tokens": result.cached_prompt_tokens,
        "gen_ai.response.finish_reasons": [FINISH_REASON_NAMES.get(result.finish_reason, "unknown")],
        "gen_ai.response.model": model_name,
        **{f"specdec.{name}": value for name, value in result.speculation_stats().items()},
        "specdec.target.reopened_sessions": reopened_sessions,
        **result.time_split.attributes("specdec.time"),
    }
