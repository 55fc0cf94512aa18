"""EAGLE-3 drafts (``draft.method: eagle3``): a head (:mod:`specdist.models.eagle3`) over its own one-layer KV
cache, drafting from the target's hidden states.

The states (three layers' inputs, ``StartItem.hidden_layers``) arrive with each ProposeItem for the positions
committed since the last one: position ``i`` of the head's cache is computed from the target's fused states at
``i`` and the token at ``i + 1``. The first pass of a step feeds every such pair not fed yet (the prompt's at
the first draft, then ``accepted + 1`` per step); its output at the last committed position gives the first
draft token, and each further pass feeds the drafted token with the head's own output for the position before
in place of the target's states, as EAGLE-3 drafts. Those positions are rolled back at the next commit, when
the target's states replace them. Sampling, q and the couplings are those of model drafts
(:class:`~specdist.cores.proposers.model.ModelProposer`); a one-token prompt drafts from its second step (the
target has no state of it before its first verification). Requests share no prompt K/V: a head's K/V need the
target's states of every prompt position, which come with the request.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specdist.clock import now
from specdist.cores.proposers.base import BuildContext, DraftRequest, register
from specdist.cores.proposers.model import CATCH_UP_IN_PASS, Drafting, ModelProposer
from specdist.errors import ConfigError, FailedPrecondition, InvalidArgument
from specdist.models.eagle3 import Eagle3Head


@dataclass
class HeadState:
    """A request's states on the head."""

    states: list = field(default_factory=list)  # the target's states not fed yet ([m, nD] each, positions fed ..)
    fed: int = 0  # positions whose head K/V come from the target's states (0 .. fed - 1)
    last_feat: object = None  # [H] the head's output at the last position it drafted (pipelined drafting)


