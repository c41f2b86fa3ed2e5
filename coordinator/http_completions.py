"""What both completion endpoints do: check the model, admit the request, run it on the engine (each of its
choices), and answer with the whole completion or a stream of its chunks."""

import asyncio
import contextlib
import logging
from dataclasses import replace

from fastapi import Request
from fastapi.responses import JSONResponse
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind

from specdec.coordinator.admission import Admission
from specdec.coordinator.config import HttpSettings
from specdec.coordinator.engine import GenerationEngine
from specdec.coordinator.requests import params_of
from specdec.coordinator.types import GenerationParams, GenerationResult

from specdec.coordinator.http_errors import ClientClosed, ModelNotFound, error_response
from specdec.coordinator.http_responses import Completion
from specdec.coordinator.http_schema import ChatCompletionRequest, CompletionRequest
from specdec.coordinator.http_streaming import EventStream, before_deadline, merged, release, stream_events
from specdec.coordinator.http_translate import Tools, choice_params, choices_of, echo_text, generate_request_of, render_tool_chat

log = logging.getLogger("specdec.coordinator")
DISCONNECT_POLL_SECONDS = 0.25  # how often a whole (non-streamed) request checks that its client is still there


def request_context(request: Request) -> otel_context.Context:
    """The trace context the request's GenAI span goes under: the HTTP server span FastAPI opened, continuing the
    caller's traceparent; or, when this process exports no traces (FastAPI then opens none), the traceparent itself,
    which the workers' calls carry on."""
    current = otel_context.get_current()
    if trace.get_current_span(current).get_span_context().is_valid:
        return current
    return propagate.extract(request.headers)


class CompletionHandler:
    """What both completion endpoints do: check the model, admit the request, run it on the engine, and answer
    with the whole completion or a stream of its chunks."""

    def __init__(self, engine: GenerationEngine, admission: Admission, http: HttpSettings):
        self.engine, self.admission, self.http = engine, admission, http

    async def complete(self, request: Request, body: CompletionRequest | ChatCompletionRequest, chat: bool, default_max_tokens):
        engine, http = self.engine, self.http
        if body.model != engine.target.model_name:
            return error_response(ModelNotFound(body.model, engine.target.model_name))
        slot, events, handed_off, admitted = contextlib.ExitStack(), None, False, False
        try:
            tools = Tools(body, engine.tokenizer)
            generate_request = generate_request_of(body, default_max_tokens, tools)
            if chat and not generate_request.WhichOneof("input"):
                ids = await asyncio.to_thread(render_tool_chat, body, tools, engine.tokenizer)
                generate_request.prompt_token_ids.token_ids.extend(ids)
            slot.enter_context(self.admission.slot())
            admitted = True
            params = await params_of(generate_request, engine.tokenizer, engine.config)
            if chat:  # a chat rendered here (with tools) reaches the engine as token ids: still a chat in the metrics
                params = replace(params, operation="chat")
            echo = echo_text(body, params, engine.tokenizer)
            completion = Completion(
                chat, engine.target.model_name, bool(body.speculation_by_position), engine.tokenizer, params, echo, tools
            )
            # Under FastAPI's HTTP server span: the span of a request that arrived over HTTP, not the server's own.
            limit, context = http.http_request_timeout, request_context(request)
            choices = choice_params(params, choices_of(body))
            # Choices that score the prompt compute all of it themselves: nothing to prefill for them.
            if len(choices) > 1 and engine.target.prefix_cache_tokens and not params.prompt_logprobs:
                await prefill_once(engine, params, context, limit)
            events = merged(
                [before_deadline(engine.generate(choice, context, limit, kind=SpanKind.INTERNAL), limit) for choice in choices]
            )
            if not body.stream:
                handed_off = True
                return await whole_response(request, events, completion, slot, body)
            # The first event comes before the response starts, so that a request that fails at once (no worker,
            # a bad prompt) gets its own status rather than an error inside a 200 stream.
            first = await anext(events)
            handed_off = True
        except Exception as error:  # noqa: BLE001 - every failure becomes an OpenAI-shaped error, never a crash
            return error_response(error, body, admitted)
        finally:
            if not handed_off:
                await release(events, slot)

        async def close() -> None:
            await release(events, slot)

        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return EventStream(stream_events(first, events, completion, include_usage), close, http.http_stall_timeout)


async def prefill_once(engine: GenerationEngine, params: GenerationParams, context, limit: float) -> None:
    """n choices of one prompt prefill it once: a request that only prefills it (max_new_tokens 0) leaves its keys
    and values in the target's prefix cache as it closes, and each choice's session starts from a copy of them. Only
    where the target keeps a prefix cache (elsewhere this would be one prefill more)."""
    only_prefill = replace(params, max_new_tokens=0, num_speculative_tokens=0, logprobs=None, prompt_logprobs=False)
    events = before_deadline(engine.generate(only_prefill, context, limit, kind=SpanKind.INTERNAL), limit)
    async with contextlib.aclosing(events):
        async for _ in events:
            pass


async def whole_response(request: Request, events, completion: Completion, slot: contextlib.ExitStack, body):
    """Runs the request to its end; a client that disconnects meanwhile stops it (answered 499, which nobody reads)."""
    task = asyncio.ensure_future(results_of(events))
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=DISCONNECT_POLL_SECONDS)
            if not task.done() and await request.is_disconnected():
                log.info("client closed the request (499)")
                task.cancel()
                break
        await asyncio.gather(task, return_exceptions=True)
        if task.cancelled():
            return error_response(ClientClosed(), body, admitted=True)
        if task.exception() is not None:
            return error_response(task.exception(), body, admitted=True)
        return JSONResponse(completion.whole(task.result()))
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)  # the generator is not running when it is closed
        await release(events, slot)


async def results_of(events) -> list[GenerationResult]:
    """Each choice's result, in order of the choices."""
    results: dict[int, GenerationResult] = {}
    async for index, event in events:
        if isinstance(event, GenerationResult):
            results[index] = event
    if not results or sorted(results) != list(range(len(results))):
        raise RuntimeError("generation ended without a result")
    return [results[i] for i in range(len(results))]
