"""The deployment a coordinator serves: its workers, their models and limits, and what its requests measured.

GenerationEngine is the entry point: it checks a request against the deployment and runs it as a RequestRun
(coordinator.request_run) under the request's root span. It knows nothing of gRPC's server side;
coordinator.server translates protobuf to calls on it.
"""

import asyncio
import contextlib
import logging
import time

from opentelemetry.context import Context
from opentelemetry.trace import SpanKind, Status, StatusCode

from specdec.common.errors import InvalidArgument
from specdec.common.telemetry import tracer
from specdec.common.tokenizer import Tokenizer
from specdec.common.validation import check_prompt, check_token_ids
from specdec.coordinator.config import CoordinatorConfig
from specdec.coordinator.gamma_policy import MeasuredSpeed
from specdec.coordinator.gamma_policy_factory import PolicyFactory, gamma_policy_for
from specdec.coordinator.metrics import CoordinatorMetrics
from specdec.coordinator.request_run import RequestRun
from specdec.coordinator.request_tracing import request_attributes
from specdec.coordinator.types import GenerationParams, GenerationResult
from specdec.coordinator.workers import IncompatibleWorkers, WorkerInfo, Workers

log = logging.getLogger("specdec.coordinator")


def check_pair(target: WorkerInfo, draft: WorkerInfo | None, tokenizer_fingerprint: str) -> None:
    if tokenizer_fingerprint != target.tokenizer_fingerprint:
        raise IncompatibleWorkers(
            f"the coordinator's tokenizer ({tokenizer_fingerprint}) differs from the target worker's "
            f"({target.model_name}, {target.tokenizer_fingerprint}); pass --tokenizer with the target's model"
        )
    if draft is not None and draft.tokenizer_fingerprint and draft.tokenizer_fingerprint != target.tokenizer_fingerprint:
        raise IncompatibleWorkers(
            f"draft model {draft.model_name!r} and target model {target.model_name!r} use different tokenizers "
            f"(fingerprints {draft.tokenizer_fingerprint} and {target.tokenizer_fingerprint}); "
            "speculative decoding needs both to share one vocabulary"
        )


class GenerationEngine:
    """A coordinator's deployment: its workers and their models, its settings, what its requests measured
    (measured_speed, shared by them) and how each request's gamma policy is built (policy_for). Each request runs as
    a RequestRun."""

    def __init__(
        self,
        workers: Workers,
        tokenizer: Tokenizer,
        target: WorkerInfo,
        draft: WorkerInfo | None,
        config: CoordinatorConfig,
        policy_for: PolicyFactory = gamma_policy_for,
    ):
        self.workers = workers
        self.tokenizer = tokenizer
        self.target = target
        self.draft = draft  # None until a configured draft worker has answered GetInfo
        self.draft_disabled = False
        self.config = config
        self.metrics = CoordinatorMetrics(workers.status)
        self.measured_speed = MeasuredSpeed()
        self.policy_for = policy_for  # each request's gamma policy
        self.running = 0  # requests in progress
        self.server_address, self.server_port = "localhost", 0  # where clients reach it: set by listening_on

    def listening_on(self, address: str, port: int) -> None:
        """Where the server that serves this engine listens (its spans' server.address and server.port)."""
        self.server_address, self.server_port = address, port

    @property
    def max_context_length(self) -> int:
        limits = [w.max_context_length for w in (self.target, self.draft) if w and w.max_context_length]
        return min(limits) if limits else 0

    def check(self, params: GenerationParams) -> None:
        """Checks that need the deployment's models and limits (field-level checks are in coordinator.requests)."""
        limit, vocab_size = self.max_context_length, self.target.vocab_size
        # A bad id is the token ids' fault (named first, as their own field); an empty or too long prompt is the
        # prompt's, whether it came as text or as ids.
        check_prompt(params.prompt_token_ids, vocab_size, limit, "prompt", ids_field="prompt_token_ids")
        check_token_ids([token for token, _ in params.sampling.logit_bias], vocab_size, "logit_bias")
        prompt = len(params.prompt_token_ids)
        if limit and params.max_new_tokens_given and prompt + params.max_new_tokens > limit:
            raise InvalidArgument(
                "max_new_tokens",
                f"{prompt} prompt tokens + {params.max_new_tokens} new tokens exceed the context of {limit}; "
                f"ask for at most {limit - prompt}",
            )

    async def connect_draft(self) -> bool:
        """True when a draft worker can be used now: known, compatible, and not backing off after a failure."""
        if not self.workers.has_draft or self.draft_disabled or not self.workers.draft_available():
            return False
        if self.draft is not None:
            return True
        try:
            draft = await asyncio.wait_for(self.workers.draft_info(), self.config.draft_timeout)
            check_pair(self.target, draft, self.tokenizer.fingerprint)
        except IncompatibleWorkers as error:
            log.error("draft worker disabled: %s", error)
            self.draft_disabled = True
            return False
        except Exception as error:  # noqa: BLE001 - an absent draft only costs speed
            log.warning("draft worker unavailable (%s); serving target-only, retrying in a while", error)
            return False
        self.draft = draft
        self.measured_speed.forget_draft()
        log.info("draft worker %s connected", draft.model_name)
        return True

    async def generate(
        self,
        params: GenerationParams,
        parent: Context | None = None,
        time_limit: float | None = None,
        kind: SpanKind = SpanKind.SERVER,
    ):
        """Yields deltas as rounds commit tokens, then the GenerationResult.

        time_limit: seconds the caller still waits (its gRPC deadline); bounds the retries after a worker failure.
        kind: of the request's span: SERVER where it is the server's span for the call, INTERNAL under another
        server span (the HTTP API's).
        """
        started = time.perf_counter()
        self.check(params)
        root = tracer().start_span(
            f"{params.operation} {self.target.model_name}",
            context=parent,
            kind=kind,
            attributes=request_attributes(params, self.target, self.draft, self.server_address, self.server_port),
        )
        run = RequestRun(self, params, root, started, time_limit)
        self.running += 1
        try:
            async for event in run.events():
                yield event
        except GeneratorExit:  # the caller stopped reading (e.g. after the result): not an error of the request
            raise
        except BaseException as error:
            root.set_status(Status(StatusCode.ERROR, str(error) or type(error).__name__))
            root.set_attribute("error.type", type(error).__name__)
            raise
        finally:
            self.running -= 1
            root.end()

    async def generate_all(self, params: GenerationParams, parent: Context | None = None, time_limit: float | None = None):
        async with contextlib.aclosing(self.generate(params, parent, time_limit)) as events:
            async for event in events:
                if isinstance(event, GenerationResult):
                    return event
        raise RuntimeError("generation ended without a result")
