"""What the coordinator tells clients: its refusals, and the messages of a failed request.

A failed request's final delta carries ``error`` (everything known, also logged where it happened: worker
addresses, process ids, exception text) and ``message``, what the servers send to the client: a stable sentence
naming the failure's class (``target unavailable (target rank 1 failed); retry later``, ``internal error: ...``)
without addresses, process ids or exception text. Refusals (:class:`TargetDown`, :class:`EngineDown`) say as
little. Each refusal is the :mod:`specdist.errors` class of its code (:class:`~specdist.errors.Unavailable`, ...)
built from a message alone (:class:`~specdist.errors.Refusal`): errors.py alone gives a class its code.
"""

from __future__ import annotations

import re

from specdist.errors import AlreadyExists, InvalidArgument, Refusal, ResourceExhausted, Unavailable

ENGINE_DOWN_MESSAGE = "the engine thread died; this server serves no more requests until it is restarted"
INTERNAL_MESSAGE = "internal error"
STEP_FAILED_MESSAGE = "internal error: the engine step failed"
TARGET_FAILED_MESSAGE = "internal error: the target failed the request"
_TARGET_RANK = re.compile(r"\btarget rank (\d+)\b")  # how a deployment's diagnosis names a rank


class Overloaded(Refusal, ResourceExhausted):
    """The server already holds ``max_queued`` requests."""


class TenantQuotaExceeded(Overloaded):
    """The request's tenant already holds its quota of live requests (``limits.max_queued_per_tenant``): gRPC
    RESOURCE_EXHAUSTED like a full server, HTTP 429 (the tenant's own quota, not the server's state)."""

    http_status = 429


class ShuttingDown(Refusal, Unavailable):
    """The coordinator is draining or closed and takes no new requests."""


class TargetDown(Refusal, Unavailable):
    """The target failed and is being rebuilt; no new requests until it is back."""


class EngineDown(Refusal, Unavailable):
    """The engine thread died of an unexpected error; nothing more is served until a restart."""


class DuplicateRequestId(AlreadyExists, InvalidArgument):
    """A live request already has this client-chosen id: a bad ``request_id`` answered ALREADY_EXISTS."""

    def __init__(self, request_id: str):
        self.request_id = request_id
        super().__init__("request_id", f"{request_id!r} is already in use by a running request")

    def __reduce__(self):
        return (type(self), (self.request_id,))


def engine_down() -> EngineDown:
    """The refusal once the engine thread died: a stable message (the cause is logged, and is
    ``Coordinator.engine_error``)."""
    return EngineDown(ENGINE_DOWN_MESSAGE)


def failed_ranks(reason: str | None) -> str | None:
    """The target ranks a failure's reason names, for a client: ``"target rank 1"`` /
    ``"target ranks 0, 1"``, or None. Reads the wording of a deployment's diagnosis
    (``cluster.deployment.Deployment.diagnose_target``: each cause starts ``target rank N``) and
    keeps nothing else of it (no process ids, addresses or worker errors)."""
    ranks = sorted({int(r) for r in _TARGET_RANK.findall(reason or "")})
    if not ranks:
        return None
    return f"target rank {ranks[0]}" if len(ranks) == 1 else "target ranks " + ", ".join(map(str, ranks))


def target_unavailable_message(reason: str | None) -> str:
    """What a client is told when the target failed (a rank died or hangs, rank 0 is unreachable):
    the ranks named, if the reason names any; retrying is safe."""
    ranks = failed_ranks(reason)
    return f"target unavailable ({ranks} failed); retry later" if ranks else "target unavailable; retry later"


def target_lost_message(reason: str | None) -> str:
    ranks = failed_ranks(reason)
    why = f"{ranks} failed and every rebuild failed" if ranks else "every rebuild failed"
    return f"target lost ({why}); this server serves no more requests until it is restarted"
