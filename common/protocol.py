"""Conversions between the protobuf messages of specdec.v1 and the tensors and dataclasses the engines use."""

import torch

from specdec.common.rounds import DraftQ, DraftSource
from specdec.common.sampling import SamplingParams, SparseDistribution, TokenLogprob
from specdec.v1 import worker_pb2

DRAFT_SOURCES = {
    DraftSource.NONE: worker_pb2.DRAFT_SOURCE_UNSPECIFIED,
    DraftSource.MODEL: worker_pb2.DRAFT_SOURCE_MODEL,
    DraftSource.PROMPT_LOOKUP: worker_pb2.DRAFT_SOURCE_PROMPT_LOOKUP,
    DraftSource.SUFFIX_REQUEST: worker_pb2.DRAFT_SOURCE_SUFFIX_REQUEST,
    DraftSource.SUFFIX_GLOBAL: worker_pb2.DRAFT_SOURCE_SUFFIX_GLOBAL,
}
DRAFT_SOURCE_OF = {number: source for source, number in DRAFT_SOURCES.items()}


def sampling_to_proto(params: SamplingParams) -> worker_pb2.SamplingParams:
    return worker_pb2.SamplingParams(
        temperature=params.temperature,
        top_k=params.top_k,
        top_p=params.top_p,
        seed=params.seed,
        min_p=params.min_p,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty if params.repetition_penalty != 1.0 else None,
        logit_bias=dict(params.logit_bias),
        generated_tokens=params.generated_tokens,
        grammar=params.grammar,
        grammar_start=params.grammar_start,
    )


def sampling_from_proto(msg: worker_pb2.SamplingParams) -> SamplingParams:
    return SamplingParams(
        temperature=msg.temperature,
        top_k=msg.top_k,
        top_p=msg.top_p,
        seed=msg.seed if msg.HasField("seed") else None,
        min_p=msg.min_p,
        presence_penalty=msg.presence_penalty,
        frequency_penalty=msg.frequency_penalty,
        repetition_penalty=msg.repetition_penalty if msg.HasField("repetition_penalty") else 1.0,
        logit_bias=logit_bias_of(msg.logit_bias),
        generated_tokens=msg.generated_tokens,
        grammar=msg.grammar,
        grammar_start=msg.grammar_start,
    )


def logit_bias_of(bias) -> tuple[tuple[int, float], ...]:
    """A logit_bias map as SamplingParams holds it: (token id, bias) pairs, ids ascending."""
    return tuple(sorted((int(token), float(value)) for token, value in bias.items()))


def logprob_to_proto(entry: TokenLogprob) -> worker_pb2.TokenLogprob:
    return worker_pb2.TokenLogprob(logprob=entry.logprob, top_token_ids=entry.top_ids, top_logprobs=entry.top_logprobs)


def logprob_from_proto(msg: worker_pb2.TokenLogprob) -> TokenLogprob:
    return TokenLogprob(msg.logprob, list(msg.top_token_ids), list(msg.top_logprobs))


def distribution_to_proto(dist: SparseDistribution) -> worker_pb2.SparseDistribution:
    return worker_pb2.SparseDistribution(token_ids=dist.token_ids.tolist(), probs=dist.probs.tolist())


def as_distribution(dist: DraftQ) -> SparseDistribution:
    """A drafted token's q as tensors, from either form a round carries it in (common.rounds.DraftQ)."""
    return dist if isinstance(dist, SparseDistribution) else distribution_from_proto(dist)


def distribution_from_proto(msg: worker_pb2.SparseDistribution) -> SparseDistribution:
    # float32 on both ends: q arrives bit-identical to what the draft sampled from.
    return SparseDistribution(
        token_ids=torch.tensor(list(msg.token_ids), dtype=torch.long),
        probs=torch.tensor(list(msg.probs), dtype=torch.float32),
    )


def model_info(loaded) -> dict:
    """GetInfo's fields of a loaded model (common.loaded_model.LoadedModel); a model-free draft sends them empty."""
    return {
        "tokenizer_fingerprint": loaded.tokenizer.fingerprint,
        "dtype": str(loaded.dtype).removeprefix("torch."),
        "eos_token_ids": loaded.tokenizer.eos_token_ids,
        "engine": loaded.engine,
    }


def worker_info(
    model_name: str, vocab_size: int, device, max_context_length: int, sessions, forward_costs: list, model: dict
) -> dict:
    """A worker's GetInfo as a dict (info_to_proto's input, and coordinator.workers.WorkerInfo's fields for an
    engine in the coordinator's process). sessions: the engine's SessionRegistry; model: model_info's fields."""
    return {
        "model_name": model_name,
        "vocab_size": vocab_size,
        "device": str(device),
        "max_context_length": max_context_length,
        "active_sessions": len(sessions),
        "max_sessions": sessions.max_sessions,
        "max_kv_tokens": sessions.max_kv_tokens or 0,
        "reserved_kv_tokens": sessions.reserved_kv_tokens,
        "prefix_cache_tokens": sessions.spare.max_tokens if sessions.spare else 0,
        "prefix_cache_held_tokens": sessions.spare.held if sessions.spare else 0,
        "forward_costs": forward_costs,
        **model,
    }


def info_to_proto(role: int, info: dict) -> worker_pb2.GetInfoResponse:
    costs = [worker_pb2.ForwardCost(tokens=t, milliseconds=ms) for t, ms in info.get("forward_costs", [])]
    return worker_pb2.GetInfoResponse(role=role, **{**info, "forward_costs": costs})
