"""The OpenAI-compatible HTTP API (FastAPI on uvicorn) over a :class:`Coordinator`.

A second client of the coordinator next to the gRPC service (:mod:`specdist.api.grpc_server`); both
share the refusal codes and per-request statistics of :mod:`specdist.api.admission`; error codes
become HTTP statuses through :data:`HTTP_STATUS` only. uvicorn
runs as a task on the coordinator's own event loop (:func:`start_http`).

Endpoints:
- ``POST /v1/completions``, ``POST /v1/chat/completions``: JSON, or with ``"stream": true``
  Server-Sent Events, one ``data: {chunk}`` per engine step and request, ending with
  ``data: [DONE]``; ``stream_options.include_usage`` adds a last chunk with ``usage``.
- ``GET /v1/models``: the served model; ``GET /health``: 200 while requests are admitted,
  503 (``status``: ``shutting down``, ``target down`` or ``engine down``) once draining, while
  the target is down, and for good once the coordinator's engine thread has died; ``GET /metrics``:
  ``coordinator.metrics.render()`` when the coordinator has metrics, else 404.

Request fields:
- ``model``: optional; when given it must be the served model's id (``GET /v1/models``:
  the config's ``target.model``), else 404 ``model_not_found``.
- ``prompt`` (completions): text or token ids, one prompt per request (a batch of one is
  accepted). ``messages`` (chat): rendered by the model's chat template; a message's content
  is text, or a list of text parts (joined with newlines).
- ``max_tokens`` (completions: default 16); chat: ``max_completion_tokens`` (or
  ``max_tokens``; the former wins), default: up to ``limits.max_tokens`` (the context limit
  unless the config sets it). ``temperature``, ``top_p``, ``stop``, ``seed`` as OpenAI
  defines them; ``top_k``, ``stop_token_ids`` and ``ignore_eos`` as extra body fields.
- ``n``: n independent requests (at most ``limits.max_n``), run concurrently; with a ``seed``
  the i-th samples with ``seed + i``, so a request with a seed reproduces all n choices.
- ``logprobs`` (completions: an integer in [0, 20], the top entries per token) / chat:
  ``logprobs: true`` with ``top_logprobs`` in [0, 20] (default 0; without ``logprobs: true``
  a 400): the target's log-probabilities of each output token under the request's PROCESSED
  distribution (temperature, top-k, top-p applied: the one it was sampled from; a greedy
  request's token has 0.0), :mod:`specdist.logprobs`. Tokens with probability 0 are left out
  of the top entries (OpenAI and JSON have no -inf), so there may be fewer than asked. Shapes:
  completions ``logprobs: {tokens, token_logprobs, top_logprobs: [{token: logprob}],
  text_offset}``, chat ``logprobs: {content: [{token, logprob, bytes, top_logprobs: [{token,
  logprob, bytes}]}]}``, per chunk when streamed. A token's string is the token decoded alone
  (part of a multi-byte character shows U+FFFD), ``bytes`` its UTF-8; ``text_offset`` is where
  its text starts in the choice's text. A request may ask for at most ``limits.max_logprob_entries``
  entries, ``n x (logprobs + 1) x max_tokens`` (else a 400 naming ``logprobs`` / ``top_logprobs``);
  they are formatted as the tokens arrive, each token id decoded once.
- ``user``: accepted and ignored. Any other field is refused with a 400 naming it: a field
  this server does not implement (a penalty, ``logit_bias``, tools) would otherwise be
  silently ignored.

``usage``: ``prompt_tokens`` (the prompt once), ``completion_tokens`` and ``total_tokens``
(all choices), and ``speculative``: ``drafted``, ``accepted``, ``steps`` (summed over the
choices; with n = 1 exactly the gRPC API's per-request stats), ``acceptance_rate``
(accepted / drafted), ``mean_acceptance_length`` (tokens emitted per verification step) and,
with pipelined drafting, ``pipeline_hits`` / ``pipeline_misses`` (steps whose drafts were
prepared during the previous verification / whose prepared prefix did not hold).

Errors are OpenAI-shaped, ``{"error": {"message", "type", "param", "code"}}``, with
``param`` naming the request field: 400 for a bad field (schema errors too), 404 for
another model, 413 for a body over ``limits.max_message_bytes``, 503 when the server is
full, shutting down, its target down or its engine thread has died (a request running then fails
with 503 too, ``code`` ``unavailable``, as one whose target failed: a rank died, named in the
message), 500 for a request that failed on the server. Messages name the failure's class, never
worker addresses, process ids or exception text (those go to the server log). A field beyond its
limit (the config's ``limits``, :func:`specdist.api.admission.check_request`) is a 400 naming
it. Once a stream has started, a failure is sent as one ``data: {"error": ...}`` event
and the stream ends without ``[DONE]``.

A client that disconnects (mid-stream or while waiting for a JSON response) aborts its
requests: their KV slots are free within one engine step.

With a token (``specdist serve --auth-token-file``, :mod:`specdist.transport.security`), /v1/*, /metrics
and ``GET /openapi.json`` (the API's schema) answer 401 (``type`` ``authentication_error``,
``code`` ``invalid_api_key``) without ``Authorization: Bearer <token>``; ``GET /health`` stays
open for probes. FastAPI's ``/docs`` and ``/redoc`` pages are not served.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import functools
import json
import logging
import multiprocessing
import socket
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from uvicorn.protocols.http.flow_control import service_unavailable
from uvicorn.protocols.http.h11_impl import H11Protocol

from specdist.api.admission import (
    Limits,
    bare_host,
    body_values_budget,
    body_verdict,
    check_request,
    check_session_id,
    refusal_code,
    server_info,
)
from specdist.api.coordinator import Coordinator
from specdist.api.engine_thread import Delta
from specdist.api.live_requests import RequestStream
from specdist.engine.output_state import IncrementalDetokenizer
from specdist.engine.request import RequestMetrics
from specdist.errors import ErrorCode, FieldError, InvalidArgument
from specdist.logprobs import TokenLogprob
from specdist.sampling_params import SamplingParams
from specdist.transport.security import (
    METRICS_FORBIDDEN,
    ServerSecurity,
    Tokens,
    bearer_ok,
    sees_everything,
    tenant_of,
    unauthenticated_message,
)

log = logging.getLogger(__name__)

GRACEFUL_SHUTDOWN_S = 5.0  # stop(): how long uvicorn waits for open responses (the coordinator has ended them)
BODY_TIMEOUT_S = 30.0  # a request body not read whole within this gets 408 (slow uploads hold memory and a connection)
SPARE_CONNECTIONS = 32  # connections past max_queued (metrics, models, refused tries) before a 503
LOOP_PARSE_VALUES = 16384  # a body that may hold more JSON values is checked in the parser process first
TOKEN_TEXT_CACHE = 1 << 16  # token ids whose decoded text a front end keeps (log-probabilities' entries)
UNCAPPED_PATHS = frozenset({"/health"})  # answered past the connection cap: a probe must see a busy server as up
# each error code's HTTP status. RESOURCE_EXHAUSTED is 503 like UNAVAILABLE: a full queue is the
# server's state, to retry later, not a client's quota (429). CANCELLED: 499, the client closed.
HTTP_STATUS = {
    ErrorCode.CANCELLED: 499,
    ErrorCode.UNKNOWN: 500,
    ErrorCode.INVALID_ARGUMENT: 400,
    ErrorCode.DEADLINE_EXCEEDED: 504,
    ErrorCode.NOT_FOUND: 404,
    ErrorCode.ALREADY_EXISTS: 409,
    ErrorCode.PERMISSION_DENIED: 403,
    ErrorCode.RESOURCE_EXHAUSTED: 503,
    ErrorCode.FAILED_PRECONDITION: 400,
    ErrorCode.ABORTED: 409,
    ErrorCode.OUT_OF_RANGE: 400,
    ErrorCode.UNIMPLEMENTED: 501,
    ErrorCode.INTERNAL: 500,
    ErrorCode.UNAVAILABLE: 503,
    ErrorCode.DATA_LOSS: 500,
    ErrorCode.UNAUTHENTICATED: 401,
}


# ---------------------------------------------------------------- request bodies
class _Strict(BaseModel):
    # strict: "0.5" is not a temperature and true is not an n; forbid: an unknown field is an error
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class _Common(_Strict):
    """Fields both endpoints take."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    kind: str | None = None  # specdist's own: what sort of request (edit, chat, ...), read by the replicas' router


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None


