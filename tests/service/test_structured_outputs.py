"""Constrained decoding stays exact under speculation: greedy output under a grammar equals target-only output
under it, sampled output follows the target's masked and renormalised distribution (chi-square), a proposed token
the grammar forbids costs the target no row, and a bad grammar is refused by name. In one process, on the real
worker engines and the coordinator's speculation loop (tiny random models)."""

import asyncio
import itertools
from dataclasses import replace

import llguidance

import pytest
import torch

from specdec.common.errors import InvalidArgument
from specdec.common.grammar import closed_objects, grammar_of_schema, vocabulary_of
from specdec.common.models import load_model, load_tokenizer
from specdec.common.rounds import DraftSource
from specdec.common.sampling import SamplingParams, logits_to_probs
from specdec.coordinator.config import CoordinatorConfig
from specdec.coordinator.in_process import InProcessWorkers
from specdec.coordinator.server import build_engine
from specdec.coordinator.tool_calls import tag
from specdec.coordinator.types import GenerationParams
from specdec.draft_worker.engine import DraftEngine
from specdec.draft_worker.model_proposer import ModelProposer
from specdec.draft_worker.proposer import Proposer, deterministic_proposal, point_mass
from specdec.draft_worker.suffix import SuffixProposer
from specdec.target_worker.engine import TargetEngine
from tests.support.statistics import chi_square_p_value

