"""An OpenAI request as the engine's: the GenerateRequest it stands for (checked as a gRPC request is, by
coordinator.requests.params_of), its choices' parameters, and the names the caller used for the engine's fields."""

import json
from dataclasses import replace

from llguidance.gbnf_to_lark import any_to_lark

from specdec.common.errors import InvalidArgument
from specdec.coordinator.requests import MAX_MESSAGES
from specdec.coordinator.tool_calls import calls_grammar, check_tools, render_chat
from specdec.coordinator.types import GenerationParams
from specdec.common.sampling import stream_seed
from specdec.common.tokenizer import Tokenizer

from specdec.v1 import generation_pb2
from specdec.coordinator.http_schema import (
    MAX_CHAT_TOP_LOGPROBS,
    MAX_CHOICES,
    MAX_COMPLETION_LOGPROBS,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    RequestFields,
)

# OpenAI's roles that specdec renders as one of its chat roles.
ROLE_ALIASES = {"developer": "system"}


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


def choice_params(params: GenerationParams, n: int) -> list[GenerationParams]:
    """The parameters of each of n choices: the request's, each with its own seed (choice_seed)."""
    return [replace(params, sampling=replace(params.sampling, seed=choice_seed(params.sampling.seed, i))) for i in range(n)]


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
