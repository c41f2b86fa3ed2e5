"""A long answer costs the coordinator the same per round at its end as at its start: detokenising and stop-string
checks look at the new tokens only (coordinator.output), never at the whole answer again."""

import asyncio
import statistics


from specdec.common.models import load_tokenizer
from specdec.common.sampling import SamplingParams
from specdec.coordinator.config import CoordinatorConfig
from specdec.coordinator.engine import GenerationEngine
from specdec.coordinator.in_process import InProcessWorkers
from specdec.coordinator.output import StopMatcher
from specdec.coordinator.types import GenerationParams
from specdec.draft_worker.engine import DraftEngine
from specdec.draft_worker.ngram import PromptLookupProposer
from specdec.target_worker.engine import TargetEngine

ANSWER_TOKENS = 2000


class CountingTokenizer:
    """The real tokenizer, counting the tokens it is asked to detokenise, as a whole or one at a time."""

    def __init__(self, tokenizer):
        self.tokenizer, self.decoded, self.stepped = tokenizer, 0, 0

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)

    def decode(self, token_ids):
        self.decoded += len(token_ids)
        return self.tokenizer.decode(token_ids)

    def decode_stream(self):
        stream, outer = self.tokenizer.decode_stream(), self

        class Counted:
            def step(self, token_id):
                outer.stepped += 1
                return stream.step(token_id)

        return Counted()


def test_per_round_coordinator_time_does_not_grow_with_the_answer(target_model, monkeypatch):
    # SmolLM2's tokenizer over the tiny model's ids: a real BPE decoder, whose whole-answer decode would cost
    # hundreds of microseconds per round by the end of a 2,000-token answer.
    tokenizer = CountingTokenizer(load_tokenizer("smollm2-135m"))
    scanned = []  # characters each stop-string check looked at
    feed = StopMatcher.feed
    monkeypatch.setattr(
        StopMatcher, "feed", lambda self, text, start: scanned.append(len(text) - start) or feed(self, text, start)
    )
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
    # The work, counted: every token stepped through the decoder once, the whole answer decoded once (at the end),
    # each token's new text scanned for stop strings once (the streamed text may differ from the final decode by
    # the odd replacement character; rescanning the answer each round would be about a million characters).
    assert tokenizer.stepped == ANSWER_TOKENS and tokenizer.decoded == ANSWER_TOKENS
    assert len(scanned) == ANSWER_TOKENS and sum(scanned) < 1.1 * len(result.text), (sum(scanned), len(result.text))
    assert result.text == tokenizer.decode(result.token_ids)
    # And the time, for whatever else a round might redo: the fastest rounds (a tenth) of the last quarter against
    # those of the first, which a busy machine slows less than the median. Redoing the answer's detokenisation or stop
    # scan would cost hundreds of microseconds a round by the end; the margin is for a long-running test process
    # (a larger heap, a loaded machine), where both quarters run up to twice as slow as alone.
    per_round = [r.time_split.coordinator_us for r in result.rounds]
    quarter = len(per_round) // 4
    early, late = (statistics.quantiles(part, n=10)[0] for part in (per_round[:quarter], per_round[-quarter:]))
    assert late < 2 * early + 100, (early, late)
