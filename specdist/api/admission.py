"""What the public front ends share: the gRPC service (:mod:`specdist.api.grpc_server`) and the
OpenAI-compatible HTTP API (:mod:`specdist.api.http_server`), both clients of one Coordinator.

- :class:`Limits` and :func:`check_request`: what one request may ask for (the config's
  ``limits`` section), checked before the coordinator sees the request; a field beyond its
  limit is :class:`~specdist.errors.InvalidArgument` named as SamplingParams and the engine
  name it (``max_tokens``, ``stop[2]``), which each front door maps onto its own names;
- :func:`refusal_code`: the :class:`~specdist.errors.ErrorCode` a request refused before
  streaming gets (each front door maps it to its protocol's status);
- :func:`bare_host` (:mod:`specdist.transport.hosts`, imported here for the front ends): a listening host
  without the brackets of an IPv6 literal;
- :func:`request_stats`: the per-request statistics both report at the end of a request;
- :func:`server_info`: what is served (GetServerInfo, ``GET /v1/models``);
- :class:`ServedEngine`: what they read of the engine they serve, whichever it is.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any, Protocol

from specdist.config import PROMPT_CHARS_PER_TOKEN, Config
from specdist.engine.prompts import is_conversation
from specdist.engine.request import RequestMetrics
from specdist.errors import ErrorCode, InvalidArgument, code_of
from specdist.sampling_params import SamplingParams
from specdist.transport.hosts import bare_host as bare_host  # (the front ends import it from here)


class _Pipelining(Protocol):
    pipelined: bool  # the draft of the next step runs while this one verifies


class ServedEngine(Protocol):
    """What the servers read of the engine they serve to describe it and bound its requests (:meth:`Limits.of`,
    :func:`server_info`): :class:`~specdist.engine.local.Engine`, :class:`~specdist.engine.remote.RemoteEngine`
    or the front over Serve replicas (:class:`~specdist.api.replica_set.FrontEngine`). The coordinator drives it."""

    config: Config
    max_model_len: int  # tokens a request may hold, prompt and output
    k: int  # draft tokens a step (0: no drafts)

    @property
    def traits(self) -> _Pipelining: ...


log = logging.getLogger(__name__)

_REQUEST_ID_CHARS = re.compile(r"[\x21-\x7e]+")  # visible ASCII: an id is logged, so no newline or escape
MESSAGE_COST_CHARS = PROMPT_CHARS_PER_TOKEN  # what a chat message counts against max_prompt_chars besides its text


@dataclass(frozen=True)
class Limits:
    """The config's ``limits`` section, with its nulls resolved against the served engine."""

    max_message_bytes: int
    max_prompt_chars: int
    max_prompt_tokens: int
    max_tokens: int
    max_stop: int
    max_stop_chars: int
    max_stop_token_ids: int
    max_request_id_chars: int
    max_n: int
    speculative_stats: bool = True  # responses carry the drafted / accepted / steps counts
    max_messages: int = 1024
    max_logprob_entries: int = 262144  # n x (logprobs + 1) x max_tokens

    @classmethod
    def of(cls, engine: ServedEngine) -> "Limits":
        """The limits of the config's section (each field here is a key of it, by the same name), the context
        bounds resolved against ``engine``."""
        c = engine.config.limits
        return cls(
            **{f.name: getattr(c, f.name) for f in fields(cls)}
            | dict(
                max_prompt_chars=prompt_chars_limit(c.max_prompt_chars, engine.max_model_len),
                max_prompt_tokens=engine.max_model_len - 1 if c.max_prompt_tokens is None else c.max_prompt_tokens,
                max_tokens=engine.max_model_len if c.max_tokens is None else c.max_tokens,
            )
        )


def prompt_chars_limit(max_prompt_chars: int | None, max_model_len: int) -> int:
    """``limits.max_prompt_chars``, or when it is null ``PROMPT_CHARS_PER_TOKEN`` characters for each
    token of the context (a prompt cannot usefully be longer than the model's context)."""
    return max_model_len * PROMPT_CHARS_PER_TOKEN if max_prompt_chars is None else max_prompt_chars


