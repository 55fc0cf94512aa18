"""Conversions of the client-facing API's messages (proto/specdist/v1/specdist.proto) that belong to it
alone: the servers' answers. What the public request shares with the workers' messages (its
SamplingParams) is :mod:`specdist.sampling_proto`; the workers' own messages are
:mod:`specdist.transport.wire`'s."""

from __future__ import annotations

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
