"""Decoding ahead (docs/design/decode_ahead.md): the target scores a round's first token as soon as the verdict
before it gives that token, so the pass runs while the exchange is on the wire. A round scored ahead gets the very
verdict it would have got in one pass (on the gguf engine, whose rows are the same in any pass; torch's are not,
and its worker refuses), and a stream that ends while its pass runs ahead frees its session."""

import asyncio
import threading

import grpc
import pytest

from specdec.common.errors import InvalidArgument
from specdec.common.sampling import SamplingParams
from specdec.coordinator.client import build_request
from specdec.coordinator.config import CoordinatorConfig
from specdec.coordinator.pool import Member, PoolSettings
from specdec.coordinator.worker_clients import GrpcTargetSession
from specdec.coordinator.workers import WorkerInfo
from specdec.target_worker.engine import TargetEngine
from tests.support.services import draft_engine_for, running_services
from tests.support.waiting import wait_until
from tests.support.generation import PROMPTS, generate_ids
from tests.support.distributions import one_hot

PROMPT = [3, 17, 42, 99, 5, 17, 42, 7]
SAMPLED = SamplingParams(temperature=1.0, seed=11)
GREEDY = SamplingParams(temperature=0)


def drafts_for(round_index: int, tokens: list[int], greedy: list[int]) -> list[int]:
    """What a round drafts: nothing every other round, else the greedy continuation (accepted where the session is
    greedy), its last token changed every third time (rejected), so that both kinds of round follow one scored
    ahead."""
    if round_index % 2 == 0:
        return []
    drafts = greedy[len(tokens) : len(tokens) + 1 + round_index % 3]
    if round_index % 3 == 0 and drafts:
        drafts[-1] = (drafts[-1] + 1) % 200
    return drafts


def run_rounds(engine: TargetEngine, params: SamplingParams, ahead: bool, greedy: list[int] = (), rounds: int = 12):
    """A session's verdicts over a script of rounds; ahead: the pending token scored after every round."""
    session, _ = engine.open_session(PROMPT, params, max_tokens=len(PROMPT) + 4 * rounds + 8)
    verdicts = []
    try:
        for i in range(rounds):
            drafts = drafts_for(i, session.sequence.tokens, list(greedy))
            verdicts.append(engine.verify(session, drafts, [one_hot(t) for t in drafts]))
            if ahead:
                engine.score_ahead(session)
        return verdicts, list(session.sequence.tokens)
    finally:
        engine.close_session(session)


@pytest.fixture(scope="module")
def engine(smollm2):
    return TargetEngine(smollm2, calibrate=False)


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_a_round_scored_ahead_gets_the_verdict_it_gets_in_one_pass(engine, params):
    _, greedy = run_rounds(engine, GREEDY, ahead=False, rounds=60)
    plain, plain_tokens = run_rounds(engine, params, False, greedy)
    ahead, ahead_tokens = run_rounds(engine, params, True, greedy)
    assert ahead_tokens == plain_tokens
    for a, p in zip(ahead, plain, strict=True):
        assert (a.num_accepted, a.next_token, a.rollback, a.draft_token_probs) == (
            p.num_accepted,
            p.next_token,
            p.rollback,
            p.draft_token_probs,
        )
    # Every round after the first was scored ahead (its first row in a pass of its own), and the rounds that
    # drafted had rows to accept and to reject.
    assert all(v.timing.ahead_us > 0 for v in ahead[1:]) and not any(v.timing.ahead_us for v in plain)
    assert sum(v.rollback for v in plain) > 0
    assert sum(v.num_accepted for v in plain) > 0 or not params.greedy


def test_decode_ahead_is_refused_naming_the_field_where_a_rows_logits_depend_on_the_pass(engine, target_model):
    # torch picks its products' kernels by the row count: a row scored alone differs in its last bits from the
    # same row in a round's pass, so its worker says it does not decode ahead and refuses the step that asks.
    torch_engine = TargetEngine(target_model, calibrate=False)
    assert engine.info()["decodes_ahead"] and not torch_engine.info()["decodes_ahead"]
    session, _ = torch_engine.open_session(PROMPT, GREEDY)
    try:
        with pytest.raises(InvalidArgument, match="step.decode_ahead"):
            torch_engine.score_ahead(session)
        assert session.ahead is None
        torch_engine.verify(session, [], [])  # the session goes on
    finally:
        torch_engine.close_session(session)


