"""Conversions of the client-facing API's messages (proto/specdist/v1/specdist.proto) that belong to it
alone: the servers' answers. What the public request shares with the workers' messages (its
SamplingParams) is :mod:`specdist.sampling_proto`; the workers' own messages are
:mod:`specdist.transport.wire`'s."""

from __future__ import annotations

import functools
import inspect
from typing import Any

from specdist.v1 import common_pb2

_FINISH = {
    None: common_pb2.FINISH_REASON_UNSPECIFIED,
    "stop": common_pb2.FINISH_REASON_STOP,
    "length": common_pb2.FINISH_REASON_LENGTH,
    "abort": common_pb2.FINISH_REASON_ABORT,
    "error": common_pb2.FINISH_REASON_ERROR,
}


def finish_reason_to_proto(reason: str | None) -> int:
    """Engine finish reason ("stop" | "length" | "abort" | "error" | None) -> FinishReason."""
    if reason not in _FINISH:
        raise ValueError(f"unknown finish reason {reason!r}")
    return _FINISH[reason]


@functools.lru_cache(maxsize=8)
def _opens_with_kind(backend_type: type) -> bool:
    return "kind" in inspect.signature(backend_type.open).parameters


def kind_argument(backend: Any, kind: str | None) -> dict[str, str]:
    """The request's ``kind`` (gRPC ``GenerateRequest.kind``, HTTP ``kind``) as a keyword of ``backend.open``
    where it takes one: the replicas' front, whose router reads each replica's measured acceptance by kind
    (:class:`specdist.api.replica_set.ReplicaFront`); one speculative group has no router and takes none."""
    return {"kind": kind} if kind and _opens_with_kind(type(backend)) else {}
