"""Sampling math shared by both workers: warping logits, truncating q, and the acceptance rule.

Every function works on CPU float32 tensors so that the same inputs give the same draws on any device.
Greedy decoding is temperature 0: distributions become one-hot at the argmax, and the general
rejection rule then reduces exactly to "accept while argmax p == draft token".
"""

import hashlib
from dataclasses import dataclass

import torch


# Temperatures below this are greedy (vLLM's rule): dividing logits by less overflows float32 to inf, and softmax
# then gives NaN, where the limit of sampling at a vanishing temperature is the argmax.
GREEDY_BELOW = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    min_p: float = 0.0
    # The logit adjustments (adjusted_logits): functions of the tokens before a position, as vLLM defines them.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), ids ascending
    # Of a session's prompt, how many final tokens the request generated already (a session reopened mid-request):
    # the presence and frequency penalties count them as output, not as prompt.
    generated_tokens: int = 0
    grammar: str = ""  # llguidance's grammar text (common.grammar): the output is constrained to it; "": none
    grammar_start: int = 0  # where in a session's prompt the constrained output starts (a reopening replays it)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def seeded_sample(self) -> bool:
        """Sampled with a seed: the same request must give the same text, so nothing that depends on timings or on
        other requests may decide how its random streams are consumed (its gamma, its drafts)."""
        return self.seed is not None and not self.greedy

    @property
    def adjusts_logits(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0 or self.logit_bias)


@dataclass(frozen=True)
class SparseDistribution:
    """Non-zero entries of a distribution, most likely first."""

    token_ids: torch.Tensor  # int64 [n]
    probs: torch.Tensor  # float32 [n]


def stream_seed(seed: int, stream: str) -> int:
    """The seed of one random stream drawn from a request seed: a hash of both, so that streams named apart draw
    independent numbers (a non-negative int64, which torch.Generator.manual_seed takes)."""
    digest = hashlib.blake2b(f"{stream}:{seed}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def make_generator(seed: int | None, stream: str) -> torch.Generator:
    """A generator for one party of a request (stream: "draft" or "target").

    The two parties must draw independent numbers from one request seed: seeded alike, the target's acceptance
    uniforms would replay the draft's sampling uniforms and bias the output.
    """
    generator = torch.Generator(device="cpu")
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(stream_seed(seed, stream))
    return generator


def one_hot_argmax(logits: torch.Tensor) -> torch.Tensor:
    probs = torch.zeros_like(logits, dtype=torch.float32)
    return probs.scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)


def mask_top_k(probs: torch.Tensor, top_k: int) -> torch.Tensor:
    if top_k <= 0 or top_k >= probs.shape[-1]:
        return probs
    kth = torch.topk(probs, top_k, dim=-1).values[..., -1:]
    return torch.where(probs >= kth, probs, torch.zeros_like(probs))


def mask_top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keeps the smallest set of most likely tokens whose mass reaches top_p (at least one token)."""
    if top_p >= 1.0:
        return probs
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    sorted_probs = torch.where(mass_before < top_p * probs.sum(-1, keepdim=True), sorted_probs, 0.0)
    return torch.zeros_like(probs).scatter_(-1, order, sorted_probs)


def mask_min_p(probs: torch.Tensor, min_p: float) -> torch.Tensor:
    """Keeps the tokens at least min_p times as likely as the likeliest one."""
    if min_p <= 0.0:
        return probs
    return torch.where(probs >= min_p * probs.amax(dim=-1, keepdim=True), probs, 0.0)


def normalize(probs: torch.Tensor) -> torch.Tensor:
    return probs / probs.sum(dim=-1, keepdim=True)


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution target-only sampling draws from, on logits already adjusted (adjusted_logits): temperature,
    then top-k, then top-p, then min-p."""
    logits = logits.float()
    if params.greedy:
        return one_hot_argmax(logits)
    probs = torch.softmax(logits / params.temperature, dim=-1)
    probs = mask_top_k(probs, params.top_k)
    probs = mask_top_p(normalize(probs), params.top_p)
    probs = mask_min_p(normalize(probs), params.min_p)
    return normalize(probs)


