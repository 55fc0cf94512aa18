"""The target worker: holds the (possibly AutoTP-sharded) target model and verifies drafts.

:class:`TargetWorker` is a plain class (a Ray actor will host it later) whose methods take
and return the ``specdist.v1`` target messages; :class:`TargetServicer` exposes it over
``grpc.aio``. Per request it keeps a KV-cache slot, the full token sequence (prompt +
emitted tokens), the SamplingParams and its own seeded ``torch.Generator`` (seeded from
``PrefillItem.seed``; the acceptance and residual/bonus uniforms come from it, exactly as
``Engine.step`` draws them: ``num_draft + 1`` per verification).

The sequencing is the engine's (``specdist/engine.py``):

- ``prefill``: allocate a slot and write every prompt token but the last into it (the last
  one is fed with the first draft), like ``Engine._admit``;
- ``verify``: one ragged forward over ``[last token, d_1..d_k]`` per request, the logits
  processed with each request's params, the shipped draft distributions decoded
  (ONE_HOT / DENSE_FP16 / SPARSE_FP16, see ``specdist.wire``), ``rejection_sample``, the
  cache rolled back to the accepted prefix, and ``accepted + next`` appended to the sequence.

Every RPC validates the whole batch before touching any state (all or nothing).

Tensor parallelism (``world_size > 1``): only rank 0 receives RPCs. Cache operations that
do not need a collective (allocate, free, rollback) are applied on rank 0 at once and
queued; right before every forward rank 0 broadcasts ``queued ops + the forward`` with
:func:`workers.tensor_parallel.broadcast_object`, and ranks > 0, inside :meth:`follow`,
replay them in the same order on their shard. So at every forward (where the all-reduces
happen) every rank's cache bookkeeping (slot allocation order, lengths) is identical.
:meth:`shutdown` flushes the queue and ends the followers' loops.
"""

from __future__ import annotations

import asyncio
import operator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

import grpc
import torch

from specdist.errors import (  # noqa: F401  (re-exported for the draft worker)
    AlreadyExists,
    FailedPrecondition,
    FieldError,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    SpecDistError,
)
from specdist.models.runner import CausalLMRunner
from specdist.sampling import process_logits
from specdist.sampling_params import SamplingParams
from specdist.v1 import target_pb2, target_pb2_grpc
from specdist.verification import rejection_sample
from specdist.wire import decode_distribution, sampling_params_from_proto


def status_code_for(exc: BaseException) -> grpc.StatusCode:
    """The gRPC status for one of specdist's field errors; INTERNAL for anything else."""
    return getattr(grpc.StatusCode, exc.status) if isinstance(exc, FieldError) else grpc.StatusCode.INTERNAL


# ---------------------------------------------------------------- shared validation helpers
def check_request_ids(ids: list[str], field: str = "items") -> None:
    """Non-empty and distinct within one call."""
    seen: set[str] = set()
    for i, rid in enumerate(ids):
        if not rid:
            raise InvalidArgument(f"{field}[{i}].request_id", "must be non-empty")
        if rid in seen:
            raise InvalidArgument(f"{field}[{i}].request_id", f"duplicate request id {rid!r} in one call")
        seen.add(rid)


def check_token_ids(ids, vocab_size: int, field: str) -> list[int]:
    out = [operator.index(t) for t in ids]
    for t in out:
        if not 0 <= t < vocab_size:
            raise InvalidArgument(field, f"token id {t} is outside the vocabulary [0, {vocab_size})")
    return out


def check_prompt(ids, vocab_size: int, max_model_len: int, field: str) -> list[int]:
    out = check_token_ids(ids, vocab_size, field)
    if not out:
        raise InvalidArgument(field, "is empty")
    if len(out) >= max_model_len:
        raise InvalidArgument(field, f"has {len(out)} tokens; the context limit is {max_model_len} (prompt + output)")
    return out


