"""A long answer costs the coordinator the same per round at its end as at its start: detokenising and stop-string
checks look at the new tokens only (coordinator.output), never at the whole answer again."""

import asyncio
import statistics

from common.models import load_tokenizer
from common.sampling import SamplingParams
from coordinator.config import CoordinatorConfig
from coordinator.engine import GenerationEngine
from coordinator.in_process import InProcessWorkers
from coordinator.types import GenerationParams
from draft_worker.engine import DraftEngine
from draft_worker.ngram import PromptLookupProposer
from target_worker.engine import TargetEngine

ANSWER_TOKENS = 2000


def test_per_round_coordinator_time_does_not_grow_with_the_answer(target_model):
    # SmolLM2's tokenizer over the tiny model's ids: a real BPE decoder, whose whole-answer decode would cost
    # hundreds of microseconds per round by the end of a 2,000-token answer.
    tokenizer = load_tokenizer("smollm2-135m")
    workers = InProcessWorkers(TargetEngine(target_model, calibrate=False), DraftEngine(PromptLookupProposer(), "ngram"))

    async def generate():
        target, draft = await workers.target_info(), await workers.draft_info()
        engine = GenerationEngine(workers, tokenizer, target, draft, CoordinatorConfig(default_num_speculative_tokens=4))
        params = GenerationParams(
            list(range(1, 40)), SamplingParams(temperature=0), ANSWER_TOKENS, 4, stop=["\x00never\x00"], ignore_eos=True
        )
        return await engine.generate_all(params)

    result = asyncio.run(generate())
    assert len(result.token_ids) == ANSWER_TOKENS
    assert result.text == tokenizer.decode(result.token_ids)
    per_round = [r.time_split.coordinator_us for r in result.rounds]
    quarter = len(per_round) // 4
    early, late = statistics.median(per_round[:quarter]), statistics.median(per_round[-quarter:])
    assert late < 1.5 * early + 50, (early, late)