def adjusted_logits(
    logits: torch.Tensor, params: SamplingParams, context: list[int], output_from: int, drafted: list[int]
) -> torch.Tensor:
    """The logit adjustments of a request, the stage before logits_to_probs (and before any mask): logit_bias, then
    the repetition penalty (CTRL's: a positive logit divided by it, a negative one multiplied, for every token of
    the prompt and the output), then the frequency and presence penalties (minus frequency x count, minus presence
    if present, over the output only), as vLLM applies them.

    logits: float32 [R, V], row i scoring the position after context + drafted[:i]; output_from: where the output
    begins in context. Every row is adjusted by what a one-at-a-time decoder would have seen at its position, so a
    drafted prefix counts as if committed. Elementwise float32 on the tokens that occur, so a row's numbers are the
    same bits whatever the other rows.
    """
    if not params.adjusts_logits:
        return logits
    logits = logits.clone()
    if params.logit_bias:
        ids, bias = zip(*params.logit_bias, strict=True)
        logits[:, list(ids)] += torch.tensor(bias, dtype=torch.float32)
    rows = logits.shape[0]
    drafted = drafted[: rows - 1]
    seen = sorted(set(context) | set(drafted))
    if not seen or not (params.presence_penalty or params.frequency_penalty or params.repetition_penalty != 1.0):
        return logits
    ids = torch.tensor(seen, dtype=torch.long)
    columns = len(seen)
    before = torch.searchsorted(ids, torch.tensor(context, dtype=torch.long)) if context else torch.zeros(0, dtype=torch.long)
    in_context = torch.bincount(before, minlength=columns).float()
    in_output = torch.bincount(before[output_from:], minlength=columns).float()
    added = torch.zeros(rows, columns)
    if drafted:
        columns_drafted = torch.searchsorted(ids, torch.tensor(drafted, dtype=torch.long))
        added.index_put_((torch.arange(1, len(drafted) + 1), columns_drafted), torch.ones(len(drafted)), accumulate=True)
        added = added.cumsum(dim=0)
    output_counts = in_output + added
    selected = logits[:, ids]
    if params.repetition_penalty != 1.0:
        present = (in_context + added) > 0
        penalty = params.repetition_penalty
        selected = torch.where(present, torch.where(selected > 0, selected / penalty, selected * penalty), selected)
    if params.frequency_penalty:
        selected = selected - params.frequency_penalty * output_counts
    if params.presence_penalty:
        selected = selected - params.presence_penalty * (output_counts > 0).float()
    logits[:, ids] = selected
    return logits


def truncate_probs(probs: torch.Tensor, max_entries: int) -> SparseDistribution:
    """The at most max_entries most likely tokens of a 1-D distribution, renormalised.

    The draft samples from exactly this distribution and sends it as q, so q on the wire is small and the
    acceptance test stays exact.
    """
    count = min(max_entries, int((probs > 0).sum()))
    top = torch.topk(probs, count)
    return SparseDistribution(token_ids=top.indices, probs=normalize(top.values))


def sample_sparse(dist: SparseDistribution, generator: torch.Generator) -> int:
    index = torch.multinomial(dist.probs, 1, generator=generator)
    return int(dist.token_ids[index])


def sample(probs: torch.Tensor, generator: torch.Generator) -> int:
    return int(torch.multinomial(probs, 1, generator=generator))


def densify(dist: SparseDistribution, vocab_size: int) -> torch.Tensor:
    return torch.zeros(vocab_size, dtype=torch.float32).index_put_((dist.token_ids,), dist.probs.float())