class APIError(Exception):
    """An OpenAI-shaped error response."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        type: str = "invalid_request_error",
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def _bad(param: str, message: str) -> APIError:
    return APIError(HTTP_STATUS[ErrorCode.INVALID_ARGUMENT], f"{param}: {message}", param)


def _schema_error(e: ValidationError) -> APIError:
    """The first schema error, named by its field path (``messages[0].content``)."""
    err = e.errors()[0]
    path = ""
    for part in err["loc"]:
        if isinstance(part, int):
            path += f"[{part}]"
        elif not path or part.isidentifier() and part not in ("str", "int", "float", "bool"):
            path += f".{part}" if path else part
        else:  # a union member's tag (list[str], ...): not a field
            break
    if err["type"] == "extra_forbidden":
        return _bad(path, "unknown or unsupported field")
    if err["type"] == "json_invalid":
        return APIError(HTTP_STATUS[ErrorCode.INVALID_ARGUMENT], f"the body is not valid JSON: {err['msg']}")
    if not path:  # the body itself: JSON, but not an object
        return APIError(HTTP_STATUS[ErrorCode.INVALID_ARGUMENT], f"the body: {err['msg']}")
    return _bad(path, err["msg"])


# ---------------------------------------------------------------- one API call
@dataclass
class _Call:
    """One request to an endpoint, parsed: what to open on the coordinator, how to answer."""

    chat: bool
    prompt: Any  # text, token ids, or messages (chat)
    params: list[SamplingParams]  # one per choice
    stream: bool
    include_usage: bool
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))
    max_tokens_field: str = "max_tokens"
    stop_is_text: bool = False  # "stop": "x" rather than a list: its limit names "stop", not "stop[0]"
    session: str | None = None  # the OpenAI "user" field: the session the router keeps together
    kind: str | None = None  # the request's kind, for the replicas' router (GenerateRequest.kind)

    @property
    def object(self) -> str:
        return ("chat.completion.chunk" if self.stream else "chat.completion") if self.chat else "text_completion"

    @property
    def response_id(self) -> str:
        return ("chatcmpl-" if self.chat else "cmpl-") + self.id

    def param(self, engine_field: str) -> str:
        """The request field an engine error names (the engine says "prompt" for the messages, ...)."""
        if self.chat and engine_field in ("prompt", "apply_chat_template"):
            return "messages"
        if self.stop_is_text and engine_field == "stop[0]":
            return "stop"
        if self.chat and engine_field == "logprobs":  # chat's count of top entries
            return "top_logprobs"
        return self.max_tokens_field if engine_field == "max_tokens" else engine_field


def _parse(body: _Common, chat: bool, limits: Limits) -> _Call:
    """Refuse what cannot be served; SamplingParams per choice (their own checks and the
    limits name the field). Default max_tokens: completions 16, chat up to the limit."""
    if body.stream_options is not None and not body.stream:
        raise _bad("stream_options", "only allowed with stream: true")
    if chat:
        prompt = [_message(m) for m in body.messages]
        given = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    else:
        prompt, given, max_tokens = _one_prompt(body.prompt), "max_tokens", body.max_tokens
    for name in ("user", "kind"):  # (a kind is a label as a session id is: visible ASCII, bounded)
        if getattr(body, name):
            try:
                check_session_id(limits, getattr(body, name), name)
            except InvalidArgument as e:
                raise _bad(e.field, e.message) from None
    call = _Call(
        chat,
        prompt,
        [],
        body.stream,
        bool(body.stream_options and body.stream_options.include_usage),
        max_tokens_field=given,
        stop_is_text=isinstance(body.stop, str),
        session=body.user or None,
        kind=body.kind or None,
    )
    if max_tokens is None:
        max_tokens = limits.max_tokens if chat else SamplingParams.max_tokens
    kwargs = dict(
        max_tokens=max_tokens,
        stop=body.stop or (),
        stop_token_ids=body.stop_token_ids or (),
        ignore_eos=body.ignore_eos,
        logprobs=_logprobs_asked(body, chat),
    )
    for name in ("temperature", "top_p", "top_k"):
        if getattr(body, name) is not None:
            kwargs[name] = getattr(body, name)
    try:
        first = SamplingParams(**kwargs, seed=body.seed)
        check_request(limits, prompt, first, n=body.n)  # the choices differ only in their seeds
        _check_logprob_entries(limits, first, body.n, call)
        seeds = [None if body.seed is None else body.seed + i for i in range(1, body.n)]
        if body.seed is not None and seeds and body.seed < 2**64 <= seeds[-1]:
            raise InvalidArgument("seed", "seed + n - 1 must be < 2**64 (choice i samples with seed + i)")
        call.params = [first] + [SamplingParams(**kwargs, seed=seed) for seed in seeds]
    except InvalidArgument as e:
        raise _bad(call.param(e.field), e.message) from None
    return call


def _logprobs_asked(body: _Common, chat: bool) -> int | None:
    """SamplingParams.logprobs: completions' ``logprobs``; chat's ``top_logprobs`` (0 when unset)
    with ``logprobs: true``, None without."""
    if not chat:
        return body.logprobs
    if body.top_logprobs is not None and not body.logprobs:
        raise _bad("top_logprobs", "needs logprobs: true")
    return (body.top_logprobs or 0) if body.logprobs else None


def _check_logprob_entries(limits: Limits, params: SamplingParams, n: int, call: _Call) -> None:
    """Refuse log-probabilities past ``limits.max_logprob_entries``: each choice's tokens, each with its own
    entry and ``logprobs`` top entries, are formatted (a token's text each) and held until sent."""
    if params.logprobs is None:
        return
    entries = n * (params.logprobs + 1) * params.max_tokens
    if entries > limits.max_logprob_entries:
        top, most = call.param("logprobs"), call.max_tokens_field
        raise InvalidArgument(
            "logprobs",
            f"n x ({top} + 1) x {most} = {n} x {params.logprobs + 1} x "
            f"{params.max_tokens} = {entries} entries; the limit is {limits.max_logprob_entries}",
        )


def _one_prompt(prompt: str | list) -> str | list[int]:
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):  # a batch
        if len(prompt) != 1:
            raise _bad("prompt", f"one prompt per request (got a batch of {len(prompt)}); send one request each")
        return prompt[0]
    return prompt


