"""Verification on the target model: one forward pass per round, the acceptance test, and the cache rollback.

The rounds of all sessions that are ready, and the prompts of opening ones, run as one batched forward pass
(run_batch); each session's verdict depends only on its own tokens and random stream, never on what it was
batched with. A session may also have its next token scored ahead of its round (AheadCall, docs/design/
decode_ahead.md): the pass then runs while the verdict that produced the token is on the wire. The engine knows
nothing of gRPC; target_worker.server translates protobuf to calls on it.
"""

import time
from dataclasses import dataclass, field

import torch

from opentelemetry.context import Context

from common.batched_forward import as_sampling_input
from common.batcher import CONTINUE, Continue, run_alone
from common.cached_sequence import CachedSequence, forward_batch
from common.config import WorkerConfig
from common.cost_curve import cheapest_rows
from common.memory import kv_token_budget
from common.errors import FailedPrecondition, InvalidArgument
from common.grammar import GrammarMatcher, mask_logits, vocabulary_of
from common.loaded_model import LoadedModel
from common.protocol import model_info, worker_info
from common.rounds import DraftQ, Verdict
from common.sampling import (
    SamplingParams,
    TokenLogprob,
    accept_while_argmax,
    adjusted_logits,
    logits_to_probs,
    make_generator,
    token_logprobs,
    top_entries,
    verify_draft,
)
from common.prefix_cache import prefix_cache_for
from common.sessions import SessionRegistry, session_reservation
from common.telemetry import tracer
from common.timing import elapsed_us
from common.worker_metrics import WorkerMetrics
from common.wire_limits import MAX_P_ENTRIES, MAX_Q_ENTRIES, MAX_STEP_TOKENS, MAX_TOP_LOGPROBS
from common.validation import (
    check_count,
    check_distribution,
    check_prompt,
    check_sampling,
    check_sampling_tokens,
    check_token_ids,
)


@dataclass
class TargetSession:
    session_id: str
    sequence: CachedSequence
    params: SamplingParams
    generator: torch.Generator
    num_p_entries: int
    last_active: float = field(default_factory=time.monotonic)
    ahead: "Ahead | None" = None  # its pending token, scored before its round arrived
    output_from: int = 0  # where the request's output begins in its tokens (the logit adjustments' prompt ends)
    logprobs: int | None = None  # the committed tokens' log-probabilities, with this many alternatives (None: off)
    prompt_logprobs: list[TokenLogprob] | None = None  # filled by the prefill when asked for (None: not asked)
    grammar: GrammarMatcher | None = None  # at the committed output

    @property
    def can_run_ahead(self) -> bool:
        """Its next round's first row may be scored in a pass of its own: the same numbers as in the round's own
        pass only where a row's logits depend neither on the rows beside it nor on their count (what GetInfo's
        decodes_ahead says)."""
        return self.sequence.runner.rows_alone

    @property
    def argmax_verdict(self) -> bool:
        """Greedy and reporting no p: p is one-hot, so a verdict reads only the argmax of the logits, never q."""
        return self.params.greedy and not self.num_p_entries

    def adjusted(self, logits: torch.Tensor, draft_tokens: list[int]) -> torch.Tensor:
        """The rows of a round, each adjusted as a one-at-a-time target would have at its position."""
        return adjusted_logits(logits, self.params, self.sequence.tokens, self.output_from, draft_tokens)


@dataclass
class VerifyCall:
    """One session's round in a batch: its draft tokens, their q, and the trace context it belongs to."""

    session: TargetSession
    draft_tokens: list[int]
    draft_dists: list[DraftQ]  # a sampled session's as tensors; a greedy one's maybe as received (only checked)
    parent: Context | None = None
    queued_at: float = 0.0  # set by the batcher
    queue_us: int = 0
    # Under a grammar: the masks of the rows it scores, and how many drafted tokens it feeds (up to the first one
    # the grammar forbids, which is tested without a row of its own: its p is 0, so it is rejected).
    allowed: torch.Tensor | None = None
    fed: int | None = None
    num_tested: int | None = None

    @property
    def feeds(self) -> list[int]:
        return self.draft_tokens if self.fed is None else self.draft_tokens[: self.fed]

    @property
    def tested(self) -> list[int]:
        return self.draft_tokens if self.num_tested is None else self.draft_tokens[: self.num_tested]


