from specdist.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PrefillRequest(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[_common_pb2.StartItem]
    def __init__(self, items: _Optional[_Iterable[_Union[_common_pb2.StartItem, _Mapping]]] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("request_ids", "hidden")
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    hidden: _containers.RepeatedCompositeFieldContainer[_common_pb2.HiddenStates]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ..., hidden: _Optional[_Iterable[_Union[_common_pb2.HiddenStates, _Mapping]]] = ...) -> None: ...

class VerifyRequest(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[VerifyItem]
    def __init__(self, items: _Optional[_Iterable[_Union[VerifyItem, _Mapping]]] = ...) -> None: ...

class VerifyItem(_message.Message):
    __slots__ = ("request_id", "draft_token_ids", "draft_probs", "seq_len")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PROBS_FIELD_NUMBER: _ClassVar[int]
    SEQ_LEN_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    draft_token_ids: _containers.RepeatedScalarFieldContainer[int]
    draft_probs: _containers.RepeatedCompositeFieldContainer[_common_pb2.DraftDistribution]
    seq_len: int
    def __init__(self, request_id: _Optional[str] = ..., draft_token_ids: _Optional[_Iterable[int]] = ..., draft_probs: _Optional[_Iterable[_Union[_common_pb2.DraftDistribution, _Mapping]]] = ..., seq_len: _Optional[int] = ...) -> None: ...

class VerifyResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[VerifyResult]
    def __init__(self, results: _Optional[_Iterable[_Union[VerifyResult, _Mapping]]] = ...) -> None: ...

class VerifyResult(_message.Message):
    __slots__ = ("request_id", "num_accepted", "next_token_id", "logprobs", "hidden")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    NEXT_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    num_accepted: int
    next_token_id: int
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    hidden: _common_pb2.HiddenStates
    def __init__(self, request_id: _Optional[str] = ..., num_accepted: _Optional[int] = ..., next_token_id: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., hidden: _Optional[_Union[_common_pb2.HiddenStates, _Mapping]] = ...) -> None: ...

class TargetReleaseRequest(_message.Message):
    __slots__ = ("request_ids",)
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class TargetReleaseResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
