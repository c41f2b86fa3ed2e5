"""The OpenAI-compatible HTTP API: GET /v1/models, POST /v1/completions and POST /v1/chat/completions, beside
GenerationService in the coordinator's event loop (FastAPI on uvicorn).

A thin translation, as coordinator.server is for gRPC: an OpenAI request becomes a GenerateRequest and goes through
the same checks (coordinator.requests.params_of), the same admission and the same engine; the result comes back in
OpenAI's shapes, with `usage` and specdec's per-request `speculation` figures. specdec's own knobs are extra body
fields (the openai SDK's `extra_body`): top_k, num_speculative_tokens, overlap, ignore_eos,
speculation_by_position for acceptance per draft position, and grammar (Lark or GBNF) to constrain the output.
"""

import asyncio
import contextlib
import json
import logging
import socket
import ssl
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import replace

import anyio
import h11
import uvicorn
from llguidance.gbnf_to_lark import any_to_lark
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind
from pydantic import BaseModel, Field
from uvicorn.protocols.http.h11_impl import H11Protocol

from common.errors import DeadlineExceeded, InvalidArgument, Unauthenticated, classified
from common.grpc_options import MAX_MESSAGE_BYTES
from common.lifecycle import FINAL_STOP_SECONDS
from common.tls import TlsFiles
from coordinator.admission import Admission
from coordinator.config import HttpSettings
from coordinator.engine import GenerationEngine
from coordinator.output import Delta
from coordinator.requests import MAX_MESSAGES, params_of
from coordinator.finish_reasons import FINISH_REASON_NAMES
from coordinator.tool_calls import CallArguments, CallStart, CallStream, calls_grammar, check_tools, parse_calls, render_chat
from coordinator.types import GenerationParams, GenerationResult
from common.sampling import TokenLogprob, stream_seed
from common.tokenizer import Tokenizer

from specdec.v1 import generation_pb2

log = logging.getLogger("specdec.coordinator")
MAX_CHOICES = 16  # n
MAX_CHAT_TOP_LOGPROBS = 20  # OpenAI's limits
MAX_COMPLETION_LOGPROBS = 5
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the coordinator's
DISCONNECT_POLL_SECONDS = 0.25  # how often a whole (non-streamed) request checks that its client is still there
# OpenAI's roles that specdec renders as one of its chat roles.
ROLE_ALIASES = {"developer": "system"}


class StreamOptions(BaseModel):
    include_usage: bool | None = None  # a last chunk with usage (and speculation) before [DONE]


class RequestFields(BaseModel):
    """What both endpoints take. Fields that would change what is generated and that specdec cannot honour are
    accepted at their neutral values only (null, or the default); other unknown fields are ignored."""

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)  # OpenAI's signed 64 bits, or specdec's unsigned ones
    stop: str | list[str] | None = None
    n: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    tools: list | None = None
    tool_choice: str | dict | None = None
    functions: list | None = None
    function_call: str | dict | None = None
    response_format: dict | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's, which specdec takes too
    repetition_penalty: float | None = None
    min_p: float | None = None
    # specdec's own
    top_k: int | None = None
    num_speculative_tokens: int | None = None
    overlap: bool | None = None
    ignore_eos: bool | None = None
    speculation_by_position: bool | None = None
    grammar: str | None = None  # Lark (llguidance's dialect) or GBNF


