"""Greedy speculative output equals target-only greedy output, token for token, through the real gRPC services."""

import asyncio

import pytest

from specdec.coordinator.client import build_request
from tests.support.services import draft_engine_for, running_services
from specdec.target_worker.engine import TargetEngine
from tests.support.generation import PROMPTS, generate_ids

DRAFTS = [0.0, 0.1, 0.5, 1.0, "ngram", "suffix", "hybrid"]
MODEL_FREE = ("ngram", "suffix")  # drafting costs nothing: auto always drafts with them
# The quick tier (`-m "not slow"`) keeps a model draft that gets rejections and a model-free one.
DRAFT_PARAMS = [pytest.param(d, marks=() if d in (0.1, "suffix") else pytest.mark.slow) for d in DRAFTS]


@pytest.mark.parametrize("draft_kind", DRAFT_PARAMS, ids=lambda d: f"draft={d}")
def test_greedy_output_matches_target_only_for_every_gamma(target_model, draft_models, draft_kind):
    async def run():
        async with running_services(TargetEngine(target_model), draft_engine_for(draft_models, draft_kind)) as services:
            for prompt in PROMPTS:
                reference, stats = await generate_ids(services.stub, prompt, gamma=0)
                assert stats.drafted_tokens == 0 and stats.rounds == len(reference) and not stats.fallback_reason
                rates = []
                for gamma in range(1, 9):
                    ids, stats = await generate_ids(services.stub, prompt, gamma)
                    assert ids == reference, f"gamma={gamma} diverged from target-only"
                    # It speculated: equal output from a draft that fell back to target-only would prove nothing.
                    assert stats.drafted_tokens > 0 and not stats.fallback_reason, (gamma, stats)
                    assert stats.num_speculative_tokens == gamma
                    assert stats.rounds < len(reference) or stats.accepted_tokens == 0
                    rates.append(stats.acceptance_rate)
                if draft_kind == 0.0:
                    assert min(rates) == 1.0, "an identical draft must always be accepted"

    asyncio.run(run())


def test_streamed_deltas_add_up_to_the_final_response(target_model, draft_models):
    async def run():
        async with running_services(TargetEngine(target_model), draft_engine_for(draft_models, 0.1)) as services:
            request = build_request(PROMPTS[0], max_new_tokens=30, temperature=0, ignore_eos=True, num_speculative_tokens=4)
            text, ids, final = "", [], None
            async for message in services.stub.GenerateStream(request):
                if message.HasField("delta"):
                    text += message.delta.text
                    ids += list(message.delta.token_ids)
                else:
                    final = message.final
            assert final is not None and ids == list(final.token_ids) and text == final.text
            assert final.usage.completion_tokens == 30 and final.speculation.rounds < 30
            assert final.speculation.drafted_tokens > 0 and not final.speculation.fallback_reason

    asyncio.run(run())


@pytest.mark.parametrize("draft_kind", DRAFT_PARAMS, ids=lambda d: f"draft={d}")
def test_greedy_output_matches_target_only_with_auto_gamma_heuristic_schedule_and_overlap(target_model, draft_models, draft_kind):
    async def run():
        async with running_services(TargetEngine(target_model), draft_engine_for(draft_models, draft_kind)) as services:
            hits = 0
            for prompt in PROMPTS:
                reference, _ = await generate_ids(services.stub, prompt, gamma=0)
                for gamma, options in [
                    (-1, {}),
                    (-1, {"gamma_schedule": "heuristic"}),
                    (1, {"overlap": True}),
                    (3, {"overlap": True}),
                    (-1, {"overlap": True}),
                    (-1, {"overlap": True, "gamma_schedule": "heuristic"}),
                ]:
                    ids, stats = await generate_ids(services.stub, prompt, gamma, **options)
                    assert ids == reference, f"gamma={gamma} {options} diverged from target-only"
                    # num_speculative_tokens is reported 0 when no draft session opened; nothing fell back later.
                    assert stats.num_speculative_tokens == gamma and stats.overlap == bool(options.get("overlap"))
                    assert not stats.fallback_reason, (gamma, options, stats)
                    # Where it must, it drafted: a fixed gamma, the heuristic schedule (at least one token a round),
                    # a model-free draft. Auto's cost model may find a tiny model draft not worth its cost.
                    if gamma > 0 or options.get("gamma_schedule") == "heuristic" or draft_kind in MODEL_FREE:
                        assert stats.drafted_tokens > 0, (gamma, options, stats)
                    hits += stats.overlapped_rounds
                    if draft_kind == 0.0 and options.get("overlap") and gamma > 0:
                        # An identical draft guesses every bonus token: its state after overlapped steps must be
                        # exactly the target's, or acceptance would drop below 1.
                        assert stats.acceptance_rate == 1.0 and stats.overlapped_rounds >= stats.rounds - 2
            if draft_kind in (0.0, 0.1):
                assert hits > 0, "an accurate draft must make some overlapped proposals valid"

    asyncio.run(run())


PENALTIES = {"presence_penalty": 0.6, "frequency_penalty": 0.4, "repetition_penalty": 1.3}


@pytest.mark.parametrize("draft_kind", [0.0, 0.1, "suffix"], ids=lambda d: f"draft={d}")
def test_greedy_output_under_penalties_and_logit_bias_matches_target_only(target_model, draft_models, draft_kind):
    """draft=0.0 is the target's own model: it adjusts its logits as the target does, so all it drafts is accepted."""

    async def run():
        async with running_services(TargetEngine(target_model), draft_engine_for(draft_models, draft_kind)) as services:
            for prompt in PROMPTS:
                plain, _ = await generate_ids(services.stub, prompt, gamma=0)
                # The likeliest first token forbidden, another favoured: both show in the target-only output.
                adjust = {**PENALTIES, "logit_bias": {plain[0]: -100.0, plain[5]: 2.0}}
                reference, _ = await generate_ids(services.stub, prompt, gamma=0, adjust=adjust)
                assert plain[0] not in reference and reference != plain
                for gamma, options in [(1, {}), (5, {}), (2, {"overlap": True})]:
                    ids, stats = await generate_ids(services.stub, prompt, gamma, adjust=adjust, **options)
                    assert ids == reference, f"gamma={gamma} {options} diverged from target-only"
                    assert stats.drafted_tokens > 0 and not stats.fallback_reason, (gamma, stats)
                    if draft_kind == 0.0:
                        assert stats.acceptance_rate == 1.0, (gamma, options, stats)

    asyncio.run(run())
