"""The verifying core: holds the target model (or one tensor-parallel shard) and verifies drafts.

:class:`VerifierCore` takes and returns the dataclasses of :mod:`specdist.transport`. The
in-process engine calls it directly (:class:`LocalVerifier`); a target worker hosts the same
class behind gRPC (``workers/target_worker.py``). Per request it keeps a KV slot, the token
sequence (prompt + emitted tokens; all but the last are in the cache), the SamplingParams
and its own generator seeded with the request seed.

- ``prefill``: take a slot per request and write every prompt token but the last (the last
  one is fed with the first draft);
- ``verify``: one ragged forward over ``[last token, d_1..d_k]`` per request, the logits
  processed with each request's params (:func:`specdist.sampling.process_logits`, the same
  transform the draft used for q), ``num_draft + 1`` uniforms per request from its generator,
  :func:`specdist.verification.rejection_sample`, then the cache rolled back to the accepted
  prefix (O(1)) and ``accepted + next`` appended to the sequence. Logits, p, q and the
  sampling stay on the model's device; the uniforms (drawn on the host) go there, and the
  accepted counts and final tokens come back in one ``[B, 2]`` copy;
- ``release``: free the slot. Idempotent.

Tensor parallelism (``world_size > 1``): only rank 0 is called. Cache operations that need
no collective (allocate, free, rollback) are applied on rank 0 at once and queued; right
before every forward rank 0 broadcasts ``queued ops + the forward`` with the ``broadcast``
function it was given (and the queued ops alone when its last request is released, so an
idle group holds no slot), and ranks > 0, inside :meth:`follow`, replay them in the same order
on their shard. At every forward (where the all-reduces happen) every rank's cache
bookkeeping is therefore identical. :meth:`shutdown` flushes the queue and ends the
followers' loops.

Collective timeouts (``world_size > 1``): a rank that died makes the others' collectives fail
at once (the connection closes); a rank that hangs would hold them until the process group's
timeout. :class:`CollectiveDeadline` sizes that timeout to the measured forwards (at least
``collective_timeout_s``, else ``COLLECTIVE_FACTOR`` times the time the coming forward is
expected to take). Rank 0 sets it with the ``set_timeout`` function it was given and sends it
ahead of the forward (op ``("timeout", seconds)``), so every rank waits the same. A forward
that fails on rank 0 marks the core broken: later calls fail at once (UNAVAILABLE), since
the group cannot be trusted after a failed collective; the deployment rebuilds it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from specdist.errors import (
    AlreadyExists,
    FailedPrecondition,
    Unavailable,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
)
from specdist.models.runner import CausalLMRunner
from specdist.request import now
from specdist.sampling import process_logits
from specdist.sampling_params import SamplingParams
from specdist.transport import (
    CallTiming,
    StartItem,
    Verified,
    VerifyItem,
    check_prompt,
    check_request_ids,
    LocalTransport,
    check_token_ids,
    generator,
    sampling_tensors,
)
from specdist.verification import rejection_sample
from specdist.wire import ONE_HOT, decode_distribution


@dataclass
class _TargetRequest:
    slot: int
    seq: list[int]  # prompt + emitted tokens; all but the last are in the cache
    params: SamplingParams
    generator: torch.Generator = field(repr=False)


COLLECTIVE_FACTOR = 20.0  # a collective may wait this many times its forward's expected time
SMALL_FORWARD_TOKENS = 8  # forwards of at most this many tokens cost about their fixed overhead


class CollectiveDeadline:
    """The timeout a tensor-parallel forward's collectives get, from the forwards measured so far.

    Expected seconds of a forward of ``n`` tokens: ``overhead + rate * n``, where ``overhead`` is
    the slowest forward of at most ``SMALL_FORWARD_TOKENS`` tokens and ``rate`` the highest seconds
    per token of a larger one (before any: ``overhead / SMALL_FORWARD_TOKENS``). Both only grow,
    so the timeout errs long. Timeout: ``max(floor_s, COLLECTIVE_FACTOR * expected)``.
    """

    def __init__(self, floor_s: float):
        self.floor_s = float(floor_s)
        self.overhead = 0.0
        self.rate = 0.0

    def timeout_for(self, n_tokens: int) -> float:
        rate = self.rate or self.overhead / SMALL_FORWARD_TOKENS
        return max(self.floor_s, COLLECTIVE_FACTOR * (self.overhead + rate * n_tokens))

    def observe(self, n_tokens: int, seconds: float) -> None:
        if n_tokens <= SMALL_FORWARD_TOKENS:
            self.overhead = max(self.overhead, seconds)
        else:
            self.rate = max(self.rate, seconds / n_tokens)


def apply_op(runner: CausalLMRunner, op: tuple) -> Any:
    """Apply one cache / forward operation; the same code on every tensor-parallel rank."""
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


class VerifierCore:
    """One target model (or one tensor-parallel shard of it). Not thread-safe: one call at a time."""

    def __init__(self, runner: CausalLMRunner, rank: int = 0, world_size: int = 1,
                 broadcast: Callable[[Any], Any] | None = None,
                 set_timeout: Callable[[float], None] | None = None, collective_timeout_s: float = 10.0):
        if world_size > 1 and broadcast is None:
            raise ValueError("a tensor-parallel verifier needs a broadcast function")
        self.runner = runner
        self.vocab_size = runner.vocab_size
        self.max_model_len = runner.max_len
        self.rank, self.world_size = rank, world_size
        self._broadcast = broadcast
        self.requests: dict[str, _TargetRequest] = {}
        self._pending: list[tuple] = []  # ops applied on rank 0, not yet sent to the followers
        self.closed = False
        self._set_timeout = set_timeout  # (seconds) -> None: this rank's collective timeout
        self.deadline = CollectiveDeadline(collective_timeout_s)
        self._timeout_s = 0.0  # the collective timeout in force (0: the process group's own)
        self.broken: str | None = None  # why the tensor-parallel group failed (rank 0)

    @property
    def cache(self):
        return self.runner.cache

    # ------------------------------------------------------------ op plumbing
    def _local(self, op: tuple) -> Any:
        """A collective-free op: apply now, replay on the followers before the next forward."""
        out = apply_op(self.runner, op)
        if self.world_size > 1:
            self._pending.append(op)
        return out

    def _forward(self, slots: list[int], tokens: list[list[int]], num_logits: list[int]) -> torch.Tensor:
        op = ("forward", slots, tokens, num_logits)
        if self.world_size == 1:
            return apply_op(self.runner, op)
        n = sum(len(t) for t in tokens)
        ops = self._pending + [op]
        timeout = self.deadline.timeout_for(n)
        # raise it for a larger forward; lower it only when it is over twice what is needed
        if self._set_timeout is not None and not timeout <= self._timeout_s <= 2 * timeout:
            self._set_timeout(timeout)
            self._timeout_s = timeout
            ops.insert(0, ("timeout", timeout))
        t0 = now()
        self._pending = []
        out = self._collective(lambda: (self._broadcast(ops), apply_op(self.runner, op))[1])
        self.deadline.observe(n, now() - t0)
        return out

    def _collective(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` (broadcasts, a forward); a failed or timed-out collective breaks the core."""
        try:
            return fn()
        except RuntimeError as e:  # the group cannot be trusted after a failed collective
            self.broken = f"tensor-parallel collective failed: {e}"
            raise Unavailable("worker", self.broken) from None

    def _check_leader(self) -> None:
        if self.rank != 0:
            raise RuntimeError("only rank 0 of a tensor-parallel target serves calls; other ranks run follow()")
        if self.closed:
            raise FailedPrecondition("worker", "is shut down")
        if self.broken:
            raise Unavailable("worker", self.broken)

    def follow(self) -> int:
        """Ranks > 0: replay rank 0's operations until it shuts down. Returns the forwards run."""
        if self.rank == 0:
            raise RuntimeError("follow() is for ranks > 0")
        forwards = 0
        while True:
            for op in self._broadcast(None):
                if op[0] == "timeout":
                    if self._set_timeout is not None:
                        self._set_timeout(op[1])
                    continue
                apply_op(self.runner, op)
                if op[0] == "forward":
                    forwards += 1
                elif op[0] == "shutdown":
                    return forwards

    def shutdown(self) -> None:
        """Rank 0: flush queued ops and release the followers from follow(). Idempotent."""
        if self.rank != 0 or self.closed:
            return
        self.closed = True
        if self.world_size > 1:
            self._broadcast(self._pending + [("shutdown",)])
            self._pending = []

    # ------------------------------------------------------------ calls
    def prefill(self, items: list[StartItem]) -> CallTiming:
        self._check_leader()
        check_request_ids([it.request_id for it in items])
        parsed = []
        for i, it in enumerate(items):
            if it.request_id in self.requests:
                raise AlreadyExists(f"items[{i}].request_id", f"request {it.request_id!r} is already admitted")
            prompt = check_prompt(it.prompt_ids, self.vocab_size, self.max_model_len, f"items[{i}].prompt_token_ids")
            parsed.append((it, prompt))
        if len(items) > self.cache.num_free:
            raise ResourceExhausted("items", f"{len(items)} requests need KV slots; {self.cache.num_free} are free")
        t0 = now()
        admitted = []
        for it, prompt in parsed:
            slot = self.cache.allocate()  # lowest free slot: the followers get the same one
            if self.world_size > 1:
                self._pending.append(("allocate", slot))
            r = self.requests[it.request_id] = _TargetRequest(slot, prompt, it.params, generator(it.seed))
            admitted.append(r)
        todo = [r for r in admitted if len(r.seq) > 1]
        if todo:
            self._forward([r.slot for r in todo], [r.seq[:-1] for r in todo], [0] * len(todo))
        return CallTiming({"prefill": now() - t0})

    def verify(self, items: list[VerifyItem]) -> tuple[list[Verified], CallTiming]:
        self._check_leader()
        check_request_ids([it.request_id for it in items])
        if not items:
            return [], CallTiming()
        reqs, drafts, qs = self._check_verify(items)
        bsz, vocab = len(reqs), self.vocab_size
        nd = [len(d) for d in drafts]
        kdim = max(nd)

        t0 = now()
        order = sorted(range(bsz), key=lambda b: reqs[b].slot)  # contiguous slots attend through views
        logits = self._forward(
            [reqs[b].slot for b in order], [[reqs[b].seq[-1]] + drafts[b] for b in order], [nd[b] + 1 for b in order]
        )  # [B, K+1, V] in slot order, on the model's device
        t1 = now()

        # The valid (request, position) pairs in request order, as row indices built on the host:
        # src into the slot-ordered logits, dst into probs (request order).
        dev = logits.device
        rank = {b: i for i, b in enumerate(order)}
        pairs = [(b, j) for b in range(bsz) for j in range(nd[b] + 1)]
        src = torch.tensor([rank[b] * (kdim + 1) + j for b, j in pairs], device=dev)  # [N]
        dst = torch.tensor([b * (kdim + 1) + j for b, j in pairs], device=dev)  # [N]
        rows = torch.tensor([b for b, _ in pairs])  # [N] request of each pair (host)
        temp, top_k, top_p = sampling_tensors([r.params for r in reqs])  # [B] each, host
        p_valid = process_logits(logits.reshape(-1, vocab).index_select(0, src), temp[rows], top_k[rows], top_p[rows])
        probs = torch.zeros(bsz * (kdim + 1), vocab, device=dev).index_copy_(0, dst, p_valid)
        probs = probs.view(bsz, kdim + 1, vocab)  # [B, K+1, V]; rows past a request's drafts stay 0

        tokens = torch.tensor([d + [-1] * (kdim - len(d)) for d in drafts], dtype=torch.long).reshape(bsz, kdim)
        tokens = tokens.to(dev)  # [B, K]
        q = self._draft_q(qs, tokens, nd) if any(x is not None for x in qs) else None  # [B, K, V]
        # num_draft + 1 uniforms per request from its own (host) generator: acceptance, then the final sample
        u = torch.ones(bsz, kdim + 1, dtype=torch.float64)  # [B, K+1]
        for b, r in enumerate(reqs):
            x = torch.rand(nd[b] + 1, generator=r.generator, dtype=torch.float64)
            u[b, : nd[b]] = x[:-1]
            u[b, kdim] = x[-1]
        u = u.to(dev)
        num_draft = torch.tensor(nd, dtype=torch.long, device=dev)  # [B]
        res = rejection_sample(probs, q, tokens, num_draft, u[:, :kdim], u[:, kdim])
        final = res.tokens.gather(1, res.num_accepted[:, None])  # [B, 1]
        n_acc, final = zip(*torch.cat([res.num_accepted[:, None], final], 1).tolist())  # the one copy to the host
        t2 = now()

        out = []
        for b, (it, r) in enumerate(zip(items, reqs)):
            prev = len(r.seq)
            self._local(("rollback", r.slot, prev + n_acc[b]))  # last token + accepted drafts stay cached
            r.seq.extend(drafts[b][: n_acc[b]])
            r.seq.append(final[b])
            out.append(Verified(it.request_id, n_acc[b], final[b]))
        return out, CallTiming({"forward": t1 - t0, "sampling": t2 - t1, "cache": now() - t2})

    def _draft_q(self, qs: list, tokens: torch.Tensor, nd: list[int]) -> torch.Tensor:  # [B, K, V] on the device
        """The batch's q: one-hot rows scattered on the device where a request brought none; rows
        already on the device (an in-process drafter's) copied there; rows decoded on the host
        (they came over the wire) moved together, in one copy."""
        bsz, kdim = tokens.shape
        dev = tokens.device
        q = torch.zeros(bsz, kdim, self.vocab_size, device=dev)  # [B, K, V]
        flat = q.view(bsz * kdim, self.vocab_size)
        one_hot = [b * kdim + j for b in range(bsz) if qs[b] is None for j in range(nd[b])]
        if one_hot:
            idx = torch.tensor(one_hot, device=dev)  # [n]
            flat[idx, tokens.view(-1)[idx]] = 1.0
        moved = [b for b in range(bsz) if qs[b] is not None and qs[b].device != dev]
        if moved:
            idx = torch.tensor([b * kdim + j for b in moved for j in range(nd[b])], device=dev)  # [m]
            rows = [qs[b] for b in moved]
            if len({r.device for r in rows}) > 1:  # from several devices: each to this one first
                rows = [r.to(dev) for r in rows]
            flat.index_copy_(0, idx, torch.cat(rows).to(dev))
        for b in range(bsz):
            if qs[b] is not None and qs[b].device == dev:
                q[b, : nd[b]] = qs[b]
        return q

    def _check_verify(self, items: list[VerifyItem]):
        """Validate a whole verify batch: (requests, draft token lists, q [n, V] or None per item).

        A q decoded from the wire is on the host; a q an in-process drafter made is on its device."""
        reqs, drafts, qs = [], [], []
        for i, it in enumerate(items):
            r = self.requests.get(it.request_id)
            if r is None:
                raise NotFound(f"items[{i}].request_id", f"unknown request {it.request_id!r}")
            if it.seq_len != len(r.seq):
                raise FailedPrecondition(
                    f"items[{i}].seq_len", f"is {it.seq_len}; request {it.request_id!r} holds {len(r.seq)} tokens")
            p = it.proposal
            d = check_token_ids(p.token_ids, self.vocab_size, f"items[{i}].draft_token_ids") if p else []
            if len(r.seq) + len(d) + 1 > self.max_model_len:
                raise InvalidArgument(
                    f"items[{i}].draft_token_ids",
                    f"{len(d)} draft tokens after {len(r.seq)} would pass the context limit {self.max_model_len}")
            q = None
            if p is not None and p.wire is not None:
                if len(p.wire) != len(d):
                    raise InvalidArgument(f"items[{i}].draft_probs",
                                          f"has {len(p.wire)} entries for {len(d)} draft tokens")
                if d and any(m.format != ONE_HOT for m in p.wire):  # all one-hot: no tensor needed
                    q = torch.stack([decode_distribution(m, self.vocab_size, t, f"items[{i}].draft_probs[{j}]")
                                     for j, (m, t) in enumerate(zip(p.wire, d))])
            elif p is not None and p.q is not None:
                if tuple(p.q.shape) != (len(d), self.vocab_size):
                    raise InvalidArgument(f"items[{i}].draft_probs",
                                          f"has shape {tuple(p.q.shape)}, want ({len(d)}, {self.vocab_size})")
                q = p.q.float()  # stays where the drafter made it
            reqs.append(r)
            drafts.append(d)
            qs.append(q)
        return reqs, drafts, qs

    def release(self, request_ids: list[str]) -> None:
        self._check_leader()
        for rid in request_ids:
            r = self.requests.pop(rid, None)
            if r is not None:
                self._local(("free", r.slot))
        if not self.requests and self._pending:  # going idle: the followers free their slots now too
            ops, self._pending = self._pending, []
            self._collective(lambda: self._broadcast(ops))

    # ------------------------------------------------------------ introspection
    def kv_slots_in_use(self) -> int:
        return self.cache.num_used

    def health(self) -> dict:
        return {
            "ok": not self.closed and not self.broken,
            "broken": self.broken,
            "collective_timeout_s": self._timeout_s or None,
            "rank": self.rank,
            "world_size": self.world_size,
            "requests": len(self.requests),
            "kv_slots_in_use": self.kv_slots_in_use(),
            "kv_slots_total": self.cache.num_slots,
            "vocab_size": self.vocab_size,
            "max_model_len": self.max_model_len,
        }


class LocalVerifier(LocalTransport):
    """The verifier transport for a core in this process."""

    def __init__(self, core: VerifierCore):
        super().__init__(core, "target")
        self.vocab_size = core.vocab_size

    def prefill(self, items: list[StartItem]) -> CallTiming:
        return self._call(self.core.prefill, items)

    def verify(self, items: list[VerifyItem]) -> tuple[list[Verified], CallTiming]:
        return self._call(self.core.verify, items)
