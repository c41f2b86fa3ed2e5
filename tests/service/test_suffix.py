"""Suffix drafting: the tree against a brute-force reference, the proposer's contract, the global tree's bound, and
exactness (greedy equality through gRPC, the output distribution while the global tree learns from earlier
requests)."""

import asyncio
import random
import tracemalloc
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec.common.errors import InvalidArgument
from specdec.common.rounds import DraftSource
from specdec.common.sampling import SamplingParams
from specdec.coordinator.client import build_request
from specdec.draft_worker.engine import DraftEngine
from specdec.draft_worker.hybrid import HybridProposer
from specdec.draft_worker.model_proposer import ModelProposer
from specdec.draft_worker.proposer import deterministic_proposal
from specdec.draft_worker.specs import is_model_free, split_hybrid
from specdec.draft_worker.suffix import NODE_BYTES, SuffixProposer
from specdec.draft_worker.suffix_tree import ROOT, GlobalSuffixTree, SuffixTree
from specdec.v1 import worker_pb2
from specdec.target_worker.engine import TargetEngine
from tests.support.services import draft_engine_for, running_services
from tests.support.statistics import chi_square_p_value, enumerate_sequences, sample_sequences

GREEDY = SamplingParams(temperature=0)
SUFFIX_SOURCES = {worker_pb2.DRAFT_SOURCE_SUFFIX_REQUEST, worker_pb2.DRAFT_SOURCE_SUFFIX_GLOBAL}
SOURCES = {"suffix": SUFFIX_SOURCES, "hybrid": SUFFIX_SOURCES | {worker_pb2.DRAFT_SOURCE_MODEL}}


def substring_counts(sequences: list[list[int]], depth: int) -> Counter:
    return Counter(tuple(s[i : i + k]) for s in sequences for i in range(len(s)) for k in range(1, depth + 1) if i + k <= len(s))


def tree_counts(tree: SuffixTree) -> dict[tuple[int, ...], int]:
    counts, stack = {}, [(ROOT, ())]
    while stack:
        node, path = stack.pop()
        for child in tree.children(node):
            counts[path + (tree.token[child],)] = tree.count[child]
            stack.append((child, path + (tree.token[child],)))
    return counts


def brute_longest_match(sequences: list[list[int]], context: list[int], limit: int) -> int:
    """The longest suffix of context (at most limit tokens) that occurs somewhere followed by another token."""
    best = 0
    for m in range(1, min(limit, len(context)) + 1):
        suffix = context[-m:]
        if any(s[i : i + m] == suffix and i + m < len(s) for s in sequences for i in range(len(s))):
            best = m
    return best


@settings(max_examples=150, deadline=None)
@given(
    depth=st.integers(2, 6),
    sequences=st.lists(st.lists(st.integers(0, 3), max_size=30), min_size=1, max_size=4),
    chunk=st.integers(1, 5),
    removed=st.integers(0, 4),
    context=st.lists(st.integers(0, 3), min_size=1, max_size=8),
)
def test_the_tree_counts_every_substring_and_finds_the_longest_match_as_brute_force_does(
    depth, sequences, chunk, removed, context
):
    tree = SuffixTree(depth)
    for sequence in sequences:  # appended a few tokens at a time, as rounds commit them
        cursor = tree.cursor()
        for start in range(0, len(sequence), chunk):
            tree.append(cursor, sequence[start : start + chunk])
    if removed < len(sequences):
        tree.remove(sequences.pop(removed))
    assert tree_counts(tree) == substring_counts(sequences, depth)
    assert len(tree) == len(substring_counts(sequences, depth)) and tree.tokens_held == sum(map(len, sequences))
    for path in tree_counts(tree):  # each node's leader is a most frequent child
        node = tree.walk(path)
        if tree.children(node):
            assert tree.count[tree.best[node]] == max(tree.count[c] for c in tree.children(node))
    length, node = tree.longest_match(context, 10)
    assert length == brute_longest_match(sequences, context, min(10, depth - 1))
    assert node == (tree.walk(context[len(context) - length :]) if length else -1)