class CompletionRequest(RequestFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool | None = None
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
    tool_calls: list[dict] | None = None
    tool_call_id: str | None = None


class ChatCompletionRequest(RequestFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None


def refuse_unsupported(body: RequestFields) -> None:
    neutral = {
        "functions": not body.functions,
        "function_call": body.function_call in (None, "none"),
    }
    if isinstance(body, CompletionRequest):
        neutral.update(best_of=body.best_of in (None, 1), suffix=not body.suffix)
        neutral.update(tools=not body.tools, tool_choice=body.tool_choice in (None, "none"))
    for field, ok in neutral.items():
        if not ok:
            raise InvalidArgument(field, "is not supported by specdec (only its default value is accepted)")


def choices_of(body: RequestFields) -> int:
    n = 1 if body.n is None else body.n
    if not 1 <= n <= MAX_CHOICES:
        raise InvalidArgument("n", f"must be in [1, {MAX_CHOICES}], got {n}")
    return n


def logprobs_of(body: RequestFields) -> int | None:
    """The alternatives per position a request asks log-probabilities with (None: no log-probabilities): chat's
    logprobs and top_logprobs, or completions' logprobs."""
    if isinstance(body, ChatCompletionRequest):
        top = body.top_logprobs
        if top is not None and not 0 <= top <= MAX_CHAT_TOP_LOGPROBS:
            raise InvalidArgument("top_logprobs", f"must be in [0, {MAX_CHAT_TOP_LOGPROBS}], got {top}")
        if top and not body.logprobs:
            raise InvalidArgument("top_logprobs", "needs logprobs: true")
        return (top or 0) if body.logprobs else None
    if body.logprobs is not None and not 0 <= body.logprobs <= MAX_COMPLETION_LOGPROBS:
        raise InvalidArgument("logprobs", f"must be in [0, {MAX_COMPLETION_LOGPROBS}], got {body.logprobs}")
    return body.logprobs


def logit_bias_into(request: generation_pb2.GenerateRequest, bias: dict[str, float] | None) -> None:
    for key, value in (bias or {}).items():
        try:
            request.logit_bias[int(key)] = value
        except (ValueError, TypeError):
            raise InvalidArgument("logit_bias", f"key {key!r} is not a token id") from None


def choice_seed(seed: int | None, index: int) -> int | None:
    """The seed of choice `index` of a request: the request's own for the first (so n = 1 and the first of n give
    the same text), one drawn from it for each other; None (fresh randomness) without a seed."""
    if seed is None or index == 0:
        return seed
    return stream_seed(seed, f"choice:{index}")


def prompt_into(request: generation_pb2.GenerateRequest, prompt) -> None:
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise InvalidArgument("prompt", "takes one prompt per request")
        prompt = prompt[0]
    if isinstance(prompt, str):
        request.prompt = prompt
        return
    try:
        request.prompt_token_ids.token_ids.extend(prompt)
    except ValueError:
        raise InvalidArgument("prompt", "token ids must be 32-bit integers") from None


def content_text(message: ChatMessage, index: int) -> str:
    if message.content is None or isinstance(message.content, str):
        return message.content or ""
    if any(part.type != "text" for part in message.content):
        raise InvalidArgument(f"messages[{index}].content", "only text parts are supported")
    return "".join(part.text or "" for part in message.content)


class Tools:
    """A chat's tools as this request uses them: its functions, the name tool_choice forces ("" for required, None
    for auto), and whether calls are parsed out of the output (not with tool_choice "none", nor without tools)."""

    def __init__(self, body: RequestFields, tokenizer=None):
        self.tokenizer = tokenizer  # for the call tags the grammar spells (coordinator.tool_calls.tag)
        tools = body.tools if isinstance(body, ChatCompletionRequest) and body.tool_choice != "none" else []
        self.functions, self.forced = check_tools(tools or [], body.tool_choice if tools else None)
        self.parallel = body.parallel_tool_calls is not False
        self.parsed = bool(self.functions)
        self.history = isinstance(body, ChatCompletionRequest) and any(m.role == "tool" or m.tool_calls for m in body.messages)

    def grammar(self) -> str:
        return calls_grammar(self.functions, self.forced, self.parallel, self.tokenizer) if self.forced is not None else ""


def constraint_of(body: RequestFields, tools: Tools) -> generation_pb2.OutputConstraint:
    """response_format, the grammar extra, or a forced tool call, as a GenerateRequest's constraint (at most one)."""
    constraints = {
        "response_format": body.response_format not in (None, {"type": "text"}),
        "grammar": body.grammar is not None,
        "tool_choice": tools.forced is not None,
    }
    given = [name for name, on in constraints.items() if on]
    if len(given) > 1:
        raise InvalidArgument(given[1], f"cannot be combined with {given[0]}: the output follows one constraint")
    if body.grammar is not None:
        try:
            return generation_pb2.OutputConstraint(lark=any_to_lark(body.grammar))
        except Exception as error:  # noqa: BLE001 - llguidance's GBNF converter raises what it meets
            raise InvalidArgument("grammar", f"neither Lark nor GBNF: {error}") from None
    if tools.forced is not None:
        return generation_pb2.OutputConstraint(lark=tools.grammar())
    kind = (body.response_format or {}).get("type", "text")
    if kind == "text":
        return generation_pb2.OutputConstraint()
    if kind == "json_object":
        return generation_pb2.OutputConstraint(json_schema='{"type": "object"}')
    if kind != "json_schema":
        raise InvalidArgument("response_format", f"unknown type {kind!r}; use text, json_object or json_schema")
    spec = body.response_format.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
        raise InvalidArgument("response_format", 'json_schema must be {"name": ..., "schema": {...}, "strict": ...}')
    schema = json.dumps(spec.get("schema", {}))
    return generation_pb2.OutputConstraint(json_schema=schema, lenient=not spec.get("strict", False))


def generate_request_of(
    body: CompletionRequest | ChatCompletionRequest, default_max_tokens: int | None, tools: Tools | None = None
) -> generation_pb2.GenerateRequest:
    """The GenerateRequest an OpenAI request stands for (a chat with tools is rendered by render_tool_chat)."""
    refuse_unsupported(body)
    choices_of(body)
    tools = tools or Tools(body)
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    logprobs = logprobs_of(body)
    # echo with logprobs: the prompt's own log-probabilities (lm-evaluation-harness's loglikelihood requests).
    prompt_logprobs = bool(getattr(body, "echo", False)) and logprobs is not None
    request = generation_pb2.GenerateRequest(stop=stop, ignore_eos=bool(body.ignore_eos), prompt_logprobs=prompt_logprobs)
    logit_bias_into(request, body.logit_bias)
    optional = {
        "min_p": body.min_p,
        "presence_penalty": body.presence_penalty,
        "frequency_penalty": body.frequency_penalty,
        "repetition_penalty": body.repetition_penalty,
        "logprobs": logprobs,
        "max_new_tokens": max_tokens_of(body, default_max_tokens),
        "temperature": body.temperature,
        "top_p": body.top_p,
        "top_k": body.top_k,
        # OpenAI's seed is a signed 64-bit integer, specdec's unsigned: the same bits.
        "seed": body.seed % 2**64 if body.seed is not None else None,
        "num_speculative_tokens": body.num_speculative_tokens,
        "overlap": body.overlap,
    }
    for name, value in optional.items():
        if value is not None:
            try:
                setattr(request, name, value)
            except ValueError:
                raise InvalidArgument(name, f"{value} is out of range") from None
    request.constraint.CopyFrom(constraint_of(body, tools))
    if isinstance(body, CompletionRequest):
        prompt_into(request, body.prompt)
    elif not (tools.functions or tools.history):  # else rendered with its tools by render_tool_chat
        request.messages.messages.extend(
            generation_pb2.ChatMessage(role=ROLE_ALIASES.get(m.role, m.role), content=content_text(m, i))
            for i, m in enumerate(body.messages)
        )
    return request


def render_tool_chat(body: ChatCompletionRequest, tools: Tools, tokenizer) -> list[int]:
    """A chat with tools (or with tool calls and results in its history) rendered through the model's template."""
    if len(body.messages) > MAX_MESSAGES:
        raise InvalidArgument("messages", f"at most {MAX_MESSAGES} messages, got {len(body.messages)}")
    messages = [
        {"role": ROLE_ALIASES.get(m.role, m.role), "content": content_text(m, i), "tool_calls": m.tool_calls}
        for i, m in enumerate(body.messages)
    ]
    return render_chat(tokenizer, messages, tools.functions)


def max_tokens_of(body: RequestFields, default: int | None) -> int | None:
    given = [v for v in (getattr(body, "max_completion_tokens", None), body.max_tokens) if v is not None]
    return given[0] if given else default


def param_of(field: str, body: RequestFields | None) -> str:
    """The name the client used for the field a check named."""
    if field == "max_new_tokens":
        return "max_completion_tokens" if getattr(body, "max_completion_tokens", None) is not None else "max_tokens"
    if field.startswith("stop[") and isinstance(getattr(body, "stop", None), str):
        return "stop"
    if field == "logprobs" and isinstance(body, ChatCompletionRequest):
        return "top_logprobs"
    if field.startswith("constraint"):  # the caller's field the constraint came from
        return "grammar" if getattr(body, "grammar", None) is not None else "response_format" if body.response_format else "tools"
    return {"prompt_token_ids": "prompt", "input": "prompt", "prompt_logprobs": "echo"}.get(field, field)


def speculation_of(results: list[GenerationResult], by_position: bool) -> dict:
    """specdec's figures of a request, summed over its choices."""
    drafted = sum(r.drafted_tokens for r in results)
    accepted = sum(r.accepted_tokens for r in results)
    rounds = sum(len(r.rounds) for r in results)
    speculation = {
        "drafted_tokens": drafted,
        "accepted_tokens": accepted,
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "rounds": rounds,
        "mean_tokens_per_round": sum(r.mean_tokens_per_round * len(r.rounds) for r in results) / rounds if rounds else 0.0,
        "num_speculative_tokens": results[0].num_speculative_tokens,
        "fallback_reason": next((r.fallback_reason for r in results if r.fallback_reason), ""),
    }
    if by_position:
        drafted_at, accepted_at = Counter(), Counter()
        for result in results:
            for p, d, a in result.by_position():
                drafted_at[p] += d
                accepted_at[p] += a
        speculation["by_position"] = [
            {"position": p, "drafted": d, "accepted": accepted_at[p], "acceptance_rate": accepted_at[p] / d}
            for p, d in sorted(drafted_at.items())
        ]
    return speculation


def usage_of(results: list[GenerationResult]) -> dict:
    completion = sum(len(r.token_ids) for r in results)
    prompt = results[0].prompt_tokens
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": results[0].cached_prompt_tokens},
    }


class LogprobsFormat:
    """Token log-probabilities in OpenAI's shapes: chat's `content` list, or completions' parallel lists."""

    def __init__(self, tokenizer: Tokenizer, chat: bool):
        self.tokenizer, self.chat = tokenizer, chat

    def token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def chat_entry(self, token_id: int, logprob: float) -> dict:
        return {"token": self.token(token_id), "logprob": logprob, "bytes": list(self.tokenizer.token_bytes(token_id))}

    def chat_content(self, token_ids: list[int], entries: list[TokenLogprob]) -> dict:
        return {
            "content": [
                {
                    **self.chat_entry(token, entry.logprob),
                    "top_logprobs": [self.chat_entry(t, lp) for t, lp in zip(entry.top_ids, entry.top_logprobs, strict=True)],
                }
                for token, entry in zip(token_ids, entries, strict=True)
            ]
        }

    def completion_lists(self, token_ids: list[int], entries: list[TokenLogprob | None], offset: int) -> dict:
        """entries: None where a token has none (the prompt's first); offset: where the first token's text begins
        in the choice's text. Each position's top_logprobs holds its own token too, as vLLM's do (an eval harness
        checks that a token was the likeliest by comparing it with their maximum)."""
        tokens, top, offsets = [], [], []
        for token, entry in zip(token_ids, entries, strict=True):
            text = self.token(token)
            tokens.append(text)
            offsets.append(offset)
            offset += len(text)
            if entry is None:
                top.append(None)
                continue
            alternatives = {self.token(t): lp for t, lp in zip(entry.top_ids, entry.top_logprobs, strict=True)}
            top.append(alternatives | {text: entry.logprob} if text not in alternatives else alternatives)
        return {
            "tokens": tokens,
            "token_logprobs": [None if e is None else e.logprob for e in entries],
            "top_logprobs": top,
            "text_offset": offsets,
        }


class Completion:
    """The envelope of one response: its id, creation time, model and kind (chat or text completion), and how its
    choices are told (their log-probabilities; with echo, the prompt before each choice's text)."""

    def __init__(
        self,
        chat: bool,
        model: str,
        by_position: bool,
        tokenizer: Tokenizer | None = None,
        params: GenerationParams | None = None,
        echo: str | None = None,
        tools: Tools | None = None,
    ):
        self.chat, self.model, self.by_position = chat, model, by_position
        self.tools = tools if tools is not None and tools.parsed else None  # calls are parsed out of the output
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.logprobs = params is not None and params.logprobs is not None
        self.format = LogprobsFormat(tokenizer, chat) if self.logprobs else None
        self.echo = echo  # the prompt's text, which a completion's choices begin with (None: no echo)
        self.prompt_ids = params.prompt_token_ids if params is not None else []
        self.offsets: dict[int, int] = {}  # per streamed choice: the length of its text so far

    def envelope(self, chunk: bool) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def echoed(self, prompt_logprobs: list[TokenLogprob]) -> tuple[list[int], list[TokenLogprob | None]]:
        """The prompt's tokens and their entries (none for the first), where a completion echoes them."""
        if self.echo is None or not self.logprobs:
            return [], []
        return self.prompt_ids, [None, *prompt_logprobs]

    def logprobs_of(self, token_ids: list[int], entries: list[TokenLogprob], prompt: tuple = ([], []), offset: int = 0):
        if not self.logprobs:
            return None
        if self.chat:
            return self.format.chat_content(token_ids, entries)
        return self.format.completion_lists([*prompt[0], *token_ids], [*prompt[1], *entries], offset)

    def choice(self, index: int, text: str, finish_reason: str | None, chunk: bool, first: bool = False, logprobs=None) -> dict:
        if not self.chat:
            return {"index": index, "text": text, "finish_reason": finish_reason, "logprobs": logprobs}
        if chunk:
            delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
            return {"index": index, "delta": delta, "finish_reason": finish_reason, "logprobs": logprobs}
        message = {"role": "assistant", "content": text}
        return {"index": index, "message": message, "finish_reason": finish_reason, "logprobs": logprobs}

    def calls_of(self, text: str) -> tuple[str | None, list[dict]]:
        if self.tools is None:
            return text, []
        return parse_calls(text, {f["name"] for f in self.tools.functions}, self.tools.parallel)

    def whole(self, results: list[GenerationResult]) -> dict:
        choices = []
        for index, result in enumerate(results):
            prompt = self.echoed(result.prompt_logprobs)
            logprobs = self.logprobs_of(result.token_ids, result.logprobs, prompt)
            text = (self.echo or "") + result.text
            finish = FINISH_REASON_NAMES.get(result.finish_reason)
            choice = self.choice(index, text, finish, False, logprobs=logprobs)
            content, calls = self.calls_of(result.text)
            if calls:  # an output cut at max_tokens says so, whatever calls it completed before
                choice.update(message={"role": "assistant", "content": content, "tool_calls": calls})
                choice["finish_reason"] = "length" if finish == "length" else "tool_calls"
            choices.append(choice)
        return {
            **self.envelope(chunk=False),
            "choices": choices,
            "usage": usage_of(results),
            "speculation": speculation_of(results, self.by_position),
        }

    def chunk(
        self,
        index: int,
        text: str,
        finish_reason: str | None = None,
        first: bool = False,
        delta: Delta | None = None,
        prompt_logprobs: list[TokenLogprob] | None = None,
    ) -> dict:
        """A chunk of choice `index`: its text and, when asked for, the log-probabilities of delta's tokens; a first
        chunk with echo begins with the prompt (and its log-probabilities: prompt_logprobs)."""
        logprobs = None
        echoed = first and self.echo is not None
        text = (self.echo if echoed else "") + text
        if self.logprobs and (delta is not None or echoed):
            prompt = self.echoed(prompt_logprobs or []) if echoed else ([], [])
            tokens, entries = (delta.token_ids, delta.logprobs) if delta is not None else ([], [])
            offset = 0 if echoed else self.offsets.get(index, 0) + len(text) - len(delta.text)
            logprobs = self.logprobs_of(tokens, entries, prompt, offset)
        self.offsets[index] = self.offsets.get(index, 0) + len(text)
        return {**self.envelope(chunk=True), "choices": [self.choice(index, text, finish_reason, True, first, logprobs)]}

    def call_stream(self) -> CallStream:
        return CallStream({f["name"] for f in self.tools.functions}, self.tools.parallel)

    def tool_chunks(self, index: int, events: list, first: bool, delta: Delta | None = None) -> list[dict]:
        """Chunks of choice `index` with tools, from what its CallStream told of a delta (`events`): content as
        delta.content; a call's start as delta.tool_calls with its index, id, type, name and its arguments so far;
        its arguments' further pieces as delta.tool_calls with the index and function.arguments only (the pieces
        a client appends). The delta's log-probabilities go with the first chunk (alone if it tells nothing yet)."""
        deltas: list[dict] = []
        for event in events:
            if isinstance(event, CallStart):
                function = {"name": event.name, "arguments": ""}
                deltas.append({"tool_calls": [{"index": event.index, "id": event.id, "type": "function", "function": function}]})
            elif isinstance(event, CallArguments):
                last = deltas[-1]["tool_calls"][0] if deltas and "tool_calls" in deltas[-1] else None
                if last is not None and last["index"] == event.index:
                    last["function"]["arguments"] = last["function"].get("arguments", "") + event.text
                else:
                    deltas.append({"tool_calls": [{"index": event.index, "function": {"arguments": event.text}}]})
            else:
                deltas.append({"content": event})
        logprobs = self.logprobs_of(delta.token_ids, delta.logprobs) if delta is not None and delta.logprobs else None
        if not deltas and (first or logprobs):
            deltas.append({})
        chunks = []
        for i, piece in enumerate(deltas):
            if first and i == 0:
                piece = {"role": "assistant", "content": None, **piece}
            choice = {"index": index, "delta": piece, "finish_reason": None, "logprobs": logprobs if i == 0 else None}
            chunks.append({**self.envelope(chunk=True), "choices": [choice]})
        return chunks

    def last_tool_chunk(self, index: int, calls: int, finish_reason: str | None) -> dict:
        """The finish of choice `index` with tools: tool_calls if it made calls (unless cut at max_tokens)."""
        if calls and finish_reason != "length":
            finish_reason = "tool_calls"
        return self.chunk(index, "", finish_reason)

    def usage_chunk(self, results: list[GenerationResult]) -> dict:
        return {
            **self.envelope(chunk=True),
            "choices": [],
            "usage": usage_of(results),
            "speculation": speculation_of(results, self.by_position),
        }


def sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


async def release(events, slot: contextlib.ExitStack) -> None:
    """Closes the engine's generator (its sessions with it) and gives the request slot back, whatever happens."""
    try:
        if events is not None:
            await events.aclose()
    finally:
        slot.close()


def error_response(error: Exception, body: RequestFields | None = None, admitted: bool = False) -> JSONResponse:
    """An engine error in OpenAI's error shape with the matching status; anything unexpected is a logged 500.

    admitted: the request ran, and the coordinator already spent its own retries on the workers: the openai SDK is
    told not to retry it (it honours x-should-retry). A refusal at admission while draining closes the connection,
    so that a retry goes out on a new one, which a load balancer may send to another coordinator."""
    error_status, message = classified(error)  # common.errors.ERROR_STATUS: the rule gRPC's statuses follow too
    status, kind = error_status.http_status, error_status.openai_type
    param = None
    if isinstance(error, InvalidArgument):
        # The check names the engine's field; the caller is told the name it sent (max_tokens, not max_new_tokens).
        param = param_of(error.field, body)
        if param != error.field and message.startswith(f"{error.field}:"):
            message = param + message[len(error.field) :]
    headers = {}
    if status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    elif status == 429:
        headers["Retry-After"] = "1"
    elif status >= 500:
        headers["x-should-retry"] = "false" if admitted else "true"
        if not admitted:
            headers["Connection"] = "close"
    return JSONResponse(error_body(message, kind, param), status_code=status, headers=headers)


class EventStream(StreamingResponse):
    """Server-sent events that end, however they end (the last event, an error, the client gone, the client not
    reading), with on_close: the engine's generator closes, freeing both sessions at once, and the request slot is
    given back.

    The client's disconnect is listened for whatever ASGI version the server speaks, so that it stops the request
    within a round rather than at the next event that fails to send. A client that stops reading leaves the
    connection open while the server's buffers fill and a send waits: after stall_timeout seconds of one send
    waiting, the stream is cancelled."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable, stall_timeout: float):
        super().__init__(
            content, media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        )
        self.on_close = on_close
        self.stall_timeout = stall_timeout

    async def __call__(self, scope, receive, send) -> None:
        async def send_unless_stalled(message) -> None:
            with anyio.fail_after(self.stall_timeout):
                await send(message)

        try:
            async with anyio.create_task_group() as group:

                async def stream() -> None:
                    try:
                        await self.stream_response(send_unless_stalled)
                    except TimeoutError:
                        log.info("client stopped reading its stream for %.0f s: cancelled", self.stall_timeout)
                    group.cancel_scope.cancel()

                group.start_soon(stream)
                await self.listen_for_disconnect(receive)
                group.cancel_scope.cancel()
        finally:
            await self.on_close()


def request_context(request: Request) -> otel_context.Context:
    """The trace context the request's GenAI span goes under: the HTTP server span FastAPI opened, continuing the
    caller's traceparent; or, when this process exports no traces (FastAPI then opens none), the traceparent itself,
    which the workers' calls carry on."""
    current = otel_context.get_current()
    if trace.get_current_span(current).get_span_context().is_valid:
        return current
    return propagate.extract(request.headers)


def param_from_location(location: tuple) -> str | None:
    """The field a body validation error is about, without pydantic's union member tags (e.g. 'stop.str')."""
    parts = [part for part in location[1:] if isinstance(part, int) or ("[" not in part and part not in TYPE_TAGS)]
    if not parts or isinstance(parts[0], int):  # malformed JSON: the location is a byte offset
        return None
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in parts).lstrip(".")


TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


class AuthenticateFirst:
    """Checks the bearer token before the body is read: an unauthenticated client gets 401 without the coordinator
    reading (or describing the schema of) what it sent."""

    def __init__(self, app, admission: Admission):
        self.app, self.admission = app, admission

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            headers = dict(scope["headers"])
            presented = headers.get(b"authorization", b"").decode("latin-1")
            try:
                self.admission.authenticate(presented, "the header 'Authorization: Bearer <token>'")
            except Unauthenticated as error:
                await error_response(error)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(engine: GenerationEngine, admission: Admission, http: HttpSettings | None = None) -> FastAPI:
    app = FastAPI(
        title="specdec",
        summary="OpenAI-compatible API over speculative decoding",
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
        max_body_size=MAX_MESSAGE_BYTES,  # the gRPC API's message limit
        # The HTTP server span, continuing the caller's traceparent, from the providers this process set up
        # (common.telemetry); no providers or exporters of FastAPI's own, no span per endpoint function.
        telemetry={"auto_configure": False, "operation_spans": False},
    )
    app.add_middleware(AuthenticateFirst, admission=admission)
    app.add_exception_handler(RequestValidationError, invalid_body)
    add_routes(app, engine, CompletionHandler(engine, admission, http or HttpSettings()))
    return app


