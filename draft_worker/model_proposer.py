"""A draft model as a proposer: gamma sampled tokens with the exact q each was drawn from, the k-th forward pass of
every session of a batch run as one pass."""

import torch

from specdec.common.batched_forward import as_sampling_input
from specdec.common.cached_sequence import CachedSequence
from specdec.common.config import DraftWorkerConfig
from specdec.common.grammar import GrammarMatcher, mask_logits, vocabulary_of
from specdec.common.model_runner import ModelRunner
from specdec.common.loaded_model import LoadedModel
from specdec.common.prefix_cache import prefix_cache_for
from specdec.common.protocol import model_info
from specdec.common.rounds import DraftSource, Proposal
from specdec.common.sampling import (
    SamplingParams,
    adjusted_logits,
    logits_to_probs,
    make_generator,
    sample_sparse,
    truncate_probs,
)
from specdec.common.validation import check_prompt, check_token_ids
from specdec.draft_worker.proposer import Proposer


class ModelDraftSession:
    """Per round.md: after proposing x1..xg the cache holds S + x1..x(g-1); a sync crops the rejected ones.

    The chain holds what the draft proposed (and, with overlap, assumed) since the last sync, in order; a sync
    keeps its first num_accepted tokens. A step is a few forward passes, driven one at a time by ModelProposer so
    that the passes of all sessions in a batch run together: next_feed() says what to feed, consume() takes the
    logits and samples. Tokens chained without a pass of this model (a hybrid's suffix proposal) are simply not
    cached yet: the next feed includes them.
    """

    def __init__(
        self,
        runner: ModelRunner,
        prompt: list[int],
        params: SamplingParams,
        max_q_entries: int,
        max_tokens: int | None = None,
        grammar: GrammarMatcher | None = None,
    ):
        self.sequence = CachedSequence(runner, prompt, max_tokens)
        self.params = params
        # Under a grammar q is masked as the target masks p: the matcher follows the output and the chain.
        self.grammar = grammar
        self.output_start = params.grammar_start or len(prompt)
        self.generator = make_generator(params.seed, "draft")
        self.max_q_entries = max_q_entries
        self.output_from = len(prompt) - params.generated_tokens  # where the output begins (the logit adjustments')
        self.chain: list[int] = []
        self.reused_tokens: int | None = None  # of its prompt, from the prefix cache (None: not looked up yet)
        self.start_step(0, False)

    @property
    def tokens(self) -> list[int]:
        return self.sequence.tokens

    @property
    def num_committed(self) -> int:
        return len(self.sequence.tokens)

    @property
    def max_tokens(self) -> int:
        return self.sequence.max_tokens

    def prefill(self, max_tokens: int | None = None) -> bool:
        """The next chunk of the prompt (all of it without max_tokens); True once it is cached."""
        return self.sequence.prefill(max_tokens)

    @property
    def cached(self) -> int:
        return self.sequence.cache_len

    def sync(self, num_accepted: int, committed: list[int]) -> None:
        sequence = self.sequence
        sequence.crop_to(len(sequence.tokens) + num_accepted)
        sequence.tokens += self.chain[:num_accepted] + committed
        self.chain = []

    def start_step(self, num_tokens: int, assume_accepted: bool) -> None:
        self.remaining = num_tokens
        self.guessing = assume_accepted and num_tokens > 0
        self.proposal = Proposal([], [], source=DraftSource.MODEL)

    def next_feed(self) -> list[int] | None:
        """The tokens of the next forward pass (everything of S + chain not yet cached), or None when done."""
        if self.remaining == 0:
            return None
        return (self.sequence.tokens + self.chain)[self.sequence.cache_len :]

    def consume(self, logits: torch.Tensor) -> None:
        if self.grammar is not None and not self.grammar.follow((self.sequence.tokens + self.chain)[self.output_start :]):
            # The chain left the grammar (a hybrid's suffix proposal): the target cuts it there; propose no more.
            self.remaining, self.guessing = 0, False
            return
        if self.params.adjusts_logits:
            # As the target adjusts its row at this position: by the committed tokens and the chain before it.
            context = self.sequence.tokens + self.chain
            logits = adjusted_logits(as_sampling_input(logits)[None], self.params, context, self.output_from, [])[0]
        if self.grammar is not None:
            logits = mask_logits(as_sampling_input(logits), self.grammar.allowed())
        if self.guessing:
            # The target's bonus token is unknown while it verifies: stand in the draft's likeliest token.
            token = int(logits.argmax())
            self.proposal.assumed_token = token
            self.guessing = False
        else:
            q = truncate_probs(logits_to_probs(as_sampling_input(logits), self.params), self.max_q_entries)
            token = sample_sparse(q, self.generator)
            self.proposal.token_ids.append(token)
            self.proposal.distributions.append(q)
            self.remaining -= 1
        self.chain.append(token)