def sampling_tensors_of(params: list[SamplingParams]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    temp = torch.tensor([p.temperature for p in params], dtype=torch.float32)
    top_k = torch.tensor([p.top_k for p in params], dtype=torch.long)
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32)
    return temp, top_k, top_p


# ---------------------------------------------------------------- the worker
@dataclass
class _TargetRequest:
    slot: int
    seq: list[int]  # prompt + emitted tokens; all but the last are in the cache
    params: SamplingParams
    generator: torch.Generator = field(repr=False)


def apply_op(runner: CausalLMRunner, op: tuple) -> Any:
    """Apply one cache/forward operation; the same code on every tensor-parallel rank."""
    kind = op[0]
    if kind == "forward":
        return runner.forward(op[1], op[2], op[3])
    if kind == "allocate":
        slot = runner.cache.allocate()
        if slot != op[1]:
            raise RuntimeError(f"tensor-parallel ranks diverged: allocated slot {slot}, rank 0 got {op[1]}")
        return slot
    if kind == "free":
        runner.cache.free(op[1])
    elif kind == "rollback":
        runner.cache.rollback(op[1], op[2])
    elif kind != "shutdown":
        raise ValueError(f"unknown operation {kind!r}")
    return None


class TargetWorker:
    """One target model (or one tensor-parallel shard of it). Not thread-safe: one call at a time."""

    def __init__(
        self,
        model: torch.nn.Module,
        max_batch_size: int,
        max_model_len: int,
        rank: int = 0,
        world_size: int = 1,
    ):
        self.runner = CausalLMRunner(model, max_batch_size, max_model_len)
        self.vocab_size = self.runner.vocab_size
        self.max_model_len = max_model_len
        self.rank, self.world_size = rank, world_size
        self.requests: dict[str, _TargetRequest] = {}
        self._pending: list[tuple] = []  # ops applied on rank 0, not yet sent to the followers
        self._closed = False

    # ------------------------------------------------------------ op plumbing
    def _local(self, op: tuple) -> Any:
        """A collective-free op: apply now, replay on the followers before the next forward."""
        out = apply_op(self.runner, op)
        if self.world_size > 1:
            self._pending.append(op)
        return out

    def _forward(self, slots: list[int], tokens: list[list[int]], num_logits: list[int]) -> torch.Tensor:
        op = ("forward", slots, tokens, num_logits)
        if self.world_size > 1:
            # imported lazily: single-process workers never touch torch.distributed
            from workers.tensor_parallel import broadcast_object

            broadcast_object(self._pending + [op])
            self._pending = []
        return apply_op(self.runner, op)

    def _check_leader(self) -> None:
        if self.rank != 0:
            raise RuntimeError("only rank 0 of a tensor-parallel target serves calls; other ranks run follow()")
        if self._closed:
            raise FailedPrecondition("worker", "is shut down")

    def follow(self) -> int:
        """Ranks > 0: replay rank 0's operations until it shuts down. Returns the forwards run."""
        from workers.tensor_parallel import broadcast_object

        if self.rank == 0:
            raise RuntimeError("follow() is for ranks > 0")
        forwards = 0
        while True:
            ops = broadcast_object(None)
            for op in ops:
                apply_op(self.runner, op)
                if op[0] == "forward":
                    forwards += 1
                elif op[0] == "shutdown":
                    return forwards

    def shutdown(self) -> None:
        """Rank 0: flush queued ops and release the followers from follow(). Idempotent."""
        if self.rank != 0 or self._closed:
            return
        self._closed = True
        if self.world_size > 1:
            from workers.tensor_parallel import broadcast_object

            broadcast_object(self._pending + [("shutdown",)])
            self._pending = []

    # ------------------------------------------------------------ RPCs
    def prefill(self, msg: target_pb2.PrefillRequest) -> target_pb2.PrefillResponse:
        self._check_leader()
        items = list(msg.items)
        check_request_ids([it.request_id for it in items])
        parsed = []
        for i, it in enumerate(items):
            if it.request_id in self.requests:
                raise AlreadyExists(f"items[{i}].request_id", f"request {it.request_id!r} is already admitted")
            prompt = check_prompt(it.prompt_token_ids, self.vocab_size, self.max_model_len,
                                  f"items[{i}].prompt_token_ids")
            params = sampling_params_from_proto(it.params, f"items[{i}].params")
            parsed.append((it.request_id, prompt, params, it.seed))
        if len(items) > self.runner.cache.num_free:
            raise ResourceExhausted(
                "items", f"{len(items)} requests need KV slots; {self.runner.cache.num_free} are free"
            )
        admitted = []
        for rid, prompt, params, seed in parsed:
            slot = self.runner.cache.allocate()  # lowest free slot: the followers get the same one
            if self.world_size > 1:
                self._pending.append(("allocate", slot))
            self.requests[rid] = _TargetRequest(slot, prompt, params, torch.Generator().manual_seed(seed))
            admitted.append(self.requests[rid])
        todo = [r for r in admitted if len(r.seq) > 1]
        if todo:
            self._forward([r.slot for r in todo], [r.seq[:-1] for r in todo], [0] * len(todo))
        return target_pb2.PrefillResponse(request_ids=[p[0] for p in parsed])

    def verify(self, msg: target_pb2.VerifyRequest) -> target_pb2.VerifyResponse:
        self._check_leader()
        items = list(msg.items)
        check_request_ids([it.request_id for it in items])
        if not items:
            return target_pb2.VerifyResponse()
        reqs: list[_TargetRequest] = []
        drafts: list[list[int]] = []
        qs: list[list[torch.Tensor]] = []
        for i, it in enumerate(items):
            r = self.requests.get(it.request_id)
            if r is None:
                raise NotFound(f"items[{i}].request_id", f"unknown request {it.request_id!r}")
            if it.seq_len != len(r.seq):
                raise FailedPrecondition(
                    f"items[{i}].seq_len", f"is {it.seq_len}; request {it.request_id!r} holds {len(r.seq)} tokens"
                )
            d = check_token_ids(it.draft_token_ids, self.vocab_size, f"items[{i}].draft_token_ids")
            if len(it.draft_probs) != len(d):
                raise InvalidArgument(
                    f"items[{i}].draft_probs", f"has {len(it.draft_probs)} entries for {len(d)} draft tokens"
                )
            if len(r.seq) + len(d) + 1 > self.max_model_len:
                raise InvalidArgument(
                    f"items[{i}].draft_token_ids",
                    f"{len(d)} draft tokens after {len(r.seq)} would pass the context limit {self.max_model_len}",
                )
            qs.append([decode_distribution(pm, self.vocab_size, t, f"items[{i}].draft_probs[{j}]")
                       for j, (pm, t) in enumerate(zip(it.draft_probs, d))])
            reqs.append(r)
            drafts.append(d)

        # ---- one ragged forward (slot order keeps contiguous slots on the view path)
        bsz = len(reqs)
        nd = [len(d) for d in drafts]
        kdim = max(nd)
        order = sorted(range(bsz), key=lambda b: reqs[b].slot)
        logits_sorted = self._forward(
            [reqs[b].slot for b in order], [[reqs[b].seq[-1]] + drafts[b] for b in order], [nd[b] + 1 for b in order]
        )  # [B, kdim + 1, V] in slot order
        logits = torch.empty_like(logits_sorted)
        logits[torch.tensor(order)] = logits_sorted

        num_draft = torch.tensor(nd, dtype=torch.long)
        pos_valid = torch.arange(kdim + 1)[None, :] <= num_draft[:, None]  # [B, K+1]
        temp, top_k, top_p = sampling_tensors_of([r.params for r in reqs])
        rows = pos_valid.nonzero()[:, 0]
        probs = torch.zeros(bsz, kdim + 1, self.vocab_size)
        probs[pos_valid] = process_logits(logits[:, : kdim + 1][pos_valid], temp[rows], top_k[rows], top_p[rows])
        tokens = torch.full((bsz, kdim), -1, dtype=torch.long)
        q = torch.zeros(bsz, kdim, self.vocab_size)
        acc_u = torch.ones(bsz, kdim, dtype=torch.float64)
        smp_u = torch.empty(bsz, dtype=torch.float64)
        for b, r in enumerate(reqs):
            if nd[b]:
                tokens[b, : nd[b]] = torch.tensor(drafts[b])
                q[b, : nd[b]] = torch.stack(qs[b])
            u = torch.rand(nd[b] + 1, generator=r.generator, dtype=torch.float64)
            acc_u[b, : nd[b]] = u[:-1]
            smp_u[b] = u[-1]
        res = rejection_sample(probs, q, tokens, num_draft, acc_u, smp_u)

        n_acc = res.num_accepted.tolist()
        out = target_pb2.VerifyResponse()
        for b, (it, r) in enumerate(zip(items, reqs)):
            prev = len(r.seq)
            self._local(("rollback", r.slot, prev + n_acc[b]))  # last token + accepted drafts stay cached
            nxt = int(res.tokens[b, n_acc[b]])
            r.seq.extend(drafts[b][: n_acc[b]] + [nxt])
            out.results.add(request_id=it.request_id, num_accepted=n_acc[b], next_token_id=nxt)
        return out

    def release(self, msg: target_pb2.TargetReleaseRequest) -> target_pb2.TargetReleaseResponse:
        self._check_leader()
        for rid in msg.request_ids:
            r = self.requests.pop(rid, None)
            if r is not None:
                self._local(("free", r.slot))
        return target_pb2.TargetReleaseResponse()

    # ------------------------------------------------------------ introspection
    def kv_slots_in_use(self) -> int:
        return self.runner.cache.num_used

    def health(self) -> dict:
        return {
            "ok": not self._closed,
            "rank": self.rank,
            "world_size": self.world_size,
            "requests": len(self.requests),
            "kv_slots_in_use": self.kv_slots_in_use(),
            "kv_slots_total": self.runner.cache.num_slots,
            "vocab_size": self.vocab_size,
            "max_model_len": self.max_model_len,
        }