def test_a_speculation_follows_the_most_frequent_continuation_for_as_long_as_the_match():
    tree = SuffixTree(16)
    text = [1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3, 4, 9, 9, 1, 2, 3, 4, 5, 6, 7]
    tree.append(tree.cursor(), text)
    # [1 2 3 4] was followed by 5 twice and by 9 once: 5 leads, with probability 2/3 after it.
    found = tree.speculate([0, 1, 2, 3, 4], max_tokens=8, max_match=8, factor=1.0, min_prob=0.1)
    assert found.match_length == 4 and found.token_ids == [5, 6, 7, 8]
    assert found.score == pytest.approx(2 / 3 + 2 / 3 + 2 / 3 + 1 / 3)
    assert tree.speculate([3, 4], 8, 8, factor=1.0, min_prob=0.1).token_ids == [5, 6]  # factor x match length
    assert tree.speculate([3, 4], 8, 8, factor=2.0, min_prob=0.5).token_ids == [5, 6, 7]  # the path's probability floor
    assert tree.speculate([42], 8, 8, 1.0, 0.1).token_ids == []  # no match


@pytest.mark.slow
def test_the_global_tree_stays_within_its_token_budget_over_a_long_run():
    """Bounded memory: 400 requests' outputs through a budget of 2,000 tokens; the nodes, the tokens held and the
    bytes allocated stay bounded, the latest outputs are kept and the oldest evicted."""
    rng = random.Random(0)
    shared = GlobalSuffixTree(depth=16, max_tokens=2000)
    tracemalloc.start()
    peaks = []
    for request in range(400):
        output = [rng.randrange(1000) for _ in range(rng.randrange(50, 300))]
        shared.add(output)
        assert shared.tree.tokens_held <= 2000 and len(shared.tree) <= 2000 * 16
        if request >= 100:
            peaks.append(tracemalloc.get_traced_memory()[0])
    tracemalloc.stop()
    assert max(peaks) < 1.5 * min(peaks), "memory keeps growing"
    assert shared.tree.speculate(output[:5], 4, 8, 1.0, 0.1).token_ids == output[5:9]
    assert len(shared.held) < 40
    assert shared.tree.tokens_held == sum(map(len, shared.held.values()))


def test_the_global_tree_shows_the_memory_a_thousand_tokens_cost():
    """The figure the README and the KV budget quote: bytes per 1k tokens of text that never repeats (the worst
    case: depth nodes a token)."""
    rng = random.Random(1)
    tracemalloc.start()
    tree = SuffixTree(24)
    tree.append(tree.cursor(), [rng.randrange(30000) for _ in range(1000)])
    held = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    assert len(tree) > 20_000
    assert held / len(tree) < NODE_BYTES and held / 1000 < SuffixProposer(depth=24).kv_bytes_per_token


def test_a_session_tree_is_extended_by_what_the_target_commits_never_rebuilt():
    proposer = SuffixProposer(global_tokens=0)
    prompt = [7, 1, 2, 3, 4, 5, 8, 1, 2]
    state = proposer.open(prompt, GREEDY, 0, 64)
    assert proposer.propose([state], [(4, False)])[0].token_ids == [3, 4]  # match [1, 2]: two tokens
    proposer.observe(state, 1, [9])  # 3 accepted, then 9
    assert state.tokens == prompt + [3, 9] and state.tree.tokens_held == len(prompt) + 2
    rebuilt = SuffixTree(proposer.depth)
    rebuilt.append(rebuilt.cursor(), state.tokens)
    assert tree_counts(state.tree) == tree_counts(rebuilt)


def test_the_global_tree_proposes_what_an_earlier_request_answered_except_to_a_seeded_sample():
    proposer = SuffixProposer()
    first = proposer.open([1, 2, 3], GREEDY, 0, 64)
    answer = [10, 11, 12, 13, 14, 15, 16, 17]
    proposer.observe(first, 0, answer)
    proposer.close(first)  # its output goes into the global tree
    second = proposer.open([4, 5, 10, 11, 12, 13], GREEDY, 0, 64)  # no earlier occurrence in its own text
    proposal = proposer.propose([second], [(8, False)])[0]
    assert proposal.token_ids == [14, 15, 16, 17] and all(float(q.probs[0]) == 1.0 for q in proposal.distributions)
    seeded = proposer.open([4, 5, 10, 11, 12, 13], SamplingParams(temperature=1.0, seed=7), 0, 64)
    assert proposer.propose([seeded], [(8, False)])[0].token_ids == []  # its drafts must not depend on other requests
    unseeded = proposer.open([4, 5, 10, 11, 12, 13], SamplingParams(temperature=1.0), 0, 64)
    assert proposer.propose([unseeded], [(8, False)])[0].token_ids == [14, 15, 16, 17]
    private = SuffixProposer(global_tokens=0)
    first = private.open([1, 2, 3], GREEDY, 0, 64)
    private.observe(first, 0, answer)
    private.close(first)
    assert private.propose([private.open([4, 5, 10, 11, 12, 13], GREEDY, 0, 64)], [(8, False)])[0].token_ids == []


