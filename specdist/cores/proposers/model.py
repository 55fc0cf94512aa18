"""Model drafts (``draft.method``: ``model``, ``self-w8``, ``self-w4``): a small causal LM over its own KV cache.

The draft model is a separate model of the target's vocabulary (``model``) or the target's own low-precision
copy (``self-w8``, ``self-w4``: :func:`specdist.models.native.self_draft`). Each draft token is sampled from
the *processed* draft distribution (:func:`specdist.cores.sampling.process_rows`, the transform the target
applies to p) after rounding it to ``r = fp16_exact(q)``, the distribution the wire can carry exactly: the
draft reports r, the target verifies against r, so exactness holds on either transport and both give the same
tokens. Greedy requests have a one-hot q (no tensor). The token at sequence position ``n`` is sampled with the
uniform :func:`~specdist.randomness.draft_uniform` ``(seed, n)`` (under the Gumbel coupling, the noise
of position ``n``), so the tokens depend on the positions drafted, not on how often the request drafted before.

With ``confidence_threshold > 0`` a request stops drafting early once the draft's untempered probability of
its latest token is below the threshold (that token is still proposed). The rule looks only at the draft's own
distribution, so the draft length is fixed before verification and exactness is unaffected.

:class:`ModelProposer` is also the base of the methods that draft by passes of a network over a KV cache
(``hybrid``, ``eagle3``): a subclass changes what a pass computes (:meth:`ModelProposer.pass_logits`) and, for
EAGLE-3, what a commit keeps.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from specdist.clock import now
from specdist.cores.coupling import gumbel_argmax, row_starts
from specdist.cores.device_inputs import HostInputs
from specdist.cores.proposers.base import BuildContext, Draft, DraftRequest, Proposer, register
from specdist.cores.sampling import SamplingRows, process_rows, sample_from
from specdist.errors import ConfigError
from specdist.models.runner import CausalLMRunner
from specdist.randomness import draft_uniform
from specdist.transport.wire import fp16_exact

# unseen tokens a draft pass feeds per row; more (a prompt's first draft) go through a forward first
CATCH_UP_IN_PASS = 2


@dataclass
class Drafting:
    """The state of one :meth:`ModelProposer.draft_model` call, per request b."""

    reqs: list[DraftRequest]
    ahead: list[list[int]]  # tokens assumed after the committed sequence
    base: list[int]  # sequence position of the first token drafted (the guess, if any)
    passes: list[int]  # draft passes (the guess's included); shortened by the confidence threshold
    guess: bool
    toks: list[list[int]]
    rows_q: list[list[torch.Tensor]]  # [V] rows of the sampled tokens, on the device
    guesses: list[int | None]
    feats: list = field(default_factory=list)  # eagle3: [H] the head's output at each row's last fed position


@register
class ModelProposer(Proposer):
    methods = ("model",)
    reads_draft_model = True
    drafts_ahead = True

    def __init__(self, runner: CausalLMRunner, confidence_threshold: float = 0.0, q_top_k: int = 0):
        self.runner = runner
        self.cache = runner.cache
        self.vocab_size = runner.vocab_size
        self.confidence_threshold = confidence_threshold
        # rejection coupling: sample from (and send) only the q's top q_top_k tokens, renormalised, so a
        # drafted token's q costs at most 6 * q_top_k bytes on the wire whatever the vocabulary (0: all)
        self.q_top_k = q_top_k
        self.catch_up_s = 0.0

    # ------------------------------------------------------------ making one
    @classmethod
    def load(cls, dc, sources, dtype: str, device, target=None, target_tokenizer=None):
        """The draft model ``sources.draft``, refused unless its vocabulary is the target's
        (:func:`check_draft_vocab` against ``target`` and ``target_tokenizer`` when the caller has them, else
        against the target's config and tokenizer as ``sources`` reads them, without weights)."""
        from specdist.models.loader import load_model, load_tokenizer

        dsrc = sources.draft
        if dsrc is None:
            raise ConfigError("draft.model", f"method {dc.method!r} needs a draft model")
        draft = load_model(dsrc, dtype, device)
        if target is not None:
            vocab = int(target.config.vocab_size)
        else:
            vocab, target_tokenizer = sources.vocab_size(), sources.tokenizer()
        check_draft_vocab(draft, vocab, load_tokenizer(dsrc), target_tokenizer)
        return draft

    @classmethod
    def runner_of(cls, ctx: BuildContext, method: str) -> CausalLMRunner:
        """The runner over ``ctx.model`` (refused without one, or when its vocabulary is not the target's)."""
        if ctx.model is None:
            raise ConfigError("draft.method", f"{method!r} needs a draft model")
        check_draft_vocab(ctx.model, ctx.vocab_size)
        return CausalLMRunner(
            ctx.model, ctx.max_batch_size, ctx.max_model_len, kv_cache_dtype=ctx.kv_cache_dtype, kv=ctx.kv
        )

    @classmethod
    def build(cls, dc, ctx: BuildContext) -> "ModelProposer":
        return cls(cls.runner_of(ctx, dc.method), dc.confidence_threshold, dc.q_top_k)

    # ------------------------------------------------------------ calls
    def prefill(self, reqs: list[DraftRequest]) -> None:
        cache = self.cache
        self.runner.forward([r.slot for r in reqs], [r.seq[cache.lengths[r.slot] : -1] for r in reqs], [0] * len(reqs))

    def commit(self, r: DraftRequest, kept, n_acc: int, prev: int, prepared, hidden) -> None:
        # the cache holds the accepted drafts, then stale ones: drop those (after a hybrid's suffix proposal it
        # holds a prefix of the old seq: kept as it is); with prepared drafts it holds the committed sequence,
        # then them
        valid = prev + n_acc if prepared is None else len(r.seq) + len(prepared) - 1
        self.cache.rollback(r.slot, min(self.cache.lengths[r.slot], valid))

    def propose(self, reqs: list[DraftRequest], ks: list[int]) -> list[Draft]:
        toks, qs, _ = self.draft_model(reqs, ks)
        return [Draft(t, q) for t, q in zip(toks, qs)]

    def draft_ahead(
        self, reqs: list[DraftRequest], ks: list[int], gate: Callable[[int], bool] | None = None, each_pass=None
    ) -> tuple[list[list[int]], list[torch.Tensor | None], list[int | None]]:
        """Draft each request's next step before the target has verified its proposal: a guess of the target's
        token after the proposal, then ``ks[b]`` tokens after proposal + guess (:mod:`specdist.cores.draft_pipeline`).
        (tokens, q, guess) per request; ``gate`` and ``each_pass`` as in :meth:`draft_model`. The requests' state
        is unchanged (the cache holds the passes' K/V): a commit with ``prepared`` takes the tokens once the
        target kept that prefix."""
        return self.draft_model(
            reqs, ks, ahead=[list(r.proposal) for r in reqs], guess=True, gate=gate, each_pass=each_pass
        )

    # ------------------------------------------------------------ the passes
    def draft_model(
        self,
        reqs: list[DraftRequest],
        ks: list[int],
        ahead: list[list[int]] | None = None,
        guess: bool = False,
        gate: Callable[[int], bool] | None = None,
        each_pass=None,
    ):
        """Sequential draft passes: (tokens, q [n, V] or None, guesses) per request.

        Request b drafts after ``seq + ahead[b]`` (``ahead``: tokens not committed yet, which the pipelined
        drafter assumes the target will keep; default none). With ``guess`` the first pass picks the mode of q
        as a guess of the target's next token (no uniform drawn, not part of the tokens; see
        :mod:`specdist.cores.draft_pipeline`) and the ``ks[b]`` tokens follow it. ``each_pass``: a context
        manager (a lock) held around every pass; ``gate(b)``, called inside it before the pass, drops request b
        from the remaining passes when it is False.

        Logits processing and sampling run on the model's device and each q stays there; per pass only the
        drafted token ids (and, with a confidence threshold, their confidences) come to the host, in one copy.
        """
        bsz = len(reqs)
        ahead = ahead if ahead is not None else [[] for _ in range(bsz)]
        g0 = 1 if guess else 0  # passes before the sampled tokens
        d = Drafting(
            reqs=reqs,
            ahead=ahead,
            base=[len(r.seq) + len(a) for r, a in zip(reqs, ahead)],
            passes=[k + g0 if k > 0 or guess else 0 for k in ks],
            guess=guess,
            toks=[[] for _ in range(bsz)],
            rows_q=[[] for _ in range(bsz)],
            guesses=[None] * bsz,
        )
        self.begin_drafting(d)
        alive = [True] * bsz
        held = each_pass if each_pass is not None else contextlib.nullcontext()
        for j in range(max(d.passes, default=0)):
            with held:
                if gate is not None:
                    alive = [alive[b] and gate(b) for b in range(bsz)]
                rows = sorted((b for b in range(bsz) if d.passes[b] > j and alive[b]), key=lambda b: reqs[b].slot)
                if not rows:  # (sorted by slot: contiguous slots are cache views)
                    break
                self.draft_pass(d, j, rows)
        qs = [torch.stack(rq) if rq else None for rq in d.rows_q]  # on the device
        self.end_drafting(d)
        return d.toks, qs, d.guesses

    def begin_drafting(self, d: Drafting) -> None:
        """Before the passes of :meth:`draft_model` (a subclass may cut ``d.passes``)."""

    def end_drafting(self, d: Drafting) -> None:
        """After the passes of :meth:`draft_model`."""

    def pass_logits(self, d: Drafting, j: int, rows: list[int], inputs: HostInputs | None):
        """Pass j's logits of the next token of each request of ``rows`` ([n, V]) and the words of ``inputs`` on
        the device (None without inputs). The forward feeds what the cache has not seen of ``seq + ahead``
        (usually 1 or 2 tokens; a long tail goes through :meth:`catch_up` first) at pass 0, the last drafted
        token (or the guess) after."""
        reqs = d.reqs
        if j == 0:
            feed = []
            for b in rows:
                seq, seen = reqs[b].seq, self.cache.lengths[reqs[b].slot]
                feed.append(seq[seen:] + d.ahead[b][max(0, seen - len(seq)) :])
            feed = self.catch_up([reqs[b].slot for b in rows], feed)
        else:
            feed = [[d.toks[b][-1] if d.toks[b] else d.guesses[b]] for b in rows]
        logits = self.runner.forward(
            [reqs[b].slot for b in rows], feed, [1] * len(rows), extra=inputs.words() if inputs is not None else None
        )[:, 0]  # [n, V]
        return logits, self.runner.last_extra

    def draft_pass(self, d: Drafting, j: int, rows: list[int]) -> None:
        """Pass j of :meth:`draft_model` over the requests ``rows`` (indices into ``d.reqs``). What the sampling
        needs from the host rides in the forward's copy (:meth:`pass_inputs`); the drafted tokens (and, with a
        confidence threshold, their confidences) come back in one copy."""
        inputs, plan = self.pass_inputs(d, j, rows)
        logits, words = self.pass_logits(d, j, rows, inputs)
        if inputs is None:  # every row greedy: its token is the argmax of its logits, nothing was sent
            x = logits.argmax(-1)  # [n]: the one-hot q's token (process_logits' greedy rows)
        else:
            dd = inputs.unpack(words)  # views of the words: int64 indices, float settings and uniforms
            q = process_rows(
                logits,
                SamplingRows(dd["temperature"], dd["top_k"], dd["top_p"], dd.get("top_p_rows"), **plan["decisions"]),
            )  # [n, V]
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
            r16 = fp16_exact(top_k_only(q.index_select(0, s), self.q_top_k))  # [m, V]: the q the target will see
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

    def pass_inputs(self, d: Drafting, j: int, rows: list[int]) -> tuple[HostInputs | None, dict]:
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
        sampled = (
            []
            if j == 0 and d.guess
            else [n for n, b in enumerate(rows) if reqs[b].params.temperature > 0 and reqs[b].coupling != "gumbel"]
        )
        if sampled:
            h.add("sampled", sampled, np.int64)
            h.add("uniforms", [draft_uniform(reqs[rows[n]].seed, d.base[rows[n]] + j) for n in sampled], np.float64)
        return h, {"decisions": decisions, "coupled": coupled, "sampled": sampled}

    def catch_up(self, slots: list[int], inputs: list[list[int]]) -> list[list[int]]:
        """Feed all but the last ``CATCH_UP_IN_PASS`` unseen tokens of long rows (a prompt whose K/V the core
        deferred) in a forward of their own, so the draft pass stays decode-sized for every row instead of
        padding each to the longest. Returns what the pass still feeds."""
        long = [n for n, toks in enumerate(inputs) if len(toks) > CATCH_UP_IN_PASS]
        if not long:
            return inputs
        t0 = now()
        self.runner.forward([slots[n] for n in long], [inputs[n][:-CATCH_UP_IN_PASS] for n in long], [0] * len(long))
        self.catch_up_s += now() - t0
        return [toks[-CATCH_UP_IN_PASS:] for toks in inputs]


@register
class SelfDraftProposer(ModelProposer):
    """The target's own low-precision copy as the draft model (``self-w8``: int8, ``self-w4``: 4-bit)."""

    methods = ("self-w8", "self-w4")
    reads_draft_model = False
    runs_in_target_dtype = True

    def __init__(
        self, runner: CausalLMRunner, confidence_threshold: float = 0.0, q_top_k: int = 0, method: str = "self-w8"
    ):
        super().__init__(runner, confidence_threshold, q_top_k)
        self.served = method  # the draft.method it was built for (one class serves several)

    @property
    def method(self) -> str:
        return self.served

    @classmethod
    def target_copy(cls, method: str) -> str | None:
        return method

    @classmethod
    def load(cls, dc, sources, dtype: str, device, target=None, target_tokenizer=None):
        """The target's low-precision copy (:func:`specdist.models.native.self_draft`) of ``target`` (a self-w4
        copy of a target already on int4 groups shares its modules) or, without one, of the target loaded here
        from ``sources.target``: a GGUF file's own blocks for self-w4, the floats (quantized) otherwise."""
        from specdist.models.loader import load_model
        from specdist.models.native import self_draft

        copy = cls.target_copy(dc.method)
        src = sources.target
        if target is None:
            target = load_model(src, dtype, device, weights="native" if copy == "self-w4" else "float")
        return self_draft(target, copy, src.gguf_path)

    @classmethod
    def build(cls, dc, ctx: BuildContext) -> "SelfDraftProposer":
        return cls(cls.runner_of(ctx, dc.method), dc.confidence_threshold, dc.q_top_k, dc.method)


def top_k_only(q: torch.Tensor, k: int) -> torch.Tensor:  # [m, V] -> [m, V], rows renormalised
    """q restricted to each row's k largest entries (ties: those topk returns); k = 0: q itself."""
    if k <= 0 or k >= q.shape[-1]:
        return q
    vals, idx = q.topk(k, dim=-1)  # [m, k]
    kept = torch.zeros_like(q).scatter_(-1, idx, vals)
    return kept / kept.sum(-1, keepdim=True)


def check_draft_vocab(draft: torch.nn.Module, vocab_size: int, draft_tokenizer=None, target_tokenizer=None) -> None:
    """A draft model proposes token ids of the target's vocabulary: the same size and, where both
    tokenizers are known, the same tokens (ConfigError naming ``draft.model`` otherwise)."""
    if int(draft.config.vocab_size) != int(vocab_size):
        raise ConfigError(
            "draft.model", f"vocabulary size {draft.config.vocab_size} differs from the target's {vocab_size}"
        )
    if (
        draft_tokenizer is not None
        and target_tokenizer is not None
        and draft_tokenizer.get_vocab() != target_tokenizer.get_vocab()
    ):
        raise ConfigError("draft.model", "tokenizer vocabulary differs from the target's (same size, other tokens)")