def _message(m: ChatMessage) -> dict[str, str]:
    content = m.content if isinstance(m.content, str) or m.content is None else "\n".join(p.text for p in m.content)
    msg = {"role": m.role, "content": content or ""}
    if m.name is not None:
        msg["name"] = m.name
    return msg


# ---------------------------------------------------------------- responses
def _finish_reason(d: Delta | None) -> str:
    """ "stop" / "length"; a request the server aborted (or ended without a final delta) or
    failed is an error to the client."""
    if d is None or d.finish_reason == "abort":
        raise APIError(
            HTTP_STATUS[ErrorCode.UNAVAILABLE],
            "the request was aborted: the server is shutting down",
            type="server_error",
            code="aborted",
        )
    if d.finish_reason == "error":
        code = d.code or ErrorCode.INTERNAL  # UNAVAILABLE: the target failed or is down, the engine thread died
        raise APIError(
            HTTP_STATUS[code],
            f"the request failed on the server: {d.message or 'unknown error'}",
            type="server_error",
            code="internal_error" if code == ErrorCode.INTERNAL else code.name.lower(),
        )
    return d.finish_reason


def usage(metrics: Sequence[RequestMetrics], speculative: bool = True) -> dict[str, Any]:
    """``usage`` of one API call over its choices' final metrics (module docstring); without ``speculative``
    (``limits.speculative_stats`` false) no ``speculative`` entry."""
    total = RequestMetrics(
        prompt_tokens=metrics[0].prompt_tokens,
        output_tokens=sum(m.output_tokens for m in metrics),
        drafted=sum(m.drafted for m in metrics),
        accepted=sum(m.accepted for m in metrics),
        steps=sum(m.steps for m in metrics),
        emitted=sum(m.emitted for m in metrics),
        pipeline_hits=sum(m.pipeline_hits for m in metrics),
        pipeline_misses=sum(m.pipeline_misses for m in metrics),
    )
    out = {
        "prompt_tokens": total.prompt_tokens,
        "completion_tokens": total.output_tokens,
        "total_tokens": total.prompt_tokens + total.output_tokens,
    }
    if not speculative:
        return out
    return out | {
        "speculative": {
            "drafted": total.drafted,
            "accepted": total.accepted,
            "steps": total.steps,
            "acceptance_rate": total.acceptance_rate,
            "mean_acceptance_length": total.mean_accepted_length,
            "pipeline_hits": total.pipeline_hits,
            "pipeline_misses": total.pipeline_misses,
        },
    }