def test_target_only_and_prompt_lookup_decode_ahead_through_grpc_with_the_same_output(smollm2):
    decided_on = []  # the threads that took a verdict decided from rows scored ahead (TargetEngine.verify)

    async def generate_all(config: CoordinatorConfig):
        outputs = []
        target = TargetEngine(smollm2, calibrate=False)
        verify = target.verify
        target.verify = lambda *args: decided_on.append(threading.current_thread().name) or verify(*args)
        async with running_services(target, draft_engine_for({}, "ngram"), config) as services:
            for prompt in PROMPTS:
                for gamma, seed in [(0, None), (-1, None), (0, 5)]:
                    options = {"temperature": 1.0, "seed": seed} if seed is not None else {"temperature": 0}
                    request = build_request(prompt, max_new_tokens=30, ignore_eos=True, num_speculative_tokens=gamma, **options)
                    response = await services.stub.Generate(request)
                    outputs.append((list(response.token_ids), response.time_split.verify_ahead_us))
            await asyncio.to_thread(wait_until, lambda: len(target.sessions) == 0, message="sessions left open")
        return outputs

    ahead = asyncio.run(generate_all(CoordinatorConfig()))
    plain = asyncio.run(generate_all(CoordinatorConfig(decode_ahead=False)))
    assert [ids for ids, _ in ahead] == [ids for ids, _ in plain]
    # It decoded ahead: scoring was hidden behind the exchange in the first run, never in the second. Not asked of
    # every request: here the three services share one event loop and one GIL, and a pass queued ahead starts only
    # once the loop goes idle, which can be after the coordinator has already sent the next step (nothing hidden).
    assert sum(hidden for _, hidden in ahead) > 0 and not any(hidden for _, hidden in plain)
    # Like every engine call, never on the event loop: one thread runs the engine (common.session_stream).
    assert decided_on and all(name.startswith("compute") for name in decided_on), set(decided_on)


def test_a_request_that_stops_while_its_target_decodes_ahead_frees_its_session(smollm2):
    async def run():
        target = TargetEngine(smollm2, calibrate=False)
        async with running_services(target, None) as services:
            reference, _ = await generate_ids(services.stub, PROMPTS[0], gamma=0, max_new_tokens=20)
            stop = services.target.loaded.tokenizer.decode(reference[:4])[-2:]
            await asyncio.to_thread(wait_until, lambda: len(target.sessions) == 0, message="the session was not freed")
            hidden = 0
            for _ in range(3):
                request = build_request(PROMPTS[0], max_new_tokens=20, temperature=0, ignore_eos=True, stop=[stop])
                response = await services.stub.Generate(request)
                # The stop string ended it early, while its target decoded ahead (its rounds asked it to).
                assert len(response.token_ids) < 20
                hidden += response.time_split.verify_ahead_us
                await asyncio.to_thread(wait_until, lambda: len(target.sessions) == 0, message="the session was not freed")
            assert hidden > 0  # it decoded ahead (not every round hides scoring here, see the test above)
            ids, _ = await generate_ids(services.stub, PROMPTS[0], gamma=0, max_new_tokens=20)
            assert ids == reference

    asyncio.run(run())


def test_a_session_is_asked_to_decode_ahead_only_where_its_own_worker_takes_it():
    """A pool may hold targets of two engines for a while (a rolling update from one to the other): the flag follows
    the worker each session is on, since one that refuses it would fail the step; a worker not yet polled is not
    asked."""

    def session_on(info: WorkerInfo | None) -> GrpcTargetSession:
        member = Member("localhost:0", channel, stub=None, settings=PoolSettings())
        member.info = info
        return GrpcTargetSession(call=None, member=member)

    def info(engine: str, decodes_ahead: bool) -> WorkerInfo:
        return WorkerInfo("m", 49152, "f", "cpu", "float32", 2048, 0, 8, engine=engine, decodes_ahead=decodes_ahead)

    with grpc.insecure_channel("localhost:0") as channel:  # never connected: the member's stubs need one
        assert session_on(info("gguf", True)).decodes_ahead
        assert not session_on(info("torch", False)).decodes_ahead
        assert not session_on(None).decodes_ahead
