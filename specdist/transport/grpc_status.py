"""specdist's error codes on gRPC: the one mapping between :class:`~specdist.errors.ErrorCode`
and ``grpc.StatusCode``, used by every gRPC server (the public service, the workers) and by the
remote transports, which turn a status from the wire into a code where they receive it."""

from __future__ import annotations

import grpc

from specdist.errors import ErrorCode, code_of

_TO_GRPC = {code: grpc.StatusCode[code.name] for code in ErrorCode}
_FROM_GRPC = {status: code for code, status in _TO_GRPC.items()}


def grpc_status(code: ErrorCode) -> grpc.StatusCode:
    """The gRPC status a server answers ``code`` with."""
    return _TO_GRPC[code]


def grpc_status_of(e: BaseException) -> grpc.StatusCode:
    """The gRPC status for ``e``: a specdist error's code, INTERNAL for anything else."""
    return _TO_GRPC[code_of(e)]


def error_code(status: grpc.StatusCode) -> ErrorCode:
    """The code of a status received from the wire (OK, which no failure carries, and a status
    grpc may add later read as UNKNOWN)."""
    return _FROM_GRPC.get(status, ErrorCode.UNKNOWN)
