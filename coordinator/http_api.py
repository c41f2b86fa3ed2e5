"""The OpenAI-compatible HTTP API: GET /v1/models, POST /v1/completions and POST /v1/chat/completions, beside
GenerationService in the coordinator's event loop (FastAPI on uvicorn).

A thin translation, as coordinator.server is for gRPC: an OpenAI request becomes a GenerateRequest and goes through
the same checks (coordinator.requests.params_of), the same admission and the same engine; the result comes back in
OpenAI's shapes, with `usage` and specdec's per-request `speculation` figures. specdec's own knobs are extra body
fields (the openai SDK's `extra_body`): top_k, num_speculative_tokens, overlap, ignore_eos, and
speculation_by_position for acceptance per draft position.
"""

import asyncio
import contextlib
import json
import logging
import socket
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from opentelemetry import context as otel_context
from pydantic import BaseModel, Field

from common.errors import InvalidArgument, ResourceExhausted, SpecdecError, Unauthenticated, Unavailable
from coordinator.admission import Admission
from coordinator.engine import GenerationEngine
from coordinator.output import Delta
from coordinator.requests import params_of
from coordinator.types import FINISH_REASON_NAMES, GenerationResult
from specdec.v1 import generation_pb2

log = logging.getLogger("specdec.coordinator")
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the coordinator's
# The field a GenerateRequest check names, as the OpenAI request calls it.
PARAM_NAMES = {"max_new_tokens": "max_tokens", "prompt_token_ids": "prompt", "input": "prompt"}


class StreamOptions(BaseModel):
    include_usage: bool = False  # a last chunk with usage (and speculation) before [DONE]


class RequestFields(BaseModel):
    """What both endpoints take. Fields that specdec cannot honour are accepted at their neutral values only."""

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    # specdec's own
    top_k: int | None = None
    num_speculative_tokens: int | None = None
    overlap: bool | None = None
    ignore_eos: bool = False
    speculation_by_position: bool = False