def _choice(
    call: _Call,
    index: int,
    text: str | None,
    finish: str | None,
    first: bool = False,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    if not call.chat:
        return {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
    if not call.stream:
        return {
            "index": index,
            "message": {"role": "assistant", "content": text},
            "logprobs": logprobs,
            "finish_reason": finish,
        }
    delta: dict[str, str] = {"role": "assistant"} if first else {}
    if text or first:
        delta["content"] = text or ""
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}


class _Logprobs:
    """One choice's log-probabilities in OpenAI's shapes (module docstring), a block of tokens at a
    time: a streamed choice keeps its text offset from chunk to chunk. ``token_text``: a token id's
    (text, UTF-8 bytes), cached by the front end (:meth:`_OpenAIFrontEnd.token_text`)."""

    def __init__(self, tokenizer, chat: bool, token_text: Callable[[int], tuple[str, list[int]]]):
        self.chat, self.token_text = chat, token_text
        self.detok = IncrementalDetokenizer(tokenizer) if tokenizer is not None else None
        self.offset = 0  # characters of the choice's text before the next token

    def block(self, ids: Sequence[int], logprobs: Sequence[TokenLogprob]) -> dict[str, Any]:
        if self.chat:
            content = [
                dict(self._entry(t, lp.logprob), top_logprobs=[self._entry(i, v) for i, v in lp.top])
                for t, lp in zip(ids, logprobs)
            ]
            return {"content": content, "refusal": None}
        return {
            "tokens": [self.token_text(t)[0] for t in ids],
            "token_logprobs": [lp.logprob for lp in logprobs],
            "top_logprobs": [{self.token_text(i)[0]: v for i, v in lp.top} for lp in logprobs],
            "text_offset": [self._advance(t) for t in ids],
        }

    def _entry(self, token: int, logprob: float) -> dict[str, Any]:
        text, utf8 = self.token_text(token)  # utf8 is shared between entries: encoded at once, never changed
        return {"token": text, "logprob": logprob, "bytes": utf8}

    def _advance(self, token: int) -> int:
        """Where ``token``'s text starts in the choice's text (the text the detokenizer released before it)."""
        at = self.offset
        if self.detok is not None:
            self.offset += len(self.detok.push([token]))
        return at


class _LogprobsJSON:
    """A JSON response's ``logprobs`` for one choice, encoded a block at a time as its deltas arrive: each
    block's lists are turned into JSON text at once, so the response's end joins strings instead of
    formatting every entry in one burst on the event loop (and no entry stays alive as Python objects)."""

    def __init__(self):
        self.lists: dict[str, list[str]] = {}  # key -> the JSON text of each block's items (without brackets)
        self.scalars: dict[str, Any] = {}  # key -> its value (chat's "refusal")

    def add(self, block: dict[str, Any]) -> None:
        for key, value in block.items():
            if isinstance(value, list):
                items = self.lists.setdefault(key, [])
                if value:
                    items.append(_json(value)[1:-1])
            else:
                self.scalars[key] = value

    def text(self) -> str:
        members = [f"{_json(k)}:[{','.join(v)}]" for k, v in self.lists.items()]
        members += [f"{_json(k)}:{_json(v)}" for k, v in self.scalars.items()]
        return "{" + ",".join(members) + "}"


def _json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))


def _json_with(obj: dict[str, Any], raw: dict[str, str]) -> str:
    """``obj`` as JSON, with the members of ``raw`` (key -> a value's JSON text) added at its end."""
    head = _json(obj)[:-1]  # without the closing brace
    members = ",".join(f"{_json(k)}:{v}" for k, v in raw.items())
    return head + ("," if obj and members else "") + members + "}"


async def _merged(streams: Sequence[RequestStream]) -> AsyncIterator[tuple[int, Delta]]:
    """(choice index, delta) of several request streams, as they arrive; closes them all at the end."""
    pending = {asyncio.ensure_future(s.__anext__()): i for i, s in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=pending.__getitem__):
                i = pending.pop(task)
                try:
                    delta = task.result()
                except StopAsyncIteration:
                    continue
                yield i, delta
                if not delta.finished:
                    pending[asyncio.ensure_future(streams[i].__anext__())] = i
    finally:
        for task in pending:
            task.cancel()
        for s in streams:
            s.close()  # aborts a request that has not finished