def test_suffix_specs_parse_and_refuse_out_of_range_values():
    proposer = SuffixProposer.from_spec("suffix:depth=16,factor=2.5,min_prob=0.2,global=0")
    assert (proposer.depth, proposer.factor, proposer.min_prob, proposer.shared) == (16, 2.5, 0.2, None)
    for bad in ("suffix:depth=1", "suffix:factor=0", "suffix:min_prob=2", "suffix:global=-1", "suffix:size=3"):
        with pytest.raises(InvalidArgument, match="model"):
            SuffixProposer.from_spec(bad)
    assert split_hybrid("suffix:depth=16+qwen2.5-coder-0.5b#int8") == ("suffix:depth=16", "qwen2.5-coder-0.5b#int8")
    assert split_hybrid("qwen2.5-coder-0.5b") == ("", "qwen2.5-coder-0.5b")
    assert is_model_free("suffix") and is_model_free("ngram:max=4") and not is_model_free("suffix+smollm2-135m")
    assert not is_model_free("suffix:depth=8+smollm2-135m")


def test_the_hybrid_proposes_from_the_trees_where_they_match_and_from_the_model_elsewhere(draft_models):
    proposer = HybridProposer(SuffixProposer(global_tokens=0), ModelProposer(draft_models[0.5], calibrate=False))
    engine = DraftEngine(proposer, "hybrid")
    repeated = [5, 6, 7, 8, 9, 10, 11, 12]
    handle, _, _ = engine.open_session(repeated + [40] + repeated[:4], GREEDY)
    proposal = engine.step(handle, 0, [], 4)
    assert proposal.token_ids == [9, 10, 11, 12] and handle.state.last[0] == "suffix"
    unseen, _, _ = engine.open_session([3, 1, 4, 1, 5, 9, 2, 6], GREEDY)
    proposal = engine.step(unseen, 0, [], 4)
    assert len(proposal.token_ids) == 4 and unseen.state.last[0] == "model"
    # A verdict reaches both sources: the model's cache catches up on the trees' tokens at its next pass.
    engine.step(handle, 4, [77], 0)
    assert handle.state.model.tokens == handle.state.suffix.tokens == repeated + [40] + repeated + [77]
    again = engine.step(handle, 0, [], 3)
    assert len(again.token_ids) == 3 and handle.state.model.cached >= len(handle.state.model.tokens)


@pytest.mark.parametrize("kind", ["suffix", "hybrid"])
def test_greedy_suffix_speculation_equals_target_only_and_drafts(target_model, draft_models, kind):
    """Through the real gRPC services: the same tokens as target-only, with proposals made and accepted (the
    later requests' drafts come from the earlier ones' outputs too). Auto gamma comes last, its drafts from the
    global tree that holds the fixed gammas' outputs; whether it drafts is the cost model's call on what it measures
    (on these tiny models, noise under load: once the first proposal misses, drafting can look no better than not),
    which test_gamma_policy proves on given costs. Here auto must give the same tokens, its rounds naming their
    sources."""

    async def run():
        async with running_services(TargetEngine(target_model), draft_engine_for(draft_models, kind)) as services:
            for prompt in ["Once upon a time, there", "def add(a, b):\n    return a + b\n\ndef"]:
                reference = await services.stub.Generate(
                    build_request(prompt, max_new_tokens=48, temperature=0, ignore_eos=True, num_speculative_tokens=0)
                )
                for gamma in (4, 8, -1):
                    request = build_request(
                        prompt,
                        max_new_tokens=48,
                        temperature=0,
                        ignore_eos=True,
                        num_speculative_tokens=gamma,
                        include_rounds=True,
                    )
                    response = await services.stub.Generate(request)
                    assert list(response.token_ids) == list(reference.token_ids)
                    speculation = response.speculation
                    assert not speculation.fallback_reason
                    if gamma > 0:
                        assert speculation.drafted_tokens > 0 and speculation.accepted_tokens > 0
                        assert speculation.rounds < len(reference.token_ids)
                    # Every round says what proposed its tokens, and only the draft's own sources appear.
                    sources = {r.draft_source for r in response.rounds if r.drafted}
                    assert sources <= SOURCES[kind] and (sources or gamma < 0)
                    assert all(r.draft_source == worker_pb2.DRAFT_SOURCE_UNSPECIFIED for r in response.rounds if not r.drafted)

    asyncio.run(run())


