from specdec.v1 import worker_pb2 as _worker_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class VerifySessionStart(_message.Message):
    __slots__ = ("prompt_token_ids", "sampling", "num_p_entries", "max_tokens", "logprobs", "prompt_logprobs")
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    NUM_P_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _worker_pb2.SamplingParams
    num_p_entries: int
    max_tokens: int
    logprobs: int
    prompt_logprobs: bool
    def __init__(self, prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_worker_pb2.SamplingParams, _Mapping]] = ..., num_p_entries: _Optional[int] = ..., max_tokens: _Optional[int] = ..., logprobs: _Optional[int] = ..., prompt_logprobs: _Optional[bool] = ...) -> None: ...

class VerifyStep(_message.Message):
    __slots__ = ("draft_token_ids", "draft_distributions", "decode_ahead")
    DRAFT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_DISTRIBUTIONS_FIELD_NUMBER: _ClassVar[int]
    DECODE_AHEAD_FIELD_NUMBER: _ClassVar[int]
    draft_token_ids: _containers.RepeatedScalarFieldContainer[int]
    draft_distributions: _containers.RepeatedCompositeFieldContainer[_worker_pb2.SparseDistribution]
    decode_ahead: bool
    def __init__(self, draft_token_ids: _Optional[_Iterable[int]] = ..., draft_distributions: _Optional[_Iterable[_Union[_worker_pb2.SparseDistribution, _Mapping]]] = ..., decode_ahead: _Optional[bool] = ...) -> None: ...

class VerifyRequest(_message.Message):
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
    start: VerifySessionStart
    step: VerifyStep
    trace_context: _containers.ScalarMap[str, str]
    def __init__(self, start: _Optional[_Union[VerifySessionStart, _Mapping]] = ..., step: _Optional[_Union[VerifyStep, _Mapping]] = ..., trace_context: _Optional[_Mapping[str, str]] = ...) -> None: ...

class VerifyResult(_message.Message):
    __slots__ = ("num_accepted", "next_token_id", "rollback", "draft_token_probs", "distributions", "timing", "logprobs")
    NUM_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    NEXT_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    ROLLBACK_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKEN_PROBS_FIELD_NUMBER: _ClassVar[int]
    DISTRIBUTIONS_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    num_accepted: int
    next_token_id: int
    rollback: int
    draft_token_probs: _containers.RepeatedScalarFieldContainer[float]
    distributions: _containers.RepeatedCompositeFieldContainer[_worker_pb2.SparseDistribution]
    timing: _worker_pb2.WorkerTiming
    logprobs: _containers.RepeatedCompositeFieldContainer[_worker_pb2.TokenLogprob]
    def __init__(self, num_accepted: _Optional[int] = ..., next_token_id: _Optional[int] = ..., rollback: _Optional[int] = ..., draft_token_probs: _Optional[_Iterable[float]] = ..., distributions: _Optional[_Iterable[_Union[_worker_pb2.SparseDistribution, _Mapping]]] = ..., timing: _Optional[_Union[_worker_pb2.WorkerTiming, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[_worker_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...

class VerifyResponse(_message.Message):
    __slots__ = ("started", "result")
    STARTED_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    started: _worker_pb2.SessionStarted
    result: VerifyResult
    def __init__(self, started: _Optional[_Union[_worker_pb2.SessionStarted, _Mapping]] = ..., result: _Optional[_Union[VerifyResult, _Mapping]] = ...) -> None: ...
