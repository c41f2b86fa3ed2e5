from specdec.v1 import worker_pb2 as _worker_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DraftSessionStart(_message.Message):
    __slots__ = ("prompt_token_ids", "sampling", "max_q_entries", "max_tokens")
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MAX_Q_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _worker_pb2.SamplingParams
    max_q_entries: int
    max_tokens: int
    def __init__(self, prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_worker_pb2.SamplingParams, _Mapping]] = ..., max_q_entries: _Optional[int] = ..., max_tokens: _Optional[int] = ...) -> None: ...

class DraftStep(_message.Message):
    __slots__ = ("num_accepted", "committed_token_ids", "num_tokens", "assume_accepted")
    NUM_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ASSUME_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    num_accepted: int
    committed_token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_tokens: int
    assume_accepted: bool
    def __init__(self, num_accepted: _Optional[int] = ..., committed_token_ids: _Optional[_Iterable[int]] = ..., num_tokens: _Optional[int] = ..., assume_accepted: _Optional[bool] = ...) -> None: ...

class DraftRequest(_message.Message):
    __slots__ = ("start", "step", "trace_context")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    START_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    start: DraftSessionStart
    step: DraftStep
    trace_context: _containers.ScalarMap[str, str]
    def __init__(self, start: _Optional[_Union[DraftSessionStart, _Mapping]] = ..., step: _Optional[_Union[DraftStep, _Mapping]] = ..., trace_context: _Optional[_Mapping[str, str]] = ...) -> None: ...

class DraftProposal(_message.Message):
    __slots__ = ("token_ids", "distributions", "timing", "assumed_token_id", "source", "confidence")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DISTRIBUTIONS_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    ASSUMED_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    CONFIDENCE_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    distributions: _containers.RepeatedCompositeFieldContainer[_worker_pb2.SparseDistribution]
    timing: _worker_pb2.WorkerTiming
    assumed_token_id: int
    source: _worker_pb2.DraftSource
    confidence: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., distributions: _Optional[_Iterable[_Union[_worker_pb2.SparseDistribution, _Mapping]]] = ..., timing: _Optional[_Union[_worker_pb2.WorkerTiming, _Mapping]] = ..., assumed_token_id: _Optional[int] = ..., source: _Optional[_Union[_worker_pb2.DraftSource, str]] = ..., confidence: _Optional[_Iterable[float]] = ...) -> None: ...

class DraftResponse(_message.Message):
    __slots__ = ("started", "proposal")
    STARTED_FIELD_NUMBER: _ClassVar[int]
    PROPOSAL_FIELD_NUMBER: _ClassVar[int]
    started: _worker_pb2.SessionStarted
    proposal: DraftProposal
    def __init__(self, started: _Optional[_Union[_worker_pb2.SessionStarted, _Mapping]] = ..., proposal: _Optional[_Union[DraftProposal, _Mapping]] = ...) -> None: ...
