from specdec.v1 import worker_pb2 as _worker_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GammaSchedule(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    GAMMA_SCHEDULE_UNSPECIFIED: _ClassVar[GammaSchedule]
    GAMMA_SCHEDULE_COST_MODEL: _ClassVar[GammaSchedule]
    GAMMA_SCHEDULE_HEURISTIC: _ClassVar[GammaSchedule]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_EOS: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]

class MemberHealth(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MEMBER_HEALTH_UNSPECIFIED: _ClassVar[MemberHealth]
    MEMBER_HEALTH_SERVING: _ClassVar[MemberHealth]
    MEMBER_HEALTH_NOT_SERVING: _ClassVar[MemberHealth]
    MEMBER_HEALTH_UNREACHABLE: _ClassVar[MemberHealth]
    MEMBER_HEALTH_REFUSED: _ClassVar[MemberHealth]
GAMMA_SCHEDULE_UNSPECIFIED: GammaSchedule
GAMMA_SCHEDULE_COST_MODEL: GammaSchedule
GAMMA_SCHEDULE_HEURISTIC: GammaSchedule
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_EOS: FinishReason
FINISH_REASON_STOP: FinishReason
MEMBER_HEALTH_UNSPECIFIED: MemberHealth
MEMBER_HEALTH_SERVING: MemberHealth
MEMBER_HEALTH_NOT_SERVING: MemberHealth
MEMBER_HEALTH_UNREACHABLE: MemberHealth
MEMBER_HEALTH_REFUSED: MemberHealth

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class ChatMessages(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("prompt", "messages", "prompt_token_ids", "temperature", "top_p", "top_k", "seed", "max_new_tokens", "stop", "ignore_eos", "num_speculative_tokens", "include_rounds", "gamma_schedule", "overlap", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "logprobs", "prompt_logprobs", "constraint")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    GAMMA_SCHEDULE_FIELD_NUMBER: _ClassVar[int]
    OVERLAP_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINT_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    messages: ChatMessages
    prompt_token_ids: TokenIds
    temperature: float
    top_p: float
    top_k: int
    seed: int
    max_new_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    ignore_eos: bool
    num_speculative_tokens: int
    include_rounds: bool
    gamma_schedule: GammaSchedule
    overlap: bool
    min_p: float
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    logprobs: int
    prompt_logprobs: bool
    constraint: OutputConstraint
    def __init__(self, prompt: _Optional[str] = ..., messages: _Optional[_Union[ChatMessages, _Mapping]] = ..., prompt_token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., max_new_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., ignore_eos: _Optional[bool] = ..., num_speculative_tokens: _Optional[int] = ..., include_rounds: _Optional[bool] = ..., gamma_schedule: _Optional[_Union[GammaSchedule, str]] = ..., overlap: _Optional[bool] = ..., min_p: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., logprobs: _Optional[int] = ..., prompt_logprobs: _Optional[bool] = ..., constraint: _Optional[_Union[OutputConstraint, _Mapping]] = ...) -> None: ...

class OutputConstraint(_message.Message):
    __slots__ = ("json_schema", "lark", "regex", "lenient")
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    LARK_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    LENIENT_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    lark: str
    regex: str
    lenient: bool
    def __init__(self, json_schema: _Optional[str] = ..., lark: _Optional[str] = ..., regex: _Optional[str] = ..., lenient: _Optional[bool] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_prompt_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ...) -> None: ...

class SpeculationStats(_message.Message):
    __slots__ = ("rounds", "drafted_tokens", "accepted_tokens", "acceptance_rate", "mean_tokens_per_round", "num_speculative_tokens", "fallback_reason", "overlap", "overlapped_rounds")
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_RATE_FIELD_NUMBER: _ClassVar[int]
    MEAN_TOKENS_PER_ROUND_FIELD_NUMBER: _ClassVar[int]
    NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FALLBACK_REASON_FIELD_NUMBER: _ClassVar[int]
    OVERLAP_FIELD_NUMBER: _ClassVar[int]
    OVERLAPPED_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    rounds: int
    drafted_tokens: int
    accepted_tokens: int
    acceptance_rate: float
    mean_tokens_per_round: float
    num_speculative_tokens: int
    fallback_reason: str
    overlap: bool
    overlapped_rounds: int
    def __init__(self, rounds: _Optional[int] = ..., drafted_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., acceptance_rate: _Optional[float] = ..., mean_tokens_per_round: _Optional[float] = ..., num_speculative_tokens: _Optional[int] = ..., fallback_reason: _Optional[str] = ..., overlap: _Optional[bool] = ..., overlapped_rounds: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("text", "token_ids", "finish_reason", "usage", "speculation", "time_split", "rounds", "logprobs", "prompt_logprobs")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    TIME_SPLIT_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: FinishReason
    usage: Usage
    speculation: SpeculationStats
    time_split: TimeSplit
    rounds: _containers.RepeatedCompositeFieldContainer[SpeculationRound]
    logprobs: _containers.RepeatedCompositeFieldContainer[_worker_pb2.TokenLogprob]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_worker_pb2.TokenLogprob]
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., speculation: _Optional[_Union[SpeculationStats, _Mapping]] = ..., time_split: _Optional[_Union[TimeSplit, _Mapping]] = ..., rounds: _Optional[_Iterable[_Union[SpeculationRound, _Mapping]]] = ..., logprobs: _Optional[_Iterable[_Union[_worker_pb2.TokenLogprob, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_worker_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...

class TimeSplit(_message.Message):
    __slots__ = ("prefill_us", "draft_us", "verify_us", "sync_us", "network_us", "coordinator_us", "total_us", "draft_overlapped_us", "queue_us", "handling_us", "verify_ahead_us")
    PREFILL_US_FIELD_NUMBER: _ClassVar[int]
    DRAFT_US_FIELD_NUMBER: _ClassVar[int]
    VERIFY_US_FIELD_NUMBER: _ClassVar[int]
    SYNC_US_FIELD_NUMBER: _ClassVar[int]
    NETWORK_US_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_US_FIELD_NUMBER: _ClassVar[int]
    TOTAL_US_FIELD_NUMBER: _ClassVar[int]
    DRAFT_OVERLAPPED_US_FIELD_NUMBER: _ClassVar[int]
    QUEUE_US_FIELD_NUMBER: _ClassVar[int]
    HANDLING_US_FIELD_NUMBER: _ClassVar[int]
    VERIFY_AHEAD_US_FIELD_NUMBER: _ClassVar[int]
    prefill_us: int
    draft_us: int
    verify_us: int
    sync_us: int
    network_us: int
    coordinator_us: int
    total_us: int
    draft_overlapped_us: int
    queue_us: int
    handling_us: int
    verify_ahead_us: int
    def __init__(self, prefill_us: _Optional[int] = ..., draft_us: _Optional[int] = ..., verify_us: _Optional[int] = ..., sync_us: _Optional[int] = ..., network_us: _Optional[int] = ..., coordinator_us: _Optional[int] = ..., total_us: _Optional[int] = ..., draft_overlapped_us: _Optional[int] = ..., queue_us: _Optional[int] = ..., handling_us: _Optional[int] = ..., verify_ahead_us: _Optional[int] = ...) -> None: ...

class SpeculationRound(_message.Message):
    __slots__ = ("gamma", "drafted", "accepted", "rollback", "committed", "time_split", "bytes_sent", "bytes_received", "overlapped", "target_batch_size", "draft_source")
    GAMMA_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    ROLLBACK_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    TIME_SPLIT_FIELD_NUMBER: _ClassVar[int]
    BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    OVERLAPPED_FIELD_NUMBER: _ClassVar[int]
    TARGET_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_SOURCE_FIELD_NUMBER: _ClassVar[int]
    gamma: int
    drafted: int
    accepted: int
    rollback: int
    committed: int
    time_split: TimeSplit
    bytes_sent: int
    bytes_received: int
    overlapped: bool
    target_batch_size: int
    draft_source: _worker_pb2.DraftSource
    def __init__(self, gamma: _Optional[int] = ..., drafted: _Optional[int] = ..., accepted: _Optional[int] = ..., rollback: _Optional[int] = ..., committed: _Optional[int] = ..., time_split: _Optional[_Union[TimeSplit, _Mapping]] = ..., bytes_sent: _Optional[int] = ..., bytes_received: _Optional[int] = ..., overlapped: _Optional[bool] = ..., target_batch_size: _Optional[int] = ..., draft_source: _Optional[_Union[_worker_pb2.DraftSource, str]] = ...) -> None: ...

class GenerateDelta(_message.Message):
    __slots__ = ("text", "token_ids", "logprobs")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[_worker_pb2.TokenLogprob]
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[_worker_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...

class GenerateStreamResponse(_message.Message):
    __slots__ = ("delta", "final")
    DELTA_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    delta: GenerateDelta
    final: GenerateResponse
    def __init__(self, delta: _Optional[_Union[GenerateDelta, _Mapping]] = ..., final: _Optional[_Union[GenerateResponse, _Mapping]] = ...) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PoolMember(_message.Message):
    __slots__ = ("address", "health", "model_name", "sessions", "coordinator_sessions", "max_sessions", "sessions_placed", "detail")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    HEALTH_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    MAX_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_PLACED_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    address: str
    health: MemberHealth
    model_name: str
    sessions: int
    coordinator_sessions: int
    max_sessions: int
    sessions_placed: int
    detail: str
    def __init__(self, address: _Optional[str] = ..., health: _Optional[_Union[MemberHealth, str]] = ..., model_name: _Optional[str] = ..., sessions: _Optional[int] = ..., coordinator_sessions: _Optional[int] = ..., max_sessions: _Optional[int] = ..., sessions_placed: _Optional[int] = ..., detail: _Optional[str] = ...) -> None: ...

class WorkerPool(_message.Message):
    __slots__ = ("role", "configured", "members")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONFIGURED_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    role: _worker_pb2.WorkerRole
    configured: _containers.RepeatedScalarFieldContainer[str]
    members: _containers.RepeatedCompositeFieldContainer[PoolMember]
    def __init__(self, role: _Optional[_Union[_worker_pb2.WorkerRole, str]] = ..., configured: _Optional[_Iterable[str]] = ..., members: _Optional[_Iterable[_Union[PoolMember, _Mapping]]] = ...) -> None: ...

class GetStatusResponse(_message.Message):
    __slots__ = ("pools", "active_requests", "target_model", "draft_model")
    POOLS_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    TARGET_MODEL_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MODEL_FIELD_NUMBER: _ClassVar[int]
    pools: _containers.RepeatedCompositeFieldContainer[WorkerPool]
    active_requests: int
    target_model: str
    draft_model: str
    def __init__(self, pools: _Optional[_Iterable[_Union[WorkerPool, _Mapping]]] = ..., active_requests: _Optional[int] = ..., target_model: _Optional[str] = ..., draft_model: _Optional[str] = ...) -> None: ...
