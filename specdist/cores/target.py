"""The verifying core: holds the target model (or one tensor-parallel shard) and verifies drafts.

:class:`VerifierCore` takes and returns the dataclasses of :mod:`specdist.transport.protocol`. The
in-process engine calls it directly (:class:`LocalVerifier`); a target worker hosts the same
class behind gRPC (``workers/target_worker.py``). Per request it keeps a KV slot, the token
sequence (prompt + emitted tokens; all but the last are in the cache), the SamplingParams
and the request seed.

- ``prefill``: take a slot per request and write every prompt token but the last (the last
  one is fed with the first draft);
- ``verify``: one ragged forward over ``[last token, d_1..d_k]`` per request, the logits
  processed with each request's params (:func:`specdist.cores.sampling.process_logits`, the same
  transform the draft used for q), :func:`specdist.cores.rejection.rejection_sample`, then the
  cache rolled back to the accepted prefix (O(1)) and ``accepted + next`` appended to the
  sequence. Logits, p, q and the sampling stay on the model's device; the uniforms (computed
  on the host) go there, and the accepted counts, final tokens and unusable-logits flags come
  back in one ``[B, 3]`` copy; the requests whose params ask for ``logprobs`` get log p of
  their emitted tokens (and the top entries of p) from the same p, in that same copy
  (:mod:`specdist.logprobs`);
- ``release``: free the slot. Idempotent.

Uniforms: a request holding ``L`` tokens (``len(seq)``, prompt + emitted) before a step has its
draft token ``d_j`` (j = 0..k-1) at sequence position ``L + j`` and its final (residual or
bonus) token at ``L + accepted``. ``d_j`` is accepted or rejected with
:func:`~specdist.randomness.target_uniforms` ``(seed, ACCEPT_ROLE, [L + j])``; the final token is
sampled with ``(seed, SAMPLE_ROLE, [L + accepted])``, so the sample uniform of every position it
can land on (``L .. L + k``) goes to the sampler. Each is a pure function of (seed, position,
role): it depends neither on the draft lengths nor on the steps before, all 64 seed bits count,
a position's uniform of one role is used at most once (later steps start past it), and the
roles' streams are distinct from each other and from the drafter's.

Checks that need the forward's output: a request whose logits have a NaN, or whose processed
distribution has no positive finite mass, at any of its positions cannot be sampled. The call
then undoes its forward (every request's cache rolled back, nothing appended) and fails with
:class:`~specdist.errors.NonFiniteLogits` naming that item (FAILED_PRECONDITION, per item), so
the caller can retry the call without it. A draft token whose own q gives it no positive
probability is refused before the forward (INVALID_ARGUMENT naming ``items[i].draft_probs[j]``),
for in-process and wire-decoded q alike.

Tensor parallelism (``world_size > 1``), the collectives' timeouts and a call that hangs are the
business of the core's :class:`~specdist.cores.collectives.Replicator` (``self.group``): every cache
operation and forward goes through it, so ranks > 0 replay rank 0's in the same order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from specdist.clock import now
from specdist.cores.collectives import Replicator
from specdist.cores.verify_batch import VerifyBatch
from specdist.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NonFiniteLogits,
    NotFound,
    Unavailable,
)
from specdist.models.kv.base import KVCache
from specdist.models.kv.prefix import PrefixCache
from specdist.models.runner import CausalLMRunner
from specdist.sampling_params import SamplingParams
from specdist.transport.checks import ReleasedUnknown, check_prompt, check_request_ids, check_token_ids
from specdist.transport.protocol import (
    CallTiming,
    LocalTransport,
    Prefilled,
    StartItem,
    Verified,
    VerifyItem,
    call_local,
)
from specdist.transport.wire import ONE_HOT, decode_distribution


@dataclass
class _TargetRequest:
    slot: int
    seq: list[int]  # prompt + emitted tokens; all but the last are in the cache
    params: SamplingParams
    seed: int  # keys the target's uniforms (specdist.randomness.target_uniforms)
    coupling: str = "rejection"  # gumbel: its drafts are decided by specdist.cores.coupling (noise keyed by draft_seed)
    # its results carry the hidden states of runner.hidden_layers (StartItem.hidden_layers set)
    returns_hidden: bool = False
    tenant: str = ""  # whose request it is (StartItem.tenant): prompt K/V are reused within its share (PrefixCache)


class VerifierCore:
    """One target model (or one tensor-parallel shard of it). Not thread-safe: one call at a time."""

    def __init__(
        self,
        runner: CausalLMRunner,
        rank: int = 0,
        world_size: int = 1,
        broadcast: Callable[[Any], Any] | None = None,
        set_timeout: Callable[[float], None] | None = None,
        collective_timeout_s: float = 10.0,
        prefix_caching: bool = True,
        prefix_scope: str = "shared",
    ):
        self.runner = runner
        self.vocab_size = runner.vocab_size
        self.max_model_len = runner.max_len
        self.rank, self.world_size = rank, world_size
        # every cache operation and forward goes through it: ranks > 0 replay them (collectives.py)
        self.group = Replicator(runner, rank, world_size, broadcast, set_timeout, collective_timeout_s)
        self.requests: dict[str, _TargetRequest] = {}
        self.released_unknown = ReleasedUnknown()  # refuses a prefill that arrives after its release
        self.closed = False
        # prompt K/V shared across requests; its cache operations reach the followers like ours
        self.prefixes = PrefixCache(runner.cache, prefix_caching, record=self.group.record, scope=prefix_scope)

    @property
    def cache(self) -> KVCache:
        return self.runner.cache

    def keep_hidden_layers(self, layers: Sequence[int]) -> None:
        """Keep the hidden states of ``layers`` in every forward, for the requests that ask for them
        (``StartItem.hidden_layers``: an EAGLE-3 draft reads them). Before any request, and before
        the runner is compiled or its CUDA graphs captured."""
        self.runner.hidden_layers = tuple(layers)

    @property
    def hidden_width(self) -> int:
        """Values per position of the hidden states it returns to requests that ask (runner.hidden_layers)."""
        return len(self.runner.hidden_layers) * int(self.runner.config.hidden_size)

    # ------------------------------------------------------------ the group
    def _check_leader(self) -> None:
        if self.rank != 0:
            raise RuntimeError("only rank 0 of a tensor-parallel target serves calls; other ranks run follow()")
        if self.closed:
            raise FailedPrecondition("worker", "is shut down")
        if self.group.broken:
            raise Unavailable("worker", self.group.broken)

    def follow(self) -> int:
        """Ranks > 0: replay rank 0's operations until it shuts down. Returns the forwards run."""
        return self.group.follow(self.prefixes.replay)

    def shutdown(self) -> None:
        """Rank 0: flush queued ops and release the followers from follow(). Idempotent."""
        if self.rank != 0 or self.closed:
            return
        self.closed = True
        self.group.shutdown()

    # ------------------------------------------------------------ calls
    def prefill(self, items: list[StartItem]) -> tuple[list[Prefilled], CallTiming]:
        with self.group.watched("prefill", sum(len(it.prompt_ids) for it in items)):
            return self._prefill(items)

    def _prefill(self, items: list[StartItem]) -> tuple[list[Prefilled], CallTiming]:
        self._check_leader()
        check_request_ids([it.request_id for it in items])
        self.released_unknown.refuse([it.request_id for it in items])
        parsed = []
        for i, it in enumerate(items):
            if it.request_id in self.requests:
                raise AlreadyExists(f"items[{i}].request_id", f"request {it.request_id!r} is already admitted")
            prompt = check_prompt(it.prompt_ids, self.vocab_size, self.max_model_len, f"items[{i}].prompt_token_ids")
            self._check_hidden_layers(it.hidden_layers, f"items[{i}].hidden_layers")
            parsed.append((it, prompt))
        # the most K/V a request holds: its prompt and max_tokens (the scheduler caps drafts to them), + 1
        need = [min(self.max_model_len, len(prompt) + it.params.max_tokens + 1) for it, prompt in parsed]
        self.prefixes.check_room(need)
        need_of = {it.request_id: n for (it, _), n in zip(parsed, need)}
        t0 = now()
        # K/V the cache already holds come from there (PrefixCache). A prompt that shares a longer
        # prefix with an earlier prompt of this call (its leader: the earliest with the longest) than
        # with anything cached waits for its leader's forward and copies from it: it runs in the wave
        # after its leader's, one forward per wave, so no prefix is computed twice. Waves, not two
        # groups: with a system prompt every prompt shares, the second of two equal prompts waits for
        # the first, which itself waits (for the system prompt) on the call's first prompt.
        # K/V held: all but the last token
        # (per share of the prefix cache: a tenant's, or everyone's)
        prefixes = self.prefixes
        lives: dict[str, object] = {}

        def live(tenant: str):  # the running requests of tenant's share, indexed (built at first use)
            key = prefixes.key(tenant)
            if key not in lives:
                lives[key] = prefixes.live_index(
                    (r.slot, r.seq[:-1]) for r in self.requests.values() if prefixes.key(r.tenant) == key
                )
            return lives[key]

        waves: list[list] = [[]]
        wave_of: list[int] = []  # the wave of each prompt of the call so far
        in_calls: dict[str, object] = {}  # those prompts, by position in the call, per share
        for i, (it, prompt) in enumerate(parsed):
            want = prompt[:-1]
            in_call = in_calls.setdefault(prefixes.key(it.tenant), prefixes.live_index(()))
            shared, lead = in_call.longest(want) if prefixes.enabled else (0, -1)
            later = shared >= prefixes.min_tokens and shared > prefixes.match(want, live(it.tenant), it.tenant)[0]
            wave_of.append(wave_of[lead] + 1 if later else 0)
            in_call.add(i, want)
            if wave_of[i] == len(waves):
                waves.append([])
            waves[wave_of[i]].append((it, prompt))
        hidden_of: dict[str, torch.Tensor] = {}  # request id -> its prompt's hidden states
        for group in waves:
            todo = []
            for it, prompt in group:
                slot, held = prefixes.acquire(prompt[:-1], live(it.tenant), need_of[it.request_id], it.tenant)
                r = self.requests[it.request_id] = _TargetRequest(
                    slot, prompt, it.params, int(it.seed), it.coupling, bool(it.hidden_layers), it.tenant
                )
                if r.returns_hidden and held:  # its hidden states are computed, not only its K/V: the whole prompt
                    self.group.local(("rollback", slot, 0))
                    held = 0
                if held < len(prompt) - 1:
                    todo.append((r, held, it.request_id))
            if todo:
                self.group.forward(
                    [r.slot for r, _, _ in todo], [r.seq[held:-1] for r, held, _ in todo], [0] * len(todo)
                )
                for row, (r, _, rid) in enumerate(todo):
                    if r.returns_hidden:
                        hidden_of[rid] = self.runner.last_hidden[row, : len(r.seq) - 1]  # [n - 1, nD]
            for it, prompt in group:
                live(it.tenant).add(self.requests[it.request_id].slot, prompt[:-1])
        out = [
            Prefilled(it.request_id, hidden_of.get(it.request_id, self._no_hidden()) if it.hidden_layers else None)
            for it in items
        ]
        return out, CallTiming({"prefill": now() - t0})

    def _check_hidden_layers(self, layers, field: str) -> None:
        """A request may ask for the hidden states this target keeps (runner.hidden_layers), or none."""
        if layers and tuple(layers) != self.runner.hidden_layers:
            kept = self.runner.hidden_layers
            raise FailedPrecondition(
                field,
                f"asks for the hidden states of layers {tuple(layers)}; this target keeps "
                + (f"layers {kept}" if kept else "none (its drafts use no EAGLE-3 head)"),
            )

    def _no_hidden(self) -> torch.Tensor:  # [0, nD]: a one-token prompt has no position before its last
        return torch.zeros(0, self.hidden_width, dtype=self.runner.dtype, device=self.runner.device)

    def verify(self, items: list[VerifyItem]) -> tuple[list[Verified], CallTiming]:
        with self.group.watched("verify", sum(1 + (len(it.proposal.token_ids) if it.proposal else 0) for it in items)):
            return self._verify(items)

    def _verify(self, items: list[VerifyItem]) -> tuple[list[Verified], CallTiming]:
        self._check_leader()
        check_request_ids([it.request_id for it in items])
        if not items:
            return [], CallTiming()
        reqs, drafts, qs = self._check_verify(items)
        bsz = len(reqs)
        nd = [len(d) for d in drafts]

        t0 = now()
        order = sorted(range(bsz), key=lambda b: reqs[b].slot)  # slot order: contiguous slots attend through views
        batch = VerifyBatch(
            [(len(r.seq), r.params, r.seed, r.coupling) for r in reqs],
            drafts,
            order,
            [q is not None for q in qs],
            self.vocab_size,
        )
        logits = self.group.forward(
            [reqs[b].slot for b in order],
            [[reqs[b].seq[-1]] + drafts[b] for b in order],
            [nd[b] + 1 for b in order],
            packed=True,
            extra=batch.words(),
        )  # [N, V]: each request's nd + 1 rows, slot order, on the model's device
        states = self.runner.last_hidden  # [B, K+1, nD] in slot order, or None
        t1 = now()
        decision = batch.decide(logits, self.runner.last_extra, qs)  # the step's one copy to the host
        bad_q = next(((b, jv) for b, jv in enumerate(decision.bad_q) if jv is not None), None)
        if bad_q is not None:
            b, (j, v) = bad_q
            self._undo_forward(reqs)
            raise InvalidArgument(
                f"items[{b}].draft_probs[{j}].values",
                f"drafted token {drafts[b][j]} has probability {v:g} in its q: it cannot have been sampled from it",
            )
        if any(decision.unusable):
            self._refuse_unusable(items, reqs, nd, decision.unusable.index(1))
        n_acc, final = decision.num_accepted, decision.final
        t2 = now()

        out = []
        row = {b: i for i, b in enumerate(order)}
        for b, (it, r) in enumerate(zip(items, reqs)):
            prev = len(r.seq)
            self.group.local(("rollback", r.slot, prev + n_acc[b]))  # last token + accepted drafts stay cached
            r.seq.extend(drafts[b][: n_acc[b]])
            r.seq.append(final[b])
            kept = states[row[b], : n_acc[b] + 1] if r.returns_hidden else None  # [n_acc + 1, nD]
            out.append(Verified(it.request_id, n_acc[b], final[b], decision.logprobs.get(b), kept))
        return out, CallTiming({"forward": t1 - t0, "sampling": t2 - t1, "cache": now() - t2})

    def _undo_forward(self, reqs: list[_TargetRequest]) -> None:
        """Every request's cache back to all but its last token, as before the call."""
        for r in reqs:
            self.group.local(("rollback", r.slot, len(r.seq) - 1))

    def _refuse_unusable(self, items: list[VerifyItem], reqs: list[_TargetRequest], nd: list[int], b: int) -> None:
        """Item b's logits cannot be sampled: undo the forward and fail the call naming item b."""
        self._undo_forward(reqs)
        at = len(reqs[b].seq)
        raise NonFiniteLogits(
            f"items[{b}]",
            f"the target's logits for request {items[b].request_id!r} at sequence "
            f"positions {at}..{at + nd[b]} contain NaN or leave no positive finite probability: "
            "no token can be sampled",
        )

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
                    f"items[{i}].seq_len", f"is {it.seq_len}; request {it.request_id!r} holds {len(r.seq)} tokens"
                )
            p = it.proposal
            d = check_token_ids(p.token_ids, self.vocab_size, f"items[{i}].draft_token_ids") if p else []
            if len(r.seq) + len(d) + 1 > self.max_model_len:
                raise InvalidArgument(
                    f"items[{i}].draft_token_ids",
                    f"{len(d)} draft tokens after {len(r.seq)} would pass the context limit {self.max_model_len}",
                )
            q = None
            if p is not None and p.wire is not None:
                if len(p.wire) != len(d):
                    raise InvalidArgument(
                        f"items[{i}].draft_probs", f"has {len(p.wire)} entries for {len(d)} draft tokens"
                    )
                if d and any(m.format != ONE_HOT for m in p.wire):  # all one-hot: no tensor needed
                    q = torch.stack(
                        [
                            decode_distribution(m, self.vocab_size, t, f"items[{i}].draft_probs[{j}]")
                            for j, (m, t) in enumerate(zip(p.wire, d))
                        ]
                    )
            elif p is not None and p.q is not None:
                if tuple(p.q.shape) != (len(d), self.vocab_size):
                    raise InvalidArgument(
                        f"items[{i}].draft_probs", f"has shape {tuple(p.q.shape)}, want ({len(d)}, {self.vocab_size})"
                    )
                q = p.q.float()  # stays where the drafter made it
            reqs.append(r)
            drafts.append(d)
            qs.append(q)
        return reqs, drafts, qs

    def release(self, request_ids: list[str]) -> None:
        with self.group.watched("release", 0):
            self._release(request_ids)

    def _release(self, request_ids: list[str]) -> None:
        self._check_leader()
        for rid in request_ids:
            r = self.requests.pop(rid, None)
            if r is None:
                self.released_unknown.add(rid)
            else:  # kept for later prompts that start the same way, or freed
                self.prefixes.release(r.slot, r.seq[:-1], r.tenant)
        if not self.requests:  # going idle: the followers free their slots now too
            self.group.flush()

    # ------------------------------------------------------------ introspection
    def prefix_kv(self, request_id: str) -> tuple[KVCache, int] | None:
        """Where a request's K/V sit on this rank: (cache, slot), or None for an unknown request.

        A drafter core over a copy of the target (same cache layout) copies a prompt's K/V from
        here instead of computing them (its ``prefix_source``, :mod:`specdist.cores.draft`)."""
        r = self.requests.get(request_id)
        return (self.cache, r.slot) if r is not None else None

    def kv_slots_in_use(self) -> int:
        """Slots held by requests (retained prefixes aside: they are evicted on demand)."""
        return self.cache.num_used - len(self.prefixes.retained)

    def health(self) -> dict:
        hung = self.group.hung()
        return {
            "ok": not self.closed and not self.group.broken and not hung,
            "broken": self.group.broken or hung,
            "collective_timeout_s": self.group.timeout_s or None,
            "rank": self.rank,
            "world_size": self.world_size,
            "requests": len(self.requests),
            "kv_slots_in_use": self.kv_slots_in_use(),
            "kv_slots_total": self.cache.num_slots,
            **{f"kv_{k}": v for k, v in self.cache.usage().items()},  # kv_blocks_total, kv_blocks_used, kv_block_size
            "kv_slots_cached": len(self.prefixes.retained),
            "prefix_reused_tokens": self.prefixes.reused_tokens,
            "vocab_size": self.vocab_size,
            "max_model_len": self.max_model_len,
        }


class LocalVerifier(LocalTransport):
    """The verifier transport for a core in this process."""

    def __init__(self, core: VerifierCore):
        super().__init__(core, "target")
        self.vocab_size = core.vocab_size

    def prefill(self, items: list[StartItem]) -> tuple[list[Prefilled], CallTiming]:
        return call_local(self.core.prefill, items)

    def verify(self, items: list[VerifyItem]) -> tuple[list[Verified], CallTiming]:
        return call_local(self.core.verify, items)