async def invalid_body(request: Request, error: RequestValidationError) -> JSONResponse:
    """A body that does not fit the schema: 400, naming its first bad parameter."""
    first = error.errors()[0]
    param = param_from_location(first["loc"])
    return JSONResponse(error_body(f"{param or 'body'}: {first['msg']}", "invalid_request_error", param), status_code=400)


class CompletionHandler:
    """What both completion endpoints do: check the model, admit the request, run it on the engine, and answer
    with the whole completion or a stream of its chunks."""

    def __init__(self, engine: GenerationEngine, admission: Admission, http: HttpSettings):
        self.engine, self.admission, self.http = engine, admission, http

    def model_not_found(self, model: str) -> JSONResponse:
        message = f"The model '{model}' does not exist; this deployment serves '{self.engine.target.model_name}'"
        return JSONResponse(error_body(message, "invalid_request_error", "model", "model_not_found"), status_code=404)

    async def complete(self, request: Request, body: CompletionRequest | ChatCompletionRequest, chat: bool, default_max_tokens):
        engine, http = self.engine, self.http
        if body.model != engine.target.model_name:
            return self.model_not_found(body.model)
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


def add_routes(app: FastAPI, engine: GenerationEngine, handler: CompletionHandler) -> None:
    @app.get("/v1/models")
    async def models():
        model = {"id": engine.target.model_name, "object": "model", "created": 0, "owned_by": "specdec"}
        return {"object": "list", "data": [model]}

    @app.post("/v1/completions")
    async def completions(request: Request, body: CompletionRequest):
        return await handler.complete(request, body, chat=False, default_max_tokens=COMPLETIONS_DEFAULT_MAX_TOKENS)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request, body: ChatCompletionRequest):
        return await handler.complete(request, body, chat=True, default_max_tokens=None)


