from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Coupling(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    COUPLING_UNSPECIFIED: _ClassVar[Coupling]
    COUPLING_REJECTION: _ClassVar[Coupling]
    COUPLING_GUMBEL: _ClassVar[Coupling]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]
    FINISH_REASON_ERROR: _ClassVar[FinishReason]

class DistributionFormat(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DISTRIBUTION_FORMAT_UNSPECIFIED: _ClassVar[DistributionFormat]
    DISTRIBUTION_FORMAT_DENSE_FP16: _ClassVar[DistributionFormat]
    DISTRIBUTION_FORMAT_SPARSE_FP16: _ClassVar[DistributionFormat]
    DISTRIBUTION_FORMAT_ONE_HOT: _ClassVar[DistributionFormat]

class HiddenDtype(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    HIDDEN_DTYPE_UNSPECIFIED: _ClassVar[HiddenDtype]
    HIDDEN_DTYPE_FLOAT32: _ClassVar[HiddenDtype]
    HIDDEN_DTYPE_BFLOAT16: _ClassVar[HiddenDtype]
    HIDDEN_DTYPE_FLOAT16: _ClassVar[HiddenDtype]
COUPLING_UNSPECIFIED: Coupling
COUPLING_REJECTION: Coupling
COUPLING_GUMBEL: Coupling
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason
FINISH_REASON_ERROR: FinishReason
DISTRIBUTION_FORMAT_UNSPECIFIED: DistributionFormat
DISTRIBUTION_FORMAT_DENSE_FP16: DistributionFormat
DISTRIBUTION_FORMAT_SPARSE_FP16: DistributionFormat
DISTRIBUTION_FORMAT_ONE_HOT: DistributionFormat
HIDDEN_DTYPE_UNSPECIFIED: HiddenDtype
HIDDEN_DTYPE_FLOAT32: HiddenDtype
HIDDEN_DTYPE_BFLOAT16: HiddenDtype
HIDDEN_DTYPE_FLOAT16: HiddenDtype

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "seed", "max_tokens", "stop", "stop_token_ids", "ignore_eos", "logprobs")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    seed: int
    max_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    logprobs: int
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., max_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[int] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("logprob", "top_token_ids", "top_logprobs")
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    logprob: float
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, logprob: _Optional[float] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class RequestStats(_message.Message):
    __slots__ = ("prompt_tokens", "output_tokens", "drafted", "accepted", "steps", "time_to_first_token_s", "total_time_s", "pipeline_hits", "pipeline_misses")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    TIME_TO_FIRST_TOKEN_S_FIELD_NUMBER: _ClassVar[int]
    TOTAL_TIME_S_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_HITS_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_MISSES_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    output_tokens: int
    drafted: int
    accepted: int
    steps: int
    time_to_first_token_s: float
    total_time_s: float
    pipeline_hits: int
    pipeline_misses: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., output_tokens: _Optional[int] = ..., drafted: _Optional[int] = ..., accepted: _Optional[int] = ..., steps: _Optional[int] = ..., time_to_first_token_s: _Optional[float] = ..., total_time_s: _Optional[float] = ..., pipeline_hits: _Optional[int] = ..., pipeline_misses: _Optional[int] = ...) -> None: ...

class StartItem(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "params", "seed", "coupling", "hidden_layers", "tenant")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    COUPLING_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_LAYERS_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    params: SamplingParams
    seed: int
    coupling: Coupling
    hidden_layers: _containers.RepeatedScalarFieldContainer[int]
    tenant: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[SamplingParams, _Mapping]] = ..., seed: _Optional[int] = ..., coupling: _Optional[_Union[Coupling, str]] = ..., hidden_layers: _Optional[_Iterable[int]] = ..., tenant: _Optional[str] = ...) -> None: ...

class HiddenStates(_message.Message):
    __slots__ = ("rows", "width", "dtype", "data")
    ROWS_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    rows: int
    width: int
    dtype: HiddenDtype
    data: bytes
    def __init__(self, rows: _Optional[int] = ..., width: _Optional[int] = ..., dtype: _Optional[_Union[HiddenDtype, str]] = ..., data: _Optional[bytes] = ...) -> None: ...

class DraftDistribution(_message.Message):
    __slots__ = ("format", "values", "token_ids")
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    format: DistributionFormat
    values: bytes
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, format: _Optional[_Union[DistributionFormat, str]] = ..., values: _Optional[bytes] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...