TARGET = "tiny-random:seed=0,vocab=256,layers=2,hidden=64"
# Compact JSON with bounded values: the grammar ends, so a random model's output ends too.
SCHEMA = {
    "x-guidance": {"whitespace_flexible": False},
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "tag": {"enum": ["red", "green", "blue"]},
    },
    "required": ["ok", "n", "tag"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def pair():
    return load_model(TARGET), load_model(f"{TARGET},noise=0.1")


async def engine_for(target, proposer: Proposer):
    workers = InProcessWorkers(TargetEngine(target, calibrate=False), DraftEngine(proposer, "draft"))
    return await build_engine(workers, CoordinatorConfig(), tokenizer=target.tokenizer)


async def generate(target, proposer, grammar: str, gamma: int, params: SamplingParams, prompt, tokens: int, engine=None):
    engine = engine or await engine_for(target, proposer)
    sampling = replace(params, grammar=grammar, grammar_start=len(prompt))
    return await engine.generate_all(GenerationParams(prompt, sampling, tokens, gamma))


@pytest.mark.parametrize("draft", ["model", pytest.param("suffix", marks=pytest.mark.slow)])
def test_greedy_constrained_output_equals_target_only_constrained_output(pair, draft):
    target, draft_model = pair
    grammar = grammar_of_schema(SCHEMA)
    prompt = target.tokenizer.encode('answer in JSON: {"ok": true, "n": 7, "tag": "red"} ')

    def proposer():
        return ModelProposer(draft_model, calibrate=False) if draft == "model" else SuffixProposer()

    async def run():
        greedy = SamplingParams(temperature=0)
        reference = await generate(target, proposer(), grammar, 0, greedy, prompt, 60)
        *body, end = reference.token_ids
        assert end in target.tokenizer.eos_token_ids, "the grammar ends, so the output ends at it"
        matcher = vocabulary_of(target.tokenizer, target.vocab_size).matcher(grammar, "test")
        assert matcher.consume(body) == len(body) and matcher.matcher.is_accepting(), reference.text
        drafted = 0
        for gamma in (2, 5):
            result = await generate(target, proposer(), grammar, gamma, greedy, prompt, 60)
            assert result.token_ids == reference.token_ids, f"gamma={gamma} diverged from target-only"
            drafted += result.drafted_tokens
        assert drafted > 0  # it speculated

    asyncio.run(run())


class ForbiddenFirst(Proposer):
    """Proposes an allowed digit, then a token no grammar here allows (byte 0), then another digit: every round
    has a forbidden token to cut."""

    def __init__(self, allowed: int, forbidden: int = 1):
        self.allowed, self.forbidden = allowed, forbidden

    def open(self, prompt, params, max_q_entries, max_tokens):
        return type("State", (), {"chain": [], "num_committed": len(prompt), "max_tokens": max_tokens, "cached": 0})()

    def observe(self, state, num_accepted, committed):
        state.num_committed += num_accepted + len(committed)

    def propose(self, states, steps):
        return [
            deterministic_proposal([self.allowed, self.forbidden, self.allowed][:n], assume, DraftSource.PROMPT_LOOKUP)
            for (n, assume) in steps
        ]


def test_a_forbidden_proposed_token_ends_the_proposal_before_the_target_scores_it(pair, monkeypatch):
    target, _ = pair
    digit = target.tokenizer.encode("5")[0]
    grammar = grammar_of_schema({"type": "integer"})
    fed = []
    engine = TargetEngine(target, calibrate=False)
    forward = engine.runner.forward

    def spy(caches, feeds, keep):
        fed.extend(feeds)
        return forward(caches, feeds, keep)

    monkeypatch.setattr(engine.runner, "forward", spy)
    prompt = target.tokenizer.encode("n=")
    session, _ = engine.open_session(prompt, SamplingParams(temperature=0, grammar=grammar, grammar_start=len(prompt)))
    fed.clear()
    verdict = engine.verify(session, [digit, 1, digit], [point_mass(t) for t in (digit, 1, digit)])
    assert fed == [[prompt[-1], digit]]  # the pending token and the allowed digit: no row for byte 0 or after it
    assert verdict.num_accepted <= 1 and verdict.rollback == 3 - verdict.num_accepted
    assert verdict.draft_token_probs[1:] == [0.0, 0.0]
    # EOS where the grammar may end is allowed, and nothing after it is tested (a second EOS included).
    session, _ = engine.open_session(prompt, SamplingParams(temperature=0, grammar=grammar, grammar_start=len(prompt)))
    fed.clear()
    eos = target.tokenizer.eos_token_ids[0]
    verdict = engine.verify(session, [digit, eos, eos], [point_mass(t) for t in (digit, eos, eos)])
    assert fed == [[prompt[-1], digit, eos]] and verdict.num_accepted <= 2


def test_a_grammar_the_worker_cannot_compile_is_refused_by_name(pair):
    target, _ = pair
    engine = TargetEngine(target, calibrate=False)
    with pytest.raises(InvalidArgument, match=r"^start\.sampling\.grammar: "):
        engine.begin_session([1, 2], SamplingParams(grammar="start: x\nx: y"))  # y is never defined
    assert not engine.sessions.sessions


MASK_VOCAB = 64  # byte-level: ids 1..63 are bytes 0..62, the digits among them
MASK_TOKENS = 3
MASK_REGEX = "[0-3]{3}"


def masked_sequences(model, params: SamplingParams, allowed: list[int], prompt: list[int]) -> dict:
    """P(first MASK_TOKENS tokens) under target-only sampling masked to `allowed` at every position (the regex
    allows the same tokens at each), by scoring every prefix without any cache."""
    mask = torch.full((model.vocab_size,), float("-inf"))
    mask[allowed] = 0.0
    probs = {(): 1.0}
    for _ in range(MASK_TOKENS):
        prefixes = list(probs)
        with torch.no_grad():
            logits = model.model(torch.tensor([prompt + list(p) for p in prefixes])).logits[:, -1]
        step = logits_to_probs(logits.float() + mask, params)
        probs = {prefix + (t,): probs[prefix] * float(step[i, t]) for i, prefix in enumerate(prefixes) for t in allowed}
    return probs


@pytest.mark.slow
def test_sampled_constrained_output_follows_the_targets_masked_distribution():
    target = load_model(f"tiny-random:seed=3,vocab={MASK_VOCAB},layers=1,hidden=16")
    draft = load_model(f"tiny-random:seed=3,vocab={MASK_VOCAB},layers=1,hidden=16,noise=1.5")
    allowed = target.tokenizer.encode("0123")
    prompt = target.tokenizer.encode("12")
    params = SamplingParams(temperature=1.0)
    grammar = llguidance.LLMatcher.grammar_from_regex(MASK_REGEX)
    exact = masked_sequences(target, params, allowed, prompt)
    assert sum(exact.values()) == pytest.approx(1.0, abs=1e-5)

    async def run(proposer, samples):
        out, drafted, engine = [], 0, await engine_for(target, proposer())
        for seed in range(samples):
            sampled = SamplingParams(temperature=1.0, seed=seed)
            result = await generate(target, None, grammar, 2, sampled, prompt, MASK_TOKENS, engine)
            out.append(tuple(result.token_ids))
            drafted += result.drafted_tokens
        return out, drafted

    # A model draft sampling its own masked q; a draft proposing forbidden tokens (cut, its point mass q kept).
    for proposer in (lambda: ModelProposer(draft, calibrate=False), lambda: ForbiddenFirst(allowed[1])):
        samples, drafted = asyncio.run(run(proposer, 1000))
        assert drafted > 0
        assert set(samples) <= set(itertools.product(allowed, repeat=MASK_TOKENS))
        assert chi_square_p_value(samples, exact) > 1e-3
    # The test can fail: the same samples reject the draft's masked distribution.
    assert chi_square_p_value(samples, masked_sequences(draft, params, allowed, prompt)) < 1e-6


def test_a_special_token_is_allowed_only_where_the_matcher_can_take_it():
    """llguidance's mask may allow an added token where a grammar spells its text, though its matcher takes it
    only where the grammar names the token: allowed() keeps the two in step, so a committed token never leaves
    the matcher behind (which would allow the same token forever)."""
    tokenizer = load_tokenizer("smollm2-135m")
    vocabulary = vocabulary_of(tokenizer, 49152)
    (start,) = tokenizer.encode("<|im_start|>")
    spelled = vocabulary.matcher(llguidance.LLMatcher.grammar_from_lark('start: "<|im_start|>" "x"'), "grammar")
    assert not spelled.allowed()[start]
    named = vocabulary.matcher(llguidance.LLMatcher.grammar_from_lark(f'start: <[{start}]> "x"'), "grammar")
    assert named.allowed()[start] and named.consume([start]) == 1
    assert tag("<|im_start|>", tokenizer) == f"<[{start}]>" and tag("<tool_call>", tokenizer) == '"<tool_call>"'


def allowed_after(tokenizer, schema: dict, text: str) -> set[str]:
    """The characters a schema's matcher allows after the output text (a byte-level vocabulary: id 1 + b is b)."""
    vocabulary = vocabulary_of(tokenizer, MASK_VOCAB + 64)
    matcher = vocabulary.matcher(grammar_of_schema({"x-guidance": {"whitespace_flexible": False}, **schema}), "schema")
    assert matcher.consume([1 + b for b in text.encode()]) == len(text)
    return {chr(i - 1) for i in torch.nonzero(matcher.allowed()).flatten().tolist() if i > 0}


def test_an_object_schema_silent_on_other_fields_allows_only_its_own(pair):
    """As xgrammar and llama.cpp read a schema (a Pydantic model's leaves additionalProperties out): once its
    fields are written the object can only end, at any depth, so a model cannot add fields until max_tokens."""
    target, _ = pair
    inner = {"type": "object", "properties": {"c": {"type": "integer"}}, "required": ["c"]}
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": inner}, "required": ["a", "b"]}
    assert allowed_after(target.tokenizer, schema, '{"a":1,"b":{"c":2') == set("0123456789}")
    assert allowed_after(target.tokenizer, schema, '{"a":1,"b":{"c":2}') == {"}"}
    # An object schema that lists no properties is any object, and one that allows others keeps allowing them.
    assert "," in allowed_after(target.tokenizer, {"type": "object"}, '{"a":1')
    assert "," in allowed_after(target.tokenizer, {**schema, "additionalProperties": True}, '{"a":1,"b":{"c":2}')


def test_closing_objects_leaves_names_data_and_negations_as_written():
    schema = {
        "properties": {"properties": {"type": "object", "properties": {"x": {}}}, "const": {"const": {"properties": {}}}},
        "$defs": {"d": {"properties": {}}},
        "not": {"properties": {"y": {}}},
        "anyOf": [{"properties": {}}, {"type": "string"}],
    }
    closed = closed_objects(schema)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["properties"]["additionalProperties"] is False  # a field named "properties"
    assert "additionalProperties" not in closed["properties"]  # the map of names is not a schema
    assert closed["properties"]["const"]["const"] == {"properties": {}}  # a value, not a schema
    assert closed["$defs"]["d"]["additionalProperties"] is False
    assert closed["not"] == {"properties": {"y": {}}}
    assert closed["anyOf"][0]["additionalProperties"] is False and closed["anyOf"][1] == {"type": "string"}
    assert schema["$defs"]["d"] == {"properties": {}}  # the caller's schema is not changed
