from specdist.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PipelineOutcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PIPELINE_OUTCOME_UNSPECIFIED: _ClassVar[PipelineOutcome]
    PIPELINE_OUTCOME_HIT: _ClassVar[PipelineOutcome]
    PIPELINE_OUTCOME_MISS: _ClassVar[PipelineOutcome]
PIPELINE_OUTCOME_UNSPECIFIED: PipelineOutcome
PIPELINE_OUTCOME_HIT: PipelineOutcome
PIPELINE_OUTCOME_MISS: PipelineOutcome

class StartRequest(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[_common_pb2.StartItem]
    def __init__(self, items: _Optional[_Iterable[_Union[_common_pb2.StartItem, _Mapping]]] = ...) -> None: ...

class StartResponse(_message.Message):
    __slots__ = ("request_ids",)
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class ProposeRequest(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[ProposeItem]
    def __init__(self, items: _Optional[_Iterable[_Union[ProposeItem, _Mapping]]] = ...) -> None: ...

class ProposeItem(_message.Message):
    __slots__ = ("request_id", "num_accepted", "new_token_ids", "num_tokens", "preferred_format", "seq_len", "hidden")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFERRED_FORMAT_FIELD_NUMBER: _ClassVar[int]
    SEQ_LEN_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    num_accepted: int
    new_token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_tokens: int
    preferred_format: _common_pb2.DistributionFormat
    seq_len: int
    hidden: _common_pb2.HiddenStates
    def __init__(self, request_id: _Optional[str] = ..., num_accepted: _Optional[int] = ..., new_token_ids: _Optional[_Iterable[int]] = ..., num_tokens: _Optional[int] = ..., preferred_format: _Optional[_Union[_common_pb2.DistributionFormat, str]] = ..., seq_len: _Optional[int] = ..., hidden: _Optional[_Union[_common_pb2.HiddenStates, _Mapping]] = ...) -> None: ...

class ProposeResponse(_message.Message):
    __slots__ = ("proposals",)
    PROPOSALS_FIELD_NUMBER: _ClassVar[int]
    proposals: _containers.RepeatedCompositeFieldContainer[Proposal]
    def __init__(self, proposals: _Optional[_Iterable[_Union[Proposal, _Mapping]]] = ...) -> None: ...

class Proposal(_message.Message):
    __slots__ = ("request_id", "token_ids", "probs", "pipeline", "match_lengths")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_FIELD_NUMBER: _ClassVar[int]
    MATCH_LENGTHS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    probs: _containers.RepeatedCompositeFieldContainer[_common_pb2.DraftDistribution]
    pipeline: PipelineOutcome
    match_lengths: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., probs: _Optional[_Iterable[_Union[_common_pb2.DraftDistribution, _Mapping]]] = ..., pipeline: _Optional[_Union[PipelineOutcome, str]] = ..., match_lengths: _Optional[_Iterable[int]] = ...) -> None: ...

class DraftReleaseRequest(_message.Message):
    __slots__ = ("request_ids",)
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class DraftReleaseResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