@pytest.mark.slow
def test_suffix_speculation_with_a_learning_global_tree_samples_the_exact_target_distribution():
    """Each request's proposals come from the outputs of the requests before it: the draft changes as the run goes
    on, and its tokens are often rejected, yet the samples follow the target's distribution."""
    from specdec.common.models import load_model
    from tests.support.statistics import TARGET

    target = load_model(TARGET)
    params = SamplingParams(temperature=1.0)
    exact = enumerate_sequences(target, params)
    samples, _, (drafted, accepted) = sample_sequences(
        target, None, params, gamma=2, proposer=SuffixProposer(factor=4.0, min_prob=0.0)
    )
    assert drafted > 1000 and 0 < accepted < drafted
    assert chi_square_p_value(samples, exact) > 1e-3


@pytest.mark.slow
def test_hybrid_speculation_mixing_its_sources_samples_the_exact_target_distribution():
    """Per round the hybrid proposes from the suffix trees (q = 1) or from the model (its sampled q): each round's
    acceptance test uses the q of the source that proposed, so the mix stays exact."""
    from specdec.common.models import load_model
    from tests.support.statistics import DRAFT, TARGET

    target, draft = load_model(TARGET), load_model(DRAFT)
    params = SamplingParams(temperature=1.0)
    proposer = HybridProposer(SuffixProposer(factor=4.0, min_prob=0.0), ModelProposer(draft, calibrate=False))
    samples, _, (drafted, accepted) = sample_sequences(target, None, params, gamma=2, proposer=proposer)
    assert drafted > 1000 and 0 < accepted < drafted
    chosen = proposer.proposals_by_source
    assert chosen[DraftSource.MODEL] > 100 and chosen[DraftSource.SUFFIX_GLOBAL] + chosen[DraftSource.SUFFIX_REQUEST] > 100
    assert chi_square_p_value(samples, enumerate_sequences(target, params)) > 1e-3
    assert chi_square_p_value(samples, enumerate_sequences(draft, params)) < 1e-6  # the test can fail


def test_a_draft_worker_loads_the_proposer_its_model_spec_names():
    from specdec.common.config import DraftWorkerConfig
    from specdec.draft_worker.ngram import PromptLookupProposer
    from specdec.draft_worker.server import load_draft_engine
    from tests.support.services import draft_spec

    assert isinstance(load_draft_engine(DraftWorkerConfig(model="ngram:max=4")).proposer, PromptLookupProposer)
    suffix = load_draft_engine(DraftWorkerConfig(model="suffix:depth=16,global=0")).proposer
    assert isinstance(suffix, SuffixProposer) and suffix.depth == 16 and suffix.shared is None
    hybrid = load_draft_engine(DraftWorkerConfig(model="suffix:depth=8+" + draft_spec(0.1))).proposer
    assert isinstance(hybrid, HybridProposer) and hybrid.suffix.depth == 8 and hybrid.vocab_size == 256
    assert hybrid.batched and not suffix.batched and hybrid.forward_costs and not suffix.forward_costs
    with pytest.raises(InvalidArgument, match="model"):
        load_draft_engine(DraftWorkerConfig(model="suffix:depth=x"))


def test_a_speculation_rates_each_token_by_its_frequency_and_the_length_of_text_it_follows():
    tree = SuffixTree(depth=8)
    tree.append(tree.cursor(), [1, 2, 3, 4, 1, 2, 3, 5])
    found = tree.speculate([9, 1, 2], max_tokens=8, max_match=4, factor=2.0, min_prob=0.1)
    # "1 2" matched (two tokens held): 3 always followed it; after "1 2 3" (three held) 4 and 5 once each, the
    # later one first.
    assert found.token_ids == [3, 5] and found.match_length == 2
    assert found.confidence == pytest.approx([1.0 * 2 / 3, 0.5 * 3 / 4])
    proposal = deterministic_proposal(found.token_ids, True, DraftSource.SUFFIX_REQUEST, found.confidence)
    assert proposal.assumed_token == 3 and proposal.confidence == pytest.approx([0.375])