def residual_probs(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)): what to sample from after the draft token was rejected."""
    residual = torch.clamp(p - q, min=0.0)
    total = residual.sum()
    # p == q up to rounding: a rejection then has probability ~0 and p itself is the right fallback.
    return residual / total if total > 0 else p


def speculative_accept(
    target_probs: torch.Tensor,
    draft_tokens: list[int],
    draft_probs: torch.Tensor,
    generator: torch.Generator,
) -> tuple[int, int]:
    """Modified rejection sampling (Leviathan et al. 2023, Chen et al. 2023).

    target_probs: [g + 1, V], p_1..p_(g+1); draft_probs: [g, V], the dense q_i each x_i was sampled from.
    Returns (number accepted n, next token): the correction from norm(max(0, p_(n+1) - q_(n+1))) after a
    rejection, or the bonus token from p_(g+1) when all g were accepted.
    """
    gamma = len(draft_tokens)
    if gamma == 0:
        return 0, sample(target_probs[0], generator)
    index = torch.arange(gamma)
    tokens = torch.tensor(draft_tokens, dtype=torch.long)
    p_x = target_probs[index, tokens]
    q_x = draft_probs[index, tokens]
    uniforms = torch.rand(gamma, generator=generator)
    rejected = (uniforms * q_x >= p_x).nonzero()
    if len(rejected) == 0:
        return gamma, sample(target_probs[gamma], generator)
    n = int(rejected[0])
    return n, sample(residual_probs(target_probs[n], draft_probs[n]), generator)


def greedy_accept(target_probs: torch.Tensor, draft_tokens: list[int]) -> tuple[int, int]:
    """Accept while argmax p_i == x_i; the next token is argmax of the first position not accepted."""
    return accept_while_argmax(target_probs.argmax(dim=-1).tolist(), draft_tokens)


def accept_while_argmax(argmax: list[int], draft_tokens: list[int]) -> tuple[int, int]:
    """greedy_accept given the argmax of each row (of p, or of the logits: the same)."""
    n = 0
    while n < len(draft_tokens) and argmax[n] == draft_tokens[n]:
        n += 1
    return n, argmax[n]


def verify_draft(
    target_probs: torch.Tensor,
    draft_tokens: list[int],
    draft_dists: list[SparseDistribution],
    params: SamplingParams,
    generator: torch.Generator,
) -> tuple[int, int]:
    """The target's verdict on one round: (number accepted, next token)."""
    if params.greedy:
        return greedy_accept(target_probs, draft_tokens)
    vocab = target_probs.shape[-1]
    draft_probs = (
        torch.stack([densify(d, vocab) for d in draft_dists]) if draft_dists else torch.zeros(0, vocab, dtype=torch.float32)
    )
    return speculative_accept(target_probs, draft_tokens, draft_probs, generator)


def top_entries(probs: torch.Tensor, count: int) -> list[SparseDistribution]:
    """The count most likely entries of each row, for reporting p without sending the whole vocabulary."""
    count = min(count, probs.shape[-1])
    top = torch.topk(probs, count, dim=-1)
    return [SparseDistribution(token_ids=i, probs=p) for i, p in zip(top.indices, top.values, strict=True)]


@dataclass(frozen=True)
class TokenLogprob:
    """A position's log-probability of its token, and of the `top` likeliest tokens there, likeliest first."""

    logprob: float
    top_ids: list[int]
    top_logprobs: list[float]


def token_logprobs(logits: torch.Tensor, tokens: list[int], top: int) -> list[TokenLogprob]:
    """Log-probabilities of the model's own distribution at each row (log-softmax of its logits, before the logit
    adjustments, temperature and truncation: vLLM's raw_logprobs), of rows' tokens. Row by row, so that a row's
    numbers never depend on how many rows were scored with it."""
    entries = []
    for row, token in zip(logits, tokens, strict=False):
        logprobs = torch.log_softmax(row.float(), dim=-1)
        best = torch.topk(logprobs, min(top, logprobs.shape[-1])) if top else None
        entries.append(
            TokenLogprob(
                float(logprobs[token]),
                best.indices.tolist() if best is not None else [],
                best.values.tolist() if best is not None else [],
            )
        )
    return entries
