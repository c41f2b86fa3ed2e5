"""A model draft whose use the cost model decides opens only when the policy first wants to draft, in the background
(gamma_policy_factory.defers_draft): a request that never drafts costs the draft worker nothing, and one that starts
drafting later runs target-only until the draft session, prefilled with the prompt and every token committed so
far, is open, with output identical to target-only's."""

import asyncio
from dataclasses import dataclass

import pytest

from specdec.common.errors import InvalidArgument
from specdec.coordinator.gamma_policy import FixedPolicy
from specdec.coordinator.gamma_policy_factory import gamma_policy_for
from specdec.target_worker.engine import TargetEngine
from tests.support.services import draft_engine_for, running_services
from tests.support.waiting import wait_async
from tests.support.generation import PROMPTS, generate_ids
from tests.support.draft_spies import slowed_prefill, spy_on_openings

AUTO = -1


@dataclass
class DraftsAfter(FixedPolicy):
    """Asks for nothing in its first `after` rounds, then for `gamma` tokens a round."""

    after: int = 0
    asks: int = 0

    def ask(self, limit: int) -> int:
        self.asks += 1
        return 0 if self.asks <= self.after else min(self.gamma, limit)


@dataclass
class ScriptedPolicies:
    """The engine's policy factory (its policy_for): auto requests get DraftsAfter(after) (None: a policy that never
    drafts) in place of the cost model; every other request the deployment's own policy."""

    after: int | None = None

    def __call__(self, engine, params, overhead=None):
        if params.num_speculative_tokens != AUTO:
            return gamma_policy_for(engine, params, overhead)
        return FixedPolicy(0) if self.after is None else DraftsAfter(3, after=self.after)


def test_a_model_draft_the_policy_never_wants_is_never_opened(target_model, draft_models):
    async def run():
        draft = draft_engine_for(draft_models, 0.0)
        openings = spy_on_openings(draft)
        async with running_services(TargetEngine(target_model), draft, policy_for=ScriptedPolicies(None)) as services:
            ids, stats = await generate_ids(services.stub, PROMPTS[0], gamma=AUTO, max_new_tokens=16)
            assert len(ids) == 16 and stats.drafted_tokens == 0 and not stats.fallback_reason
            assert openings == []
            # A fixed gamma still opens its draft with the target's, as before.
            _, stats = await generate_ids(services.stub, PROMPTS[0], gamma=2, max_new_tokens=16)
            assert stats.drafted_tokens > 0 and len(openings) == 1

    asyncio.run(run())


def spy_on_first_steps(draft) -> list[int]:
    """How many committed tokens each draft session's first step brought it: for an adopted deferred draft, those of
    the rounds that ran while it opened (what it had not heard of)."""
    heard, seen, run_ready = [], set(), draft.run_ready

    def recording(calls, ready, results):
        for call in (calls[i] for i in ready):
            if call.handle.session_id not in seen:
                seen.add(call.handle.session_id)
                heard.append(len(call.committed))
        return run_ready(calls, ready, results)

    draft.run_ready = recording
    return heard


@pytest.mark.parametrize("after", [0, 5], ids=["first round", "sixth round"])
def test_a_deferred_draft_opens_on_the_committed_tokens_and_keeps_the_output_target_only(target_model, draft_models, after):
    async def run():
        draft = draft_engine_for(draft_models, 0.0)
        openings = spy_on_openings(draft)
        async with running_services(TargetEngine(target_model), draft, policy_for=ScriptedPolicies(after)) as services:
            for prompt in PROMPTS:
                reference, _ = await generate_ids(services.stub, prompt, gamma=0, max_new_tokens=160)
                await generate_ids(services.stub, prompt, gamma=2, max_new_tokens=4)  # opens on the prompt alone
                unheard = spy_on_first_steps(draft)
                # The opening takes long enough for target-only rounds to commit tokens it must then hear of.
                slowed_prefill(draft, 0.05)
                ids, stats = await generate_ids(services.stub, prompt, gamma=AUTO, max_new_tokens=160)
                del draft.prefill_chunk, draft.run_ready  # the engine's own methods again
                assert ids == reference
                # It speculated, with the identical draft: every drafted token accepted, so the draft's cache held
                # the prompt, the tokens it opened on and those committed while it opened, in order.
                assert stats.drafted_tokens > 0 and stats.accepted_tokens == stats.drafted_tokens
                assert not stats.fallback_reason
                assert len(unheard) == 1 and unheard[0] > 0
                # One opening, on the prompt and the tokens of the `after` rounds that ran without it.
                bare, deferred = openings[-2:]
                assert deferred - bare == after
        assert len(draft.sessions) == 0, "every draft session was closed"

    asyncio.run(run())


def test_a_request_that_ends_while_its_draft_opens_frees_the_draft_session(target_model, draft_models):
    async def run():
        draft = draft_engine_for(draft_models, 0.0)
        openings = spy_on_openings(draft)
        slowed_prefill(draft, 0.5)  # far longer than the request's few rounds of the tiny target
        async with running_services(TargetEngine(target_model), draft, policy_for=ScriptedPolicies(0)) as services:
            ids, stats = await generate_ids(services.stub, PROMPTS[0], gamma=AUTO, max_new_tokens=4)
            assert len(ids) == 4 and stats.drafted_tokens == 0
            assert len(openings) == 1, "the opening began"
            await wait_async(lambda: draft.sessions.reserved_kv_tokens == 0, 5.0, 0.05, "the draft session was not freed")
            assert len(draft.sessions) == 0

    asyncio.run(run())


def test_a_deferred_draft_that_fails_to_open_leaves_the_request_target_only_without_retrying(target_model, draft_models):
    async def run():
        draft = draft_engine_for(draft_models, 0.0)
        openings = spy_on_openings(draft)
        original = draft.proposer.check_prompt

        def refuse(prompt):
            original(prompt)
            raise InvalidArgument("start.prompt_token_ids", "refused by the test")

        draft.proposer.check_prompt = refuse
        async with running_services(TargetEngine(target_model), draft, policy_for=ScriptedPolicies(2)) as services:
            reference, _ = await generate_ids(services.stub, PROMPTS[1], gamma=0, max_new_tokens=24)
            ids, stats = await generate_ids(services.stub, PROMPTS[1], gamma=AUTO, max_new_tokens=24)
            assert ids == reference
            assert stats.fallback_reason == "draft_open_failed" and stats.drafted_tokens == 0
            # Tried once, in the background; never again in the foreground for the rest of the request.
            assert len(openings) == 1
            assert len(draft.sessions) == 0 and draft.sessions.reserved_kv_tokens == 0

    asyncio.run(run())