def choice_params(params: GenerationParams, n: int) -> list[GenerationParams]:
    """The parameters of each of n choices: the request's, each with its own seed (choice_seed)."""
    return [replace(params, sampling=replace(params.sampling, seed=choice_seed(params.sampling.seed, i))) for i in range(n)]


async def prefill_once(engine: GenerationEngine, params: GenerationParams, context, limit: float) -> None:
    """n choices of one prompt prefill it once: a request that only prefills it (max_new_tokens 0) leaves its keys
    and values in the target's prefix cache as it closes, and each choice's session starts from a copy of them. Only
    where the target keeps a prefix cache (elsewhere this would be one prefill more)."""
    only_prefill = replace(params, max_new_tokens=0, num_speculative_tokens=0, logprobs=None, prompt_logprobs=False)
    events = before_deadline(engine.generate(only_prefill, context, limit, kind=SpanKind.INTERNAL), limit)
    async with contextlib.aclosing(events):
        async for _ in events:
            pass


def echo_text(body: RequestFields, params: GenerationParams, tokenizer: Tokenizer) -> str | None:
    """The text a completion with echo begins with: the prompt as sent, or its token ids decoded."""
    if not getattr(body, "echo", False):
        return None
    prompt = (
        body.prompt[0]
        if isinstance(body.prompt, list) and body.prompt and isinstance(body.prompt[0], (str, list))
        else body.prompt
    )
    return prompt if isinstance(prompt, str) else tokenizer.decode(params.prompt_token_ids)


