"""The remote transports: gRPC stubs to the workers that host the verifying and drafting cores.

:class:`RemoteVerifier` calls a target worker (``TargetWorker`` service, the rank 0 of a
possibly tensor-parallel target) and :class:`RemoteDrafter` a draft worker (``DraftWorker``
service). They speak the dataclasses of :mod:`specdist.transport`, converted by
:mod:`specdist.wire`; a draft's q travels as it came (the proposal keeps the messages and
the verifier forwards them, no re-encoding).

Errors: every gRPC failure becomes a :class:`~specdist.transport.TransportError`. The cores
name the item they blame in the status details (``items[i].field: ...``); that item's
request id goes on the error, otherwise every request of the call does.

Authentication: with a ``secret`` (a deployment's worker secret, :mod:`specdist.security`)
every call carries it as ``authorization: Bearer <secret>`` metadata; a worker that requires
it refuses calls without it (UNAUTHENTICATED).

Deadlines: a call may take ``timeout_s``, except a drafter's Propose and Release: the larger
of ``DEADLINE_FLOOR_S`` and ``DEADLINE_FACTOR`` times that method's recent wall time (capped at
``timeout_s``), so a hung draft worker fails its call (DEADLINE_EXCEEDED) within a few of its
normal latencies and the scheduler ejects it instead of waiting.

Timing: the worker reports the seconds its core spent, by phase, in the
``specdist-timing`` trailing metadata (``forward=0.012,sampling=0.001``); the scheduler books
the rest of each call's wall time as network.
"""

from __future__ import annotations

import re
import time

import grpc

from specdist.security import bearer_metadata
from specdist.transport import (
    CallTiming,
    Proposal,
    ProposeItem,
    StartItem,
    TransportError,
    Verified,
    VerifyItem,
)
from specdist.v1 import draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc
from specdist.wire import (
    proposal_from_proto,
    propose_items_to_proto,
    start_items_to_proto,
    verified_from_proto,
    verify_items_to_proto,
)

TIMING_METADATA_KEY = "specdist-timing"
CHANNEL_OPTIONS = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
_ITEM = re.compile(r"^items\[(\d+)\]")


_HIDDEN = "hidden"  # CallTiming.hidden_s in the timing metadata (not a phase of the call)
RUNS_METADATA_KEY = "specdist-draft-runs"  # CallTiming.runs: "passes:rows:seconds;..."


def timing_metadata(timing: CallTiming) -> tuple[tuple[str, str], ...]:
    """The trailing metadata a worker sends with a call's core timing."""
    phases = dict(timing.phases)
    if timing.hidden_s:
        phases[_HIDDEN] = timing.hidden_s
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
            hidden = phases.pop(_HIDDEN, 0.0)
            runs = [(int(p), int(r), float(s)) for p, r, s in
                    (run.split(":") for run in meta.get(RUNS_METADATA_KEY, "").split(";") if run)]
            return CallTiming(phases, hidden_s=hidden, runs=runs)
    except (ValueError, AttributeError):  # absent or malformed: the whole call counts as network
        pass
    return CallTiming()


DEADLINE_FLOOR_S = 2.0  # a draft worker call may always take this long ...
DEADLINE_FACTOR = 8.0  # ... or this many times its method's recent wall time (EMA), up to timeout_s
DEADLINE_EMA = 0.2  # weight of the newest call in that EMA


class _Remote:
    is_remote = True

    def __init__(self, address: str, timeout_s: float, secret: str | None = None):
        self.address = address
        self.timeout_s = timeout_s
        self.channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
        self._metadata = bearer_metadata(secret)
        self._latency: dict[object, float] = {}  # stub method -> EMA of successful calls' wall seconds
        self._adaptive: set = set()  # stub methods with a deadline from measured latency

    def deadline(self, method) -> float:
        """Seconds a call of ``method`` may take: ``timeout_s``, or for a drafter's Propose and
        Release ``min(timeout_s, max(DEADLINE_FLOOR_S, DEADLINE_FACTOR * recent wall time))``."""
        if method not in self._adaptive:
            return self.timeout_s
        # a method not measured yet takes the slowest measured one's (none yet: timeout_s, the warm-up)
        ema = self._latency.get(method, max((self._latency.get(m, 0.0) for m in self._adaptive), default=0.0))
        if not ema:
            return self.timeout_s
        return min(self.timeout_s, max(DEADLINE_FLOOR_S, DEADLINE_FACTOR * ema))

    def _call(self, method, request, request_ids: list[str]):
        """(response, core timing); gRPC errors as TransportError naming the blamed request."""
        t0 = time.perf_counter()
        try:
            resp, call = method.with_call(request, timeout=self.deadline(method), metadata=self._metadata)
            wall = time.perf_counter() - t0
            ema = self._latency.get(method)
            self._latency[method] = wall if ema is None else (1 - DEADLINE_EMA) * ema + DEADLINE_EMA * wall
        except grpc.RpcError as e:
            details = e.details() or ""
            m = _ITEM.match(details)
            item = int(m.group(1)) if m and int(m.group(1)) < len(request_ids) else None
            ids = [request_ids[item]] if item is not None else request_ids
            raise TransportError(f"{self.address}: {details}", ids, e.code().name, item) from None
        return resp, _timing_of(call)

    def close(self) -> None:
        self.channel.close()


class RemoteVerifier(_Remote):
    def __init__(self, address: str, vocab_size: int, timeout_s: float = 120.0, secret: str | None = None):
        super().__init__(address, timeout_s, secret)
        self.vocab_size = int(vocab_size)
        self.name = f"target {address}"
        self.stub = target_pb2_grpc.TargetWorkerStub(self.channel)

    def prefill(self, items: list[StartItem]) -> CallTiming:
        _, timing = self._call(self.stub.Prefill, start_items_to_proto(items, target_pb2.PrefillRequest),
                               [it.request_id for it in items])
        return timing

    def verify(self, items: list[VerifyItem]) -> tuple[list[Verified], CallTiming]:
        resp, timing = self._call(self.stub.Verify, verify_items_to_proto(items, self.vocab_size),
                                  [it.request_id for it in items])
        return verified_from_proto(resp), timing

    def release(self, request_ids: list[str]) -> None:
        self._call(self.stub.Release, target_pb2.TargetReleaseRequest(request_ids=request_ids), request_ids)


class RemoteDrafter(_Remote):
    def __init__(self, address: str, timeout_s: float = 120.0, secret: str | None = None):
        super().__init__(address, timeout_s, secret)
        self.name = address
        self.stub = draft_pb2_grpc.DraftWorkerStub(self.channel)
        # Propose and Release take about the same time call after call; Start scales with the prompt
        self._adaptive = {self.stub.Propose, self.stub.Release}

    def start(self, items: list[StartItem]) -> CallTiming:
        _, timing = self._call(self.stub.Start, start_items_to_proto(items, draft_pb2.StartRequest),
                               [it.request_id for it in items])
        return timing

    def propose(self, items: list[ProposeItem]) -> tuple[list[Proposal], CallTiming]:
        resp, timing = self._call(self.stub.Propose, propose_items_to_proto(items), [it.request_id for it in items])
        return [proposal_from_proto(p) for p in resp.proposals], timing

    def release(self, request_ids: list[str]) -> None:
        self._call(self.stub.Release, draft_pb2.DraftReleaseRequest(request_ids=request_ids), request_ids)
