"""Batching across sessions: one forward pass serves every ready session, each at its own length and position, and
no session's output depends on what it was batched with."""

import asyncio
import time

import pytest
import torch

from specdec.common.batcher import CONTINUE
from specdec.common.batched_forward import GrowableLayer, forward_sessions, session_cache
from specdec.common.errors import InvalidArgument, ResourceExhausted
from specdec.common.models import load_model
from specdec.common.sampling import SamplingParams, truncate_probs
from specdec.coordinator.client import build_request
from specdec.coordinator.config import CoordinatorConfig
from specdec.draft_worker.engine import DraftCall, DraftEngine
from specdec.draft_worker.model_proposer import ModelProposer
from specdec.target_worker.engine import PrefillCall, TargetEngine, VerifyCall
from tests.support.services import draft_engine_for, running_services

PROMPTS = [[(7 * i + j) % 256 for j in range(n)] for i, n in enumerate([3, 11, 6, 25, 1, 9, 14, 4])]


def test_batched_forward_matches_each_session_alone(target_model):
    model = target_model.model
    layers = model.config.num_hidden_layers
    alone, batched = [session_cache(layers) for _ in PROMPTS], [session_cache(layers) for _ in PROMPTS]
    for a, b, prompt in zip(alone, batched, PROMPTS, strict=True):
        forward_sessions(model, [a], [prompt], [1])
        forward_sessions(model, [b], [prompt], [1])
    feeds = [[(i + k) % 256 for k in range(1 + i % 5)] for i in range(len(PROMPTS))]
    expected = [forward_sessions(model, [a], [f], [len(f)])[0] for a, f in zip(alone, feeds, strict=True)]
    got = forward_sessions(model, batched, feeds, [len(f) for f in feeds])
    for e, g in zip(expected, got, strict=True):
        assert g.shape == e.shape
        assert torch.allclose(g, e, atol=1e-5)
        assert torch.equal(g.argmax(-1), e.argmax(-1))
    for a, b in zip(alone, batched, strict=True):
        assert a.get_seq_length() == b.get_seq_length()
        assert torch.allclose(a.layers[0].keys, b.layers[0].keys, atol=1e-5)


def test_appending_to_a_session_cache_writes_only_the_new_tokens(target_model):
    """Appends go into spare capacity (no copy of the cache per round) and a rollback only moves the length."""
    model = target_model.model
    cache = session_cache(model.config.num_hidden_layers)
    forward_sessions(model, [cache], [list(range(10))], [1])
    layer: GrowableLayer = cache.layers[0]
    buffer = layer.key_buffer.data_ptr()
    for step in range(20):
        forward_sessions(model, [cache], [[step, step + 1]], [1])
        assert layer.key_buffer.data_ptr() == buffer
    assert cache.get_seq_length() == 50
    cache.crop(-7)
    assert cache.get_seq_length() == 43 and layer.keys.shape[-2] == 43 and layer.key_buffer.data_ptr() == buffer
    forward_sessions(model, [cache], [list(range(30))], [1])  # past the capacity of 64: it doubles, once
    assert cache.get_seq_length() == 73 and layer.key_buffer.shape[-2] == 128


def test_one_bad_call_in_a_batch_fails_alone(target_model):
    engine = TargetEngine(target_model, calibrate=False)
    greedy = SamplingParams(temperature=0)
    solo = [engine.open_session(p, greedy)[0] for p in PROMPTS[:3]]
    batch = [engine.open_session(p, greedy)[0] for p in PROMPTS[:3]]
    drafts = [[5, 6], [300, 1], [9]]  # 300 is outside the vocabulary
    dists = [[truncate_probs(torch.eye(256)[t % 256], 1) for t in d] for d in drafts]
    results = engine.run_batch([VerifyCall(s, d, q) for s, d, q in zip(batch, drafts, dists, strict=True)])
    assert isinstance(results[1], InvalidArgument) and "step.draft_token_ids" in str(results[1])
    for i in (0, 2):
        expected = engine.verify(solo[i], drafts[i], dists[i])
        assert (results[i].num_accepted, results[i].next_token) == (expected.num_accepted, expected.next_token)
        assert results[i].timing.batch_size == 2 and results[i].timing.batch_tokens == 2 + 1 + 1 + 1
        assert batch[i].sequence.tokens == solo[i].sequence.tokens


def test_batched_draft_steps_propose_what_each_session_proposes_alone(draft_models):
    engine = DraftEngine(ModelProposer(draft_models[0.5], calibrate=False), "draft")
    params = SamplingParams(temperature=0.8, seed=3)
    solo = [engine.open_session(p, params)[0] for p in PROMPTS]
    batch = [engine.open_session(p, params)[0] for p in PROMPTS]
    sizes = [1 + i % 4 for i in range(len(PROMPTS))]  # sessions finish after different numbers of passes
    proposals = engine.run_batch([DraftCall(h, 0, [], n) for h, n in zip(batch, sizes, strict=True)])
    for handle, n, proposal in zip(solo, sizes, proposals, strict=True):
        expected = engine.step(handle, 0, [], n)
        assert proposal.token_ids == expected.token_ids and proposal.timing.batch_size == len(PROMPTS)
        for q, e in zip(proposal.distributions, expected.distributions, strict=True):
            assert torch.equal(q.token_ids, e.token_ids) and torch.allclose(q.probs, e.probs, atol=1e-6)