async def merged(streams: list) -> AsyncIterator[tuple[int, Delta | GenerationResult]]:
    """The events of several choices' streams as they come, each as (choice index, event); the first error ends
    all of them. Every stream is closed when this generator is (its sessions with it)."""
    if len(streams) == 1:
        try:
            async for event in streams[0]:
                yield 0, event
        finally:
            await streams[0].aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream) -> None:
        try:
            async for event in stream:
                await queue.put((index, event, None))
            await queue.put((index, None, None))
        except Exception as error:  # noqa: BLE001 - handed to the reader, which raises it
            await queue.put((index, None, error))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        running = len(streams)
        while running:
            index, event, error = await queue.get()
            if error is not None:
                raise error
            if event is None:
                running -= 1
                continue
            yield index, event
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(*(s.aclose() for s in streams), return_exceptions=True)


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
            return JSONResponse(error_body("client closed the request", "client_closed_request"), status_code=499)
        if task.exception() is not None:
            return error_response(task.exception(), body, admitted=True)
        return JSONResponse(completion.whole(task.result()))
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)  # the generator is not running when it is closed
        await release(events, slot)


async def before_deadline(events, seconds: float):
    """The engine's events, ended by DeadlineExceeded once `seconds` have passed: an HTTP request has no gRPC
    deadline to cancel it, and a client that waits forever must not hold its sessions forever."""
    deadline = asyncio.get_running_loop().time() + seconds
    try:
        while True:
            limit = asyncio.timeout_at(deadline)
            try:
                async with limit:
                    event = await anext(events)
            except StopAsyncIteration:
                return
            except TimeoutError:
                if not limit.expired():
                    raise  # the engine's own, not this deadline
                raise DeadlineExceeded(f"the request ran past its deadline of {seconds:g} s (--http-request-timeout)") from None
            yield event
    finally:
        await events.aclose()


