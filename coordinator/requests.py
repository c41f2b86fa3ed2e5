"""GenerateRequest in, GenerateResponse out: field checks (each error names its field) and conversions."""

import asyncio

from dataclasses import replace

from specdec.common.errors import InvalidArgument
from specdec.common.grammar import check_grammar, grammar_of_constraint
from specdec.common.protocol import DRAFT_SOURCES, logit_bias_of, logprob_to_proto
from specdec.common.wire_limits import MAX_TOP_LOGPROBS
from specdec.common.sampling import SamplingParams
from specdec.common.tokenizer import CHAT_ROLES, Tokenizer
from specdec.common.validation import check_sampling
from specdec.coordinator.config import CoordinatorConfig
from specdec.coordinator.types import GenerationParams, GenerationResult, RoundStats, TimeSplit
from specdec.coordinator.output import Delta
from specdec.v1 import generation_pb2

# A request's stop strings are matched against every round's text on the event loop that serves all requests:
# bounded in number and length (vLLM and OpenAI bound the number; the length keeps a round's matching bounded).
MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 256  # characters
MAX_MESSAGES = 1024  # of a chat request
# Text above this is tokenized (or a chat rendered) on a thread, so that the event loop serving every request
# stays free; below it the hand-off costs more than the tokenizing.
TOKENIZE_ON_THREAD_CHARS = 8192
AUTO_GAMMA = -1
GAMMA_SCHEDULES = {
    generation_pb2.GAMMA_SCHEDULE_UNSPECIFIED: "cost_model",
    generation_pb2.GAMMA_SCHEDULE_COST_MODEL: "cost_model",
    generation_pb2.GAMMA_SCHEDULE_HEURISTIC: "heuristic",
}


def prompt_text_length(request: generation_pb2.GenerateRequest) -> int:
    kind = request.WhichOneof("input")
    if kind == "prompt":
        return len(request.prompt)
    if kind == "messages":
        return sum(len(m.content) + len(m.role) for m in request.messages.messages)
    return 0


def check_prompt_input(request: generation_pb2.GenerateRequest, config: CoordinatorConfig) -> None:
    """The checks on the input that come before tokenizing it: which one is set, and its size."""
    kind = request.WhichOneof("input")
    if kind is None:
        raise InvalidArgument("input", "set one of prompt, messages or prompt_token_ids")
    if kind == "prompt" and not request.prompt:
        raise InvalidArgument("prompt", "must not be empty")
    if kind == "messages":
        messages = request.messages.messages
        if not messages:
            raise InvalidArgument("messages", "must hold at least one message")
        if len(messages) > MAX_MESSAGES:
            raise InvalidArgument("messages", f"at most {MAX_MESSAGES} messages, got {len(messages)}")
        for i, message in enumerate(messages):
            if message.role not in CHAT_ROLES:
                raise InvalidArgument(f"messages[{i}].role", f"unknown role {message.role!r}; use one of {', '.join(CHAT_ROLES)}")
    if kind == "prompt_token_ids" and not request.prompt_token_ids.token_ids:
        raise InvalidArgument("prompt_token_ids", "must not be empty")
    length = prompt_text_length(request)
    if length > config.max_prompt_chars:
        field = "messages" if kind == "messages" else "prompt"
        raise InvalidArgument(field, f"{length} characters; at most {config.max_prompt_chars} are accepted")


def prompt_tokens_of(request: generation_pb2.GenerateRequest, tokenizer: Tokenizer) -> list[int]:
    """The prompt's token ids, from whichever input the request set (checked by check_prompt_input)."""
    kind = request.WhichOneof("input")
    if kind == "prompt":
        return tokenizer.encode(request.prompt)
    if kind == "messages":
        return tokenizer.render_chat([{"role": m.role, "content": m.content} for m in request.messages.messages])
    return list(request.prompt_token_ids.token_ids)


