"""After rejections, both workers' cropped caches give the same logits as a fresh prefill of the accepted prefix,
and the rollback runs no forward pass."""

import contextlib

import torch

from specdec.common.cached_sequence import CachedSequence
from specdec.common.sampling import SamplingParams, logits_to_probs, truncate_probs
from specdec.draft_worker.engine import DraftEngine
from specdec.draft_worker.model_proposer import ModelProposer
from specdec.target_worker.engine import TargetEngine

PROMPT = [5, 17, 42, 99, 7, 63]


def fresh_next_logits(loaded, tokens: list[int]) -> torch.Tensor:
    sequence = CachedSequence(loaded.runner, tokens)
    sequence.prefill()
    return sequence.forward(sequence.pending(), 1)[-1]


@contextlib.contextmanager
def counting_forwards(model):
    calls = []
    hook = model.register_forward_hook(lambda *_: calls.append(1))
    try:
        yield calls
    finally:
        hook.remove()


def test_target_cache_after_rejection_equals_fresh_prefill(target_model):
    engine = TargetEngine(target_model)
    session, _ = engine.open_session(PROMPT, SamplingParams(temperature=0))
    sequence = session.sequence
    expected_first = int(fresh_next_logits(target_model, PROMPT).argmax())
    wrong = (expected_first + 1) % 256
    verdict = engine.verify(session, [wrong, 3, 4, 5], [truncate_probs(torch.eye(256)[t], 1) for t in (wrong, 3, 4, 5)])
    assert (verdict.num_accepted, verdict.next_token, verdict.rollback) == (0, expected_first, 4)
    assert sequence.tokens == PROMPT + [expected_first]
    assert sequence.cache_len == len(PROMPT) and sequence.cache.get_seq_length() == len(PROMPT)
    logits = sequence.forward(sequence.pending(), 1)[-1]
    assert torch.allclose(logits, fresh_next_logits(target_model, sequence.tokens), atol=1e-5)


def test_target_rollback_of_a_partial_acceptance_keeps_the_accepted_prefix(target_model):
    engine = TargetEngine(target_model)
    reference = CachedSequence(target_model.runner, PROMPT)
    reference.prefill()
    greedy = []
    feed = reference.pending()
    for _ in range(2):
        greedy.append(int(reference.forward(feed, 1)[-1].argmax()))
        feed = greedy[-1:]
    session, _ = engine.open_session(PROMPT, SamplingParams(temperature=0))
    drafted = greedy + [(greedy[-1] + 7) % 256, 1]
    verdict = engine.verify(session, drafted, [truncate_probs(torch.eye(256)[t], 1) for t in drafted])
    assert verdict.num_accepted == 2 and verdict.rollback == 2
    sequence = session.sequence
    assert sequence.tokens == PROMPT + greedy + [verdict.next_token]
    assert sequence.cache.get_seq_length() == len(PROMPT) + 2
    logits = sequence.forward(sequence.pending(), 1)[-1]
    assert torch.allclose(logits, fresh_next_logits(target_model, sequence.tokens), atol=1e-5)


def test_draft_cache_after_rejection_equals_fresh_prefill(draft_models):
    loaded = draft_models[0.5]
    engine = DraftEngine(ModelProposer(loaded), "draft", default_max_q_entries=256)
    params = SamplingParams(temperature=1.0, seed=0)
    handle, _, _ = engine.open_session(PROMPT, params)
    proposal = engine.step(handle, 0, [], 5)
    assert len(proposal.token_ids) == 5
    # The target accepted 2 of 5 and sent token 11: the draft crops x3, x4 (x5 was never fed) without a forward.
    with counting_forwards(loaded.model) as forwards:
        handle.state.sync(2, [11])
    assert forwards == []
    committed = PROMPT + proposal.token_ids[:2] + [11]
    assert handle.state.sequence.cache.get_seq_length() == len(committed) - 1
    next_q = engine.step(handle, 0, [], 1).distributions[0]
    expected = truncate_probs(logits_to_probs(fresh_next_logits(loaded, committed), params), 256)
    assert next_q.token_ids.tolist() == expected.token_ids.tolist()
    assert torch.allclose(next_q.probs, expected.probs, atol=1e-5)


def test_draft_keeps_its_cache_when_every_token_is_accepted(draft_models):
    loaded = draft_models[0.5]
    engine = DraftEngine(ModelProposer(loaded), "draft")
    handle, _, _ = engine.open_session(PROMPT, SamplingParams(temperature=0))
    proposal = engine.step(handle, 0, [], 3)
    handle.state.sync(3, [9])
    sequence = handle.state.sequence
    assert sequence.tokens == PROMPT + proposal.token_ids + [9]
    assert sequence.pending() == [proposal.token_ids[-1], 9]


def test_rollback_is_a_crop_not_a_re_forward(target_model):
    sequence = CachedSequence(target_model.runner, PROMPT)
    sequence.prefill()
    sequence.forward(sequence.pending() + [1, 2, 3, 4], 5)
    with counting_forwards(target_model.model) as forwards:
        assert sequence.crop_to(len(PROMPT) + 1) == 3
    assert forwards == [] and sequence.cache.get_seq_length() == len(PROMPT) + 1


def test_a_cloned_cache_scores_as_its_source_and_moves_on_its_own(target_model):
    runner = target_model.runner
    source = CachedSequence(runner, PROMPT)
    source.prefill()
    copy = CachedSequence(runner, PROMPT)
    copy.cache = runner.copy_cache(source.cache)
    assert copy.cache_len == source.cache_len == len(PROMPT) - 1
    assert torch.equal(copy.forward([PROMPT[-1]], 1), source.forward([PROMPT[-1]], 1))
    copy.forward([1, 2, 3], 1)  # the copy moves on; its source does not see it
    assert (copy.cache_len, source.cache_len) == (len(PROMPT) + 3, len(PROMPT))
    assert torch.allclose(source.forward([9], 1)[0], fresh_next_logits(target_model, PROMPT + [9]), atol=1e-5)
