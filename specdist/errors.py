"""Errors specdist raises on purpose. Each names the field or setting that is wrong."""

from __future__ import annotations


class SpecDistError(Exception):
    """Base class of every error specdist raises deliberately."""


class FieldError(SpecDistError):
    """An error about one request field. ``field`` is its dotted name (e.g. ``params.top_p``);
    ``status`` names the gRPC status code servers answer it with."""

    status = "INTERNAL"

    def __init__(self, field: str, message: str):
        self.field = field
        self.message = message
        super().__init__(f"{field}: {message}")

    def __str__(self) -> str:  # KeyError subclasses would otherwise repr() the message
        return f"{self.field}: {self.message}"

    def __reduce__(self):  # rebuild from (field, message) when Ray or pickle ships it
        return (type(self), (self.field, self.message))


class InvalidArgument(FieldError, ValueError):
    """A request field has a bad value."""

    status = "INVALID_ARGUMENT"


class NotFound(FieldError, KeyError):
    """An unknown request id."""

    status = "NOT_FOUND"


class AlreadyExists(FieldError):
    """A request id that is already live."""

    status = "ALREADY_EXISTS"


class FailedPrecondition(FieldError):
    """The receiver's state does not match the call (e.g. a sequence-length mismatch)."""

    status = "FAILED_PRECONDITION"


class NonFiniteLogits(FailedPrecondition):
    """A model's logits for one request hold a NaN or leave no positive finite probability, so no
    token can be sampled. The core undoes the call first: that request fails, the others can be
    retried without it (a per-item status)."""


class ResourceExhausted(FieldError):
    """No room: no free KV slot, or the admission queue is full."""

    status = "RESOURCE_EXHAUSTED"


class Unavailable(FieldError):
    """The receiver cannot serve now (a worker or the target group failed); retry later."""

    status = "UNAVAILABLE"


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
