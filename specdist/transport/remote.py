"""The remote transports: gRPC stubs to the workers that host the verifying and drafting cores.

:class:`RemoteVerifier` calls a target worker (``TargetWorker`` service, the rank 0 of a
possibly tensor-parallel target) and :class:`RemoteDrafter` a draft worker (``DraftWorker``
service). They speak the dataclasses of :mod:`specdist.transport.protocol`, converted by
:mod:`specdist.transport.wire`; a draft's q travels as it came (the proposal keeps the messages and
the verifier forwards them, no re-encoding).

Errors: every gRPC failure becomes a :class:`~specdist.transport.protocol.TransportError` whose code is
the received status as an :class:`~specdist.errors.ErrorCode` (converted here, once). The cores
name the item they blame in the status details (``items[i].field: ...``); that item's
request id goes on the error, otherwise every request of the call does.

Authentication: with a ``secret`` (a deployment's worker secret, :mod:`specdist.transport.security`)
every call carries it as ``authorization: Bearer <secret>`` metadata; a worker that requires
it refuses calls without it (UNAUTHENTICATED). With ``tls`` (the deployment's
:class:`~specdist.transport.worker_tls.WorkerTLS`) the channel is mutual TLS: the worker must show the
deployment's certificate, and this side shows it too (a worker serving with it refuses anyone else).

Deadlines: a call may take ``timeout_s``, except a drafter's Start and Propose and a Release:
the larger of ``DEADLINE_FLOOR_S`` and ``DEADLINE_FACTOR`` times that method's recent wall time
(per prompt token for Start), capped at ``timeout_s``, so a hung worker fails its call
(DEADLINE_EXCEEDED) within a few of its normal latencies and the scheduler ejects a draft, or
fails its requests, instead of waiting. Before a method was measured (a worker's first calls:
no latency to scale from) it may take ``FIRST_CALL_S`` (a Start ``FIRST_CALL_S_PER_TOKEN`` per
prompt token, if longer), not ``timeout_s``; :meth:`_Remote.cut` ends the calls in flight at once
when a supervisor found the worker down.

Message size: a call's request and response may be up to ``message_limit`` bytes
(:func:`specdist.transport.wire.message_limit_bytes` of the deployment's settings, as the workers are
given; by default any size); grpc fails a larger one with RESOURCE_EXHAUSTED.

Restarts: channels retry connecting at least every second, and :meth:`_Remote.reconnect`
points a transport at a worker that was restarted or moved (a fresh channel; the old channel's
calls in flight fail CANCELLED at once).

Timing: the worker reports the seconds its core spent, by phase, in the
``specdist-timing`` trailing metadata (``forward=0.012,sampling=0.001``); the scheduler books
the rest of each call's wall time as network.
"""

from __future__ import annotations

import threading
import time

import grpc

from specdist.errors import ErrorCode
from specdist.transport.grpc_status import error_code
from specdist.transport.protocol import (
    CallTiming,
    Prefilled,
    Proposal,
    ProposeItem,
    StartItem,
    Verified,
    VerifyItem,
    error_for_items,
)
from specdist.transport.security import bearer_metadata
from specdist.transport.wire import (
    NO_MESSAGE_LIMIT,
    grpc_message_options,
    prefilled_from_proto,
    proposal_from_proto,
    propose_items_to_proto,
    start_items_to_proto,
    verified_from_proto,
    verify_items_to_proto,
)
from specdist.transport.worker_tls import WorkerTLS
from specdist.v1 import draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc

TIMING_METADATA_KEY = "specdist-timing"
CHANNEL_OPTIONS = [  # besides the message limits (grpc_message_options)
    # a worker that restarts is back within seconds: retry connecting at least every second
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1000),
    # a channel of its own: a reconnect() must not inherit the old connection's failure backoff
    ("grpc.use_local_subchannel_pool", 1),
]

_HIDDEN_S = "hidden"  # CallTiming.hidden_s in the timing metadata (not a phase of the call)
RUNS_METADATA_KEY = "specdist-draft-runs"  # CallTiming.runs: "passes:rows:seconds;..."


def timing_metadata(timing: CallTiming) -> tuple[tuple[str, str], ...]:
    """The trailing metadata a worker sends with a call's core timing."""
    phases = dict(timing.phases)
    if timing.hidden_s:
        phases[_HIDDEN_S] = timing.hidden_s
    out = ((TIMING_METADATA_KEY, ",".join(f"{k}={v:.9f}" for k, v in phases.items())),)
    if timing.runs:
        out += ((RUNS_METADATA_KEY, ";".join(f"{p}:{r}:{s:.9f}" for p, r, s in timing.runs)),)
    return out