def sampling_of(request: generation_pb2.GenerateRequest) -> SamplingParams:
    """The request's sampling fields (unset: SamplingParams' defaults), checked as the workers check theirs."""
    defaults = SamplingParams()
    optional = ("temperature", "top_k", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
    params = SamplingParams(
        **{name: getattr(request, name) if request.HasField(name) else getattr(defaults, name) for name in optional},
        seed=request.seed if request.HasField("seed") else None,
        logit_bias=logit_bias_of(request.logit_bias),
    )
    check_sampling(params)
    return params


async def params_of(request: generation_pb2.GenerateRequest, tokenizer: Tokenizer, config: CoordinatorConfig) -> GenerationParams:
    """Every field checked, then the prompt tokenized (on a thread when it is long)."""
    check_prompt_input(request, config)
    max_new_tokens = request.max_new_tokens if request.HasField("max_new_tokens") else config.default_max_new_tokens
    least = 0 if request.prompt_logprobs else 1  # 0: score the prompt only
    if not least <= max_new_tokens <= config.max_new_tokens_cap:
        raise InvalidArgument("max_new_tokens", f"must be in [{least}, {config.max_new_tokens_cap}], got {max_new_tokens}")
    logprobs = request.logprobs if request.HasField("logprobs") else None
    if logprobs is not None and not 0 <= logprobs <= MAX_TOP_LOGPROBS:
        raise InvalidArgument("logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}], got {logprobs}")
    if request.prompt_logprobs and logprobs is None:
        raise InvalidArgument("prompt_logprobs", "needs logprobs (the alternatives per position)")
    gamma = (
        request.num_speculative_tokens if request.HasField("num_speculative_tokens") else config.default_num_speculative_tokens
    )
    if not AUTO_GAMMA <= gamma <= config.max_num_speculative_tokens:
        raise InvalidArgument(
            "num_speculative_tokens", f"must be -1 (auto) or in [0, {config.max_num_speculative_tokens}], got {gamma}"
        )
    if request.gamma_schedule not in GAMMA_SCHEDULES:
        raise InvalidArgument("gamma_schedule", f"unknown value {request.gamma_schedule}")
    stop = list(request.stop)
    if len(stop) > MAX_STOP_STRINGS:
        raise InvalidArgument("stop", f"at most {MAX_STOP_STRINGS} strings, got {len(stop)}")
    for i, s in enumerate(stop):
        if not 0 < len(s) <= MAX_STOP_LENGTH:
            raise InvalidArgument(f"stop[{i}]", f"must hold 1 to {MAX_STOP_LENGTH} characters, got {len(s)}")
    sampling = sampling_of(request)
    if prompt_text_length(request) > TOKENIZE_ON_THREAD_CHARS:
        prompt_token_ids = await asyncio.to_thread(prompt_tokens_of, request, tokenizer)
    else:
        prompt_token_ids = prompt_tokens_of(request, tokenizer)
    grammar = grammar_of_constraint(request.constraint)
    if grammar:
        if request.ignore_eos:
            raise InvalidArgument("ignore_eos", "cannot be combined with a constraint, whose output ends where it is complete")
        field = f"constraint.{request.constraint.WhichOneof('kind')}"
        # On a thread: compiling is bounded (common.grammar.GRAMMAR_LIMITS) but not free, and a tokenizer's first
        # grammar builds its vocabulary's index (about a second for 151k tokens).
        await asyncio.to_thread(check_grammar, grammar, tokenizer, field)
        sampling = replace(sampling, grammar=grammar, grammar_start=len(prompt_token_ids))
    return GenerationParams(
        prompt_token_ids=prompt_token_ids,
        sampling=sampling,
        max_new_tokens=max_new_tokens,
        num_speculative_tokens=gamma,
        stop=stop,
        ignore_eos=request.ignore_eos,
        operation="chat" if request.WhichOneof("input") == "messages" else "text_completion",
        gamma_schedule=GAMMA_SCHEDULES[request.gamma_schedule],
        overlap=request.overlap if request.HasField("overlap") else config.overlap,
        max_new_tokens_given=request.HasField("max_new_tokens"),
        logprobs=logprobs,
        prompt_logprobs=request.prompt_logprobs,
    )


def time_split_of(split: TimeSplit) -> generation_pb2.TimeSplit:
    return generation_pb2.TimeSplit(**vars(split))


def round_of(record: RoundStats) -> generation_pb2.SpeculationRound:
    return generation_pb2.SpeculationRound(
        gamma=record.gamma,
        drafted=record.drafted,
        accepted=record.accepted,
        rollback=record.rollback,
        committed=record.committed,
        time_split=time_split_of(record.time_split),
        bytes_sent=record.bytes_sent,
        bytes_received=record.bytes_received,
        overlapped=record.overlapped,
        target_batch_size=record.target_batch_size,
        draft_source=DRAFT_SOURCES[record.draft_source],
    )


def response_of(result: GenerationResult, include_rounds: bool = False) -> generation_pb2.GenerateResponse:
    return generation_pb2.GenerateResponse(
        text=result.text,
        token_ids=result.token_ids,
        finish_reason=result.finish_reason,
        usage=generation_pb2.Usage(
            prompt_tokens=result.prompt_tokens,
            completion_tokens=len(result.token_ids),
            cached_prompt_tokens=result.cached_prompt_tokens,
        ),
        speculation=generation_pb2.SpeculationStats(**result.speculation_stats()),
        time_split=time_split_of(result.time_split),
        rounds=[round_of(r) for r in result.rounds] if include_rounds else [],
        logprobs=[logprob_to_proto(e) for e in result.logprobs],
        prompt_logprobs=[logprob_to_proto(e) for e in result.prompt_logprobs],
    )


def stream_message_of(event: Delta | GenerationResult, include_rounds: bool = False) -> generation_pb2.GenerateStreamResponse:
    if isinstance(event, Delta):
        return generation_pb2.GenerateStreamResponse(
            delta=generation_pb2.GenerateDelta(
                text=event.text, token_ids=event.token_ids, logprobs=[logprob_to_proto(e) for e in event.logprobs]
            )
        )
    return generation_pb2.GenerateStreamResponse(final=response_of(event, include_rounds))
