"""Chunked prefill: a long prompt is prefilled a chunk per pass, between the other sessions' rounds, so that it
delays each of their rounds by one chunk at most; every output stays what it is alone."""

import asyncio

import pytest

from specdec.coordinator.client import build_request
from specdec.coordinator.config import CoordinatorConfig
from specdec.draft_worker.engine import DraftEngine
from specdec.draft_worker.model_proposer import ModelProposer
from specdec.target_worker.engine import PrefillCall, TargetEngine, VerifyCall
from tests.support.services import draft_spec, running_services
from tests.support.waiting import wait_until

CHUNK = 64
LONG_PROMPT = [(5 * j) % 250 + 1 for j in range(1500)]


class RecordingTarget(TargetEngine):
    """Records, for every pass, the prompt tokens it prefilled and the rounds it verified."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.passes: list[tuple[int, int]] = []

    def run_batch(self, calls):
        prefill_before = {id(c): c.session.sequence.cache_len for c in calls if isinstance(c, PrefillCall)}
        results = super().run_batch(calls)
        prefilled = sum(c.session.sequence.cache_len - prefill_before[id(c)] for c in calls if isinstance(c, PrefillCall))
        self.passes.append((prefilled, sum(isinstance(c, VerifyCall) for c in calls)))
        return results


def stream_request(i: int):
    return build_request([i + 1, i + 2, i + 3], max_new_tokens=60, ignore_eos=True, temperature=0, num_speculative_tokens=3)


def test_a_long_prompt_arriving_during_four_streams_is_prefilled_in_chunks_between_their_rounds(target_model, draft_models):
    async def run():
        target = RecordingTarget(target_model, max_prefill_tokens=CHUNK)
        draft = DraftEngine(ModelProposer(draft_models[0.1]), draft_spec(0.1), max_prefill_tokens=CHUNK)
        long_request = build_request(LONG_PROMPT, max_new_tokens=8, ignore_eos=True, temperature=0, num_speculative_tokens=3)
        async with running_services(target, draft, CoordinatorConfig()) as services:
            solo = [list((await services.stub.Generate(stream_request(i))).token_ids) for i in range(4)]
            solo_long = list((await services.stub.Generate(long_request)).token_ids)
            target.passes.clear()

            streams = [asyncio.ensure_future(services.stub.Generate(stream_request(i))) for i in range(4)]
            await wait_until(lambda: any(rounds for _, rounds in target.passes), message="the streams are under way")
            long = await services.stub.Generate(long_request)
            outputs = [list(r.token_ids) for r in await asyncio.gather(*streams)]

        assert outputs == solo and list(long.token_ids) == solo_long  # nothing changed by the chunking
        prefill_passes = [(tokens, rounds) for tokens, rounds in target.passes if tokens > 0]
        assert max(tokens for tokens, _ in prefill_passes) <= CHUNK
        assert len(prefill_passes) >= len(LONG_PROMPT) // CHUNK  # the long prompt took many passes ...
        # ... and the streams' rounds ran in them, each delayed by one chunk's pass, not by the whole prompt.
        # ... and the streams' rounds ran in passes of their own or beside a chunk while it lasted: their rounds
        # waited for a chunk's pass, not for the whole prompt's (one pass, which would hold at most one round).
        assert sum(rounds > 0 for _, rounds in prefill_passes) >= 5, target.passes

    asyncio.run(run())


@pytest.mark.slow
def test_on_the_gguf_engine_a_chunked_prefill_scores_bit_identically_to_one_pass():
    # Its rows are computed on their own (kernels and attention alike), so the chunking of a prompt changes no bit
    # of what the cache then scores: prompts longer than a chunk keep the outputs of an unchunked prefill. (The
    # torch engine's attention rounds differently for some query lengths: see README, chunked prefill.)
    import torch

    from specdec.common.models import load_model
    from specdec.common.sampling import SamplingParams
    from specdec.target_worker.engine import SessionOpened

    model = load_model("smollm2-135m", engine="gguf")
    prompt = LONG_PROMPT[:300]
    scored = []
    for chunk in (100_000, 64, 7):
        engine = TargetEngine(model, max_prefill_tokens=chunk, calibrate=False)
        session = engine.begin_session(prompt, SamplingParams(temperature=0))
        passes = 1
        while not isinstance(engine.run_batch([PrefillCall(session)])[0], SessionOpened):
            passes += 1
        assert passes == -(-(len(prompt) - 1) // chunk)
        scored.append(session.sequence.forward([prompt[-1], 3, 4], 3))
    assert all(torch.equal(scored[0], other) for other in scored[1:])


def test_a_long_prompts_opening_gets_the_time_its_prefill_needs_beyond_a_rounds_deadline():
    # Measured on this CPU: SmolLM2's 4,000-token prompt took 80 s to prefill; the opening had the round deadline
    # (60 s) and the retry window (30 s) and was refused UNAVAILABLE. Now it gets PREFILL_SLACK times what the
    # worker's own curve says those tokens cost (here 5 ms a token at its largest count).
    from specdec.coordinator.request_workers import PREFILL_SLACK, prefill_allowance

    curve = [(1, 20.0), (16, 100.0), (64, 320.0)]
    assert prefill_allowance(curve, 4000) == PREFILL_SLACK * 4000 * 0.005
    assert prefill_allowance(curve, 4000) > 60 and prefill_allowance([], 4000) == 0.0
