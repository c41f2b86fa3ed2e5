"""What one speculation round produces on each worker, as the engines return it and the coordinator reads it."""

from dataclasses import dataclass, field, fields
from enum import StrEnum

from specdec.common.sampling import SparseDistribution, TokenLogprob
from specdec.v1 import worker_pb2

# q of one drafted token as a round carries it: tensors where it was sampled (or converted for sampling), or the
# protobuf message as it came off the wire, which the coordinator forwards to the target without a round of
# conversions (worker_clients.wire_form). Readers take either: both have token_ids and probs sequences.
DraftQ = SparseDistribution | worker_pb2.SparseDistribution


class DraftSource(StrEnum):
    """What proposed a round's tokens (draft.proto's DraftSource)."""

    NONE = ""
    MODEL = "model"
    PROMPT_LOOKUP = "prompt_lookup"
    SUFFIX_REQUEST = "suffix_request"  # the request's own suffix tree
    SUFFIX_GLOBAL = "suffix_global"  # the worker's tree over earlier requests' outputs


@dataclass
class WorkerTiming:
    """A worker's account of handling one message: the proto WorkerTiming's fields, one record from the engine that
    measures them through the wire to the coordinator's time split and the gamma policy."""

    compute_us: int = 0
    sync_us: int = 0  # KV-cache rollback
    batch_size: int = 1  # sessions in the worker's batched forward pass
    batch_tokens: int = 0  # tokens fed in that pass, over all its sessions (the target's)
    queue_us: int = 0  # waiting on the worker for the batch to form and for the pass before it
    handling_us: int = 0  # the worker's whole handling of the message (0: not measured, in process)
    ahead_us: int = 0  # of compute_us, scoring done ahead, before the message arrived (hidden behind the exchange)

    def to_proto(self) -> worker_pb2.WorkerTiming:
        return worker_pb2.WorkerTiming(**vars(self))

    @classmethod
    def from_proto(cls, msg: worker_pb2.WorkerTiming) -> "WorkerTiming":
        return cls(**{f.name: getattr(msg, f.name) for f in fields(cls)})


@dataclass
class Proposal:
    """The draft's tokens x1..xg with the exact q_i each was sampled from."""

    token_ids: list[int]
    distributions: list[DraftQ]
    timing: WorkerTiming = field(default_factory=WorkerTiming)
    bytes_sent: int = 0  # serialized size of the messages that asked for it and carried it (0 in process)
    bytes_received: int = 0
    assumed_token: int | None = None  # overlap: the token assumed to precede x1 (the target's bonus)
    source: DraftSource = DraftSource.NONE
    # Per token, the proposer's uncalibrated estimate that the target accepts it once it accepted the tokens before
    # it (suffix trees); empty where the proposer makes none. The coordinator calibrates it against verdicts and
    # verifies the prefix expected to pay most (CostModelPolicy.trim). Deterministic proposals (q = 1) only: a
    # length chosen from a sampled token's own value would bias the output (docs/design/round.md).
    confidence: list[float] = field(default_factory=list)


@dataclass
class Verdict:
    """The target's decision: n accepted, the next token (correction or bonus), and g - n rolled back."""

    num_accepted: int
    next_token: int
    rollback: int
    draft_token_probs: list[float]
    distributions: list[SparseDistribution] = field(default_factory=list)
    timing: WorkerTiming = field(default_factory=WorkerTiming)
    bytes_sent: int = 0
    bytes_received: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)  # per committed token, when the session asked