def _timing_of(call) -> CallTiming:
    try:
        meta = dict(call.trailing_metadata() or ())
        value = meta.get(TIMING_METADATA_KEY)
        if value is not None:
            phases = {k: float(v) for k, v in (kv.split("=") for kv in value.split(",") if kv)}
            hidden_s = phases.pop(_HIDDEN_S, 0.0)
            runs = [
                (int(p), int(r), float(s))
                for p, r, s in (run.split(":") for run in meta.get(RUNS_METADATA_KEY, "").split(";") if run)
            ]
            return CallTiming(phases, hidden_s=hidden_s, runs=runs)
    except (ValueError, AttributeError):  # absent or malformed: the whole call counts as network
        pass
    return CallTiming()


DEADLINE_FLOOR_S = 2.0  # a draft worker call may always take this long ...
DEADLINE_FACTOR = 8.0  # ... or this many times its method's recent wall time (EMA), up to timeout_s
DEADLINE_EMA = 0.2  # weight of the newest call in that EMA
FIRST_CALL_S = 30.0  # a method not measured yet may take this long (not timeout_s) ...
FIRST_CALL_S_PER_TOKEN = (
    0.05  # ... a Start this long per prompt token if longer (20 tokens/s: any draft prefills faster)
)


class _Remote:
    is_remote = True

    def __init__(
        self,
        address: str,
        timeout_s: float = 120.0,
        secret: str | None = None,
        message_limit: int = NO_MESSAGE_LIMIT,
        tls: WorkerTLS | None = None,
    ):
        self.timeout_s = timeout_s
        self.message_limit = message_limit
        self._metadata = bearer_metadata(secret)
        self.tls = tls
        self._latency: dict[str, float] = {}  # method name -> EMA of its calls' wall seconds (per token)
        self._swap = threading.Lock()  # reconnect() from the step's thread and cut() from a supervisor's
        self.channel = None
        self.reconnect(address)

    def reconnect(self, address: str) -> None:
        """A fresh channel to ``address`` (a worker restarted or moved); the old one is closed, which
        fails its calls in flight (CANCELLED). The measured latencies stay: a restarted worker runs
        the same model, and its first calls keep short deadlines. Safe from any thread."""
        options = grpc_message_options(self.message_limit) + CHANNEL_OPTIONS
        with self._swap:
            old = self.channel
            channel = (
                self.tls.channel(address, options)
                if self.tls is not None
                else grpc.insecure_channel(address, options=options)
            )
            self.address, self.name = address, f"{self.name_prefix}{address}"
            self.channel, self.stub = channel, self.stub_class(channel)
        if old is not None:
            old.close()

    def cut(self) -> None:
        """The worker is known to be down: its calls in flight fail now (CANCELLED), not at their
        deadlines; later calls go out on a fresh channel to the same address. Safe from any thread."""
        self.reconnect(self.address)

    stub_class: type  # the service's generated stub
    name_prefix = ""  # logs name the worker "<prefix><address>"

    # method name -> what its time scales with: "call" (about the same every call) or "token"
    # (the prompt tokens it carries); methods not named wait up to timeout_s
    _adaptive: dict[str, str] = {}

    def deadline(self, method: str, tokens: int = 1) -> float:
        """Seconds a call of ``method`` (carrying ``tokens`` prompt tokens) may take: for a method
        in ``_adaptive`` that was measured, ``min(timeout_s, max(DEADLINE_FLOOR_S, DEADLINE_FACTOR
        * its recent time per call or per token * (1 or tokens)))``, where a per-call method not
        measured yet takes the slowest measured one's time, and with nothing measured
        ``min(timeout_s, max(FIRST_CALL_S, FIRST_CALL_S_PER_TOKEN * tokens for a Start))``;
        otherwise ``timeout_s``."""
        kind = self._adaptive.get(method)
        if kind is None:
            return self.timeout_s
        rate = self._latency.get(method)
        if kind == "call" and rate is None:  # not measured yet: the slowest measured per-call method's
            rate = max((r for m, r in self._latency.items() if self._adaptive.get(m) == "call"), default=None)
        if not rate:  # nothing measured (a worker's first calls): bounded all the same
            first = FIRST_CALL_S_PER_TOKEN * max(1, tokens) if kind == "token" else 0.0
            return min(self.timeout_s, max(FIRST_CALL_S, first))
        size = max(1, tokens) if kind == "token" else 1
        return min(self.timeout_s, max(DEADLINE_FLOOR_S, DEADLINE_FACTOR * rate * size))

    def _rpc(self, method: str, request, request_ids: list[str], tokens: int = 1):
        """(response, core timing) of the stub's ``method``; gRPC errors as TransportError naming
        the blamed request."""
        t0 = time.perf_counter()
        stub, address = self.stub, self.address
        try:
            resp, call = getattr(stub, method).with_call(
                request, timeout=self.deadline(method, tokens), metadata=self._metadata
            )
            rate = (time.perf_counter() - t0) / (max(1, tokens) if self._adaptive.get(method) == "token" else 1)
            ema = self._latency.get(method)
            self._latency[method] = rate if ema is None else (1 - DEADLINE_EMA) * ema + DEADLINE_EMA * rate
        except grpc.RpcError as e:
            details = e.details() or ""
            raise error_for_items(f"{address}: {details}", details, error_code(e.code()), request_ids) from None
        except ValueError:  # grpc refuses a call on a closed channel: cut() or reconnect() closed it meanwhile
            if stub is self.stub:
                raise
            raise error_for_items(
                f"{address}: call cut (channel closed)", "", ErrorCode.CANCELLED, request_ids
            ) from None
        return resp, _timing_of(call)

    def close(self) -> None:
        self.channel.close()


