from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DraftSource(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DRAFT_SOURCE_UNSPECIFIED: _ClassVar[DraftSource]
    DRAFT_SOURCE_MODEL: _ClassVar[DraftSource]
    DRAFT_SOURCE_PROMPT_LOOKUP: _ClassVar[DraftSource]
    DRAFT_SOURCE_SUFFIX_REQUEST: _ClassVar[DraftSource]
    DRAFT_SOURCE_SUFFIX_GLOBAL: _ClassVar[DraftSource]

class WorkerRole(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WORKER_ROLE_UNSPECIFIED: _ClassVar[WorkerRole]
    WORKER_ROLE_DRAFT: _ClassVar[WorkerRole]
    WORKER_ROLE_TARGET: _ClassVar[WorkerRole]
DRAFT_SOURCE_UNSPECIFIED: DraftSource
DRAFT_SOURCE_MODEL: DraftSource
DRAFT_SOURCE_PROMPT_LOOKUP: DraftSource
DRAFT_SOURCE_SUFFIX_REQUEST: DraftSource
DRAFT_SOURCE_SUFFIX_GLOBAL: DraftSource
WORKER_ROLE_UNSPECIFIED: WorkerRole
WORKER_ROLE_DRAFT: WorkerRole
WORKER_ROLE_TARGET: WorkerRole

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "seed", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "generated_tokens", "grammar", "grammar_start")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_START_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    seed: int
    min_p: float
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    generated_tokens: int
    grammar: str
    grammar_start: int
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., min_p: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., generated_tokens: _Optional[int] = ..., grammar: _Optional[str] = ..., grammar_start: _Optional[int] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("logprob", "top_token_ids", "top_logprobs")
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    logprob: float
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, logprob: _Optional[float] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class SparseDistribution(_message.Message):
    __slots__ = ("token_ids", "probs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    probs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., probs: _Optional[_Iterable[float]] = ...) -> None: ...

class WorkerTiming(_message.Message):
    __slots__ = ("compute_us", "sync_us", "batch_size", "batch_tokens", "queue_us", "handling_us", "ahead_us")
    COMPUTE_US_FIELD_NUMBER: _ClassVar[int]
    SYNC_US_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    BATCH_TOKENS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_US_FIELD_NUMBER: _ClassVar[int]
    HANDLING_US_FIELD_NUMBER: _ClassVar[int]
    AHEAD_US_FIELD_NUMBER: _ClassVar[int]
    compute_us: int
    sync_us: int
    batch_size: int
    batch_tokens: int
    queue_us: int
    handling_us: int
    ahead_us: int
    def __init__(self, compute_us: _Optional[int] = ..., sync_us: _Optional[int] = ..., batch_size: _Optional[int] = ..., batch_tokens: _Optional[int] = ..., queue_us: _Optional[int] = ..., handling_us: _Optional[int] = ..., ahead_us: _Optional[int] = ...) -> None: ...

class ForwardCost(_message.Message):
    __slots__ = ("tokens", "milliseconds")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    MILLISECONDS_FIELD_NUMBER: _ClassVar[int]
    tokens: int
    milliseconds: float
    def __init__(self, tokens: _Optional[int] = ..., milliseconds: _Optional[float] = ...) -> None: ...

class SessionStarted(_message.Message):
    __slots__ = ("session_id", "cached_tokens", "timing", "reused_tokens", "prompt_logprobs")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    REUSED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    cached_tokens: int
    timing: WorkerTiming
    reused_tokens: int
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, session_id: _Optional[str] = ..., cached_tokens: _Optional[int] = ..., timing: _Optional[_Union[WorkerTiming, _Mapping]] = ..., reused_tokens: _Optional[int] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class GetInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetInfoResponse(_message.Message):
    __slots__ = ("role", "model_name", "vocab_size", "tokenizer_fingerprint", "device", "dtype", "max_context_length", "active_sessions", "max_sessions", "eos_token_ids", "forward_costs", "engine", "max_kv_tokens", "reserved_kv_tokens", "decodes_ahead", "prefix_cache_tokens", "prefix_cache_held_tokens")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    MAX_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_COSTS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    MAX_KV_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RESERVED_KV_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DECODES_AHEAD_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HELD_TOKENS_FIELD_NUMBER: _ClassVar[int]
    role: WorkerRole
    model_name: str
    vocab_size: int
    tokenizer_fingerprint: str
    device: str
    dtype: str
    max_context_length: int
    active_sessions: int
    max_sessions: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    forward_costs: _containers.RepeatedCompositeFieldContainer[ForwardCost]
    engine: str
    max_kv_tokens: int
    reserved_kv_tokens: int
    decodes_ahead: bool
    prefix_cache_tokens: int
    prefix_cache_held_tokens: int
    def __init__(self, role: _Optional[_Union[WorkerRole, str]] = ..., model_name: _Optional[str] = ..., vocab_size: _Optional[int] = ..., tokenizer_fingerprint: _Optional[str] = ..., device: _Optional[str] = ..., dtype: _Optional[str] = ..., max_context_length: _Optional[int] = ..., active_sessions: _Optional[int] = ..., max_sessions: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., forward_costs: _Optional[_Iterable[_Union[ForwardCost, _Mapping]]] = ..., engine: _Optional[str] = ..., max_kv_tokens: _Optional[int] = ..., reserved_kv_tokens: _Optional[int] = ..., decodes_ahead: _Optional[bool] = ..., prefix_cache_tokens: _Optional[int] = ..., prefix_cache_held_tokens: _Optional[int] = ...) -> None: ...