class ModelProposer(Proposer):
    batched = True

    def __init__(
        self, loaded: LoadedModel, calibrate: bool = True, prefix_cache_tokens: int = DraftWorkerConfig.prefix_cache_tokens
    ):
        self.loaded = loaded
        # The draft's numbers never reach the output's distribution (q is whatever it sampled from), but a seeded
        # request is reproducible only if they are the same with a kept prefix as without: the target's rule.
        self.prefixes = prefix_cache_for(loaded.runner, prefix_cache_tokens)
        self.vocab_size = loaded.vocab_size
        self.max_context_length = loaded.max_context_length
        self.kv_bytes_per_token = loaded.runner.kv_bytes_per_token
        self.device = str(loaded.device)
        # Measured once at load: the coordinator's cost model weighs drafting against verifying with it.
        self.costs = loaded.runner.cost_curve(loaded.vocab_size) if calibrate else []

    @property
    def forward_costs(self) -> list[tuple[int, float]]:
        return self.costs

    def check_prompt(self, prompt: list[int]) -> None:
        check_prompt(prompt, self.vocab_size, self.max_context_length, "start.prompt_token_ids")

    def check_tokens(self, token_ids: list[int], field: str) -> None:
        check_token_ids(token_ids, self.vocab_size, field)

    def prepare(self, params: SamplingParams) -> None:
        if params.grammar:
            vocabulary_of(self.loaded.tokenizer, self.vocab_size).compile(params.grammar, "start.sampling.grammar")

    def open(self, prompt: list[int], params: SamplingParams, max_q_entries: int, max_tokens: int) -> ModelDraftSession:
        grammar = None
        if params.grammar:
            vocabulary = vocabulary_of(self.loaded.tokenizer, self.vocab_size)
            grammar = vocabulary.session_matcher(params.grammar, prompt, params.grammar_start, "start.sampling.grammar")
        return ModelDraftSession(self.loaded.runner, prompt, params, max_q_entries, max_tokens, grammar)

    def prefill(self, state: ModelDraftSession, max_tokens: int | None) -> bool:
        if state.reused_tokens is None:
            state.reused_tokens = self.prefixes.start_from(state.tokens, state.sequence.cache) if self.prefixes else 0
        return state.prefill(max_tokens)

    def observe(self, state: ModelDraftSession, num_accepted: int, committed: list[int]) -> None:
        state.sync(num_accepted, committed)

    def propose(self, states: list[ModelDraftSession], steps: list[tuple[int, bool]]) -> list[Proposal | Exception]:
        for state, (num_tokens, assume_accepted) in zip(states, steps, strict=True):
            state.start_step(num_tokens, assume_accepted)
        failed = self.run_passes(states)
        return [failed.get(n, state.proposal) for n, state in enumerate(states)]

    def run_passes(self, states: list[ModelDraftSession]) -> dict[int, Exception]:
        """Forward passes until every session has proposed its tokens; each pass batches all unfinished sessions.
        A session whose sampling fails drops out with its error (by index in states); the others go on."""
        failed: dict[int, Exception] = {}
        while True:
            feeds = [(n, state.next_feed()) for n, state in enumerate(states) if n not in failed]
            feeds = [(n, feed) for n, feed in feeds if feed is not None]
            if not feeds:
                return failed
            caches = [states[n].sequence.cache for n, _ in feeds]
            logits = self.loaded.runner.forward(caches, [f for _, f in feeds], [1] * len(feeds))
            for (n, _), rows in zip(feeds, logits, strict=True):
                try:
                    states[n].consume(rows[-1])
                except Exception as error:  # noqa: BLE001 - fails this session's stream (and frees it), not the batch
                    failed[n] = error

    def close(self, state: ModelDraftSession) -> None:
        if self.prefixes is not None:
            self.prefixes.keep(state.tokens, state.sequence.cache)

    def describe(self) -> dict:
        return model_info(self.loaded)