class RemoteVerifier(_Remote):
    # a Release takes about the same time call after call; Prefill and Verify scale with the batch
    _adaptive = {"Release": "call"}
    stub_class = target_pb2_grpc.TargetWorkerStub
    name_prefix = "target "

    def __init__(
        self,
        address: str,
        vocab_size: int,
        timeout_s: float = 120.0,
        secret: str | None = None,
        message_limit: int = NO_MESSAGE_LIMIT,
        tls: WorkerTLS | None = None,
    ):
        self.vocab_size = int(vocab_size)
        super().__init__(address, timeout_s, secret, message_limit, tls)

    def prefill(self, items: list[StartItem]) -> tuple[list[Prefilled], CallTiming]:
        resp, timing = self._rpc(
            "Prefill", start_items_to_proto(items, target_pb2.PrefillRequest), [it.request_id for it in items]
        )
        return prefilled_from_proto(resp, items), timing

    def verify(self, items: list[VerifyItem]) -> tuple[list[Verified], CallTiming]:
        resp, timing = self._rpc(
            "Verify", verify_items_to_proto(items, self.vocab_size), [it.request_id for it in items]
        )
        return verified_from_proto(resp), timing

    def release(self, request_ids: list[str]) -> None:
        self._rpc("Release", target_pb2.TargetReleaseRequest(request_ids=request_ids), request_ids)


class RemoteDrafter(_Remote):
    # Propose and Release take about the same time call after call; Start scales with the prompt
    _adaptive = {"Propose": "call", "Release": "call", "Start": "token"}
    stub_class = draft_pb2_grpc.DraftWorkerStub

    def __init__(
        self,
        address: str,
        timeout_s: float = 120.0,
        secret: str | None = None,
        message_limit: int = NO_MESSAGE_LIMIT,
        hidden_layers: tuple[int, ...] = (),
        tls: WorkerTLS | None = None,
    ):
        """``hidden_layers``: the target layers the worker's EAGLE-3 head reads (its config's), () for other drafts."""
        self.hidden_layers = tuple(hidden_layers)
        super().__init__(address, timeout_s, secret, message_limit, tls)

    def start(self, items: list[StartItem]) -> CallTiming:
        _, timing = self._rpc(
            "Start",
            start_items_to_proto(items, draft_pb2.StartRequest),
            [it.request_id for it in items],
            sum(len(it.prompt_ids) for it in items),
        )
        return timing

    def propose(self, items: list[ProposeItem]) -> tuple[list[Proposal], CallTiming]:
        resp, timing = self._rpc("Propose", propose_items_to_proto(items), [it.request_id for it in items])
        return [proposal_from_proto(p) for p in resp.proposals], timing

    def release(self, request_ids: list[str]) -> None:
        self._rpc("Release", draft_pb2.DraftReleaseRequest(request_ids=request_ids), request_ids)
