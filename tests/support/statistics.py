"""The exact target distribution by enumeration, seeded samples through the real speculation loop, and the
chi-square test between them."""

import asyncio
from dataclasses import replace
import torch
from scipy import stats
from specdec.common.sampling import SamplingParams, adjusted_logits, logits_to_probs
from specdec.coordinator.config import CoordinatorConfig
from specdec.coordinator.types import GenerationParams
from specdec.coordinator.in_process import InProcessWorkers
from specdec.coordinator.server import build_engine
from specdec.draft_worker.engine import DraftEngine
from specdec.draft_worker.model_proposer import ModelProposer
from specdec.draft_worker.proposer import Proposer
from specdec.target_worker.engine import TargetEngine


VOCAB = 6


TOKENS = 3


SAMPLES = 3000


TARGET = f"tiny-random:seed=3,vocab={VOCAB},layers=1,hidden=16"


DRAFT = f"{TARGET},noise=1.5"


PROMPT = [1, 2, 3, 4]


def enumerate_sequences(
    model, params: SamplingParams, tokens: int = TOKENS, prompt: list[int] = PROMPT
) -> dict[tuple[int, ...], float]:
    """P(first `tokens` tokens) under target-only sampling, by scoring every prefix without any cache (and adjusting
    each prefix's logits by its own tokens)."""
    vocab = model.vocab_size
    probs = {(): 1.0}
    for _ in range(tokens):
        prefixes = list(probs)
        with torch.no_grad():
            logits = model.model(torch.tensor([prompt + list(p) for p in prefixes])).logits[:, -1].float()
        logits = torch.cat(
            [adjusted_logits(logits[i : i + 1], params, prompt + list(p), len(prompt), []) for i, p in enumerate(prefixes)]
        )
        step = logits_to_probs(logits, params)
        probs = {prefix + (t,): probs[prefix] * float(step[i, t]) for i, prefix in enumerate(prefixes) for t in range(vocab)}
    return probs


def sample_sequences(
    target,
    draft,
    params: SamplingParams,
    gamma: int,
    tokens: int = TOKENS,
    samples: int = SAMPLES,
    overlap: bool = False,
    prompt: list[int] = PROMPT,
    proposer: Proposer | None = None,
) -> tuple[list[tuple[int, ...]], int, tuple[int, int]]:
    """The first `tokens` tokens of `samples` seeded requests, how many rounds used an overlapped proposal, and the
    tokens drafted and accepted over all of them. The draft: the model `draft`, or `proposer`."""

    async def run():
        proposer_ = proposer or ModelProposer(draft, calibrate=False)
        workers = InProcessWorkers(TargetEngine(target, calibrate=False), DraftEngine(proposer_, "draft"))
        engine = await build_engine(workers, CoordinatorConfig(), tokenizer=target.tokenizer)
        out, overlapped, drafted, accepted = [], 0, 0, 0
        for seed in range(samples):
            sampling = replace(params, seed=seed)
            request = GenerationParams(prompt, sampling, tokens, gamma, ignore_eos=True, overlap=overlap)
            result = await engine.generate_all(request)
            out.append(tuple(result.token_ids))
            overlapped += result.overlapped_rounds
            drafted, accepted = drafted + result.drafted_tokens, accepted + result.accepted_tokens
        return out, overlapped, (drafted, accepted)

    return asyncio.run(run())


def chi_square_p_value(samples: list[tuple[int, ...]], exact: dict[tuple[int, ...], float]) -> float:
    """Cells with an expected count under 5 are pooled into one, as the test requires."""
    counts = {seq: 0 for seq in exact}
    for seq in samples:
        counts[seq] += 1
    observed, expected, pooled_obs, pooled_exp = [], [], 0, 0.0
    for seq, prob in exact.items():
        if prob * len(samples) >= 5:
            observed.append(counts[seq])
            expected.append(prob * len(samples))
        else:
            pooled_obs += counts[seq]
            pooled_exp += prob * len(samples)
    if pooled_exp > 0:
        observed.append(pooled_obs)
        expected.append(pooled_exp)
    scale = sum(observed) / sum(expected)
    return float(stats.chisquare(observed, [e * scale for e in expected]).pvalue)
