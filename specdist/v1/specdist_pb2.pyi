from specdist.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("text", "token_ids", "params", "request_id", "apply_chat_template", "session_id", "kind")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    APPLY_CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: TokenIds
    params: _common_pb2.SamplingParams
    request_id: str
    apply_chat_template: bool
    session_id: str
    kind: str
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., request_id: _Optional[str] = ..., apply_chat_template: _Optional[bool] = ..., session_id: _Optional[str] = ..., kind: _Optional[str] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "token_ids", "text", "finish_reason", "stop_reason_text", "stop_reason_token", "stats", "logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_REASON_TEXT_FIELD_NUMBER: _ClassVar[int]
    STOP_REASON_TOKEN_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: _common_pb2.FinishReason
    stop_reason_text: str
    stop_reason_token: int
    stats: _common_pb2.RequestStats
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., stop_reason_text: _Optional[str] = ..., stop_reason_token: _Optional[int] = ..., stats: _Optional[_Union[_common_pb2.RequestStats, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...

class CancelRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class CancelResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetServerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ServerInfo(_message.Message):
    __slots__ = ("target_model", "draft_method", "draft_model", "tensor_parallel_size", "draft_replicas", "num_speculative_tokens", "max_model_len", "counters", "draft_pipeline", "draft_pipeline_miss", "cpu_kernels", "memory_plan", "replicas", "router_policy")
    class Counters(_message.Message):
        __slots__ = ("running_requests", "queued_requests", "target_kv_slots_used", "draft_kv_slots_used", "requests_total", "requests_finished", "requests_cancelled", "requests_failed", "active_streams")
        RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
        QUEUED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
        TARGET_KV_SLOTS_USED_FIELD_NUMBER: _ClassVar[int]
        DRAFT_KV_SLOTS_USED_FIELD_NUMBER: _ClassVar[int]
        REQUESTS_TOTAL_FIELD_NUMBER: _ClassVar[int]
        REQUESTS_FINISHED_FIELD_NUMBER: _ClassVar[int]
        REQUESTS_CANCELLED_FIELD_NUMBER: _ClassVar[int]
        REQUESTS_FAILED_FIELD_NUMBER: _ClassVar[int]
        ACTIVE_STREAMS_FIELD_NUMBER: _ClassVar[int]
        running_requests: int
        queued_requests: int
        target_kv_slots_used: int
        draft_kv_slots_used: int
        requests_total: int
        requests_finished: int
        requests_cancelled: int
        requests_failed: int
        active_streams: int
        def __init__(self, running_requests: _Optional[int] = ..., queued_requests: _Optional[int] = ..., target_kv_slots_used: _Optional[int] = ..., draft_kv_slots_used: _Optional[int] = ..., requests_total: _Optional[int] = ..., requests_finished: _Optional[int] = ..., requests_cancelled: _Optional[int] = ..., requests_failed: _Optional[int] = ..., active_streams: _Optional[int] = ...) -> None: ...
    TARGET_MODEL_FIELD_NUMBER: _ClassVar[int]
    DRAFT_METHOD_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MODEL_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PIPELINE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PIPELINE_MISS_FIELD_NUMBER: _ClassVar[int]
    CPU_KERNELS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_PLAN_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    ROUTER_POLICY_FIELD_NUMBER: _ClassVar[int]
    target_model: str
    draft_method: str
    draft_model: str
    tensor_parallel_size: int
    draft_replicas: int
    num_speculative_tokens: int
    max_model_len: int
    counters: ServerInfo.Counters
    draft_pipeline: bool
    draft_pipeline_miss: str
    cpu_kernels: str
    memory_plan: str
    replicas: int
    router_policy: str
    def __init__(self, target_model: _Optional[str] = ..., draft_method: _Optional[str] = ..., draft_model: _Optional[str] = ..., tensor_parallel_size: _Optional[int] = ..., draft_replicas: _Optional[int] = ..., num_speculative_tokens: _Optional[int] = ..., max_model_len: _Optional[int] = ..., counters: _Optional[_Union[ServerInfo.Counters, _Mapping]] = ..., draft_pipeline: _Optional[bool] = ..., draft_pipeline_miss: _Optional[str] = ..., cpu_kernels: _Optional[str] = ..., memory_plan: _Optional[str] = ..., replicas: _Optional[int] = ..., router_policy: _Optional[str] = ...) -> None: ...