@register
class Eagle3Proposer(ModelProposer):
    methods = ("eagle3",)
    runs_in_target_dtype = True  # the hidden states it reads are in the target's dtype
    shares_prefixes = False

    def __init__(
        self,
        head: Eagle3Head,
        max_batch_size: int,
        max_model_len: int,
        confidence_threshold: float = 0.0,
        q_top_k: int = 0,
    ):
        self.head = head
        self.runner = None
        self.cache = head.new_cache(max_batch_size, max_model_len)  # the head's K/V (one layer)
        self.vocab_size = int(head.spec.vocab_size)
        self.hidden_layers = tuple(head.spec.aux_layers)
        self.confidence_threshold = confidence_threshold
        self.q_top_k = q_top_k
        self.catch_up_s = 0.0

    @property
    def hidden_width(self) -> int:
        return len(self.hidden_layers) * self.head.spec.target_hidden_size

    # ------------------------------------------------------------ making one
    @classmethod
    def load(cls, dc, sources, dtype: str, device, target=None, target_tokenizer=None):
        """The head directory ``sources.draft`` (:func:`specdist.models.eagle3.load_eagle3_head`), refused unless
        it fits the target (hidden size, vocabulary, layers): with ``target`` loaded, in its dtype with its
        embedding; without (a draft worker), in ``dtype`` with the target's config (``sources.config()``) and,
        unless the head embeds tokens itself, the target's input embedding alone (read from its safetensors;
        other checkpoints, GGUF files among them, load the target for it). Its linears run on int8 weights
        where the CPU's Q8 kernel does (:func:`specdist.models.eagle3.quantize_linears`)."""
        from specdist.models.dtypes import resolve_dtype
        from specdist.models.eagle3 import load_eagle3_head, quantize_linears, read_eagle3_spec
        from specdist.models.loader import load_model
        from specdist.models.sharding import load_input_embedding

        head = _head_source(sources)
        if target is not None:
            embedding = target.get_input_embeddings()
            return quantize_linears(
                load_eagle3_head(head.directory, target.config, embedding, embedding.weight.dtype, device)
            )
        src = sources.target
        config = sources.config()
        torch_dtype = getattr(torch, resolve_dtype(dtype, torch.device(device)))
        embedding = None
        if not read_eagle3_spec(head.directory, config).own_embed:
            embedding = load_input_embedding(src.directory, torch_dtype, device) if src.gguf_file is None else None
            if embedding is None:
                embedding = load_model(src, dtype, device).get_input_embeddings()
        return quantize_linears(load_eagle3_head(head.directory, config, embedding, torch_dtype, device))

    @classmethod
    def hidden_layers_of(cls, dc, sources) -> tuple[tuple[int, ...], int]:
        """From the head's config.json and the target's config (``sources``), no weights (refused as :meth:`load`
        refuses a head that does not fit): what a process that holds no head (the coordinator, a target rank)
        needs."""
        from specdist.models.eagle3 import check_eagle3_target, read_eagle3_spec

        target_config = sources.config()
        spec = read_eagle3_spec(_head_source(sources).directory, target_config)
        check_eagle3_target(spec, target_config)
        return tuple(spec.aux_layers), len(spec.aux_layers) * spec.target_hidden_size

    @classmethod
    def build(cls, dc, ctx: BuildContext) -> "Eagle3Proposer":
        head = ctx.model
        if head is None:
            raise ConfigError("draft.model", "method 'eagle3' needs the head (load_draft_model)")
        if head.spec.vocab_size != ctx.vocab_size:
            raise ConfigError(
                "draft.model",
                f"the head's vocabulary size {head.spec.vocab_size} differs from the target's {ctx.vocab_size}",
            )
        return cls(head, ctx.max_batch_size, ctx.max_model_len, dc.confidence_threshold, dc.q_top_k)

    # ------------------------------------------------------------ calls
    def check_start(self, item, field: str) -> None:
        if tuple(item.hidden_layers) != self.hidden_layers:
            raise FailedPrecondition(
                f"{field}.hidden_layers",
                f"are {tuple(item.hidden_layers)}; this EAGLE-3 head reads layers {self.hidden_layers}",
            )

    def start(self, r: DraftRequest[HeadState]) -> None:
        r.state = HeadState()

    def prefill(self, reqs: list[DraftRequest]) -> None:
        """Nothing: a head's K/V of the prompt wait for the target's states, which come with the first propose."""

    def check_propose(self, r: DraftRequest[HeadState], hidden, seq_len: int, field: str) -> None:
        """After the commit, the head holds the target's states of every position but the last."""
        h = r.state
        have = h.fed + sum(int(x.shape[0]) for x in h.states)
        rows = 0 if hidden is None else int(hidden.shape[0])
        if have + rows != seq_len - 1:
            raise FailedPrecondition(
                field,
                f"has the target's hidden states of {rows} positions; the request needs "
                f"{seq_len - 1 - have} (states of {have} of its {seq_len - 1} positions "
                "before the last are here)",
            )
        width = self.hidden_width
        if hidden is not None and (hidden.dim() != 2 or int(hidden.shape[1]) != width):
            raise InvalidArgument(
                field,
                f"has shape {tuple(hidden.shape)}; expected [{rows}, {width}] "
                f"({len(self.hidden_layers)} layers x hidden size)",
            )

    def commit(self, r: DraftRequest[HeadState], kept, n_acc: int, prev: int, prepared, hidden) -> None:
        h = r.state
        if hidden is not None and hidden.shape[0]:
            h.states.append(hidden)
        # position i of the head's cache is (states at i, token i + 1): its drafted positions hold its own states,
        # recomputed from the target's at the next draft (pass_logits); prepared drafts (a hit) keep them, so that
        # a preparation can continue from there
        if prepared is None:
            valid = h.fed
        else:
            valid = len(r.seq) + len(prepared) - 2
            if self.cache.lengths[r.slot] > valid:
                h.last_feat = None  # cut shorter than prepared: the state after the cut is not kept
        self.cache.rollback(r.slot, min(self.cache.lengths[r.slot], valid))

    # ------------------------------------------------------------ the passes
    def begin_drafting(self, d: Drafting) -> None:
        d.feats = [None] * len(d.reqs)
        # nothing new to feed (a one-token prompt before its first verification): no drafts; ahead of the target
        # (pipelined): only after a proposal the head drafted whole, its K/V still cached
        d.passes = [
            p if (bool(a) and self._can_continue(r, a) if d.guess else bool(r.state.states)) else 0
            for p, r, a in zip(d.passes, d.reqs, d.ahead)
        ]

    def end_drafting(self, d: Drafting) -> None:
        for r, feat in zip(d.reqs, d.feats):
            r.state.last_feat = feat

    def _can_continue(self, r: DraftRequest[HeadState], ahead: list[int]) -> bool:
        """The head can draft after ``seq + ahead`` (the last proposal) without the target's states: it drafted
        that proposal and holds its K/V up to the position before its last token."""
        return (
            r.state.last_feat is not None
            and ahead == r.proposal
            and self.cache.lengths[r.slot] == len(r.seq) + len(ahead) - 2
        )

    def pass_logits(self, d: Drafting, j: int, rows: list[int], inputs):
        """Pass j: the head's logits of the next token of each request of ``rows`` ([n, V] float32).

        Pass 0 feeds the positions the head has not had the target's states of: the token after each
        (``seq[fed + 1:]``) with the fused states (``head.fuse``), long rows in a forward of their own first (as
        :meth:`catch_up`). Later passes feed the last drafted token with the head's own output at the position
        before."""
        reqs, head = d.reqs, self.head
        slots = [reqs[b].slot for b in rows]
        if j == 0 and d.ahead[rows[0]]:  # ahead of the target: the proposal's last token, the head's own state
            feed = [[d.ahead[b][-1]] for b in rows]
            feats = [reqs[b].state.last_feat[None] for b in rows]  # [1, H]
        elif j == 0:
            feed, feats = [], []
            for b in rows:
                r, h = reqs[b], reqs[b].state
                self.cache.rollback(r.slot, h.fed)  # positions past it hold the head's own states (drafts)
                feed.append(r.seq[h.fed + 1 :])
                feats.append(head.fuse(torch.cat(h.states) if len(h.states) > 1 else h.states[0]))  # [m, H]
                h.states = []
                h.fed = len(r.seq) - 1
            long = [n for n, toks in enumerate(feed) if len(toks) > CATCH_UP_IN_PASS]
            if long:
                t0 = now()
                head.forward(
                    self.cache,
                    [slots[n] for n in long],
                    [feed[n][:-CATCH_UP_IN_PASS] for n in long],
                    [feats[n][:-CATCH_UP_IN_PASS] for n in long],
                )
                self.catch_up_s += now() - t0
                feed = [toks[-CATCH_UP_IN_PASS:] for toks in feed]
                feats = [f[-CATCH_UP_IN_PASS:] for f in feats]
        else:
            feed = [[d.toks[b][-1] if d.toks[b] else d.guesses[b]] for b in rows]  # (after a guess: the guess)
            feats = [d.feats[b][None] for b in rows]  # [1, H]
        # the sampling inputs ride in the forward's one copy: the pass waits for the device only when the caller
        # reads its tokens back (ModelProposer.draft_pass)
        logits, outs = head.forward(
            self.cache, slots, feed, feats, extra=inputs.words() if inputs is not None else None
        )  # [n, V], n x [m, H]
        for b, o in zip(rows, outs):
            d.feats[b] = o[-1]
        return logits, head.last_extra


def _head_source(sources):
    """The head's source (``draft.model``), refused unless it is a directory."""
    head = sources.draft
    if head is None:
        raise ConfigError("draft.model", "method 'eagle3' needs an EAGLE-3 head")
    if head.gguf_file is not None:
        raise ConfigError(
            "draft.model", "an EAGLE-3 head is a directory (config.json and its tensors), not a GGUF file"
        )
    return head