@dataclass
class AheadCall:
    """A session's pending token fed before its next round arrives (decode ahead): the pass scores the row the
    round would score first, and the round then feeds only its drafted tokens, or nothing at all."""

    session: TargetSession
    parent: Context | None = None
    queued_at: float = 0.0  # set by the batcher
    queue_us: int = 0


@dataclass
class Ahead:
    """A pending token scored ahead: the logits of the position after it, and the figures of the pass."""

    logits: torch.Tensor  # [1, V]
    compute_us: int
    batch_size: int
    batch_tokens: int


@dataclass
class PrefillCall:
    """An opening session's prompt, prefilled in a batch with the other sessions' rounds: in chunks, a pass at a
    time, when it is longer than the engine's max_prefill_tokens (the call then goes into several batches)."""

    session: TargetSession
    parent: Context | None = None
    queued_at: float = 0.0  # set by the batcher
    queue_us: int = 0
    compute_us: int = 0  # of its chunks so far
    reused_tokens: int | None = None  # of its prompt, copied from the prefix cache (None: not looked up yet)


Call = VerifyCall | AheadCall | PrefillCall


def keeps_rows(call: Call) -> bool:
    """Whether a call keeps the logits of every token it feeds (else only the last one's)."""
    return isinstance(call, VerifyCall) or (isinstance(call, PrefillCall) and call.session.prompt_logprobs is not None)


@dataclass
class SessionOpened:
    session_id: str
    cached_tokens: int
    compute_us: int
    queue_us: int = 0  # waiting in the worker beside its passes (for a batch, for the other chunks' turns)
    reused_tokens: int = 0  # of the prompt, copied from a closed session's cache instead of computed
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # when the opening asked for them