def check_request(
    limits: Limits, prompt: Any, params: SamplingParams, request_id: str | None = None, n: int = 1
) -> None:
    """Refuse a request beyond ``limits`` (InvalidArgument naming the field; module docstring).

    ``prompt``: text, token ids or a conversation (chat messages), as the coordinator takes it;
    ``n``: how many choices (the HTTP API's ``n``: that many engine requests with these params).
    """
    if n > limits.max_n:
        raise InvalidArgument("n", f"must be <= {limits.max_n}, got {n}")
    if is_conversation(prompt) and len(prompt) > limits.max_messages:
        raise InvalidArgument("prompt", f"has {len(prompt)} messages; the limit is {limits.max_messages}")
    if isinstance(prompt, str) or is_conversation(prompt):
        # a message past the first costs MESSAGE_COST_CHARS besides its text: the template adds tokens for each,
        # empty or not (one message counts as a text prompt does)
        chars = (
            len(prompt)
            if isinstance(prompt, str)
            else MESSAGE_COST_CHARS * (len(prompt) - 1)
            + sum(len(v) for m in prompt for v in m.values() if isinstance(v, str))
        )
        if chars > limits.max_prompt_chars:
            each = "" if isinstance(prompt, str) else f" ({MESSAGE_COST_CHARS} for each message past the first)"
            raise InvalidArgument("prompt", f"has {chars} characters{each}; the limit is {limits.max_prompt_chars}")
    elif isinstance(prompt, Sequence) and len(prompt) > limits.max_prompt_tokens:
        raise InvalidArgument("prompt", f"has {len(prompt)} token ids; the limit is {limits.max_prompt_tokens}")
    if params.max_tokens > limits.max_tokens:
        raise InvalidArgument("max_tokens", f"must be <= {limits.max_tokens}, got {params.max_tokens}")
    if len(params.stop) > limits.max_stop:
        raise InvalidArgument("stop", f"has {len(params.stop)} strings; the limit is {limits.max_stop}")
    for i, s in enumerate(params.stop):
        if len(s) > limits.max_stop_chars:
            raise InvalidArgument(f"stop[{i}]", f"has {len(s)} characters; the limit is {limits.max_stop_chars}")
    if len(params.stop_token_ids) > limits.max_stop_token_ids:
        raise InvalidArgument(
            "stop_token_ids", f"has {len(params.stop_token_ids)} ids; the limit is {limits.max_stop_token_ids}"
        )
    if request_id is not None:
        check_request_id(limits, request_id)


def body_values_budget(limits: Limits) -> int:
    """The JSON values a request body within ``limits`` can need: its prompt's token ids, a few a message (role,
    content, name, text parts), its stop lists, and a few dozen for the other fields."""
    return limits.max_prompt_tokens + 8 * limits.max_messages + limits.max_stop + limits.max_stop_token_ids + 64


def body_verdict(body: bytes, max_messages: int, max_values: int) -> tuple[str, str] | None:
    """A large HTTP body checked before it is parsed where the event loop runs (the HTTP API runs this in a
    process of its own): (field, message) when it is refused, "" naming the body itself; None when its shape
    is within the limits (then parsing it there costs what a request within the limits costs)."""
    try:
        obj = json.loads(body)
    except ValueError as e:
        return "", f"the body is not valid JSON: {e}"
    messages = obj.get("messages") if isinstance(obj, dict) else None
    if isinstance(messages, list) and len(messages) > max_messages:
        return "messages", f"has {len(messages)} messages; the limit is {max_messages}"
    values, stack = 0, [obj]
    while stack:
        v = stack.pop()
        values += 1
        if isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    if values > max_values:
        return "", f"the body has {values} JSON values; a request within the limits has at most {max_values}"
    return None


def check_request_id(limits: Limits, request_id: str) -> None:
    """A client's request id: 1 to ``max_request_id_chars`` visible ASCII characters."""
    if not request_id or len(request_id) > limits.max_request_id_chars:
        raise InvalidArgument(
            "request_id", f"must have 1 to {limits.max_request_id_chars} characters, got {len(request_id)}"
        )
    if not _REQUEST_ID_CHARS.fullmatch(request_id):
        raise InvalidArgument("request_id", "must be visible ASCII characters (no spaces or control characters)")


def check_session_id(limits: Limits, session_id: str, name: str = "session_id") -> None:
    """A client's session id (gRPC ``session_id``, HTTP ``user``): as a request id, 1 to ``max_request_id_chars``
    visible ASCII characters."""
    if not session_id or len(session_id) > limits.max_request_id_chars:
        raise InvalidArgument(name, f"must have 1 to {limits.max_request_id_chars} characters, got {len(session_id)}")
    if not _REQUEST_ID_CHARS.fullmatch(session_id):
        raise InvalidArgument(name, "must be visible ASCII characters (no spaces or control characters)")


