"""Checks of values that cross a service boundary; each failure names the field it is about."""

import math


from specdec.common.errors import InvalidArgument
from specdec.common.rounds import DraftQ
from specdec.common.wire_limits import MAX_Q_ENTRIES
from specdec.common.sampling import SamplingParams

MAX_TOKEN_ID = 2**31  # a model-free draft has no vocabulary: any int32 id
MAX_LOGIT_BIAS = 1024  # entries of logit_bias (vLLM and OpenAI take any; each costs a column per sampled row)
MAX_REPETITION_PENALTY = 10.0
# q may be renormalised float32; anything further from 1 is not a distribution the draft sampled from.
DISTRIBUTION_MASS_TOLERANCE = 1e-3


def check_sampling(params: SamplingParams, field: str = "") -> None:
    """field: the message the parameters came in (errors name e.g. sampling.top_k); "": they are the request's own
    fields (top_k)."""
    prefix = f"{field}." if field else ""
    if not math.isfinite(params.temperature) or params.temperature < 0:
        raise InvalidArgument(f"{prefix}temperature", f"must be a finite number >= 0, got {params.temperature}")
    if params.top_k < 0:
        raise InvalidArgument(f"{prefix}top_k", f"must be >= 0, got {params.top_k}")
    if not (0 < params.top_p <= 1):
        raise InvalidArgument(f"{prefix}top_p", f"must be in (0, 1], got {params.top_p}")
    if not 0 <= params.min_p <= 1:
        raise InvalidArgument(f"{prefix}min_p", f"must be in [0, 1], got {params.min_p}")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(params, name)
        if not -2 <= value <= 2:
            raise InvalidArgument(f"{prefix}{name}", f"must be in [-2, 2], got {value}")
    if not (0 < params.repetition_penalty <= MAX_REPETITION_PENALTY):
        raise InvalidArgument(
            f"{prefix}repetition_penalty", f"must be in (0, {MAX_REPETITION_PENALTY}], got {params.repetition_penalty}"
        )
    if len(params.logit_bias) > MAX_LOGIT_BIAS:
        raise InvalidArgument(f"{prefix}logit_bias", f"at most {MAX_LOGIT_BIAS} entries, got {len(params.logit_bias)}")
    for token, bias in params.logit_bias:
        if not -100 <= bias <= 100:
            raise InvalidArgument(f"{prefix}logit_bias", f"token {token}: the bias must be in [-100, 100], got {bias}")
    if params.generated_tokens < 0:
        raise InvalidArgument(f"{prefix}generated_tokens", f"must be >= 0, got {params.generated_tokens}")


def check_sampling_tokens(params: SamplingParams, prompt: list[int], vocab_size: int, field: str = "") -> None:
    """The sampling fields that need the model and the prompt: logit_bias's ids in the vocabulary, generated_tokens
    within the prompt."""
    prefix = f"{field}." if field else ""
    check_token_ids([token for token, _ in params.logit_bias], vocab_size, f"{prefix}logit_bias")
    if params.generated_tokens >= len(prompt) and params.generated_tokens:
        raise InvalidArgument(
            f"{prefix}generated_tokens", f"{params.generated_tokens} is not less than the prompt's {len(prompt)} tokens"
        )


def check_count(value: int, limit: int, field: str) -> None:
    """A count a caller chose (tokens to draft, entries to return): in [0, limit]."""
    if not 0 <= value <= limit:
        raise InvalidArgument(field, f"must be in [0, {limit}], got {value}")


def check_token_ids(token_ids: list[int], vocab_size: int, field: str) -> None:
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidArgument(field, f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})")


def check_prompt(prompt: list[int], vocab_size: int, max_context: int, field: str, ids_field: str = "") -> None:
    """ids_field: the name a bad id is reported under, where the caller's ids are a field of their own."""
    if not prompt:
        raise InvalidArgument(field, "must not be empty")
    check_token_ids(prompt, vocab_size, ids_field or field)
    if max_context and len(prompt) >= max_context:
        raise InvalidArgument(field, f"{len(prompt)} tokens leave no room in the model's context of {max_context}")


def check_distribution(dist: DraftQ, token: int, vocab_size: int, field: str) -> None:
    """dist: tensors or the protobuf message as it came off the wire (common.rounds.DraftQ)."""
    # On Python lists: a few entries each, and checked for every drafted token of every round, where tensor ops
    # would cost tens of microseconds apiece.
    token_ids, probs = as_list(dist.token_ids), as_list(dist.probs)
    if len(token_ids) > MAX_Q_ENTRIES:
        raise InvalidArgument(f"{field}.token_ids", f"at most {MAX_Q_ENTRIES} entries, got {len(token_ids)}")
    if not token_ids or len(token_ids) != len(probs):
        raise InvalidArgument(field, "token_ids and probs must be non-empty and of equal length")
    check_token_ids(token_ids, vocab_size, f"{field}.token_ids")
    if len(set(token_ids)) != len(token_ids):
        raise InvalidArgument(f"{field}.token_ids", "must not repeat a token")
    if not all(math.isfinite(p) and p >= 0 for p in probs):
        raise InvalidArgument(f"{field}.probs", "must be finite and non-negative")
    mass = math.fsum(probs)
    if abs(mass - 1.0) > DISTRIBUTION_MASS_TOLERANCE:
        raise InvalidArgument(f"{field}.probs", f"must sum to 1, got {mass:.6f}")
    if token not in token_ids or probs[token_ids.index(token)] <= 0:
        raise InvalidArgument(field, f"drafted token {token} has no probability under its own distribution")


def as_list(values) -> list:
    return values.tolist() if hasattr(values, "tolist") else list(values)