class TargetEngine:
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
        self.sessions: SessionRegistry[TargetSession] = SessionRegistry(max_sessions, budget, self.prefixes)
        self.metrics = WorkerMetrics("target", self.sessions)

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
        session_id = self.sessions.reserve(reservation)
        try:
            grammar = None
            if params.grammar:
                vocabulary = self.vocabulary()
                grammar = vocabulary.session_matcher(params.grammar, prompt, params.grammar_start, "start.sampling.grammar")
            sequence = CachedSequence(self.runner, prompt, reservation)
            return TargetSession(
                session_id,
                sequence,
                params,
                make_generator(params.seed, "target"),
                num_p_entries,
                output_from=len(prompt) - params.generated_tokens,
                logprobs=logprobs,
                prompt_logprobs=[] if prompt_logprobs else None,
                grammar=grammar,
            )
        except BaseException:
            self.sessions.release(session_id)
            raise

    def vocabulary(self):
        """The tokenizer's index for grammars (built at the first constrained session: about a second for 151k
        tokens)."""
        return vocabulary_of(self.loaded.tokenizer, self.loaded.vocab_size)

    def compile_grammar(self, grammar: str) -> None:
        """Compiles a session's grammar into the cache ahead of begin_session (target_worker.server does it on a
        thread)."""
        self.vocabulary().compile(grammar, "start.sampling.grammar")

    def abandon(self, session: TargetSession) -> None:
        """Frees a session whose opening failed or was cancelled, prefilled or not."""
        self.sessions.release(session.session_id)

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

    def run_batch(self, calls: list[Call]) -> list[Verdict | SessionOpened | Ahead | Exception]:
        """One forward pass for every call: the rounds of open sessions ([pending, x1..xg] each, then the acceptance
        test and the rollback of what it rejected), the pending tokens of sessions deciding ahead, and the prompts
        of opening sessions (prefilled in the same pass: the weights are streamed once for all of them). A call that
        fails its checks gets its error; the others still run. A round whose every row was scored ahead needs no
        pass: its verdict is decided at once."""
        results: list = [None] * len(calls)
        ready = self.checked(calls, results)
        if not ready:
            return results
        ready = [i for i in ready if self.started_from_kept(calls[i], results, i)]
        if not ready:
            return results
        feeds = self.feeds([calls[i] for i in ready])
        batch_tokens = sum(len(f) for f in feeds)
        start = time.perf_counter()
        spans = [self.start_span(calls[i], len(ready), batch_tokens) for i in ready]
        fed, batch = self.batch_of(calls, ready, feeds, batch_tokens)
        try:
            logits = forward_batch(*batch) if fed else []
        except BaseException:
            for span in spans:
                span.end()
            raise
        forward_us = elapsed_us(start) if fed else 0
        rows = dict(zip(fed, logits, strict=False))
        for i, span in zip(ready, spans, strict=True):
            call = calls[i]
            if isinstance(call, PrefillCall):
                span.end()
                results[i] = self.prefilled(call, rows.get(i), forward_us)
            elif isinstance(call, AheadCall):
                span.end()
                call.session.ahead = Ahead(rows[i].clone(), forward_us, len(ready), batch_tokens)
                results[i] = call.session.ahead
            else:
                results[i] = self.verified(call, rows.get(i), span, forward_us, len(ready), batch_tokens)
        if fed:
            self.metrics.record_forward("verify", elapsed_us(start) / 1e6)
        return results

    def checked(self, calls: list[Call], results: list) -> list[int]:
        """The indices of the calls that pass their checks; each other call's error goes into results."""
        ready = []
        for i, call in enumerate(calls):
            try:
                if not isinstance(call, PrefillCall) and call.session.session_id not in self.sessions.sessions:
                    raise FailedPrecondition("the session is closed")
                if isinstance(call, VerifyCall):
                    self.check_step(call.session, call.draft_tokens, call.draft_dists)
                    if call.session.grammar is not None:
                        call.allowed, call.fed, call.num_tested = call.session.grammar.masks_along(call.draft_tokens)
                elif isinstance(call, AheadCall):
                    self.check_decode_ahead(call.session)
                    if call.session.ahead is not None or len(call.session.sequence.pending()) != 1:
                        raise FailedPrecondition("decode ahead needs one pending token not yet scored")
                ready.append(i)
            except Exception as error:  # noqa: BLE001 - one bad message fails its own stream only
                results[i] = error
        return ready

    def started_from_kept(self, call: Call, results: list, index: int) -> bool:
        """An opening session's first pass starts from the longest prefix of its prompt a closed session left in
        the prefix cache; its prefill then feeds only the rest. False (its error in results) when the copy failed:
        that opening fails, not the batch."""
        if not isinstance(call, PrefillCall) or call.reused_tokens is not None:
            return True
        sequence = call.session.sequence
        try:
            # The prompt's log-probabilities need every row of it computed.
            reusing = self.prefixes is not None and call.session.prompt_logprobs is None
            call.reused_tokens = self.prefixes.start_from(sequence.tokens, sequence.cache) if reusing else 0
            return True
        except Exception as error:  # noqa: BLE001 - e.g. no memory for the copy: this opening's failure alone
            results[index] = error
            return False

    def batch_of(
        self, calls: list[Call], ready: list[int], feeds: list[list[int]], batch_tokens: int
    ) -> tuple[list[int], tuple[list[CachedSequence], list[list[int]], list[int]]]:
        """The pass's input: the indices of the calls that feed tokens, and forward_batch's arguments (sequences,
        their tokens, the logits rows to keep), padded to the cheapest row count."""
        fed = [(i, f) for i, f in zip(ready, feeds, strict=True) if f]  # a one-token prompt has nothing to prefill
        sequences = [calls[i].session.sequence for i, _ in fed]
        feeds = [f for _, f in fed]
        # A round keeps a row per token fed, and so does a prefill that reports the prompt's log-probabilities.
        keep = [len(f) if keeps_rows(calls[i]) else 1 for i, f in fed]
        padding = self.padding(batch_tokens)
        if padding and fed:
            # More rows are cheaper than these on this device: pad with a throwaway sequence of its own.
            # Its logits are computed too: the curve was measured with logits for every token.
            pad = CachedSequence(self.runner, [])
            sequences, feeds, keep = [*sequences, pad], [*feeds, [0] * padding], [*keep, padding]
        return [i for i, _ in fed], (sequences, feeds, keep)

    def prefilled(
        self, call: PrefillCall, logits: torch.Tensor | None, forward_us: int
    ) -> SessionOpened | FailedPrecondition | Continue:
        """An opening session after this pass: CONTINUE while chunks of its prompt remain, then SessionOpened.
        logits: the rows of the chunk this pass fed (each scoring the prompt token after it)."""
        call.compute_us += forward_us
        session, sequence = call.session, call.session.sequence
        if session.prompt_logprobs is not None and logits is not None:
            scored = len(session.prompt_logprobs)
            following = sequence.tokens[scored + 1 : scored + 1 + logits.shape[0]]
            session.prompt_logprobs += token_logprobs(as_sampling_input(logits), following, session.logprobs)
        if sequence.cache_len < len(sequence.tokens) - 1:
            return CONTINUE  # chunks of its prompt still to run
        if not self.sessions.add(call.session.session_id, call.session):
            return FailedPrecondition("the opening was abandoned")
        in_worker_us = int((time.monotonic() - call.queued_at) * 1e6) if call.queued_at else call.compute_us
        return SessionOpened(
            call.session.session_id,
            sequence.cache_len,
            call.compute_us,
            max(0, in_worker_us - call.compute_us),
            call.reused_tokens or 0,
            call.session.prompt_logprobs or [],
        )

    def verified(
        self, call: VerifyCall, logits: torch.Tensor | None, span, forward_us: int, batch_size: int, batch_tokens: int
    ) -> Verdict | Exception:
        """A round's verdict on the rows scored for it (its first one ahead, the rest by this pass, if any), with
        the passes' figures: a round scored wholly ahead reports the pass that scored it."""
        ahead, call.session.ahead = call.session.ahead, None
        if ahead is not None:
            logits = ahead.logits if logits is None else torch.cat([ahead.logits, logits])
            if forward_us == 0:
                batch_size, batch_tokens = ahead.batch_size, ahead.batch_tokens
        try:
            verdict = self.decide(call, logits, span)
        except Exception as error:  # noqa: BLE001 - fails this session's stream (and frees it), not the batch
            return error
        verdict.batch_size, verdict.batch_tokens = batch_size, batch_tokens
        verdict.compute_us += forward_us + (ahead.compute_us if ahead else 0)
        verdict.ahead_us = ahead.compute_us if ahead else 0
        verdict.queue_us = call.queue_us
        return verdict

    def feeds(self, calls: list[Call]) -> list[list[int]]:
        """What each call feeds this pass: a round its pending and drafted tokens (only the drafted ones where its
        pending token was scored ahead); a decode ahead its pending token; a prefill the next chunk of its prompt
        (all but the last token, which stays pending for the first round).

        Chunked prefill, as vLLM's and TGI's: the prefills of one pass hold at most max_prefill_tokens, so that a
        long prompt delays the other sessions' rounds by one chunk's pass at most. A session's chunks are always
        the same (max_prefill_tokens each, from its first token), whatever else is prefilling: the pass decides
        only which sessions' next chunks run now, so a session's numerics never depend on its batch-mates."""
        budget, feeds = self.max_prefill_tokens, []
        for call in calls:
            sequence = call.session.sequence
            if isinstance(call, VerifyCall):
                feeds.append(sequence.pending() + call.feeds)
                continue
            if isinstance(call, AheadCall):
                feeds.append(sequence.pending())
                continue
            start = sequence.cache_len
            chunk = sequence.tokens[start : min(len(sequence.tokens) - 1, start + self.max_prefill_tokens)]
            if len(chunk) > budget:
                chunk = []  # the next pass's
            budget -= len(chunk)
            feeds.append(chunk)
        return feeds

    @staticmethod
    def start_span(call: Call, batch_size: int, batch_tokens: int):
        batch = {"specdec.batch_size": batch_size, "specdec.batch_tokens": batch_tokens}
        if isinstance(call, AheadCall):
            return tracer().start_span("target.decode_ahead", context=call.parent, attributes=batch)
        if isinstance(call, PrefillCall):
            attributes = {
                "specdec.worker": "target",
                "specdec.prompt_tokens": len(call.session.sequence.tokens),
                "specdec.reused_tokens": call.reused_tokens or 0,
                **batch,
            }
            return tracer().start_span("prefill", context=call.parent, attributes=attributes)
        return tracer().start_span(
            "target.verify", context=call.parent, attributes={"specdec.gamma": len(call.draft_tokens), **batch}
        )

    def padding(self, tokens: int) -> int:
        if not self.runner.batch_invariant:
            return 0  # its sessions run one pass each: padding would be a pass of its own
        return cheapest_rows(self.forward_costs, tokens) - tokens

    def decide(self, call: VerifyCall, logits: torch.Tensor, span) -> Verdict:
        """The acceptance test on one session's scored rows, and the rollback of what it rejected."""
        session, draft_tokens = call.session, call.tested
        session.last_active = time.monotonic()
        start = time.perf_counter()
        gamma = len(call.draft_tokens)
        raw = logits  # the log-probabilities are the model's own, before the mask and the adjustments
        if call.allowed is not None:
            logits = mask_logits(as_sampling_input(logits), call.allowed)
        try:
            scores = session.adjusted(as_sampling_input(logits), draft_tokens) if session.params.adjusts_logits else logits
            if session.argmax_verdict:
                # p is one-hot at the argmax: the verdict needs only the argmax, computed where the logits are.
                argmax = scores.argmax(dim=-1).tolist()
                num_accepted, next_token = accept_while_argmax(argmax, draft_tokens)
                draft_token_probs = [float(a == x) for a, x in zip(argmax, draft_tokens, strict=False)]
                distributions = []
            else:
                probs = logits_to_probs(as_sampling_input(scores), session.params)
                num_accepted, next_token = verify_draft(probs, draft_tokens, call.draft_dists, session.params, session.generator)
                tested = torch.arange(len(draft_tokens))
                draft_token_probs = probs[tested, torch.tensor(draft_tokens, dtype=torch.long)].tolist()
                distributions = top_entries(probs, session.num_p_entries) if session.num_p_entries else []
            draft_token_probs += [0.0] * (gamma - len(draft_token_probs))  # cut by the grammar: p = 0
            span.set_attributes({"specdec.accepted": num_accepted, "specdec.rollback": gamma - num_accepted})
        finally:
            span.end()
        compute_us = elapsed_us(start)
        sequence = session.sequence
        with tracer().start_as_current_span(
            "kv.rollback",
            context=call.parent,
            attributes={"specdec.worker": "target", "specdec.rollback": gamma - num_accepted},
        ):
            sync_start = time.perf_counter()
            sequence.crop_to(len(sequence.tokens) + num_accepted)
            sync_us = elapsed_us(sync_start)
        self.metrics.record_rollback(sync_us / 1e6)
        committed = draft_tokens[:num_accepted] + [next_token]
        logprobs = [] if session.logprobs is None else token_logprobs(as_sampling_input(raw), committed, session.logprobs)
        sequence.tokens += committed
        if session.grammar is not None:
            session.grammar.consume(committed)
        return Verdict(
            num_accepted,
            next_token,
            gamma - num_accepted,
            draft_token_probs,
            distributions,
            compute_us,
            sync_us,
            logprobs=logprobs,
        )

    def close_session(self, session: TargetSession) -> None:
        if self.sessions.remove(session.session_id) and self.prefixes is not None:
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