# what the coordinator refuses a request with: bad input (InvalidArgument; DuplicateRequestId is
# ALREADY_EXISTS), a full queue (Overloaded), shutting down or the target down (ShuttingDown, TargetDown)
REFUSAL_CODES = frozenset(
    {ErrorCode.INVALID_ARGUMENT, ErrorCode.ALREADY_EXISTS, ErrorCode.RESOURCE_EXHAUSTED, ErrorCode.UNAVAILABLE}
)


def refusal_code(e: BaseException, what: str) -> ErrorCode:
    """The code of a request refused with ``e`` (its :func:`~specdist.errors.code_of`). Anything
    else is the server's fault: INTERNAL, logged with its traceback under ``what`` (call it from
    ``except``)."""
    code = code_of(e)
    if code in REFUSAL_CODES:
        return code
    log.exception("%s failed before streaming", what)
    return ErrorCode.INTERNAL


def request_stats(m: RequestMetrics, speculative: bool = True) -> dict[str, Any]:
    """One finished request's statistics (the fields of the wire's ``RequestStats``); ``speculative`` False
    (``limits.speculative_stats``): the drafted / accepted / steps / pipeline counts left at 0."""
    spec = speculative
    return dict(
        prompt_tokens=m.prompt_tokens,
        output_tokens=m.output_tokens,
        drafted=m.drafted if spec else 0,
        accepted=m.accepted if spec else 0,
        steps=m.steps if spec else 0,
        time_to_first_token_s=m.time_to_first_token or 0.0,
        total_time_s=m.total_time or 0.0,
        pipeline_hits=m.pipeline_hits if spec else 0,
        pipeline_misses=m.pipeline_misses if spec else 0,
    )


def server_info(engine: ServedEngine) -> dict[str, Any]:
    """What the engine serves (the fields of the wire's ``ServerInfo`` besides its counters)."""
    cfg = engine.config
    pipelined = engine.traits.pipelined
    return dict(
        target_model=cfg.target.model,
        draft_method=cfg.draft.method,
        draft_model=cfg.draft.model or "",
        tensor_parallel_size=getattr(engine, "tensor_parallel_size", 1),
        draft_replicas=draft_replicas(engine),
        num_speculative_tokens=engine.k,
        max_model_len=engine.max_model_len,
        draft_pipeline=pipelined,
        draft_pipeline_miss=cfg.draft.pipeline_miss if pipelined else "",
        cpu_kernels=public_kernels(getattr(engine, "cpu_kernels", "")),  # Engine: this process's; RemoteEngine: its
        # target rank 0's
        memory_plan=getattr(engine, "memory_plan", ""),  # Engine: its GPU's plan (specdist.models.memory_plan)
        replicas=int(getattr(engine, "replica_count", 1)),  # Serve replicas running (replica_set.FrontEngine)
        router_policy=getattr(engine, "router_policy", ""),
    )


# What server info says of the CPU kernels: a fixed vocabulary, never the backend's own words, which name the
# library's absolute path when it was refused (those go to the server log).
KERNELS_OFF = "torch's kernels (engine.cpu_kernels: off)"
KERNELS_NOT_BUILT = "torch's kernels: the C kernels were not built with this install"
KERNELS_CPU = "torch's kernels: this CPU lacks the instructions the C kernels need"
KERNELS_REFUSED = "torch's kernels: the C kernels were refused (the server log says why)"
_KERNELS_ON = re.compile(r"specdist's C kernels \([A-Z0-9, ]*\)")  # the features are a fixed list


def public_kernels(described: str) -> str:
    """``described`` (:func:`specdist.models.kernels.cpu_kernels.backend`'s line) as one of the fixed phrases
    above ("" when unknown): no path or error text of the host reaches a client."""
    if not described or _KERNELS_ON.fullmatch(described) or described == KERNELS_OFF:
        return described
    if described.startswith("torch's kernels: the C kernels were not built"):
        return KERNELS_NOT_BUILT
    if described.startswith("torch's kernels: this CPU lacks"):
        return KERNELS_CPU
    return KERNELS_REFUSED


def draft_replicas(engine) -> int:
    """The engine's draft replicas (``Scheduler.num_draft_replicas``; 0 for an engine without any)."""
    return int(getattr(engine, "num_draft_replicas", 0))
