"""Errors specdist raises on purpose. Each names the field or setting that is wrong.

Every error a server answers with carries an :class:`ErrorCode`: the :class:`FieldError` subclasses here as a
class attribute ``code`` (the one place a class gets its code: the coordinator's refusals,
:mod:`specdist.api.refusals`, subclass them), :class:`~specdist.transport.protocol.TransportError` per instance.
Servers translate it in one place each (gRPC: :mod:`specdist.transport.grpc_status`, HTTP:
:mod:`specdist.api.http_server`); code inside specdist decides on the code, never on message text.
"""

from __future__ import annotations

import enum
import re


class ErrorCode(str, enum.Enum):
    """The canonical status codes (gRPC's, ``google.rpc.Code``), by name.

    A ``str`` enum: a code equals (and hashes as) its name, and ``str()`` of it is the name, so
    ``f"{code}: {message}"`` reads as a gRPC status line does.
    """

    CANCELLED = "CANCELLED"
    UNKNOWN = "UNKNOWN"
    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"
    NOT_FOUND = "NOT_FOUND"
    ALREADY_EXISTS = "ALREADY_EXISTS"
    PERMISSION_DENIED = "PERMISSION_DENIED"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    FAILED_PRECONDITION = "FAILED_PRECONDITION"
    ABORTED = "ABORTED"
    OUT_OF_RANGE = "OUT_OF_RANGE"
    UNIMPLEMENTED = "UNIMPLEMENTED"
    INTERNAL = "INTERNAL"
    UNAVAILABLE = "UNAVAILABLE"
    DATA_LOSS = "DATA_LOSS"
    UNAUTHENTICATED = "UNAUTHENTICATED"

    def __str__(self) -> str:
        return self.value

    __format__ = str.__format__  # f"{code}" is the name on every Python version


class SpecDistError(Exception):
    """Base class of every error specdist raises deliberately."""


def code_of(e: BaseException) -> ErrorCode:
    """The status code a server answers ``e`` with: a specdist error's ``code``, else INTERNAL."""
    code = getattr(e, "code", None)
    return code if isinstance(e, SpecDistError) and isinstance(code, ErrorCode) else ErrorCode.INTERNAL


class FieldError(SpecDistError):
    """An error about one request field. ``field`` is its dotted name (e.g. ``params.top_p``), or "" when it
    blames the request as a whole (a :class:`Refusal`); ``code`` is the status servers answer it with.

    A field named ``items[i]...`` blames item ``i`` of a batch call (:func:`blamed_item`); the
    other items can be retried without it when the code allows (a per-item refusal)."""

    code = ErrorCode.INTERNAL

    def __init__(self, field: str, message: str):
        self.field = field
        self.message = message
        super().__init__(str(self))

    def __str__(self) -> str:  # KeyError subclasses would otherwise repr() the message
        return f"{self.field}: {self.message}" if self.field else self.message

    def __reduce__(self):  # rebuild from (field, message) when Ray or pickle ships it
        return (type(self), (self.field, self.message))


class InvalidArgument(FieldError, ValueError):
    """A request field has a bad value."""

    code = ErrorCode.INVALID_ARGUMENT


class NotFound(FieldError, KeyError):
    """An unknown request id."""

    code = ErrorCode.NOT_FOUND


class AlreadyExists(FieldError):
    """A request id that is already live."""

    code = ErrorCode.ALREADY_EXISTS


class FailedPrecondition(FieldError):
    """The receiver's state does not match the call (e.g. a sequence-length mismatch)."""

    code = ErrorCode.FAILED_PRECONDITION


class NonFiniteLogits(FailedPrecondition):
    """A model's logits for one request hold a NaN or leave no positive finite probability, so no
    token can be sampled. The core undoes the call first: that request fails, the others can be
    retried without it (a per-item status)."""


class ResourceExhausted(FieldError):
    """No room: no free KV slot, or the admission queue is full."""

    code = ErrorCode.RESOURCE_EXHAUSTED


class Unavailable(FieldError):
    """The receiver cannot serve now (a worker or the target group failed); retry later."""

    code = ErrorCode.UNAVAILABLE


class Refusal:
    """A request refused as a whole, before it runs (the coordinator's refusals): mixed in before the
    :class:`FieldError` class of its code, it is that error built from its message alone (``field`` "", which
    blames no item: :func:`blamed_item`), so ``str()`` is the message a client reads."""

    message: str

    def __init__(self, message: str):
        super().__init__("", message)

    def __reduce__(self):  # from its message, with what a subclass adds (e.g. the replica that refused)
        return (type(self), (self.message,), self.__dict__)


_ITEM = re.compile(r"items\[(\d+)\]")


def blamed_item(field: str, num_items: int) -> int | None:
    """The item of a ``num_items``-item batch that ``field`` blames: ``i`` when it starts with
    ``items[i]`` and ``0 <= i < num_items``, else None (the whole call).

    ``field`` is a :class:`FieldError`'s field, or its ``str()`` ("items[1].seq_len: ...") as a
    remote worker sends it in the status details."""
    m = _ITEM.match(field)
    i = int(m.group(1)) if m else None
    return i if i is not None and i < num_items else None


class ConfigError(SpecDistError, ValueError):
    """A deployment config is invalid. `key` is the dotted path of the bad setting."""

    def __init__(self, key: str, message: str):
        self.key = key
        self.message = message
        super().__init__(f"config {key}: {message}")

    def __reduce__(self):
        return (type(self), (self.key, self.message))


class ListenError(SpecDistError):
    """A server cannot listen on the requested address."""
