"""Prefix caching (common.prefix_cache): a prompt that begins with a closed session's tokens starts from a copy of
that session's keys and values. On the gguf engine every row is computed alone, so a token's keys and values are the
same whichever pass computed them: a session that reuses a prefix is scored bit for bit as one that prefilled it.
Kept caches live inside the KV budget and give their room back to openings."""

import asyncio

import pytest
import torch

from specdec.common.errors import ResourceExhausted
from specdec.common.prefix_cache import PrefixCache
from specdec.common.sampling import SamplingParams
from specdec.common.sessions import SessionRegistry
from specdec.coordinator.client import build_request
from specdec.coordinator.http_responses import usage_of
from specdec.coordinator.types import GenerationResult, TimeSplit
from specdec.draft_worker.engine import DraftEngine
from specdec.draft_worker.model_proposer import ModelProposer
from specdec.target_worker.engine import TargetEngine
from tests.support.distributions import one_hot
from tests.support.services import running_services

GREEDY = SamplingParams(temperature=0)
SAMPLED = SamplingParams(temperature=1.0, seed=5)


def prompt_of(n: int, seed: int = 0) -> list[int]:
    return torch.randint(10, 4000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def layer_contents(cache) -> list[torch.Tensor]:
    return [t[:, :, : layer.length].clone() for layer in cache.layers for t in (layer.key_buffer, layer.value_buffer)]


def test_a_prompts_keys_and_values_are_the_same_whichever_passes_computed_them(smollm2):
    """What makes a reused prefix exact: one pass, chunks of any size and single tokens write the same numbers."""
    prompt = prompt_of(90)
    caches = []
    for chunk in (90, 37, 8, 3, 1):
        cache = smollm2.runner.new_cache()
        for start in range(0, len(prompt), chunk):
            smollm2.runner.forward([cache], [prompt[start : start + chunk]], [1])
        caches.append(layer_contents(cache))
    for other in caches[1:]:
        assert all(torch.equal(a, b) for a, b in zip(caches[0], other, strict=True))


def run_session(engine: TargetEngine, prompt: list[int], params: SamplingParams, rounds: int = 10):
    """A session's verdicts over a script of rounds, every other one drafting 1 to 3 tokens (passes of several
    rows write its cache, and crops take rejected rows back), its tokens, and how many prompt tokens it reused."""
    session, opened = engine.open_session(prompt, params, max_tokens=len(prompt) + 5 * rounds + 8)
    verdicts = []
    try:
        for i in range(rounds):
            drafts = [] if i % 2 else [7] * (1 + i % 3)
            verdicts.append(engine.verify(session, drafts, [one_hot(t) for t in drafts]))
        return verdicts, list(session.sequence.tokens), opened.reused_tokens
    finally:
        engine.close_session(session)


def verdict_figures(verdicts):
    return [(v.num_accepted, v.next_token, v.rollback, v.draft_token_probs) for v in verdicts]


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_a_session_that_reuses_a_prefix_is_scored_as_one_that_prefilled_it(smollm2, params):
    cached = TargetEngine(smollm2, calibrate=False)
    plain = TargetEngine(smollm2, calibrate=False, prefix_cache_tokens=0)
    first = prompt_of(70)
    _, tokens, reused = run_session(cached, first, params)
    assert reused == 0
    # The next turn: the whole first exchange (prompt and answer, whose cache the rounds wrote) and a new line.
    second = tokens + prompt_of(20, seed=1)
    reused_verdicts, reused_tokens, reused = run_session(cached, second, params)
    plain_verdicts, plain_tokens, plain_reused = run_session(plain, second, params)
    assert plain_reused == 0 and reused == len(tokens) - 1  # the first session's last token was never fed
    assert reused_tokens == plain_tokens
    assert verdict_figures(reused_verdicts) == verdict_figures(plain_verdicts)


def draft_session(engine: DraftEngine, prompt: list[int], steps: int = 6):
    """A sampled draft session's proposals over steps that accept half of each and commit a token of its own; its
    tokens, and how many prompt tokens it reused."""
    handle, _, _ = engine.open_session(prompt, SAMPLED, max_tokens=len(prompt) + 6 * steps + 8)
    proposals, accepted = [], 0
    try:
        for i in range(steps):
            committed = [11 + i] if proposals else []
            proposal = engine.step(handle, accepted, committed, 4)
            proposals.append((proposal.token_ids, [d.probs.tolist() for d in proposal.distributions]))
            accepted = len(proposal.token_ids) // 2
        return proposals, list(handle.state.tokens), handle.state.reused_tokens
    finally:
        engine.close_session(handle)


def test_a_draft_session_that_reuses_a_prefix_proposes_as_one_that_prefilled_it(smollm2):
    """The draft's numbers only shape acceptance, never the output's distribution; they are reused on the same
    rule, so that a seeded request samples the same drafts with a warm cache as with a cold one."""
    cached = DraftEngine(ModelProposer(smollm2, calibrate=False), "draft")
    plain = DraftEngine(ModelProposer(smollm2, calibrate=False, prefix_cache_tokens=0), "draft")
    _, tokens, reused = draft_session(cached, prompt_of(60))
    assert reused == 0
    second = tokens + prompt_of(10, seed=2)
    reused_proposals, _, reused = draft_session(cached, second)
    plain_proposals, _, plain_reused = draft_session(plain, second)
    assert reused > 50 and plain_reused == 0 and cached.info()["prefix_cache_held_tokens"] > 0
    assert reused_proposals == plain_proposals


def test_a_prompt_equal_to_a_kept_one_recomputes_only_its_last_token(smollm2):
    engine = TargetEngine(smollm2, calibrate=False)
    prompt = prompt_of(40)
    for expected in (0, 39, 39):
        session, opened = engine.open_session(prompt, GREEDY, max_tokens=60)
        assert opened.reused_tokens == expected and len(session.sequence.pending()) == 1
        engine.close_session(session)
    assert engine.prefixes.hits == 2


def test_the_torch_runner_keeps_no_prefix_cache(target_model):
    engine = TargetEngine(target_model, calibrate=False)
    assert engine.prefixes is None and engine.info()["prefix_cache_tokens"] == 0


def kept(prefixes: PrefixCache, tokens: list[int], held: int) -> bool:
    cache = type("Cache", (), {})()
    cache.get_seq_length = lambda: len(tokens)
    cache.layers = [type("Layer", (), {"key_buffer": torch.empty(1, 1, held, 1)})()]
    return prefixes.keep(tokens, cache)


def test_the_prefix_cache_keeps_the_longest_and_evicts_the_least_recently_used_within_its_bound():
    prefixes = PrefixCache(max_tokens=100)
    assert kept(prefixes, [1, 2, 3], 40)
    assert kept(prefixes, [1, 2, 3, 4, 5], 40)  # replaces [1, 2, 3], a prefix of it
    assert [e.tokens.tolist() for e in prefixes.entries] == [[1, 2, 3, 4, 5]]
    assert not kept(prefixes, [1, 2, 3, 4], 40)  # adds nothing
    assert kept(prefixes, [9, 8, 7], 40)
    assert prefixes.longest([1, 2, 3, 4, 5, 6])[1] == 5
    assert prefixes.longest([1, 2, 3, 4, 5])[1] == 4  # its last token stays to be fed
    assert kept(prefixes, [6, 6, 6], 40)  # 120 > 100: the least recently used ([9, 8, 7]) goes
    assert sorted(e.tokens.tolist()[0] for e in prefixes.entries) == [1, 6] and prefixes.held == 80
    assert not kept(prefixes, [5, 5, 5], 101)  # more than the whole bound


def test_kept_caches_give_their_room_back_to_an_opening_and_limits_still_fail_closed():
    prefixes = PrefixCache(max_tokens=1000)
    registry = SessionRegistry(max_sessions=8, max_kv_tokens=100, spare=prefixes)
    assert kept(prefixes, [1, 2, 3], 60) and kept(prefixes, [4, 5, 6], 30)
    first = registry.reserve(50)  # 50 + 90 kept > 100: the older kept cache goes
    assert prefixes.held == 30 and [e.tokens.tolist() for e in prefixes.entries] == [[4, 5, 6]]
    with pytest.raises(ResourceExhausted):
        registry.reserve(60)  # even with nothing kept, 50 + 60 > 100: refused, and nothing evicted for it
    assert prefixes.held == 30
    registry.reserve(50)  # fits only without the kept cache
    assert prefixes.held == 0
    registry.release(first)
    assert registry.unreserved_kv_tokens() == 50


def test_a_closing_session_is_kept_only_within_the_budget_its_reservation_freed(smollm2):
    engine = TargetEngine(smollm2, calibrate=False, max_kv_tokens=300)
    holder, _ = engine.open_session(prompt_of(30, seed=3), GREEDY, max_tokens=200)
    session, _ = engine.open_session(prompt_of(40), GREEDY, max_tokens=100)
    engine.close_session(session)
    assert 0 < engine.prefixes.held <= 100
    engine.close_session(holder)
    assert engine.sessions.reserved_kv_tokens == 0 and engine.prefixes.held <= 300


def test_the_response_reports_the_prompt_tokens_the_target_reused(smollm2):
    """Through gRPC: the same output, and the second request's usage counts the cached prompt tokens."""

    async def run():
        async with running_services(TargetEngine(smollm2, calibrate=False), None) as services:
            prompt = "def fibonacci(n):\n    " * 6
            responses = [
                await services.stub.Generate(build_request(text, max_new_tokens=12, temperature=0, ignore_eos=True))
                for text in (prompt, prompt, prompt + "return")
            ]
            return responses

    first, again, longer = asyncio.run(run())
    assert list(first.token_ids) == list(again.token_ids)
    assert first.usage.cached_prompt_tokens == 0
    assert again.usage.cached_prompt_tokens == first.usage.prompt_tokens - 1
    assert 0 < longer.usage.cached_prompt_tokens < longer.usage.prompt_tokens


def test_the_http_usage_reports_the_cached_prompt_tokens_where_openai_does():
    result = GenerationResult("", [1, 2], 0, 30, 0, [], TimeSplit(), cached_prompt_tokens=29)
    assert usage_of([result]) == {
        "prompt_tokens": 30,
        "completion_tokens": 2,
        "total_tokens": 32,
        "prompt_tokens_details": {"cached_tokens": 29},
    }