@pytest.mark.parametrize("gamma", [3, -1], ids=["gamma=3", "auto"])
def test_concurrent_requests_share_forward_passes_and_match_their_solo_output(target_model, draft_models, gamma):
    async def run():
        config = CoordinatorConfig()
        async with running_services(TargetEngine(target_model), draft_engine_for(draft_models, 0.1), config) as services:

            def request(i: int, prompt: list[int]):
                sampled = {"temperature": 0.9, "seed": i} if i % 2 else {"temperature": 0}
                return build_request(
                    prompt, max_new_tokens=48, ignore_eos=True, num_speculative_tokens=gamma, include_rounds=True, **sampled
                )

            solo = [await services.stub.Generate(request(i, p)) for i, p in enumerate(PROMPTS)]
            together = await asyncio.gather(*(services.stub.Generate(request(i, p)) for i, p in enumerate(PROMPTS)))
            for alone, batched in zip(solo, together, strict=True):
                assert list(batched.token_ids) == list(alone.token_ids)
            assert max(r.target_batch_size for response in together for r in response.rounds) > 1
            assert all(r.target_batch_size == 1 for r in solo[0].rounds)

    asyncio.run(run())


def test_an_int8_model_runs_its_sessions_one_pass_each_so_that_batching_cannot_change_them():
    """Dynamic int8 quantization scales activations per tensor: batched, one session would see the others' scale."""
    runner = load_model("tiny-random:seed=0,vocab=256,layers=2,hidden=64#int8").runner
    alone, batched = [runner.new_cache() for _ in PROMPTS], [runner.new_cache() for _ in PROMPTS]
    expected = [runner.forward([c], [p], [1])[0] for c, p in zip(alone, PROMPTS, strict=True)]
    got = runner.forward(batched, PROMPTS, [1] * len(PROMPTS))
    assert all(torch.equal(e, g) for e, g in zip(expected, got, strict=True))
    # The test can fail: the same sessions in one pass of the int8 model are scored differently.
    together = forward_sessions(runner.model, [runner.new_cache() for _ in PROMPTS], PROMPTS, [1] * len(PROMPTS))
    assert not all(torch.equal(e, g) for e, g in zip(expected, together, strict=True))


def test_a_verification_padded_to_a_cheaper_row_count_gives_the_same_verdict(target_model):
    engine = TargetEngine(target_model, calibrate=False)
    engine.forward_costs = [(1, 10.0), (2, 30.0), (3, 30.0), (4, 12.0)]  # 2 or 3 rows cost more than 4
    assert engine.padding(2) == 2 and engine.padding(1) == 0
    greedy = SamplingParams(temperature=0)
    padded, plain = engine.open_session(PROMPTS[3], greedy)[0], engine.open_session(PROMPTS[3], greedy)[0]
    drafts = [[17], [17, 5]]
    for draft in drafts:
        dists = [truncate_probs(torch.eye(256)[t], 1) for t in draft]
        got = engine.verify(padded, draft, dists)
        engine.forward_costs, saved = [], engine.forward_costs
        expected = engine.verify(plain, draft, dists)
        engine.forward_costs = saved
        assert (got.num_accepted, got.next_token) == (expected.num_accepted, expected.next_token)
        assert padded.sequence.tokens == plain.sequence.tokens
        assert padded.sequence.cache_len == plain.sequence.cache_len


def test_an_opening_session_is_prefilled_in_the_same_pass_as_the_others_rounds(target_model):
    engine = TargetEngine(target_model, calibrate=False)
    greedy = SamplingParams(temperature=0)
    running, reference = engine.open_session(PROMPTS[1], greedy)[0], engine.open_session(PROMPTS[1], greedy)[0]
    opening = engine.begin_session(PROMPTS[3], greedy)
    dists = [truncate_probs(torch.eye(256)[5], 1)]
    opened, verdict = engine.run_batch([PrefillCall(opening), VerifyCall(running, [5], dists)])
    assert opened.cached_tokens == len(PROMPTS[3]) - 1 and opening.session_id in engine.sessions.sessions
    expected = engine.verify(reference, [5], dists)
    assert (verdict.num_accepted, verdict.next_token) == (expected.num_accepted, expected.next_token)
    assert verdict.timing.batch_size == 2 and verdict.timing.batch_tokens == len(PROMPTS[3]) - 1 + 2
    alone = engine.open_session(PROMPTS[3], greedy)[0]
    first = engine.verify(opening, [], [])
    assert first.next_token == engine.verify(alone, [], []).next_token


def test_an_opening_reports_its_wait_in_the_worker_apart_from_its_prefill(target_model):
    """What the opening waited for (a batch, the passes between its chunks) is reported as queue_us, so that the
    coordinator's first guess of a round's transport (the round trip less both) does not count it."""
    engine = TargetEngine(target_model, calibrate=False, max_prefill_tokens=8)
    opening = PrefillCall(engine.begin_session(PROMPTS[3], SamplingParams(temperature=0)))
    opening.queued_at = time.perf_counter() - 0.2  # as the batcher sets it: it arrived 200 ms ago
    while (opened := engine.run_batch([opening])[0]) is CONTINUE:  # 24 tokens in chunks of 8
        pass
    in_worker_us = 1e6 * (time.perf_counter() - opening.queued_at)
    assert opened.compute_us > 0 and opened.queue_us >= 200_000
    assert opened.queue_us + opened.compute_us <= in_worker_us + 1  # the prefill is not counted as waiting


def test_an_abandoned_opening_frees_its_reservation(target_model):
    engine = TargetEngine(target_model, max_sessions=1, calibrate=False)
    session = engine.begin_session(PROMPTS[0], SamplingParams(temperature=0))
    with pytest.raises(ResourceExhausted):
        engine.begin_session(PROMPTS[1], SamplingParams(temperature=0))
    engine.abandon(session)
    assert isinstance(engine.run_batch([PrefillCall(session)])[0], Exception)
    assert len(engine.sessions) == 0
    engine.open_session(PROMPTS[1], SamplingParams(temperature=0))