# ---------------------------------------------------------------- gRPC
class BlockingCallRunner:
    """Runs a worker's blocking methods on ONE thread (models and collectives are not thread-safe)
    and turns specdist errors into gRPC statuses."""

    def __init__(self, name: str, executor: ThreadPoolExecutor | None = None):
        self.executor = executor or ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)

    async def call(self, fn: Callable, request, context):
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self.executor, fn, request)
        except SpecDistError as e:
            await context.abort(status_code_for(e), str(e))
        except Exception as e:  # a bug or a broken model: say so instead of hanging the caller
            await context.abort(grpc.StatusCode.INTERNAL, f"{type(e).__name__}: {e}")

    def close(self) -> None:
        self.executor.shutdown(wait=True)


class TargetServicer(target_pb2_grpc.TargetWorkerServicer):
    """grpc.aio servicer over a rank-0 :class:`TargetWorker`."""

    def __init__(self, worker: TargetWorker, executor: ThreadPoolExecutor | None = None):
        self.worker = worker
        self.runner = BlockingCallRunner("target-worker", executor)

    async def Prefill(self, request, context):
        return await self.runner.call(self.worker.prefill, request, context)

    async def Verify(self, request, context):
        return await self.runner.call(self.worker.verify, request, context)

    async def Release(self, request, context):
        return await self.runner.call(self.worker.release, request, context)

    def shutdown(self) -> None:
        """Shut the worker down on its own thread (tensor-parallel followers exit), then stop the pool."""
        self.runner.executor.submit(self.worker.shutdown).result()
        self.runner.close()
