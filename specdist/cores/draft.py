"""The drafting core: keeps the requests and their KV slots, and asks its draft method for proposals.

:class:`DrafterCore` takes and returns the dataclasses of :mod:`specdist.transport.protocol`. The in-process
engine calls it directly (:class:`LocalDrafter`); a draft worker hosts the same class behind gRPC
(``workers/draft_worker.py``). What it drafts with is a proposer (:mod:`specdist.cores.proposers`, one module a
``draft.method``: model and self drafts, n-gram, suffix, hybrid, EAGLE-3); the core validates every call before
changing anything, keeps each request's committed tokens, sampling settings, seed and last proposal
(:class:`~specdist.cores.proposers.base.DraftRequest`), and gives the requests slots of the proposer's KV cache
with prompt K/V shared across requests (:class:`~specdist.models.kv.prefix.PrefixCache`).

:func:`build_drafter_core` is the one place that turns a ``draft:`` config into a core, and
:func:`load_draft_model` the one that loads what it drafts with (each method's ``load``, from the config's
models resolved once: :class:`~specdist.models.metadata.ModelSources`); the engine and the draft worker actor
both call them. :func:`warm_up_drafter` is a draft worker's warm-up before it serves.

In process ``start`` runs no draft forward: a self draft copies the target's prompt K/V, and any other prompt
is prefilled by the request's first draft pass, so a request that never drafts (the length rule gave it k = 0
throughout) costs the drafter nothing but its slot (``defer_prefill=True``, what the engine builds). A draft
worker prefills in ``start``, where its call deadline scales with the prompt. ``propose`` first commits what
the target kept (``num_accepted`` of the last proposal, then ``new_token_ids``), the proposer rolling its cache
back to the accepted prefix in O(1), then drafts ``num_tokens`` tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from specdist.clock import now
from specdist.config import DraftConfig
from specdist.cores.proposers import proposer_class
from specdist.cores.proposers.base import BuildContext, DraftRequest, Proposer
from specdist.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound
from specdist.models.kv.base import KVCache
from specdist.models.kv.options import KVOptions
from specdist.models.kv.prefix import PrefixCache
from specdist.sampling_params import SamplingParams
from specdist.transport.checks import ReleasedUnknown, check_prompt, check_request_ids, check_token_ids
from specdist.transport.protocol import CallTiming, LocalTransport, Proposal, ProposeItem, StartItem, call_local

if TYPE_CHECKING:
    from specdist.models.metadata import ModelSources

# where the prompt K/V of a request already sit: (cache, slot) or None
PrefixSource = Callable[[str], "tuple[KVCache, int] | None"]
# K/V positions a draft may hold past a request's prompt and max_tokens: a proposal of up to 64 tokens
# (draft.num_speculative_tokens' bound), a guess and a prepared proposal after it (draft_pipeline)
DRAFT_AHEAD = 2 * 64 + 2


class DrafterCore:
    """Not thread-safe: one call at a time."""

    def __init__(
        self,
        proposer: Proposer,
        max_model_len: int,
        prefix_source: PrefixSource | None = None,
        defer_prefill: bool = False,
    ):
        self.proposer = proposer
        self.vocab_size = int(proposer.vocab_size)
        self.max_model_len = max_model_len
        self.prefix_source = prefix_source
        # prompt K/V shared across requests (a released slot is kept until needed), where the method allows
        cache = proposer.cache
        self.prefixes = PrefixCache(cache, enabled=proposer.shares_prefixes) if cache is not None else None
        self.requests: dict[str, DraftRequest] = {}
        self.released_unknown = ReleasedUnknown()  # refuses a start that arrives after its release
        # True (the in-process engine): a prompt's K/V wait for the request's first draft. False: start
        # prefills them (a draft worker: its Start deadline scales with the prompt, Propose's does not)
        self.defer_prefill = defer_prefill

    @property
    def method(self) -> str:
        return self.proposer.method

    @property
    def runner(self):
        """The causal LM the method drafts with (model, self and hybrid drafts), else None."""
        return self.proposer.runner

    @property
    def hidden_layers(self) -> tuple[int, ...]:
        return self.proposer.hidden_layers

    @property
    def hidden_width(self) -> int:
        """Values per position of the target's hidden states it drafts from (eagle3), else 0."""
        return self.proposer.hidden_width

    @property
    def cache(self) -> KVCache | None:
        return self.proposer.cache

    # ------------------------------------------------------------ calls
    def start(self, items: list[StartItem]) -> CallTiming:
        check_request_ids([it.request_id for it in items])
        self.released_unknown.refuse([it.request_id for it in items])
        parsed = []
        for i, it in enumerate(items):
            if it.request_id in self.requests:
                raise AlreadyExists(f"items[{i}].request_id", f"request {it.request_id!r} is already started")
            parsed.append(
                (it, check_prompt(it.prompt_ids, self.vocab_size, self.max_model_len, f"items[{i}].prompt_token_ids"))
            )
            self.proposer.check_start(it, f"items[{i}]")
        cache = self.cache
        # the most K/V a request holds: prompt, max_tokens and what a pipelined drafter drafts ahead of them
        need = {
            it.request_id: min(self.max_model_len, len(prompt) + it.params.max_tokens + DRAFT_AHEAD)
            for it, prompt in parsed
        }
        if cache is not None:
            self.prefixes.check_room(list(need.values()))
        t0 = now()
        # the K/V each running request's slot holds: its committed tokens up to the slot's length, per share of the
        # prefix cache (a tenant's, or everyone's)
        lives: dict[str, object] = {}

        def live(tenant: str):
            key = self.prefixes.key(tenant)
            if key not in lives:
                lives[key] = self.prefixes.live_index(
                    (q.slot, q.seq[: cache.lengths[q.slot]])
                    for q in self.requests.values()
                    if q.slot is not None and self.prefixes.key(q.tenant) == key
                )
            return lives[key]

        computed = []
        for it, prompt in parsed:
            r = DraftRequest(prompt, it.params, int(it.seed), coupling=it.coupling, tenant=it.tenant)
            if cache is not None:
                # prompt K/V another cache of the same layout already holds (self drafts), else those this cache
                # holds (PrefixCache), else computed
                src = self.prefix_source(it.request_id) if self.prefix_source is not None and len(prompt) > 1 else None
                if src is not None and cache.same_layout(src[0]) and src[0].lengths[src[1]] >= len(prompt) - 1:
                    r.slot = self.prefixes.allocate(need[it.request_id])
                    cache.copy_prefix(src[0], src[1], r.slot, len(prompt) - 1)
                else:
                    r.slot, held = self.prefixes.acquire(prompt[:-1], live(r.tenant), need[it.request_id], r.tenant)
                    if held < len(prompt) - 1:
                        computed.append(r)
            self.proposer.start(r)
            self.requests[it.request_id] = r
        # Deferred: the other prompts' K/V are computed at the request's first draft pass, so a request the length
        # rule never gives a draft (k = 0) costs no draft forward at all.
        if computed and not self.defer_prefill:
            self.proposer.prefill(computed)
        return CallTiming({"prefill": now() - t0})

    def propose(self, items: list[ProposeItem]) -> tuple[list[Proposal], CallTiming]:
        """Commit what the target kept, then draft. Timing: "draft", and "prefill" for prompts whose
        K/V this call computed first (a request's first draft), which the draft-cost fits leave out."""
        plan = self.validate_propose(items)
        t0 = now()
        self.proposer.catch_up_s = 0.0
        for it, (r, n_acc, new, _) in zip(items, plan):
            self.commit(r, n_acc, new, hidden=it.hidden)
        proposals = self.draft(items, [p[0] for p in plan], [p[3] for p in plan])
        prefill = self.proposer.catch_up_s
        phases = {"draft": now() - t0 - prefill} | ({"prefill": prefill} if prefill else {})
        return proposals, CallTiming(phases)

    def validate_propose(self, items: list[ProposeItem]) -> list[tuple[DraftRequest, int, list[int], int]]:
        """Validate a whole Propose call, changing nothing: (request, num_accepted, new tokens, k) per item."""
        check_request_ids([it.request_id for it in items])
        plan = []
        for i, it in enumerate(items):
            r = self.requests.get(it.request_id)
            if r is None:
                raise NotFound(f"items[{i}].request_id", f"unknown request {it.request_id!r}")
            if not 0 <= it.num_accepted <= len(r.proposal):
                raise InvalidArgument(
                    f"items[{i}].num_accepted", f"is {it.num_accepted}; the last proposal had {len(r.proposal)} tokens"
                )
            new = check_token_ids(it.new_token_ids, self.vocab_size, f"items[{i}].new_token_ids")
            seq_len = len(r.seq) + it.num_accepted + len(new)
            if it.seq_len != seq_len:
                raise FailedPrecondition(
                    f"items[{i}].seq_len", f"is {it.seq_len}; request {it.request_id!r} would hold {seq_len} tokens"
                )
            if it.num_tokens < 0 or (it.num_tokens and seq_len + it.num_tokens + 1 > self.max_model_len):
                raise InvalidArgument(
                    f"items[{i}].num_tokens",
                    f"{it.num_tokens} draft tokens after {seq_len} would pass the context limit {self.max_model_len}",
                )
            self.proposer.check_propose(r, it.hidden, seq_len, f"items[{i}].hidden")
            plan.append((r, int(it.num_accepted), new, int(it.num_tokens)))
        return plan

    def commit(
        self,
        r: DraftRequest,
        n_acc: int,
        new: list[int],
        prepared: list[int] | None = None,
        hidden: torch.Tensor | None = None,
    ) -> None:
        """Keep ``n_acc`` tokens of the last proposal and the target's ``new`` tokens after them.

        ``prepared``: drafts after exactly that sequence whose K/V the cache already holds (a pipelined
        preparation whose assumed prefix held, :mod:`specdist.cores.draft_pipeline`); they become the request's
        proposal, and the cache keeps them as after drafting them (all but the last). ``hidden``: eagle3, the
        target's states of the positions committed (``ProposeItem.hidden``)."""
        prev = len(r.seq)
        kept = r.proposal[:n_acc] + new
        r.seq.extend(kept)
        r.proposal = list(prepared) if prepared is not None else []
        self.proposer.commit(r, kept, n_acc, prev, prepared, hidden)

    def draft(self, items: list[ProposeItem], reqs: list[DraftRequest], ks: list[int]) -> list[Proposal]:
        """Draft ``ks[b]`` tokens after each request's committed sequence; they become its proposal."""
        drafts = self.proposer.propose(reqs, ks)
        for r, d in zip(reqs, drafts):
            r.proposal = list(d.tokens)
        return [Proposal(it.request_id, d.tokens, d.q, match_lengths=d.match_lengths) for it, d in zip(items, drafts)]

    def draft_ahead(
        self, reqs: list[DraftRequest], ks: list[int], gate: Callable[[int], bool] | None = None, each_pass=None
    ):
        """The proposer's drafts of each request's next step before the target verified this one
        (:meth:`specdist.cores.proposers.model.ModelProposer.draft_ahead`)."""
        return self.proposer.draft_ahead(reqs, ks, gate=gate, each_pass=each_pass)

    def release(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            r = self.requests.pop(rid, None)
            if r is None:
                self.released_unknown.add(rid)
                continue
            if r.slot is not None:  # kept for later prompts that start the same way
                self.prefixes.release(r.slot, r.seq, r.tenant)
            self.proposer.release(r)

    def forget_finished(self) -> None:
        """The method forgets what finished requests left (a suffix index's cached sequences): what follows
        drafts from live requests only, as on a fresh worker."""
        self.proposer.forget_finished()

    # ------------------------------------------------------------ introspection
    def kv_slots_in_use(self) -> int:
        """Slots held by requests (retained prefixes aside: they are evicted on demand)."""
        return self.cache.num_used - len(self.prefixes.retained) if self.cache is not None else 0

    def health(self) -> dict:
        return {
            "ok": True,
            "method": self.method,
            "requests": len(self.requests),
            "kv_slots_in_use": self.kv_slots_in_use(),
            "vocab_size": self.vocab_size,
            "max_model_len": self.max_model_len,
        } | self.proposer.stats()


def load_draft_model(
    dc: DraftConfig,
    sources: ModelSources,
    dtype: str,
    device: torch.device | str = "cpu",
    target: torch.nn.Module | None = None,
    target_tokenizer=None,
):
    """What ``dc.method`` drafts with (its proposer's ``load``), in ``dtype`` on ``device``: a draft model checked
    against the target's vocabulary, the target's own low-precision copy, an EAGLE-3 head; None for the
    model-free methods and ``none``. ``sources``: the config's models, resolved once
    (:func:`specdist.models.metadata.resolve_sources`; nothing here resolves a spec again). ``target``,
    ``target_tokenizer``: the loaded target's, if the caller has them."""
    if dc.method == "none":
        return None
    return proposer_class(dc.method).load(dc, sources, dtype, device, target, target_tokenizer)


def draft_hidden_layers(dc: DraftConfig, sources: ModelSources) -> tuple[tuple[int, ...], int]:
    """The target layers whose hidden states the drafts of ``dc`` read and the values per position they make,
    without loading anything ((), 0 for the methods that read none, which use nothing of ``sources``): what a
    process that holds no draft (the coordinator, a target rank) needs to know of it. Worked out once per
    ``sources`` (kept in ``sources.draft_hidden_layers``)."""
    if dc.method == "none":
        return (), 0
    if dc.method not in sources.draft_hidden_layers:
        sources.draft_hidden_layers[dc.method] = proposer_class(dc.method).hidden_layers_of(dc, sources)
    return sources.draft_hidden_layers[dc.method]


def build_drafter_core(
    dc: DraftConfig,
    vocab_size: int,
    max_batch_size: int,
    max_model_len: int,
    model=None,
    prefix_source: PrefixSource | None = None,
    defer_prefill: bool = False,
    prefix_caching: bool = True,
    kv_cache_dtype: str = "auto",
    kv: KVOptions | None = None,
    prefix_scope: str = "shared",
) -> DrafterCore | None:
    """The drafter core of a ``draft:`` config section (None for method ``none``).

    ``model``: what :func:`load_draft_model` loaded for the methods that draft with one. ``prefix_source``:
    where the target's prompt K/V sit, for a copy of the target (same layout) to take instead of its own
    prefill. ``defer_prefill``: compute a prompt's K/V at its first draft instead of in ``start``.
    ``prefix_caching``: reuse prompt K/V across requests (``engine.prefix_caching``), within a tenant or across
    them (``prefix_scope``, ``engine.prefix_cache_scope``). ``kv_cache_dtype``: a model draft's KV cache
    elements (``engine.kv_cache_dtype``); ``kv``: its layout (``engine.kv_cache``)."""
    if dc.method == "none":
        return None
    ctx = BuildContext(vocab_size, max_batch_size, max_model_len, model, kv_cache_dtype, kv)
    core = DrafterCore(proposer_class(dc.method).build(dc, ctx), max_model_len, prefix_source, defer_prefill)
    if core.prefixes is not None and core.proposer.shares_prefixes:
        core.prefixes.enabled = prefix_caching
        core.prefixes.scope = prefix_scope
    return core


WARMUP_ID = "__specdist_warmup__"  # the request id of a worker's warm-up calls (draft and target)


def warm_up_drafter(core, k: int) -> None:
    """One short greedy Start / Propose (up to ``k`` tokens) / Release on ``core`` (a
    :class:`DrafterCore`, or a DraftPipeline around one): first-call costs are paid before
    serving, and the core holds nothing of it afterwards."""
    sp = SamplingParams(temperature=0.0, max_tokens=2)
    prompt = [0, 1 % core.vocab_size]
    layers = core.hidden_layers
    # an EAGLE-3 head drafts from the target's states of the prompt: zeros stand in for them
    hidden = torch.zeros(len(prompt) - 1, core.hidden_width) if layers else None
    try:
        core.start([StartItem(WARMUP_ID, prompt, sp, 1, hidden_layers=layers)])
        n = max(0, min(k, core.max_model_len - len(prompt) - 1))
        core.propose([ProposeItem(WARMUP_ID, 0, [], n, len(prompt), hidden=hidden)])
    finally:
        core.release([WARMUP_ID])


class LocalDrafter(LocalTransport):
    """The drafter transport for a core in this process."""

    def __init__(self, core: DrafterCore, name: str = "draft/0"):
        super().__init__(core, name)
        self.hidden_layers = core.hidden_layers

    def start(self, items: list[StartItem]) -> CallTiming:
        return call_local(self.core.start, items)

    def propose(self, items: list[ProposeItem]) -> tuple[list[Proposal], CallTiming]:
        return call_local(self.core.propose, items)

    def close(self) -> None:
        close = getattr(self.core, "close", None)  # a DraftPipeline stops its preparation thread
        if close is not None:
            close()