class _OpenAIFrontEnd:
    """The endpoints' logic over one coordinator (the routes of :func:`create_app` call it)."""

    def __init__(self, coordinator: Coordinator, model_name: str | None = None):
        self.coordinator = coordinator
        self.engine = coordinator.engine
        self.info = server_info(self.engine)
        self.limits = Limits.of(self.engine)
        self.model = model_name or self.info["target_model"]
        self.created = int(time.time())
        self._parser: concurrent.futures.ProcessPoolExecutor | None = None  # made at the first large body
        # a token id's (text, UTF-8 bytes) for log-probabilities: one decode per id, not per entry
        self.token_text = functools.lru_cache(maxsize=TOKEN_TEXT_CACHE)(self._decode_token)

    def _decode_token(self, token: int) -> tuple[str, list[int]]:
        """The token decoded alone (special tokens included); ``token_id:N`` without a tokenizer."""
        tokenizer = self.engine.tokenizer
        text = tokenizer.decode([token]) if tokenizer is not None else f"token_id:{token}"
        return text, list(text.encode())

    async def check_body(self, body: bytes) -> None:
        """Refuse (400) a body whose JSON is larger than a request within the limits can be, without parsing it
        on the event loop: parsing costs the loop time for each value (140,000 empty chat messages, 4 MB, cost
        about a second), and a thread would hold the interpreter's lock all along. A body that may hold more
        than LOOP_PARSE_VALUES values (counted from its brackets and commas, strings included: an upper bound)
        is parsed in a process of its own (:func:`specdist.api.admission.body_verdict`) first."""
        if body.count(b",") + body.count(b"[") + body.count(b"{") < LOOP_PARSE_VALUES:
            return
        args = (body, self.limits.max_messages, body_values_budget(self.limits))
        try:  # submitted from a thread: the pool's first submit starts its process, which waits on the fork
            verdict = await asyncio.wrap_future(
                await asyncio.to_thread(self._parser_pool().submit, body_verdict, *args)
            )
        except concurrent.futures.BrokenExecutor:  # the process died (memory?): a fresh one next time
            self._parser = None
            log.exception("the HTTP body parser process died")
            raise APIError(
                HTTP_STATUS[ErrorCode.UNAVAILABLE],
                "the request body could not be checked; retry",
                type="server_error",
                code="unavailable",
            ) from None
        if verdict is not None:
            field, message = verdict
            raise _bad(field, message) if field else APIError(HTTP_STATUS[ErrorCode.INVALID_ARGUMENT], message)

    def _parser_pool(self) -> concurrent.futures.ProcessPoolExecutor:
        if self._parser is None:  # forkserver: a child of a clean process, not of this one and its threads
            ctx = multiprocessing.get_context(
                "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
            )
            self._parser = concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx)
        return self._parser

    def close(self) -> None:
        """Stop the parser process, if one was started."""
        if self._parser is not None:
            self._parser.shutdown(wait=False, cancel_futures=True)
            self._parser = None

    async def open(self, call: _Call, tenant: str = "") -> list[RequestStream]:
        """Admit one engine request per choice (the prompt templated and tokenized once, off the
        engine thread), as ``tenant``'s; on a refusal close those already open."""
        streams: list[RequestStream] = []
        try:
            self.coordinator.check_room(len(call.params))  # every choice's room, before the template and tokenizer
            prompt = await self.coordinator.encode(call.prompt, chat=call.chat)
            for i, params in enumerate(call.params):
                rid = f"{call.response_id}-{i}"
                streams.append(
                    await self.coordinator.open(
                        prompt,
                        params,
                        rid,
                        tenant=tenant,
                        session=call.session,
                        kind=call.kind,
                    )
                )
        except Exception as e:  # each refusal has its code
            for s in streams:
                s.close()
            code = refusal_code(e, "HTTP " + call.object)
            if code == ErrorCode.INVALID_ARGUMENT and isinstance(e, FieldError):
                raise _bad(call.param(e.field), e.message) from None
            if code == ErrorCode.INTERNAL:  # logged there, with its traceback
                raise APIError(
                    HTTP_STATUS[code], "internal error", type="server_error", code="internal_error"
                ) from None
            status = getattr(e, "http_status", HTTP_STATUS[code])  # a tenant's quota: 429 (TenantQuotaExceeded)
            raise APIError(status, str(e), type="server_error", code=code.name.lower()) from None
        except BaseException:
            for s in streams:
                s.close()
            raise
        return streams

    def check_room(self, n: int = 1) -> None:
        """503 (or the refusal's own status) unless the coordinator can take ``n`` more requests now."""
        try:
            self.coordinator.check_room(n)
        except Exception as e:  # each refusal has its code
            code = refusal_code(e, "HTTP request")
            raise APIError(HTTP_STATUS[code], str(e), type="server_error", code=code.name.lower()) from None

    def check_model(self, body: _Common) -> None:
        if body.model is not None and body.model != self.model:
            raise APIError(
                HTTP_STATUS[ErrorCode.NOT_FOUND],
                f"model: the model {body.model!r} does not exist; this server serves {self.model!r}",
                "model",
                code="model_not_found",
            )

    def envelope(self, call: _Call, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {
            "id": call.response_id,
            "object": call.object,
            "created": call.created,
            "model": self.model,
            "choices": choices,
            **extra,
        }

    async def complete(self, call: _Call, streams: list[RequestStream]) -> bytes:
        """Every choice to its end: the JSON response's body. Log-probabilities are encoded as their deltas
        arrive (:class:`_LogprobsJSON`)."""
        texts = [[] for _ in streams]
        formats = [_Logprobs(self.engine.tokenizer, call.chat, self.token_text) for _ in streams]
        encoded: dict[int, _LogprobsJSON] = {}  # choice -> its logprobs so far (requests that asked)
        finals: list[Delta | None] = [None] * len(streams)
        async with contextlib.aclosing(_merged(streams)) as merged:
            async for i, d in merged:
                texts[i].append(d.text)
                if d.logprobs is not None:
                    encoded.setdefault(i, _LogprobsJSON()).add(formats[i].block(d.token_ids, d.logprobs))
                if d.finished:
                    finals[i] = d
        choices = []
        for i, (t, d) in enumerate(zip(texts, finals)):
            choice = _choice(call, i, "".join(t), _finish_reason(d))
            if i in encoded:
                del choice["logprobs"]
                choices.append(_json_with(choice, {"logprobs": encoded[i].text()}))
            else:
                choices.append(_json(choice))
        envelope = self.envelope(call, [], usage=usage([d.metrics for d in finals], self.limits.speculative_stats))
        del envelope["choices"]
        return _json_with(envelope, {"choices": "[" + ",".join(choices) + "]"}).encode()

    def _logprobs(
        self, call: _Call, ids: list[int], logprobs: list[TokenLogprob] | None, fmt: _Logprobs
    ) -> dict[str, Any] | None:
        """A choice's ``logprobs`` for these tokens; None when the request did not ask."""
        if logprobs is None:
            return None
        return fmt.block(ids, logprobs)

    async def events(self, call: _Call, streams: list[RequestStream]) -> AsyncIterator[bytes]:
        """The Server-Sent Events of a streamed response."""
        extra = {"usage": None} if call.include_usage else {}
        finals: list[Delta | None] = [None] * len(streams)
        formats = [_Logprobs(self.engine.tokenizer, call.chat, self.token_text) for _ in streams]
        try:
            if call.chat:  # the first chunk of each choice names the role
                yield _event(
                    self.envelope(call, [_choice(call, i, "", None, first=True) for i in range(len(streams))], **extra)
                )
            async with contextlib.aclosing(_merged(streams)) as merged:
                async for i, d in merged:
                    finish = _finish_reason(d) if d.finished else None
                    if d.finished:
                        finals[i] = d
                    logprobs = self._logprobs(call, d.token_ids, d.logprobs, formats[i]) if d.token_ids else None
                    if d.text or finish or logprobs:
                        choice = _choice(call, i, d.text, finish, logprobs=logprobs)
                        yield _event(self.envelope(call, [choice], **extra))
            for d in finals:
                _finish_reason(d)  # a stream that ended without its final delta
            if call.include_usage:
                yield _event(
                    self.envelope(call, [], usage=usage([d.metrics for d in finals], self.limits.speculative_stats))
                )
            yield b"data: [DONE]\n\n"
        except APIError as e:
            yield _event(e.body())


def _event(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


# ---------------------------------------------------------------- the app
def create_app(coordinator: Coordinator, model_name: str | None = None, tokens: Tokens | None = None) -> FastAPI:
    """The FastAPI app serving the OpenAI-compatible API over ``coordinator`` (module docstring).

    ``tokens`` (as they are at each request): with a tenants' token, /v1/*, /metrics and /openapi.json answer 401
    without ``Authorization: Bearer <token>`` (several: any of them, one a tenant: a request's tenant is its
    token's, :func:`specdist.transport.security.tenant_of`); the admin token reads /metrics.
    """
    tokens = tokens or Tokens()
    front = _OpenAIFrontEnd(coordinator, model_name)
    # FastAPI's own /openapi.json route has no dependencies; this app serves it itself, behind the
    # token like /v1/*. No /docs or /redoc: their pages load scripts from a CDN.
    app = FastAPI(
        title="specdist",
        description="OpenAI-compatible API over speculative decoding",
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    app.state.front = front
    auth = [Depends(_bearer_auth(tokens))] if tokens.now()[0] is not None else []

    @app.get("/openapi.json", dependencies=auth, include_in_schema=False)
    async def openapi() -> JSONResponse:
        return JSONResponse(app.openapi())

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError) -> JSONResponse:
        return e.response()

    async def generate(request: Request, model: type[_Common], chat: bool) -> Response:
        front.check_room()  # a full server answers before it reads the body, renders or tokenizes (as gRPC does)
        raw = await _body(request, front.limits.max_message_bytes)
        await front.check_body(raw)
        try:
            body = model.model_validate_json(raw)
        except ValidationError as e:
            raise _schema_error(e) from None
        front.check_model(body)
        call = _parse(body, chat, front.limits)
        streams = await front.open(call, tenant_of(request.headers.get("authorization"), tokens.now()[0]))
        if call.stream:
            return _EventStream(front.events(call, streams))
        result = await _unless_disconnected(request.receive, front.complete(call, streams))
        if result is None:
            return Response(status_code=HTTP_STATUS[ErrorCode.CANCELLED])
        return Response(result, media_type="application/json")

    @app.post("/v1/completions", dependencies=auth)
    async def completions(request: Request) -> Response:
        return await generate(request, CompletionRequest, chat=False)

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat_completions(request: Request) -> Response:
        return await generate(request, ChatRequest, chat=True)

    @app.get("/v1/models", dependencies=auth)
    async def models() -> dict[str, Any]:
        card = {
            "id": front.model,
            "object": "model",
            "created": front.created,
            "owned_by": "specdist",
            "max_model_len": front.info["max_model_len"],
            "specdist": front.info,
        }
        return {"object": "list", "data": [card]}

    @app.get("/health")
    async def health() -> JSONResponse:
        if coordinator.accepting:
            return JSONResponse({"status": "ok"})
        if getattr(coordinator, "engine_error", None) is not None:  # a stand-in coordinator may not have it
            status = "engine down"
        elif coordinator.target_is_down:
            status = "target down"
        else:  # (steps_failing: a stand-in coordinator may not have it)
            status = "steps failing" if getattr(coordinator, "steps_failing", False) else "shutting down"
        return JSONResponse({"status": status}, status_code=HTTP_STATUS[ErrorCode.UNAVAILABLE])

    @app.get("/metrics", dependencies=[Depends(_metrics_auth(tokens))])  # every tenant's traffic
    async def metrics() -> Response:
        m = getattr(coordinator, "metrics", None)
        if m is None:
            raise APIError(
                HTTP_STATUS[ErrorCode.NOT_FOUND], "metrics are not enabled on this server", type="not_found_error"
            )
        body, content_type = m.render()
        return Response(body, headers={"Content-Type": content_type})

    return app


def _metrics_auth(tokens: Tokens) -> Callable[[Request], Awaitable[None]]:
    """/metrics' dependency: for whoever may see every tenant's traffic (the admin token, :func:`sees_everything`);
    403 to a tenant's token, 401 to anything else."""

    async def check(request: Request) -> None:
        header = request.headers.get("authorization")
        token, admin_token = tokens.now()
        if sees_everything(header, token, admin_token):
            return
        if token is not None and bearer_ok(header, token):
            raise APIError(
                HTTP_STATUS[ErrorCode.PERMISSION_DENIED],
                METRICS_FORBIDDEN,
                type="permission_error",
                code="admin_token_required",
            )
        raise APIError(
            HTTP_STATUS[ErrorCode.UNAUTHENTICATED],
            unauthenticated_message(header),
            type="authentication_error",
            code="invalid_api_key",
        )

    return check


def _bearer_auth(tokens: Tokens) -> Callable[[Request], Awaitable[None]]:
    """A route dependency: 401 (OpenAI's ``invalid_api_key`` shape) unless the request carries a tenant's token
    (as the tokens are now: one removed from the file is refused from its next check on)."""

    async def check(request: Request) -> None:
        header = request.headers.get("authorization")
        token = tokens.now()[0]
        if token is not None and not bearer_ok(header, token):
            raise APIError(
                HTTP_STATUS[ErrorCode.UNAUTHENTICATED],
                unauthenticated_message(header),
                type="authentication_error",
                code="invalid_api_key",
            )

    return check


async def _body(request: Request, limit: int) -> bytes:
    """The request body; 413 once it is over ``limit`` bytes (``limits.max_message_bytes``), 408 when it has not
    arrived whole within ``BODY_TIMEOUT_S`` (the connection is then closed)."""
    # 413, not RESOURCE_EXHAUSTED's 503: HTTP has a status of its own for a body over the limit
    too_large = APIError(413, f"the request body is over the limit of {limit} bytes", code="request_too_large")
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise too_large

    async def read() -> bytes:
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large
            chunks.append(chunk)
        return b"".join(chunks)

    try:
        return await asyncio.wait_for(read(), BODY_TIMEOUT_S)
    except TimeoutError:
        raise APIError(
            408,
            f"the request body did not arrive within {BODY_TIMEOUT_S:g} s",
            code="request_timeout",
            headers={"Connection": "close"},
        ) from None


async def _until_disconnected(receive: Callable[[], Awaitable[dict]]) -> None:
    """Return once the client has gone (call it after the request body was read)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(receive: Callable[[], Awaitable[dict]], work: Awaitable[Any]) -> Any:
    """``await work``, cancelled (None) if the client disconnects first."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_until_disconnected(receive))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(task, gone, return_exceptions=True)
    return task.result() if not task.cancelled() else None


class _EventStream(Response):
    """A ``text/event-stream`` response whose sending stops (and whose events generator is
    closed, aborting its requests) as soon as the client disconnects, whether or not an event
    is due."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes]):
        super().__init__(headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.raw_headers = [(k, v) for k, v in self.raw_headers if k != b"content-length"]  # chunked
        self.events = events

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        async def send_all() -> None:
            try:
                await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
                async for chunk in self.events:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            finally:
                await self.events.aclose()

        with contextlib.suppress(OSError):  # the client went away while a chunk was being sent
            await _unless_disconnected(receive, send_all())


# ---------------------------------------------------------------- serving
class _Server(uvicorn.Server):
    """uvicorn, minus its signal handling: the serve process's own handlers drain both protocols."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield

    def install_signal_handlers(self) -> None:
        pass


@dataclass
class _Guard:
    """What every connection of one server is held to (``limits.http_*``), and the open connections by peer."""

    idle_timeout_s: float
    write_timeout_s: float
    per_peer: int | None
    peers: collections.Counter = field(default_factory=collections.Counter)


class _GuardedH11(H11Protocol):
    """uvicorn's h11 connection with the timers uvicorn lacks (h11 chosen explicitly: these hook its methods).

    - idle: a connection with no request in progress (just opened, headers still arriving, or after a
      response) is closed ``idle_timeout_s`` after it began waiting; bytes that arrive do not extend it, so
      neither a silent client nor one sending its headers a byte at a time holds a place for long;
    - write: a response whose client reads nothing (the transport's buffer full, uvicorn's ``pause_writing``)
      for ``write_timeout_s`` is aborted; the disconnect ends the response, which closes its streams and
      so cancels its requests;
    - per peer: a client address past ``per_peer`` open connections has the new one closed at once.
    """

    guard: _Guard  # set on the subclass each server makes (start_http)

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._idle = self._write = None
        self.peer = self.client[0] if self.client else ""
        g = self.guard
        self.counted = g.per_peer is None or g.peers[self.peer] < g.per_peer
        if not self.counted:
            transport.close()
            return
        g.peers[self.peer] += 1
        self._arm_idle()

    def connection_lost(self, exc: Exception | None) -> None:
        for timer in (self._idle, self._write):
            if timer is not None:
                timer.cancel()
        self._idle = self._write = None
        if self.counted:
            self.counted = False
            self.guard.peers[self.peer] -= 1
            if not self.guard.peers[self.peer]:
                del self.guard.peers[self.peer]
        super().connection_lost(exc)

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not cycle and self._idle is not None:  # a request's headers are in
            self._idle.cancel()
            self._idle = None

    def on_response_complete(self) -> None:
        super().on_response_complete()  # may start a pipelined request (handle_events)
        if self.cycle is None or self.cycle.response_complete:
            self._arm_idle()

    def _arm_idle(self) -> None:
        if self._idle is not None:
            self._idle.cancel()
        self._idle = self.loop.call_later(self.guard.idle_timeout_s, self._idle_expired)

    def _idle_expired(self) -> None:
        self._idle = None
        if self.cycle is None or self.cycle.response_complete:
            self.transport.close()

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._write is None:
            self._write = self.loop.call_later(self.guard.write_timeout_s, self.transport.abort)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._write is not None:
            self._write.cancel()
            self._write = None


class _Capped:
    """The app behind the connection cap: past ``cap`` open connections (or ``cap`` requests in progress) a
    request gets 503 at once, as uvicorn's ``limit_concurrency`` answers, except the paths of UNCAPPED_PATHS."""

    def __init__(self, app: FastAPI, state: Any, cap: int):
        self.app, self.state, self.cap = app, state, cap

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        # both sets hold this request's own (as uvicorn's limit_concurrency counts: up to cap - 1 connections)
        full = len(self.state.connections) >= self.cap or len(self.state.tasks) > self.cap
        if full and scope["type"] == "http" and scope["path"] not in UNCAPPED_PATHS:
            await service_unavailable(scope, receive, send)
            return
        await self.app(scope, receive, send)


@dataclass
class HttpServer:
    """A started HTTP server (a task on the event loop); ``stop()`` ends it."""

    server: uvicorn.Server
    task: asyncio.Task
    host: str
    port: int
    front: _OpenAIFrontEnd | None = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    async def stop(self) -> None:
        """Stop accepting, let open responses end (within GRACEFUL_SHUTDOWN_S), close connections."""
        self.server.should_exit = True
        await asyncio.shield(self.task)
        if self.front is not None:
            self.front.close()


async def start_http(
    coordinator: Coordinator,
    host: str = "127.0.0.1",
    port: int = 0,
    model_name: str | None = None,
    security: ServerSecurity | None = None,
    max_connections: int | None = None,
) -> HttpServer:
    """Serve the API on ``host:port`` (0: a free port, see ``.port``) as a task on the running loop.

    ``max_connections``: connections (and requests in progress) past which a request gets 503 at once, except
    ``GET /health`` (default: the coordinator's ``max_queued`` plus ``SPARE_CONNECTIONS``). Each connection is
    held to the config's ``limits.http_idle_timeout_s``, ``http_write_timeout_s`` and
    ``http_connections_per_peer`` (:class:`_GuardedH11`).

    ``security``: HTTPS with its certificate (a client certificate required with a client CA),
    and its token on /v1/*, /metrics and /openapi.json (:mod:`specdist.transport.security`); both are read again
    when their files change (a new handshake presents the new certificate, a token removed is refused).

    The socket is bound here, so an address in use raises (``ListenError``) before anything starts.
    """
    from specdist.errors import ListenError

    bare = bare_host(host)
    family = socket.AF_INET6 if ":" in bare else socket.AF_INET
    try:
        sock = socket.create_server((bare, port), family=family)
    except OSError as e:
        raise ListenError(f"cannot listen on {host}:{port} (HTTP): {e.strerror or e}") from None
    bound = sock.getsockname()[1]
    security = security or ServerSecurity()
    tls = security.tls.uvicorn_kwargs() if security.tls is not None else {}
    cap = max_connections or getattr(coordinator, "max_queued", 256) + SPARE_CONNECTIONS
    limits = coordinator.engine.config.limits
    guard = _Guard(limits.http_idle_timeout_s, limits.http_write_timeout_s, limits.http_connections_per_peer)
    protocol = type("_Connection", (_GuardedH11,), {"guard": guard})
    app = _Capped(create_app(coordinator, model_name, security.tokens), None, cap)
    config = uvicorn.Config(
        app,
        log_config=None,
        access_log=False,
        lifespan="off",
        http=protocol,
        timeout_keep_alive=limits.http_idle_timeout_s,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        **tls,
    )
    if security.tls is not None:  # each handshake with the certificate files as they are then
        config.load()
        config.ssl = security.tls.server_context()
    server = _Server(config)
    app.state = server.server_state
    task = asyncio.create_task(server.serve(sockets=[sock]), name=f"specdist-http-{bound}")
    while not server.started:  # startup takes a few event-loop turns; the socket already queues connections
        if task.done():
            sock.close()
            task.result()
            raise RuntimeError("the HTTP server exited during startup")
        await asyncio.sleep(0.005)
    return HttpServer(server, task, host, bound, app.app.state.front)