class CompletionRequest(RequestFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    best_of: int | None = None
    logprobs: int | None = None
    suffix: str | None = None


class ContentPart(BaseModel):
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatCompletionRequest(RequestFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None


def refuse_unsupported(body: RequestFields) -> None:
    neutral = {
        "n": body.n == 1,
        "frequency_penalty": body.frequency_penalty == 0,
        "presence_penalty": body.presence_penalty == 0,
        "logit_bias": not body.logit_bias,
        "logprobs": not body.logprobs,
    }
    if isinstance(body, CompletionRequest):
        neutral.update(echo=not body.echo, best_of=body.best_of in (None, 1), suffix=not body.suffix)
    for field, ok in neutral.items():
        if not ok:
            raise InvalidArgument(field, "is not supported by specdec (only its default value is accepted)")
    if body.seed is not None and body.seed < 0:
        raise InvalidArgument("seed", f"must be >= 0, got {body.seed}")


def prompt_into(request: generation_pb2.GenerateRequest, prompt) -> None:
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise InvalidArgument("prompt", "takes one prompt per request")
        prompt = prompt[0]
    if isinstance(prompt, str):
        request.prompt = prompt
    else:
        request.prompt_token_ids.token_ids.extend(prompt)


def content_text(message: ChatMessage, index: int) -> str:
    if message.content is None or isinstance(message.content, str):
        return message.content or ""
    if any(part.type != "text" for part in message.content):
        raise InvalidArgument(f"messages[{index}].content", "only text parts are supported")
    return "".join(part.text or "" for part in message.content)


def generate_request_of(
    body: CompletionRequest | ChatCompletionRequest, default_max_tokens: int | None
) -> generation_pb2.GenerateRequest:
    """The GenerateRequest an OpenAI request stands for."""
    refuse_unsupported(body)
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    request = generation_pb2.GenerateRequest(stop=stop, ignore_eos=body.ignore_eos)
    max_tokens = next(
        (v for v in (getattr(body, "max_completion_tokens", None), body.max_tokens, default_max_tokens) if v is not None), None
    )
    optional = {
        "max_new_tokens": max_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "top_k": body.top_k,
        "seed": body.seed,
        "num_speculative_tokens": body.num_speculative_tokens,
        "overlap": body.overlap,
    }
    for name, value in optional.items():
        if value is not None:
            setattr(request, name, value)
    if isinstance(body, ChatCompletionRequest):
        request.messages.messages.extend(
            generation_pb2.ChatMessage(role=m.role, content=content_text(m, i)) for i, m in enumerate(body.messages)
        )
    else:
        prompt_into(request, body.prompt)
    return request


def speculation_of(result: GenerationResult, by_position: bool) -> dict:
    speculation = {
        "drafted_tokens": result.drafted_tokens,
        "accepted_tokens": result.accepted_tokens,
        "acceptance_rate": result.acceptance_rate,
        "rounds": len(result.rounds),
        "mean_tokens_per_round": result.mean_tokens_per_round,
        "num_speculative_tokens": result.num_speculative_tokens,
        "fallback_reason": result.fallback_reason,
    }
    if by_position:
        drafted, accepted = Counter(), Counter()
        for stats in result.rounds:
            drafted.update(range(1, stats.drafted + 1))
            accepted.update(range(1, stats.accepted + 1))
        speculation["by_position"] = [
            {"position": p, "drafted": drafted[p], "accepted": accepted[p], "acceptance_rate": accepted[p] / drafted[p]}
            for p in sorted(drafted)
        ]
    return speculation


def usage_of(result: GenerationResult) -> dict:
    completion = len(result.token_ids)
    return {
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": result.prompt_tokens + completion,
    }


class Completion:
    """The envelope of one response: its id, creation time, model and kind (chat or text completion)."""

    def __init__(self, chat: bool, model: str, by_position: bool):
        self.chat, self.model, self.by_position = chat, model, by_position
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def envelope(self, chunk: bool) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def choice(self, text: str, finish_reason: str | None, chunk: bool, first: bool = False) -> dict:
        if not self.chat:
            return {"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}
        if chunk:
            delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
            return {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}
        return {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish_reason, "logprobs": None}

    def whole(self, result: GenerationResult) -> dict:
        finish = FINISH_REASON_NAMES.get(result.finish_reason)
        return {
            **self.envelope(chunk=False),
            "choices": [self.choice(result.text, finish, chunk=False)],
            "usage": usage_of(result),
            "speculation": speculation_of(result, self.by_position),
        }

    def chunk(self, text: str, finish_reason: str | None = None, first: bool = False) -> dict:
        return {**self.envelope(chunk=True), "choices": [self.choice(text, finish_reason, chunk=True, first=first)]}

    def usage_chunk(self, result: GenerationResult) -> dict:
        return {
            **self.envelope(chunk=True),
            "choices": [],
            "usage": usage_of(result),
            "speculation": speculation_of(result, self.by_position),
        }


def sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


ERROR_STATUS = {
    InvalidArgument: (400, "invalid_request_error"),
    Unauthenticated: (401, "authentication_error"),
    ResourceExhausted: (429, "rate_limit_error"),
    Unavailable: (503, "service_unavailable_error"),
}


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(error: Exception) -> JSONResponse:
    """An engine error in OpenAI's error shape with the matching status; anything unexpected is a logged 500."""
    status, kind = ERROR_STATUS.get(type(error), (500, "internal_error"))
    if status == 500:
        log.exception("internal error", exc_info=error)
    param = PARAM_NAMES.get(error.field, error.field) if isinstance(error, InvalidArgument) else None
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return JSONResponse(error_body(str(error) or type(error).__name__, kind, param), status_code=status, headers=headers)


class EventStream(StreamingResponse):
    """Server-sent events whose end, however it comes (the last event, an error, the client gone), runs on_close:
    the engine's generator closes (freeing both sessions at once) and the request slot is given back."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable):
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.on_close()


def build_app(engine: GenerationEngine, admission: Admission) -> FastAPI:
    app = FastAPI(title="specdec", summary="OpenAI-compatible API over speculative decoding", docs_url=None, redoc_url=None)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, error: RequestValidationError) -> JSONResponse:
        first = error.errors()[0]
        where = [str(part) for part in first["loc"] if part != "body"]
        param = ".".join(where) if where else None
        return JSONResponse(error_body(f"{param or 'body'}: {first['msg']}", "invalid_request_error", param), status_code=400)

    def authenticate(request: Request) -> None:
        admission.authenticate(request.headers.get("authorization"), "the header 'Authorization: Bearer <token>'")

    def check_model(model: str) -> JSONResponse | None:
        if model != engine.target.model_name:
            message = f"The model '{model}' does not exist; this deployment serves '{engine.target.model_name}'"
            return JSONResponse(error_body(message, "invalid_request_error", "model", "model_not_found"), status_code=404)
        return None

    @app.get("/v1/models")
    async def models(request: Request):
        try:
            authenticate(request)
        except SpecdecError as error:
            return error_response(error)
        model = {"id": engine.target.model_name, "object": "model", "created": 0, "owned_by": "specdec"}
        return {"object": "list", "data": [model]}

    async def complete(request: Request, body: CompletionRequest | ChatCompletionRequest, chat: bool, default_max_tokens):
        slot = contextlib.ExitStack()
        try:
            authenticate(request)
            if (missing := check_model(body.model)) is not None:
                return missing
            generate_request = generate_request_of(body, default_max_tokens)
            slot.enter_context(admission.slot())
            params = params_of(generate_request, engine.tokenizer, engine.config)
            completion = Completion(chat, engine.target.model_name, body.speculation_by_position)
            # FastAPI's own telemetry opens the HTTP server span, continuing the caller's traceparent; the GenAI
            # request span, with its rounds, goes below it.
            events = engine.generate(params, otel_context.get_current())
            if not body.stream:
                return await whole_response(request, events, completion, slot)
            # The first event comes before the response starts, so that a request that fails at once (no worker,
            # a bad prompt) gets its own status rather than an error inside a 200 stream.
            first = await anext(events)
        except Exception as error:  # noqa: BLE001 - every failure becomes an OpenAI-shaped error, never a crash
            slot.close()
            return error_response(error)

        async def close() -> None:
            await events.aclose()
            slot.close()

        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return EventStream(stream_events(first, events, completion, include_usage), close)

    @app.post("/v1/completions")
    async def completions(request: Request, body: CompletionRequest):
        return await complete(request, body, chat=False, default_max_tokens=COMPLETIONS_DEFAULT_MAX_TOKENS)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request, body: ChatCompletionRequest):
        return await complete(request, body, chat=True, default_max_tokens=None)

    return app


async def whole_response(request: Request, events, completion: Completion, slot: contextlib.ExitStack):
    """Runs the request to its end; a client that disconnects meanwhile stops it within a round (499)."""
    task = asyncio.ensure_future(last_event(events))
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=0.25)
            if not task.done() and await request.is_disconnected():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                return JSONResponse(error_body("client closed the request", "client_closed_request"), status_code=499)
        result = task.result()
    finally:
        if not task.done():
            task.cancel()
        await events.aclose()
        slot.close()
    return JSONResponse(completion.whole(result))


async def last_event(events):
    async for event in events:
        if isinstance(event, GenerationResult):
            return event
    raise RuntimeError("generation ended without a result")


async def stream_events(first, events, completion: Completion, include_usage: bool) -> AsyncIterator[str]:
    """The SSE body: a chunk per committed delta, the finish reason, then usage if asked, then [DONE]. An error
    after the stream began is sent as an error event (the status line is gone by then)."""
    opened = False
    event = first
    try:
        while True:
            if isinstance(event, Delta):
                if event.text or not opened:
                    yield sse(completion.chunk(event.text, first=not opened))
                    opened = True
            else:
                finish = FINISH_REASON_NAMES.get(event.finish_reason)
                yield sse(completion.chunk("", finish, first=not opened))
                if include_usage:
                    yield sse(completion.usage_chunk(event))
                break
            event = await anext(events)
    except Exception as error:  # noqa: BLE001 - reported in the stream
        status, kind = ERROR_STATUS.get(type(error), (500, "internal_error"))
        if status == 500:
            log.exception("internal error", exc_info=error)
        yield sse(error_body(str(error) or type(error).__name__, kind))
    yield sse("[DONE]")


class HttpServer(uvicorn.Server):
    """uvicorn in the coordinator's event loop: the coordinator owns SIGTERM and the drain (common.server), so
    uvicorn installs no signal handlers of its own; `stop()` ends it once the drain is over."""

    def capture_signals(self):
        return contextlib.nullcontext()

    async def stop(self) -> None:
        self.should_exit = True


async def start_http(app: FastAPI, host: str, port: int, tls=None) -> tuple[HttpServer, int, asyncio.Task]:
    """Binds host:port (0: any free port) and serves the app on it in this event loop; returns the port bound."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    tls_options = {"ssl_certfile": tls.cert, "ssl_keyfile": tls.key} if tls is not None and tls.enabled else {}
    config = uvicorn.Config(app, log_level="warning", lifespan="off", timeout_graceful_shutdown=5, **tls_options)
    server = HttpServer(config)
    task = asyncio.ensure_future(server.serve(sockets=[sock]))
    while not server.started and not task.done():
        await asyncio.sleep(0.01)
    if task.done():
        task.result()  # raises what stopped it
    return server, sock.getsockname()[1], task
