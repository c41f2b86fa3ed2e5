"""Verification on the target model: one forward pass per round, the acceptance test, and the cache rollback.

The rounds of all sessions that are ready, and the prompts of opening ones, run as one batched forward pass
(run_batch); each session's verdict depends only on its own tokens and random stream, never on what it was
batched with. A session may also have its next token scored ahead of its round (AheadCall, docs/design/
decode_ahead.md): the pass then runs while the verdict that produced the token is on the wire. Each kind of call
(target_worker.calls) checks, feeds and finishes itself. The engine knows nothing of gRPC; target_worker.server
translates protobuf to calls on it.
"""

import time

import torch
from transformers.cache_utils import Cache

from specdec.common.batcher import run_alone
from specdec.common.cached_sequence import CachedSequence
from specdec.common.config import WorkerConfig
from specdec.common.cost_curve import cheapest_rows
from specdec.common.memory import kv_token_budget
from specdec.common.errors import InvalidArgument
from specdec.common.grammar import vocabulary_of
from specdec.common.loaded_model import LoadedModel
from specdec.common.protocol import model_info, worker_info
from specdec.common.rounds import DraftQ, Verdict
from specdec.common.sampling import SamplingParams, make_generator
from specdec.common.prefix_cache import prefix_cache_for
from specdec.common.sessions import SessionRegistry, session_reservation
from specdec.common.timing import elapsed_us
from specdec.common.wire_limits import MAX_P_ENTRIES, MAX_Q_ENTRIES, MAX_STEP_TOKENS, MAX_TOP_LOGPROBS
from specdec.common.validation import (
    check_count,
    check_distribution,
    check_prompt,
    check_sampling,
    check_sampling_tokens,
    check_token_ids,
)
from specdec.common.worker_engine import WorkerEngine
from specdec.target_worker.calls import (
    Ahead,
    AheadCall,
    Call,
    PassFigures,
    PrefillBudget,
    PrefillCall,
    SessionOpened,
    TargetSession,
    VerifyCall,
)

__all__ = ["Ahead", "AheadCall", "Call", "PrefillCall", "SessionOpened", "TargetEngine", "TargetSession", "VerifyCall"]