async def results_of(events) -> list[GenerationResult]:
    """Each choice's result, in order of the choices."""
    results: dict[int, GenerationResult] = {}
    async for index, event in events:
        if isinstance(event, GenerationResult):
            results[index] = event
    if not results or sorted(results) != list(range(len(results))):
        raise RuntimeError("generation ended without a result")
    return [results[i] for i in range(len(results))]


async def stream_events(first, events, completion: Completion, include_usage: bool) -> AsyncIterator[str]:
    """The SSE body: a chunk per committed delta, the finish reason, then usage if asked, then [DONE]. An error
    after the stream began is sent as an error event (the status line is gone by then)."""
    opened: set[int] = set()  # the choices whose first chunk went out
    results: dict[int, GenerationResult] = {}
    calls: dict[int, CallStream] = {}  # with tools, each choice's tool calls as they are generated
    index, event = first
    try:
        while True:
            if isinstance(event, Delta) and completion.tools is not None:
                stream = calls.setdefault(index, completion.call_stream())
                for chunk in completion.tool_chunks(index, stream.feed(event.text), index not in opened, event):
                    yield sse(chunk)
                    opened.add(index)
            elif isinstance(event, Delta):
                if event.text or event.logprobs or index not in opened:
                    chunk = completion.chunk(
                        index, event.text, first=index not in opened, delta=event, prompt_logprobs=event.prompt_logprobs
                    )
                    yield sse(chunk)
                    opened.add(index)
            else:
                finish = FINISH_REASON_NAMES.get(event.finish_reason)
                if completion.tools is not None:
                    stream = calls.setdefault(index, completion.call_stream())
                    for chunk in completion.tool_chunks(index, stream.end(), index not in opened):
                        yield sse(chunk)
                    yield sse(completion.last_tool_chunk(index, stream.calls_started, finish))
                else:
                    prompt = event.prompt_logprobs
                    yield sse(completion.chunk(index, "", finish, first=index not in opened, prompt_logprobs=prompt))
                opened.add(index)
                results[index] = event
            try:
                index, event = await anext(events)
            except StopAsyncIteration:
                break
        if include_usage:
            yield sse(completion.usage_chunk([results[i] for i in sorted(results)]))
    except Exception as error:  # noqa: BLE001 - reported in the stream
        error_status, message = classified(error)
        yield sse(error_body(message, error_status.openai_type))
    yield sse("[DONE]")


class HeaderTimeoutProtocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline on each request's headers: uvicorn times out idle keep-alive
    connections but not a client that trickles its headers in (slowloris), which would hold a connection forever."""

    header_timeout = HttpSettings.http_header_timeout

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self.header_timer = self.loop.call_later(self.header_timeout, self.headers_late)

    def handle_events(self) -> None:
        super().handle_events()
        if self.conn.their_state is not h11.IDLE:
            if self.header_timer is not None:
                self.header_timer.cancel()  # this request's headers are in
                self.header_timer = None
        elif self.header_timer is None and not self.transport.is_closing():
            self.header_timer = self.loop.call_later(self.header_timeout, self.headers_late)  # awaiting the next

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.header_timer is None and not self.transport.is_closing():
            self.header_timer = self.loop.call_later(self.header_timeout, self.headers_late)

    def headers_late(self) -> None:
        self.header_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            log.info("a client sent no complete request headers within %.0f s: connection closed", self.header_timeout)
            self.transport.close()

    def connection_lost(self, exc) -> None:
        if self.header_timer is not None:
            self.header_timer.cancel()
        super().connection_lost(exc)


def protocol_with_header_timeout(seconds: float) -> type[HeaderTimeoutProtocol]:
    return type("HeaderTimeoutProtocol", (HeaderTimeoutProtocol,), {"header_timeout": seconds})


class HttpServer(uvicorn.Server):
    """uvicorn in the coordinator's event loop: the coordinator owns SIGTERM and the drain (common.lifecycle), so
    uvicorn installs no signal handlers of its own; `stop()` ends it once the drain is over."""

    def capture_signals(self):
        return contextlib.nullcontext()

    async def stop(self, task: asyncio.Task) -> None:
        self.should_exit = True
        await task


def bind(host: str, port: int) -> socket.socket:
    host = host.strip("[]")
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except BaseException:
        sock.close()
        raise
    return sock


def tls_options(tls: TlsFiles | None) -> dict:
    """The gRPC API's TLS for the HTTP one: a certificate, and client certificates required with a CA."""
    if tls is None or not tls.enabled:
        return {}
    options = {"ssl_certfile": tls.cert, "ssl_keyfile": tls.key}
    if tls.ca:
        options.update(ssl_ca_certs=tls.ca, ssl_cert_reqs=ssl.CERT_REQUIRED)
    return options


async def start_http(
    app: FastAPI, host: str, port: int, tls: TlsFiles | None = None, http: HttpSettings | None = None
) -> tuple[HttpServer, int, asyncio.Task]:
    """Binds host:port (0: any free port) and serves the app on it in this event loop; returns the port bound."""
    http = http or HttpSettings()
    sock = bind(host, port)
    config = uvicorn.Config(
        app,
        log_config=None,  # the process's logging, as configured by common.lifecycle.configure_logging
        log_level="warning",
        lifespan="off",
        timeout_graceful_shutdown=int(FINAL_STOP_SECONDS) or 1,
        http=protocol_with_header_timeout(http.http_header_timeout),
        timeout_keep_alive=http.http_keep_alive,
        limit_concurrency=http.http_max_connections,
        **tls_options(tls),
    )
    server = HttpServer(config)
    task = asyncio.ensure_future(server.serve(sockets=[sock]))
    while not server.started and not task.done():
        await asyncio.sleep(0.01)
    if task.done():
        sock.close()
        task.result()  # raises what stopped it
        raise OSError(f"the HTTP API did not start on {host}:{port}")
    task.add_done_callback(report_stop)
    return server, sock.getsockname()[1], task


def report_stop(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("the HTTP API stopped", exc_info=task.exception())
