"""The drafting core: proposes tokens and returns the exact q each one was sampled from.

:class:`DrafterCore` takes and returns the dataclasses of :mod:`specdist.transport.protocol`. The
in-process engine calls it directly (:class:`LocalDrafter`); a draft worker hosts the same
class behind gRPC (``workers/draft_worker.py``). The methods:

- ``model``: a small causal LM (a separate draft model, or the target's int8 ``self-w8``
  copy) over its own slot KV cache. Each draft token is sampled from the *processed* draft
  distribution (:func:`specdist.cores.sampling.process_logits`, the transform the target applies to
  p) after rounding it to ``r = fp16_exact(q)``, the distribution the wire can carry exactly:
  the proposal reports r, the target verifies against r, so exactness holds on either
  transport and both give the same tokens. Greedy requests have a one-hot q (no tensor).
- ``ngram`` (prompt lookup): the continuation of the latest earlier occurrence of the
  sequence's last n tokens (:class:`specdist.cores.ngram.NgramIndex`); q is one-hot.
- ``suffix`` (SuffixDecoding): the most frequent continuation of the longest suffix that
  occurred before in any sequence of this core, live or recently finished
  (:class:`specdist.cores.suffix.SuffixIndex`, one per core); q is one-hot. Each token carries the
  length of the match it was read after (``Proposal.match_lengths``), which the length rule prices.
- ``eagle3``: an EAGLE-3 head (:mod:`specdist.models.eagle3`) over its own one-layer slot KV
  cache. It drafts from the target's hidden states (three layers' inputs, ``StartItem.hidden_layers``)
  that arrive with each ProposeItem for the positions committed since the last one: position
  ``i`` of the head's cache is computed from the target's fused states at ``i`` and the token at
  ``i + 1``. The first pass of a step feeds every such pair not fed yet (the prompt's at the
  first draft, then ``accepted + 1`` per step); its output at the last committed position gives
  the first draft token, and each further pass feeds the drafted token with the head's own
  output for the position before in place of the target's states, as EAGLE-3 drafts. Those
  positions are rolled back at the next commit, when the target's states replace them.
  Sampling, q and the couplings are those of model drafts; a one-token prompt drafts from its
  second step (the target has no state of it before its first verification).
- ``hybrid``: a model runner (the target's int8 copy) *and* the suffix index. Per request and
  step the suffix draft is taken when its score (expected accepted tokens by the counts) is at
  least ``min(min_score, k)`` (k: the tokens asked for; a score of k means every token certain by
  the counts), otherwise the model drafts. Both choices depend on committed tokens
  only, so they are fixed before verification. A request whose suffix draft was taken skips
  the model: its KV cache catches up on every committed token at its next model pass.

:func:`build_drafter_core` is the one place that turns a ``draft:`` config into a core, and
:func:`load_draft_model` the one that loads the model it drafts with (a draft model checked
against the target's vocabulary by :func:`check_draft_vocab`, or the target's own copy); the
engine and the draft worker actor both call them. :func:`warm_up_drafter` is a draft worker's
warm-up before it serves.

Per request the core keeps the committed token sequence, the SamplingParams, its seed (the
StartItem seed, i.e. ``draft_seed(request seed)``), the tokens of its last proposal and, for
model drafts, a KV slot. In process ``start`` runs no draft forward: a self draft copies the
target's prompt K/V, and any other prompt is prefilled by the request's first draft pass, so a
request that never drafts (the length rule gave it k = 0 throughout) costs the drafter nothing
but its slot (``defer_prefill=True``, what the engine builds). A draft worker prefills in
``start``, where its call deadline scales with the prompt. ``propose`` first commits what the target kept (``num_accepted`` of
the last proposal, then ``new_token_ids``), rolling the cache back to the accepted prefix in
O(1), then drafts ``num_tokens`` tokens. The token at sequence position ``n`` is sampled with
the uniform :func:`~specdist.transport.protocol.draft_uniform` ``(seed, n)``, so the tokens depend on
the positions drafted, not on how often the request drafted before.

With ``confidence_threshold > 0`` a request stops drafting early once the draft's
untempered probability of its latest token is below the threshold (that token is still
proposed). The rule looks only at the draft's own distribution, so the draft length is
fixed before verification and exactness is unaffected.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from specdist.config import DraftConfig, target_copy
from specdist.errors import AlreadyExists, ConfigError, FailedPrecondition, InvalidArgument, NotFound
from specdist.models.eagle3 import Eagle3Head
from specdist.models.kv_cache import PrefixCache, SlotKVCache
from specdist.models.graphs import KVOptions
from specdist.models.runner import CausalLMRunner
from specdist.cores.ngram import NgramIndex
from specdist.cores.device_inputs import HostInputs
from specdist.cores.sampling import SamplingRows, process_rows, sample_from
from specdist.sampling_params import SamplingParams
from specdist.cores.coupling import gumbel_argmax, row_starts
from specdist.cores.suffix import SuffixIndex, SuffixIndexes, SuffixSettings, SuffixState
from specdist.transport.protocol import (
    CallTiming,
    Proposal,
    ProposeItem,
    ReleasedUnknown,
    StartItem,
    check_prompt,
    check_request_ids,
    LocalTransport,
    check_token_ids,
    draft_uniform,
    now,
)
from specdist.transport.wire import fp16_exact

# where the prompt K/V of a request already sit: (cache, slot) or None
PrefixSource = Callable[[str], "tuple[SlotKVCache, int] | None"]
# unseen tokens a draft pass feeds per row; more (a prompt's first draft) go through a forward first
CATCH_UP_IN_PASS = 2
# K/V positions a draft may hold past a request's prompt and max_tokens: a proposal of up to 64 tokens
# (draft.num_speculative_tokens' bound), a guess and a prepared proposal after it (draft_pipeline)
DRAFT_AHEAD = 2 * 64 + 2


@dataclass
class DraftRequest:
    """One request's state on a :class:`DrafterCore` (its ``requests``), changed only by the core's methods."""

    seq: list[int]  # committed tokens (prompt + output)
    params: SamplingParams
    seed: int  # draft_uniform(seed, n) samples the token at position n (gumbel: keys the noise)
    coupling: str = "rejection"  # gumbel: tokens are argmax log q + G, and no q goes to the target
    slot: int | None = None  # model drafts: KV slot holding a prefix of seq (+ stale drafts)
    index: NgramIndex | None = None  # n-gram drafts: lookup table over seq
    suffix: SuffixState | None = None  # suffix / hybrid drafts: seq's place in its tenant's suffix index
    suffix_index: SuffixIndex | None = None  # that index
    tenant: str = ""  # whose request it is (StartItem.tenant)
    # eagle3: the target's hidden states not fed to the head yet ([m, nD] each, positions fed .. len(seq) - 2)
    states: list = field(default_factory=list)
    fed: int = 0  # eagle3: positions whose head K/V come from the target's states (0 .. fed - 1)
    last_feat: object = None  # eagle3: [H] the head's output at the last position it drafted (pipelined drafting)
    proposal: list[int] = field(default_factory=list)  # tokens of the last proposal


@dataclass
class _Drafting:
    """The state of one :meth:`DrafterCore._draft_model` call, per request b."""

    reqs: list[DraftRequest]
    ahead: list[list[int]]  # tokens assumed after the committed sequence
    base: list[int]  # sequence position of the first token drafted (the guess, if any)
    passes: list[int]  # draft passes (the guess's included); shortened by the confidence threshold
    guess: bool
    toks: list[list[int]]
    rows_q: list[list[torch.Tensor]]  # [V] rows of the sampled tokens, on the device
    guesses: list[int | None]
    feats: list = field(default_factory=list)  # eagle3: [H] the head's output at each row's last fed position


class DrafterCore:
    """Not thread-safe: one call at a time."""

    def __init__(self, runner: CausalLMRunner | None, vocab_size: int, max_model_len: int,
                 confidence_threshold: float = 0.0, ngram: tuple[int, int] | None = None,
                 prefix_source: PrefixSource | None = None, suffix: SuffixSettings | None = None,
                 defer_prefill: bool = False, head: Eagle3Head | None = None, max_batch_size: int = 0):
        kinds = (runner is not None, ngram is not None, suffix is not None, head is not None)
        if kinds not in ((True, False, False, False), (False, True, False, False), (False, False, True, False),
                         (True, False, True, False), (False, False, False, True)):
            raise ValueError("a drafter has a model runner, n-gram settings, suffix settings, a runner and "
                             "suffix settings (hybrid), or an EAGLE-3 head")
        self.runner = runner
        self.head = head
        # eagle3: the head's K/V (one layer), and the target layers whose hidden states it drafts from
        self.head_cache = head.new_cache(max_batch_size, max_model_len) if head is not None else None
        self.hidden_layers: tuple[int, ...] = tuple(head.spec.aux_layers) if head is not None else ()
        self.ngram = ngram
        self.suffix_settings = suffix
        # one suffix index a tenant (or one shared: suffix_scope), each request holding its own's
        self.suffix = SuffixIndexes(suffix) if suffix is not None else None
        self.drafts_by_source = {"suffix": 0, "model": 0}  # hybrid: request steps drafted by each
        self.vocab_size = int(vocab_size)
        self.max_model_len = max_model_len
        self.confidence_threshold = confidence_threshold
        # rejection coupling: sample from (and send) only the q's top q_top_k tokens, renormalised, so a
        # drafted token's q costs at most 6 * q_top_k bytes on the wire whatever the vocabulary (0: all)
        self.q_top_k = 0
        self.prefix_source = prefix_source
        # model drafts: prompt K/V shared across requests (a released slot is kept until needed)
        # (eagle3: off; a head's K/V need the target's states of every prompt position, which come with it)
        self.prefixes = PrefixCache(self.cache, enabled=head is None) if self.cache is not None else None
        self.requests: dict[str, DraftRequest] = {}
        self.released_unknown = ReleasedUnknown()  # refuses a start that arrives after its release
        self.catch_up_s = 0.0  # seconds of prompt K/V computed by _catch_up since the last propose began
        # True (the in-process engine): a prompt's K/V wait for the request's first draft. False: start
        # prefills them (a draft worker: its Start deadline scales with the prompt, Propose's does not)
        self.defer_prefill = defer_prefill

    @classmethod
    def from_model(cls, model: torch.nn.Module, max_batch_size: int, max_model_len: int,
                   confidence_threshold: float = 0.0, prefix_source: PrefixSource | None = None,
                   defer_prefill: bool = False, kv_cache_dtype: str = "auto",
                   kv: KVOptions | None = None) -> "DrafterCore":
        """A model draft (``specdist.models.fusion.quantized_copy(target)`` for self-w8); ``kv``: its cache's layout."""
        runner = CausalLMRunner(model, max_batch_size, max_model_len, kv_cache_dtype=kv_cache_dtype, kv=kv)
        return cls(runner, runner.vocab_size, max_model_len, confidence_threshold, prefix_source=prefix_source,
                   defer_prefill=defer_prefill)

    @classmethod
    def from_head(cls, head: Eagle3Head, max_batch_size: int, max_model_len: int,
                  confidence_threshold: float = 0.0) -> "DrafterCore":
        """An EAGLE-3 head (:func:`specdist.models.eagle3.load_eagle3_head`) drafting over the target's vocabulary."""
        return cls(None, head.spec.vocab_size, max_model_len, confidence_threshold, head=head,
                   max_batch_size=max_batch_size)

    @classmethod
    def from_ngram(cls, vocab_size: int, max_model_len: int, ngram_min: int = 1, ngram_max: int = 3) -> "DrafterCore":
        return cls(None, vocab_size, max_model_len, ngram=(ngram_min, ngram_max))

    @classmethod
    def from_suffix(cls, vocab_size: int, max_model_len: int, settings: SuffixSettings | None = None) -> "DrafterCore":
        return cls(None, vocab_size, max_model_len, suffix=settings or SuffixSettings())

    @classmethod
    def hybrid(cls, model: torch.nn.Module, max_batch_size: int, max_model_len: int,
               settings: SuffixSettings | None = None, confidence_threshold: float = 0.0,
               prefix_source: PrefixSource | None = None, defer_prefill: bool = False,
               kv_cache_dtype: str = "auto", kv: KVOptions | None = None) -> "DrafterCore":
        """A model draft (the target's self-w8 copy) and the suffix index, chosen per request and step."""
        runner = CausalLMRunner(model, max_batch_size, max_model_len, kv_cache_dtype=kv_cache_dtype, kv=kv)
        return cls(runner, runner.vocab_size, max_model_len, confidence_threshold, prefix_source=prefix_source,
                   suffix=settings or SuffixSettings(), defer_prefill=defer_prefill)

    @property
    def method(self) -> str:
        if self.head is not None:
            return "eagle3"
        if self.suffix is not None:
            return "suffix" if self.runner is None else "hybrid"
        return "ngram" if self.runner is None else "model"

    @property
    def hidden_width(self) -> int:
        """Values per position of the target's hidden states it drafts from (eagle3), else 0."""
        return len(self.hidden_layers) * self.head.spec.target_hidden_size if self.head is not None else 0

    @property
    def cache(self) -> SlotKVCache | None:
        return self.runner.cache if self.runner is not None else self.head_cache

    # ------------------------------------------------------------ calls
    def start(self, items: list[StartItem]) -> CallTiming:
        check_request_ids([it.request_id for it in items])
        self.released_unknown.refuse([it.request_id for it in items])
        parsed = []
        for i, it in enumerate(items):
            if it.request_id in self.requests:
                raise AlreadyExists(f"items[{i}].request_id", f"request {it.request_id!r} is already started")
            parsed.append((it, check_prompt(it.prompt_ids, self.vocab_size, self.max_model_len,
                                            f"items[{i}].prompt_token_ids")))
            if self.head is not None and tuple(it.hidden_layers) != self.hidden_layers:
                raise FailedPrecondition(f"items[{i}].hidden_layers",
                                         f"are {tuple(it.hidden_layers)}; this EAGLE-3 head reads layers "
                                         f"{self.hidden_layers}")
        cache = self.cache
        # the most K/V a request holds: prompt, max_tokens and what a pipelined drafter drafts ahead of them
        need = {it.request_id: min(self.max_model_len, len(prompt) + it.params.max_tokens + DRAFT_AHEAD)
                for it, prompt in parsed}
        if cache is not None:
            self.prefixes.check_room(list(need.values()))
        t0 = now()
        # the K/V each running request's slot holds: its committed tokens up to the slot's length, per share of the
        # prefix cache (a tenant's, or everyone's)
        lives: dict[str, object] = {}

        def live(tenant: str):
            key = self.prefixes.key(tenant)
            if key not in lives:
                lives[key] = self.prefixes.live_index((q.slot, q.seq[:cache.lengths[q.slot]])
                                                      for q in self.requests.values()
                                                      if q.slot is not None and self.prefixes.key(q.tenant) == key)
            return lives[key]

        new = []
        for it, prompt in parsed:
            r = DraftRequest(prompt, it.params, int(it.seed), coupling=it.coupling, tenant=it.tenant)
            if cache is not None:
                new.append((it.request_id, r))
            elif self.ngram is not None:
                r.index = NgramIndex(*self.ngram)
                r.index.extend(prompt)
            if self.suffix is not None:
                r.suffix_index = self.suffix.for_tenant(it.tenant)
                r.suffix = r.suffix_index.start(prompt)  # O(len(prompt) * max_depth)
            self.requests[it.request_id] = r
        computed = []
        for rid, r in new:
            # prompt K/V another cache of the same layout already holds (self drafts), else those this
            # cache holds (PrefixCache), else computed
            src = self.prefix_source(rid) if self.prefix_source is not None and len(r.seq) > 1 else None
            if src is not None and cache.same_layout(src[0]) and src[0].lengths[src[1]] >= len(r.seq) - 1:
                r.slot = self.prefixes.allocate(need[rid])
                cache.copy_prefix(src[0], src[1], r.slot, len(r.seq) - 1)
                continue
            r.slot, held = self.prefixes.acquire(r.seq[:-1], live(r.tenant), need[rid], r.tenant)
            if held < len(r.seq) - 1:
                computed.append(r)
        # Deferred: the other prompts' K/V are computed at the request's first draft pass (_catch_up),
        # so a request the length rule never gives a draft (k = 0) costs no draft forward at all.
        if computed and not self.defer_prefill and self.runner is not None:  # (a head waits for the target's states)
            self.runner.forward([r.slot for r in computed], [r.seq[cache.lengths[r.slot]:-1] for r in computed],
                                [0] * len(computed))
        return CallTiming({"prefill": now() - t0})

    def propose(self, items: list[ProposeItem]) -> tuple[list[Proposal], CallTiming]:
        """Commit what the target kept, then draft. Timing: "draft", and "prefill" for prompts whose
        K/V this call computed first (a request's first draft), which the draft-cost fits leave out."""
        plan = self.validate_propose(items)
        t0 = now()
        self.catch_up_s = 0.0
        for it, (r, n_acc, new, _) in zip(items, plan):
            self.commit(r, n_acc, new, hidden=it.hidden)
        proposals = self.draft(items, [p[0] for p in plan], [p[3] for p in plan])
        prefill = self.catch_up_s
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
                    f"items[{i}].num_accepted", f"is {it.num_accepted}; the last proposal had {len(r.proposal)} tokens")
            new = check_token_ids(it.new_token_ids, self.vocab_size, f"items[{i}].new_token_ids")
            seq_len = len(r.seq) + it.num_accepted + len(new)
            if it.seq_len != seq_len:
                raise FailedPrecondition(
                    f"items[{i}].seq_len", f"is {it.seq_len}; request {it.request_id!r} would hold {seq_len} tokens")
            if it.num_tokens < 0 or (it.num_tokens and seq_len + it.num_tokens + 1 > self.max_model_len):
                raise InvalidArgument(
                    f"items[{i}].num_tokens",
                    f"{it.num_tokens} draft tokens after {seq_len} would pass the context limit {self.max_model_len}")
            if self.head is not None:
                self._check_states(r, it.hidden, seq_len, f"items[{i}].hidden")
            plan.append((r, int(it.num_accepted), new, int(it.num_tokens)))
        return plan

    def _check_states(self, r: DraftRequest, hidden, seq_len: int, field: str) -> None:
        """eagle3: after the commit, the head holds the target's states of every position but the last."""
        have = r.fed + sum(int(x.shape[0]) for x in r.states)
        rows = 0 if hidden is None else int(hidden.shape[0])
        if have + rows != seq_len - 1:
            raise FailedPrecondition(field, f"has the target's hidden states of {rows} positions; the request needs "
                                            f"{seq_len - 1 - have} (states of {have} of its {seq_len - 1} positions "
                                            "before the last are here)")
        width = self.hidden_width
        if hidden is not None and (hidden.dim() != 2 or int(hidden.shape[1]) != width):
            raise InvalidArgument(field, f"has shape {tuple(hidden.shape)}; expected [{rows}, {width}] "
                                         f"({len(self.hidden_layers)} layers x hidden size)")

    def commit(self, r: DraftRequest, n_acc: int, new: list[int], prepared: list[int] | None = None,
               hidden: torch.Tensor | None = None) -> None:
        """Keep ``n_acc`` tokens of the last proposal and the target's ``new`` tokens after them.

        ``prepared``: drafts after exactly that sequence whose K/V the cache already holds (a
        pipelined preparation whose assumed prefix held, :mod:`specdist.cores.draft_pipeline`); they become the
        request's proposal, and the cache keeps them as after drafting them (all but the last).
        ``hidden``: eagle3, the target's states of the positions committed (``ProposeItem.hidden``)."""
        prev = len(r.seq)
        kept = r.proposal[:n_acc] + new
        r.seq.extend(kept)
        r.proposal = list(prepared) if prepared is not None else []
        if hidden is not None and hidden.shape[0]:
            r.states.append(hidden)
        if r.index is not None:
            r.index.extend(kept)
        if r.suffix is not None:
            r.suffix_index.extend(r.suffix, kept)
        if r.slot is not None:
            # the cache holds the accepted drafts, then stale ones: drop those (after a hybrid's suffix
            # proposal it holds a prefix of the old seq: kept as it is); with prepared drafts it holds
            # the committed sequence, then them
            valid = prev + n_acc if prepared is None else len(r.seq) + len(prepared) - 1
            if self.head is not None:
                # position i of the head's cache is (states at i, token i + 1): its drafted positions hold its
                # own states, recomputed from the target's at the next draft (see _head_pass); prepared drafts
                # (a hit) keep them, so that a preparation can continue from there
                valid = r.fed if prepared is None else valid - 1
                if prepared is not None and self.cache.lengths[r.slot] > valid:
                    r.last_feat = None  # cut shorter than prepared: the state after the cut is not kept
            self.cache.rollback(r.slot, min(self.cache.lengths[r.slot], valid))

    def draft(self, items: list[ProposeItem], reqs: list[DraftRequest], ks: list[int]) -> list[Proposal]:
        """Draft ``ks[b]`` tokens after each request's committed sequence; they become its proposal."""
        if self.suffix is not None:
            proposals = self._draft_suffix(items, reqs, ks)
        elif self.runner is None and self.head is None:
            proposals = [Proposal(it.request_id, r.index.lookup(k) if k > 0 else []) for it, r, k in zip(items, reqs, ks)]
        else:
            toks, qs, _ = self._draft_model(reqs, ks)
            proposals = [Proposal(it.request_id, t, q) for it, t, q in zip(items, toks, qs)]
        for r, p in zip(reqs, proposals):
            r.proposal = list(p.token_ids)
        return proposals

    def _draft_suffix(self, items: list[ProposeItem], reqs: list[DraftRequest], ks: list[int]) -> list[Proposal]:
        """Suffix drafts (q one-hot); hybrid: the model drafts the requests whose suffix score is low."""
        st = self.suffix_settings
        drafts = [r.suffix_index.lookup(r.suffix, k, st.min_prob, st.max_spec_factor) if k > 0 else None
                  for r, k in zip(reqs, ks)]
        out = [Proposal(it.request_id, d.tokens, match_lengths=d.depths) if d is not None else Proposal(it.request_id, [])
               for it, d in zip(items, drafts)]
        if self.runner is not None:  # confident: expected accepted >= min_score, or all k tokens certain
            rows = [b for b, (d, k) in enumerate(zip(drafts, ks))
                    if k > 0 and not (d.tokens and d.score >= min(st.min_score, k))]
            self.drafts_by_source["model"] += len(rows)
            self.drafts_by_source["suffix"] += sum(k > 0 for k in ks) - len(rows)
            if rows:
                toks, qs, _ = self._draft_model([reqs[b] for b in rows], [ks[b] for b in rows])
                for b, t, q in zip(rows, toks, qs):
                    out[b] = Proposal(items[b].request_id, t, q)
        return out

    def draft_ahead(self, reqs: list[DraftRequest], ks: list[int], gate: "Callable[[int], bool] | None" = None,
                    each_pass=None) -> tuple[list[list[int]], list[torch.Tensor | None], list[int | None]]:
        """Draft each request's next step before the target has verified its proposal: a guess of
        the target's token after the proposal, then ``ks[b]`` tokens after proposal + guess
        (:mod:`specdist.cores.draft_pipeline`). (tokens, q, guess) per request; ``gate`` and ``each_pass``
        as in :meth:`_draft_model`. The requests' state is unchanged (the cache holds the passes'
        K/V): :meth:`commit` with ``prepared`` takes the tokens once the target kept that prefix."""
        return self._draft_model(reqs, ks, ahead=[list(r.proposal) for r in reqs], guess=True, gate=gate,
                                 each_pass=each_pass)

    def _draft_model(self, reqs: list[DraftRequest], ks: list[int], ahead: list[list[int]] | None = None,
                     guess: bool = False, gate: "Callable[[int], bool] | None" = None, each_pass=None):
        """Sequential draft passes: (tokens, q [n, V] or None, guesses) per request.

        Request b drafts after ``seq + ahead[b]`` (``ahead``: tokens not committed yet, which the
        pipelined drafter assumes the target will keep; default none). With ``guess`` the first
        pass picks the mode of q as a guess of the target's next token (no uniform drawn, not
        part of the tokens; see :mod:`specdist.cores.draft_pipeline`) and the ``ks[b]`` tokens follow it.
        The token at sequence position n is sampled with ``draft_uniform(seed, n)``.
        ``each_pass``: a context manager (a lock) held around every pass; ``gate(b)``, called
        inside it before the pass, drops request b from the remaining passes when it is False.

        Logits processing and sampling run on the model's device and each q stays there; per
        pass only the drafted token ids (and, with a confidence threshold, their confidences)
        come to the host, in one copy.
        """
        bsz = len(reqs)
        ahead = ahead if ahead is not None else [[] for _ in range(bsz)]
        g0 = 1 if guess else 0  # passes before the sampled tokens
        d = _Drafting(
            reqs=reqs,
            ahead=ahead,
            base=[len(r.seq) + len(a) for r, a in zip(reqs, ahead)],
            passes=[k + g0 if k > 0 or guess else 0 for k in ks],
            guess=guess,
            toks=[[] for _ in range(bsz)],
            rows_q=[[] for _ in range(bsz)],
            guesses=[None] * bsz,
        )
        if self.head is not None:
            d.feats = [None] * bsz
            # nothing new to feed (a one-token prompt before its first verification): no drafts; ahead of
            # the target (pipelined): only after a proposal the head drafted whole, its K/V still cached
            d.passes = [p if (bool(a) and self._head_can_continue(r, a) if guess else bool(r.states)) else 0
                        for p, r, a in zip(d.passes, reqs, ahead)]
        alive = [True] * bsz
        held = each_pass if each_pass is not None else contextlib.nullcontext()
        for j in range(max(d.passes, default=0)):
            with held:
                if gate is not None:
                    alive = [alive[b] and gate(b) for b in range(bsz)]
                rows = sorted((b for b in range(bsz) if d.passes[b] > j and alive[b]), key=lambda b: reqs[b].slot)
                if not rows:  # (sorted by slot: contiguous slots are cache views)
                    break
                self._draft_pass(d, j, rows)
        qs = [torch.stack(rq) if rq else None for rq in d.rows_q]  # on the device
        if self.head is not None:
            for r, feat in zip(reqs, d.feats):
                r.last_feat = feat
        return d.toks, qs, d.guesses

    def _head_can_continue(self, r: DraftRequest, ahead: list[int]) -> bool:
        """eagle3: the head can draft after ``seq + ahead`` (the last proposal) without the target's states:
        it drafted that proposal and holds its K/V up to the position before its last token."""
        return (r.last_feat is not None and ahead == r.proposal
                and self.cache.lengths[r.slot] == len(r.seq) + len(ahead) - 2)

    def _draft_pass(self, d: "_Drafting", j: int, rows: list[int]) -> None:
        """Pass j of :meth:`_draft_model` over the requests ``rows`` (indices into ``d.reqs``). What the sampling
        needs from the host rides in the forward's copy (:meth:`_pass_inputs`); the drafted tokens (and, with a
        confidence threshold, their confidences) come back in one copy."""
        reqs = d.reqs
        inputs, plan = self._pass_inputs(d, j, rows)
        if inputs is None:  # every row greedy: its token is the argmax of its logits, nothing to send
            words = None
        if self.head is not None:
            logits = self._head_pass(d, j, rows)
            if inputs is not None:
                words = torch.from_numpy(inputs.words()).to(logits.device)
        else:
            if j == 0:  # everything of seq + ahead the cache has not seen yet (usually 1 or 2 tokens)
                feed = []
                for b in rows:
                    seq, seen = reqs[b].seq, self.cache.lengths[reqs[b].slot]
                    feed.append(seq[seen:] + d.ahead[b][max(0, seen - len(seq)):])
                feed = self._catch_up([reqs[b].slot for b in rows], feed)
            else:
                feed = [[d.toks[b][-1] if d.toks[b] else d.guesses[b]] for b in rows]
            logits = self.runner.forward([reqs[b].slot for b in rows], feed, [1] * len(rows),
                                         extra=inputs.words() if inputs is not None else None)[:, 0]  # [n, V]
            words = self.runner.last_extra
        if inputs is None:
            x = logits.argmax(-1)  # [n]: the one-hot q's token (process_logits' greedy rows)
        else:
            dd = inputs.unpack(words)  # views of the words: int64 indices, float settings and uniforms
            q = process_rows(logits, SamplingRows(dd["temperature"], dd["top_k"], dd["top_p"], dd.get("top_p_rows"),
                                                  **plan["decisions"]))  # [n, V]
            x = q.argmax(-1)  # [n]: greedy rows (one-hot q) and the guesses of rejection-coupled rows
        if plan["coupled"]:  # the token the target takes if its p equals this q: the noise of the same position
            s = dd["coupled"]
            x[s] = gumbel_argmax(q.index_select(0, s), dd["noise_keys"])
        if j == 0 and d.guess:  # the bonus token's position: under gumbel, the target's likeliest pick
            for b, t in zip(rows, x.tolist()):
                d.guesses[b] = t
            return
        sampled = plan["sampled"]
        if sampled:
            s = dd["sampled"]
            r16 = fp16_exact(_top_k_only(q.index_select(0, s), self.q_top_k))  # [m, V]: the q the target will see
            x[s] = sample_from(r16, dd["uniforms"])
            for m, n in enumerate(sampled):
                d.rows_q[rows[n]].append(r16[m])
        if self.confidence_threshold > 0:
            # the draft's untempered (T = 1, unfiltered) probability of its token: greedy rows are judged too
            conf = torch.softmax(logits.float(), -1).gather(-1, x[:, None]).squeeze(-1)  # [n]
            # token ids < 2**53 are exact in float64: ids and confidences come over in one copy
            step = torch.stack([x.double(), conf.double()], 1).tolist()  # [n, 2]
            for b, (t, c) in zip(rows, step):
                d.toks[b].append(int(t))
                if c < self.confidence_threshold:
                    d.passes[b] = j + 1
        else:
            for b, t in zip(rows, x.tolist()):
                d.toks[b].append(t)

    def _pass_inputs(self, d: "_Drafting", j: int, rows: list[int]) -> tuple[HostInputs | None, dict]:
        """What pass j's sampling needs from the host, for the forward's copy: each row's settings, the Gumbel
        noise keys of its coupled rows (T > 0) and the uniforms of its sampled rows (rejection coupling, T > 0),
        and the host's decisions (which stages run, which rows are which). None when every row is greedy."""
        reqs = d.reqs
        params = [reqs[b].params for b in rows]
        if all(p.temperature <= 0 for p in params):
            return None, {"coupled": [], "sampled": []}
        h = HostInputs()
        temp, top_k, top_p = ([p.temperature for p in params], [p.top_k for p in params], [p.top_p for p in params])
        h.add("temperature", temp, np.float32)
        h.add("top_k", top_k, np.int64)
        h.add("top_p", top_p, np.float32)
        decisions = SamplingRows.decisions(temp, top_k, top_p, self.vocab_size)
        top_p_rows = decisions.pop("top_p_rows")
        if top_p_rows:
            h.add("top_p_rows", top_p_rows, np.int64)
        coupled = [n for n, b in enumerate(rows) if reqs[b].params.temperature > 0 and reqs[b].coupling == "gumbel"]
        if coupled:
            h.add("coupled", coupled, np.int64)
            h.add("noise_keys", [row_starts(reqs[rows[n]].seed, [d.base[rows[n]] + j])[0] for n in coupled], np.int64)
        sampled = [] if j == 0 and d.guess else [
            n for n, b in enumerate(rows) if reqs[b].params.temperature > 0 and reqs[b].coupling != "gumbel"]
        if sampled:
            h.add("sampled", sampled, np.int64)
            h.add("uniforms", [draft_uniform(reqs[rows[n]].seed, d.base[rows[n]] + j) for n in sampled], np.float64)
        return h, {"decisions": decisions, "coupled": coupled, "sampled": sampled}

    def _head_pass(self, d: "_Drafting", j: int, rows: list[int]) -> torch.Tensor:  # -> [n, V] float32
        """eagle3, pass j: the head's logits of the next token of each request of ``rows``.

        Pass 0 feeds the positions the head has not had the target's states of: the token after each
        (``seq[fed + 1:]``) with the fused states (``head.fuse``), long rows in a forward of their own
        first (as :meth:`_catch_up`). Later passes feed the last drafted token with the head's own
        output at the position before."""
        reqs, head = d.reqs, self.head
        slots = [reqs[b].slot for b in rows]
        if j == 0 and d.ahead[rows[0]]:  # ahead of the target: the proposal's last token, the head's own state
            inputs = [[d.ahead[b][-1]] for b in rows]
            feats = [reqs[b].last_feat[None] for b in rows]  # [1, H]
        elif j == 0:
            inputs, feats = [], []
            for b in rows:
                r = reqs[b]
                self.cache.rollback(r.slot, r.fed)  # positions past it hold the head's own states (drafts)
                inputs.append(r.seq[r.fed + 1:])
                feats.append(head.fuse(torch.cat(r.states) if len(r.states) > 1 else r.states[0]))  # [m, H]
                r.states = []
                r.fed = len(r.seq) - 1
            long = [n for n, toks in enumerate(inputs) if len(toks) > CATCH_UP_IN_PASS]
            if long:
                t0 = now()
                head.forward(self.cache, [slots[n] for n in long], [inputs[n][:-CATCH_UP_IN_PASS] for n in long],
                             [feats[n][:-CATCH_UP_IN_PASS] for n in long])
                self.catch_up_s += now() - t0
                inputs = [toks[-CATCH_UP_IN_PASS:] for toks in inputs]
                feats = [f[-CATCH_UP_IN_PASS:] for f in feats]
        else:
            inputs = [[d.toks[b][-1] if d.toks[b] else d.guesses[b]] for b in rows]  # (after a guess: the guess)
            feats = [d.feats[b][None] for b in rows]  # [1, H]
        logits, outs = head.forward(self.cache, slots, inputs, feats)  # [n, V], n x [m, H]
        for b, o in zip(rows, outs):
            d.feats[b] = o[-1]
        return logits

    def _catch_up(self, slots: list[int], inputs: list[list[int]]) -> list[list[int]]:
        """Feed all but the last ``CATCH_UP_IN_PASS`` unseen tokens of long rows (a prompt not
        prefilled yet, see ``start``) in a forward of their own, so the draft pass stays decode-sized
        for every row instead of padding each to the longest. Returns what the pass still feeds."""
        long = [n for n, toks in enumerate(inputs) if len(toks) > CATCH_UP_IN_PASS]
        if not long:
            return inputs
        t0 = now()
        self.runner.forward([slots[n] for n in long], [inputs[n][:-CATCH_UP_IN_PASS] for n in long], [0] * len(long))
        self.catch_up_s += now() - t0
        return [toks[-CATCH_UP_IN_PASS:] for toks in inputs]

    def release(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            r = self.requests.pop(rid, None)
            if r is None:
                self.released_unknown.add(rid)
                continue
            if r.slot is not None:  # kept for later prompts that start the same way
                self.prefixes.release(r.slot, r.seq, r.tenant)
            if r.suffix is not None:  # its sequence stays as a cached one (oldest evicted)
                self.suffix.finish(r.suffix_index, r.suffix)

    def forget_finished(self) -> None:
        """A suffix index forgets the finished requests it keeps (``suffix_cache_requests``): what
        follows drafts from live requests only, as on a fresh worker. Other drafts keep nothing."""
        if self.suffix is not None:
            self.suffix.forget_finished()

    # ------------------------------------------------------------ introspection
    def kv_slots_in_use(self) -> int:
        """Slots held by requests (retained prefixes aside: they are evicted on demand)."""
        return self.cache.num_used - len(self.prefixes.retained) if self.cache is not None else 0

    def health(self) -> dict:
        out = {
            "ok": True,
            "method": self.method,
            "requests": len(self.requests),
            "kv_slots_in_use": self.kv_slots_in_use(),
            "vocab_size": self.vocab_size,
            "max_model_len": self.max_model_len,
        }
        if self.suffix is not None:
            s = self.suffix.stats()
            out.update(suffix_nodes=s["nodes"], suffix_cached_requests=s["cached"], suffix_cached_tokens=s["cached_tokens"])
            if self.runner is not None:
                out.update(hybrid_suffix_drafts=self.drafts_by_source["suffix"],
                           hybrid_model_drafts=self.drafts_by_source["model"])
        return out


def suffix_settings(dc: DraftConfig) -> SuffixSettings:
    """The ``draft.suffix_*`` keys of a config."""
    return SuffixSettings(dc.suffix_max_depth, dc.suffix_min_prob, dc.suffix_max_spec_factor,
                          dc.suffix_cache_requests, dc.suffix_cache_tokens, dc.suffix_min_score, dc.suffix_scope)


def _top_k_only(q: torch.Tensor, k: int) -> torch.Tensor:  # [m, V] -> [m, V], rows renormalised
    """q restricted to each row's k largest entries (ties: those topk returns); k = 0: q itself."""
    if k <= 0 or k >= q.shape[-1]:
        return q
    vals, idx = q.topk(k, dim=-1)  # [m, k]
    kept = torch.zeros_like(q).scatter_(-1, idx, vals)
    return kept / kept.sum(-1, keepdim=True)


def load_draft_model(dc: DraftConfig, target_model: str, dtype: str, device: torch.device | str = "cpu",
                     target: torch.nn.Module | None = None, target_tokenizer=None) -> torch.nn.Module | None:
    """The model ``dc.method`` drafts with, in ``dtype`` on ``device``; None for the model-free methods.

    ``model``: the draft model ``dc.model``, refused unless its vocabulary is the target's
    (:func:`check_draft_vocab` against ``target`` and ``target_tokenizer`` when the caller has
    them, else against ``target_model``'s config and tokenizer, read without weights). Self drafts
    (``self-w8``, ``self-w4``, and ``hybrid``'s self-w8): the target's low-precision copy
    (:func:`specdist.models.native.self_draft`) of ``target`` (the loaded target: a self-w4 copy
    of a target already on int4 groups shares its modules) or, without one, of the target loaded
    here: a GGUF file's own blocks for self-w4, the floats (quantized) otherwise. ``eagle3``: the
    head directory ``dc.model`` (:func:`specdist.models.eagle3.load_eagle3_head`), refused unless it
    fits ``target`` (hidden size, vocabulary, layers), in the target's dtype; a head without its own
    embedding shares the target's."""
    from specdist.models.loader import load_model, load_tokenizer, resolve_model

    method = dc.method
    if method == "eagle3":
        return _load_head(dc, target_model, dtype, device, target)
    if method == "model":
        if not dc.model:
            raise ConfigError("draft.model", "method 'model' needs a draft model")
        dsrc = resolve_model(dc.model, "draft.model")
        draft = load_model(dsrc, dtype, device)
        if target is not None:
            vocab = int(target.config.vocab_size)
        else:
            from specdist.models.metadata import model_metadata

            target_tokenizer, vocab, _ = model_metadata(target_model, "target.model")
        check_draft_vocab(draft, vocab, load_tokenizer(dsrc), target_tokenizer)
        return draft
    copy = target_copy(method)
    if copy is None:
        return None
    from specdist.models.native import self_draft

    src = resolve_model(target_model, "target.model")
    if target is None:
        target = load_model(src, dtype, device, weights="native" if copy == "self-w4" else "float")
    return self_draft(target, copy, src.gguf_path)


def draft_hidden_layers(dc: DraftConfig, target_model: str) -> tuple[tuple[int, ...], int]:
    """The target layers whose hidden states the drafts of ``dc`` read and the values per position they
    make: an ``eagle3`` head's (from its config.json and the target's config, no weights; refused as
    :func:`load_draft_model` refuses a head that does not fit), ((), 0) for every other method. What
    a process that holds no head (the coordinator, a target rank) needs to know of it."""
    if dc.method != "eagle3":
        return (), 0
    from specdist.models.eagle3 import check_eagle3_target, read_eagle3_spec
    from specdist.models.loader import resolve_model
    from specdist.models.metadata import model_config

    target_config = model_config(target_model, "target.model")
    spec = read_eagle3_spec(resolve_model(dc.model, "draft.model").directory, target_config)
    check_eagle3_target(spec, target_config)
    return tuple(spec.aux_layers), len(spec.aux_layers) * spec.target_hidden_size


def _load_head(dc: DraftConfig, target_model: str, dtype: str, device, target: torch.nn.Module | None):
    """The EAGLE-3 head of ``dc`` for the target: with ``target`` loaded, in its dtype with its embedding;
    without (a draft worker), in ``dtype`` (the target's, Config.draft_dtype) with the target's config and,
    unless the head embeds tokens itself, the target's input embedding alone (read from its safetensors;
    other checkpoints, GGUF files among them, load the target for it). Its linears run on int8 weights
    where the CPU's Q8 kernel does (:func:`specdist.models.eagle3.quantize_linears`)."""
    from specdist.models.dtypes import resolve_dtype
    from specdist.models.eagle3 import load_eagle3_head, quantize_linears, read_eagle3_spec
    from specdist.models.loader import load_model, resolve_model
    from specdist.models.metadata import model_config
    from specdist.models.sharding import load_input_embedding

    head = resolve_model(dc.model, "draft.model")
    if head.gguf_file is not None:
        raise ConfigError("draft.model", "an EAGLE-3 head is a directory (config.json and its tensors), not a GGUF file")
    if target is not None:
        embedding = target.get_input_embeddings()
        return quantize_linears(load_eagle3_head(head.directory, target.config, embedding, embedding.weight.dtype,
                                                 device))
    src = resolve_model(target_model, "target.model")
    config = model_config(target_model, "target.model")
    torch_dtype = getattr(torch, resolve_dtype(dtype, torch.device(device)))
    embedding = None
    if not read_eagle3_spec(head.directory, config).own_embed:
        embedding = load_input_embedding(src.directory, torch_dtype, device) if src.gguf_file is None else None
        if embedding is None:
            embedding = load_model(src, dtype, device).get_input_embeddings()
    return quantize_linears(load_eagle3_head(head.directory, config, embedding, torch_dtype, device))


def check_draft_vocab(draft: torch.nn.Module, vocab_size: int, draft_tokenizer=None, target_tokenizer=None) -> None:
    """A draft model proposes token ids of the target's vocabulary: the same size and, where both
    tokenizers are known, the same tokens (ConfigError naming ``draft.model`` otherwise)."""
    if int(draft.config.vocab_size) != int(vocab_size):
        raise ConfigError("draft.model",
                          f"vocabulary size {draft.config.vocab_size} differs from the target's {vocab_size}")
    if (draft_tokenizer is not None and target_tokenizer is not None
            and draft_tokenizer.get_vocab() != target_tokenizer.get_vocab()):
        raise ConfigError("draft.model", "tokenizer vocabulary differs from the target's (same size, other tokens)")


def build_drafter_core(dc: DraftConfig, vocab_size: int, max_batch_size: int, max_model_len: int,
                       model: torch.nn.Module | None = None,
                       prefix_source: PrefixSource | None = None, defer_prefill: bool = False,
                       prefix_caching: bool = True, kv_cache_dtype: str = "auto",
                       kv: KVOptions | None = None, prefix_scope: str = "shared") -> DrafterCore | None:
    """The drafter core of a ``draft:`` config section (None for method ``none``).

    ``model``: the loaded draft model for the methods that draft with one: a separate model
    (``model``), the target's low-precision copy (``self-w8`` and other self drafts, and
    ``hybrid``, whose suffix index comes with it). ``prefix_source``: where the target's prompt
    K/V sit, for a copy of the target (same layout) to take instead of its own prefill.
    ``defer_prefill``: compute a prompt's K/V at its first draft instead of in ``start``.
    ``draft.q_top_k`` applies to the core's model drafts under the rejection coupling.
    ``prefix_caching``: reuse prompt K/V across requests (``engine.prefix_caching``). ``kv_cache_dtype``:
    a model draft's KV cache elements (``engine.kv_cache_dtype``); ``kv``: its layout (``engine.kv_cache``)."""
    core = _drafter_core(dc, vocab_size, max_batch_size, max_model_len, model, prefix_source, defer_prefill,
                         kv_cache_dtype, kv)
    if core is not None:
        core.q_top_k = dc.q_top_k
        if core.prefixes is not None and core.head is None:
            core.prefixes.enabled = prefix_caching
            core.prefixes.scope = prefix_scope  # (engine.prefix_cache_scope)
    return core


def _drafter_core(dc, vocab_size, max_batch_size, max_model_len, model, prefix_source, defer_prefill, kv_cache_dtype,
                  kv):
    method = dc.method
    if method == "none":
        return None
    if method == "ngram":
        return DrafterCore.from_ngram(vocab_size, max_model_len, dc.ngram_min, dc.ngram_max)
    if method == "suffix":
        return DrafterCore.from_suffix(vocab_size, max_model_len, suffix_settings(dc))
    if method == "eagle3":
        if model is None:
            raise ConfigError("draft.model", "method 'eagle3' needs the head (load_draft_model)")
        if model.spec.vocab_size != vocab_size:
            raise ConfigError("draft.model", f"the head's vocabulary size {model.spec.vocab_size} differs from the "
                                             f"target's {vocab_size}")
        return DrafterCore.from_head(model, max_batch_size, max_model_len, dc.confidence_threshold)
    if model is None:
        raise ConfigError("draft.method", f"{method!r} needs a draft model")
    check_draft_vocab(model, vocab_size)
    if method == "hybrid":
        return DrafterCore.hybrid(model, max_batch_size, max_model_len, suffix_settings(dc), dc.confidence_threshold,
                                  prefix_source=prefix_source, defer_prefill=defer_prefill,
                                  kv_cache_dtype=kv_cache_dtype, kv=kv)
    return DrafterCore.from_model(model, max_batch_size, max_model_len, dc.confidence_threshold,
                                  prefix_source=prefix_source, defer_prefill=defer_prefill,
                                  kv_cache_dtype=kv_cache_dtype, kv=kv)


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
        return self._call(self.core.start, items)

    def propose(self, items: list[ProposeItem]) -> tuple[list[Proposal], CallTiming]:
        return self._call(self.core.propose, items)

    def close(self) -> None:
        close = getattr(self.core, "close", None)  # a DraftPipeline stops its preparation thread
        if close is not None:
            close()