class TargetEngine(WorkerEngine[TargetSession]):
    def __init__(
        self,
        loaded: LoadedModel,
        max_sessions: int = WorkerConfig.max_sessions,
        calibrate: bool = True,
        max_kv_tokens: int | None = WorkerConfig.max_kv_tokens,
        max_prefill_tokens: int = WorkerConfig.max_prefill_tokens_per_pass,
        prefix_cache_tokens: int = WorkerConfig.prefix_cache_tokens,
    ):
        self.loaded, self.runner = loaded, loaded.runner
        self.max_prefill_tokens = max_prefill_tokens
        self.forward_costs = self.runner.cost_curve(loaded.vocab_size) if calibrate else []
        self.prefixes = prefix_cache_for(self.runner, prefix_cache_tokens)
        # After the calibration, whose caches are gone by now: the budget is of the memory left to sessions.
        budget = max_kv_tokens or kv_token_budget(self.runner.kv_bytes_per_token, str(loaded.device))
        super().__init__("target", SessionRegistry(max_sessions, budget, self.prefixes))

    def begin_session(
        self,
        prompt: list[int],
        params: SamplingParams,
        num_p_entries: int = 0,
        max_tokens: int = 0,
        logprobs: int | None = None,
        prompt_logprobs: bool = False,
    ) -> TargetSession:
        """Checks the opening and reserves the session (and its max_tokens of the KV budget); its prompt is
        prefilled by a PrefillCall in a batch. logprobs: the committed tokens' log-probabilities with this many
        alternatives (None: none); prompt_logprobs: the prompt's too."""
        context = self.loaded.max_context_length
        check_prompt(prompt, self.loaded.vocab_size, context, "start.prompt_token_ids")
        check_sampling(params, "start.sampling")
        check_sampling_tokens(params, prompt, self.loaded.vocab_size, "start.sampling")
        check_count(num_p_entries, MAX_P_ENTRIES, "start.num_p_entries")
        if logprobs is not None:
            check_count(logprobs, MAX_TOP_LOGPROBS, "start.logprobs")
        elif prompt_logprobs:
            raise InvalidArgument("start.prompt_logprobs", "needs start.logprobs (the alternatives per position)")
        reservation = session_reservation(max_tokens, len(prompt), context)
        return self.reserve(
            reservation,
            lambda session_id: self.new_session(
                session_id, prompt, params, reservation, num_p_entries, logprobs, prompt_logprobs
            ),
        )

    def new_session(
        self,
        session_id: str,
        prompt: list[int],
        params: SamplingParams,
        reservation: int,
        num_p_entries: int,
        logprobs: int | None,
        prompt_logprobs: bool,
    ) -> TargetSession:
        """A reserved session, its grammar compiled and its cache allocated (not prefilled yet)."""
        grammar = None
        if params.grammar:
            vocabulary = self.vocabulary()
            grammar = vocabulary.session_matcher(params.grammar, prompt, params.grammar_start, "start.sampling.grammar")
        return TargetSession(
            session_id,
            CachedSequence(self.runner, prompt, reservation),
            params,
            make_generator(params.seed, "target"),
            num_p_entries,
            output_from=len(prompt) - params.generated_tokens,
            logprobs=logprobs,
            prompt_logprobs=[] if prompt_logprobs else None,
            grammar=grammar,
        )

    def vocabulary(self):
        """The tokenizer's index for grammars (built at the first constrained session: about a second for 151k
        tokens)."""
        return vocabulary_of(self.loaded.tokenizer, self.loaded.vocab_size)

    def compile_grammar(self, grammar: str) -> None:
        """Compiles a session's grammar into the cache ahead of begin_session (target_worker.server does it on a
        thread)."""
        self.vocabulary().compile(grammar, "start.sampling.grammar")

    def open_session(
        self,
        prompt: list[int],
        params: SamplingParams,
        num_p_entries: int = 0,
        max_tokens: int = 0,
        logprobs: int | None = None,
        prompt_logprobs: bool = False,
    ) -> tuple[TargetSession, SessionOpened]:
        """Opens and prefills one session on its own (a batch of one)."""
        session = self.begin_session(prompt, params, num_p_entries, max_tokens, logprobs, prompt_logprobs)
        try:
            return session, run_alone(self.run_batch, PrefillCall(session))
        except Exception:
            self.abandon(session)
            raise

    @staticmethod
    def check_step_size(draft_tokens, draft_dists) -> None:
        """The sizes of a step as received, checked before anything is converted (any sequences with len())."""
        check_count(len(draft_tokens), MAX_STEP_TOKENS, "step.draft_token_ids")
        check_count(len(draft_dists), MAX_STEP_TOKENS, "step.draft_distributions")
        for i, dist in enumerate(draft_dists):
            check_count(len(dist.token_ids), MAX_Q_ENTRIES, f"step.draft_distributions[{i}].token_ids")

    def check_step(self, session: TargetSession, draft_tokens: list[int], draft_dists: list[DraftQ]) -> None:
        vocab = self.loaded.vocab_size
        self.check_step_size(draft_tokens, draft_dists)
        check_token_ids(draft_tokens, vocab, "step.draft_token_ids")
        if len(draft_dists) != len(draft_tokens):
            raise InvalidArgument(
                "step.draft_distributions", f"need one per drafted token ({len(draft_tokens)}), got {len(draft_dists)}"
            )
        for i, (token, dist) in enumerate(zip(draft_tokens, draft_dists, strict=True)):
            check_distribution(dist, token, vocab, f"step.draft_distributions[{i}]")
        limit = session.sequence.max_tokens
        if len(session.sequence.tokens) + len(draft_tokens) + 1 > limit:
            raise InvalidArgument(
                "step.draft_token_ids", f"the sequence would exceed the session's {limit} tokens (start.max_tokens, the context)"
            )

    @staticmethod
    def check_decode_ahead(session: TargetSession) -> None:
        if not session.can_run_ahead:
            raise InvalidArgument(
                "step.decode_ahead",
                "this target's runner scores a row differently in passes of different row counts: a row scored ahead "
                "would differ from the same row scored in the round's pass",
            )

    def verify(self, session: TargetSession, draft_tokens: list[int], draft_dists: list[DraftQ]) -> Verdict:
        """One session's round on its own (a batch of one)."""
        return run_alone(self.run_batch, VerifyCall(session, draft_tokens, draft_dists))

    def score_ahead(self, session: TargetSession) -> Ahead:
        """One session's pending token scored ahead of its round, on its own (a batch of one)."""
        return run_alone(self.run_batch, AheadCall(session))

    def check_call(self, call: Call) -> None:
        call.check(self)

    def run_ready(self, calls: list[Call], ready: list[int], results: list) -> None:
        """One forward pass for the calls that passed their checks (run_batch, by their indices in ready), each
        one's result into results: the rounds of open sessions ([pending, x1..xg] each, then the acceptance test and
        the rollback of what it rejected), the pending tokens of sessions deciding ahead, and the prompts of opening
        sessions (prefilled in the same pass: the weights are streamed once for all of them). A round whose every
        row was scored ahead needs no pass: its verdict is decided at once."""
        ready = [i for i in ready if self.started(calls[i], results, i)]
        if not ready:
            return
        feeds = self.feeds([calls[i] for i in ready])
        batch_tokens = sum(len(f) for f in feeds)
        start = time.perf_counter()
        spans = [calls[i].span(PassFigures(0, len(ready), batch_tokens)) for i in ready]
        fed, batch = self.batch_of(calls, ready, feeds, batch_tokens)
        try:
            logits = self.runner.forward(*batch) if fed else []
        except BaseException:
            for span in spans:
                span.end()
            raise
        figures = PassFigures(elapsed_us(start) if fed else 0, len(ready), batch_tokens)
        rows = dict(zip(fed, logits, strict=False))
        for i, span in zip(ready, spans, strict=True):
            results[i] = calls[i].finish(self, rows.get(i), span, figures)
        if fed:
            self.metrics.record_forward("verify", elapsed_us(start) / 1e6)

    def started(self, call: Call, results: list, index: int) -> bool:
        """Readies a call for its pass (an opening's prefix from the prefix cache); False (its error in results)
        when that failed: that call fails, not the batch."""
        try:
            call.start(self)
        except Exception as error:  # noqa: BLE001 - e.g. no memory for the copy: this opening's failure alone
            results[index] = error
            return False
        return True

    def batch_of(
        self, calls: list[Call], ready: list[int], feeds: list[list[int]], batch_tokens: int
    ) -> tuple[list[int], tuple[list[Cache], list[list[int]], list[int]]]:
        """The pass's input: the indices of the calls that feed tokens, and the runner's forward arguments (the
        sequences' caches, their tokens, the logits rows to keep), padded to the cheapest row count."""
        fed = [(i, f) for i, f in zip(ready, feeds, strict=True) if f]  # a one-token prompt has nothing to prefill
        sequences = [calls[i].session.sequence for i, _ in fed]
        feeds = [f for _, f in fed]
        # A round keeps a row per token fed, and so does a prefill that reports the prompt's log-probabilities.
        keep = [len(f) if calls[i].keeps_rows else 1 for i, f in fed]
        padding = self.padding(batch_tokens)
        if padding and fed:
            # More rows are cheaper than these on this device: pad with a throwaway sequence of its own.
            # Its logits are computed too: the curve was measured with logits for every token.
            pad = CachedSequence(self.runner, [])
            sequences, feeds, keep = [*sequences, pad], [*feeds, [0] * padding], [*keep, padding]
        return [i for i, _ in fed], ([s.cache for s in sequences], feeds, keep)

    def feeds(self, calls: list[Call]) -> list[list[int]]:
        """What each call feeds this pass: a round its pending and drafted tokens (only the drafted ones where its
        pending token was scored ahead); a decode ahead its pending token; a prefill the next chunk of its prompt
        (all but the last token, which stays pending for the first round).

        Chunked prefill, as vLLM's and TGI's: the prefills of one pass hold at most max_prefill_tokens, so that a
        long prompt delays the other sessions' rounds by one chunk's pass at most. A session's chunks are always
        the same (max_prefill_tokens each, from its first token), whatever else is prefilling: the pass decides
        only which sessions' next chunks run now, so a session's numerics never depend on its batch-mates."""
        budget = PrefillBudget(self.max_prefill_tokens, self.max_prefill_tokens)
        return [call.feed(budget) for call in calls]

    def padding(self, tokens: int) -> int:
        if not self.runner.batch_invariant:
            return 0  # its sessions run one pass each: padding would be a pass of its own
        return cheapest_rows(self.forward_costs, tokens) - tokens

    def decide(self, call: VerifyCall, logits: torch.Tensor, span) -> Verdict:
        """The acceptance test on one round's scored rows, and the rollback of what it rejected (VerifyCall.decide;
        a seam for injected faults)."""
        return call.decide(self, logits, span)

    def closed(self, session: TargetSession) -> None:
        """A closed session's tokens and cache stay in the prefix cache, for the openings that share its prefix."""
        if self.prefixes is not None:
            self.prefixes.keep(session.sequence.tokens, session.sequence.cache)

    def info(self) -> dict:
        loaded = self.loaded
        return worker_info(
            loaded.name,
            loaded.vocab_size,
            loaded.device,
            loaded.max_context_length,
            self.sessions,
            self.forward_costs,
            {**model_info(loaded), "decodes_ahead": self.runner.rows_alone},
        )
