"""What the public front ends share: the gRPC service (:mod:`specdist.server`) and the
OpenAI-compatible HTTP API (:mod:`specdist.http_server`), both clients of one Coordinator.

- :func:`refusal_status`: the status a request refused before streaming gets (named as gRPC
  names it; the HTTP API maps each to an HTTP status);
- :func:`request_stats`: the per-request statistics both report at the end of a request;
- :func:`server_info`: what is served (GetServerInfo, ``GET /v1/models``).
"""

from __future__ import annotations

import logging
from typing import Any

from specdist.coordinator import DuplicateRequestId, Overloaded, ShuttingDown
from specdist.errors import InvalidArgument
from specdist.request import RequestMetrics

log = logging.getLogger(__name__)

# checked in order: DuplicateRequestId is an InvalidArgument
_STATUS = (
    (DuplicateRequestId, "ALREADY_EXISTS"),
    (InvalidArgument, "INVALID_ARGUMENT"),
    (Overloaded, "RESOURCE_EXHAUSTED"),
    (ShuttingDown, "UNAVAILABLE"),
)


def refusal_status(e: BaseException, what: str) -> str:
    """The status of a request refused with ``e`` (a gRPC status name). Anything else is the
    server's fault: INTERNAL, logged with its traceback under ``what`` (call it from ``except``)."""
    for cls, status in _STATUS:
        if isinstance(e, cls):
            return status
    log.exception("%s failed before streaming", what)
    return "INTERNAL"


def request_stats(m: RequestMetrics) -> dict[str, Any]:
    """One finished request's statistics (the fields of the wire's ``RequestStats``)."""
    return dict(
        prompt_tokens=m.prompt_tokens,
        output_tokens=m.output_tokens,
        drafted=m.drafted,
        accepted=m.accepted,
        steps=m.steps,
        time_to_first_token_s=m.time_to_first_token or 0.0,
        total_time_s=m.total_time or 0.0,
    )


def server_info(engine) -> dict[str, Any]:
    """What the engine serves (the fields of the wire's ``ServerInfo`` besides its counters)."""
    cfg = engine.config
    return dict(
        target_model=cfg.target.model,
        draft_method=cfg.draft.method,
        draft_model=cfg.draft.model or "",
        tensor_parallel_size=getattr(engine, "tensor_parallel_size", 1),
        draft_replicas=draft_replicas(engine),
        num_speculative_tokens=engine.k,
        max_model_len=engine.max_model_len,
    )


def draft_replicas(engine) -> int:
    """``engine.num_draft_replicas`` where the engine says; else RemoteEngine: its draft workers,
    Engine: 1 with a proposer, 0 without."""
    n = getattr(engine, "num_draft_replicas", None)
    if n is not None:
        return int(n)
    replicas = getattr(engine, "replicas", None)
    if replicas is not None:
        return len(replicas)
    return 1 if getattr(engine, "proposer", None) is not None else 0
