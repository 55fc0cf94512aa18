"""One verification's decision on the device: what the target keeps of each request's drafts.

:class:`VerifyBatch` is made on the host before the forward (everything the decision needs that
the host knows: uniforms, draft tokens, each row's sampling settings, the Gumbel noise keys,
row indices), packed by :class:`~specdist.cores.device_inputs.HostInputs` into words that ride
in the forward's own host-to-device copy. After the forward, :meth:`VerifyBatch.decide` runs the
rule on the device (the rejection rule of :func:`~specdist.cores.rejection.rejection_sample`, or
Gumbel-max agreement for requests coupled by :mod:`specdist.cores.coupling`; a mixed batch runs
each on its rows) and brings back, in one copy, each request's accepted count, final token,
unusable-logits flag, the first draft token its own q gave no probability (if any) and the
log-probabilities asked for. A greedy batch (every request at temperature 0, no log-probabilities)
decides from the argmax alone, without materialising p.

Uniforms: a request holding ``L`` tokens has its draft token ``d_j`` accepted or rejected with
``target_uniforms(seed, ACCEPT_ROLE, [L + j])`` and its final token sampled with
``(seed, SAMPLE_ROLE, [L + n])`` (:mod:`specdist.cores.target`'s module doc says why).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from specdist.cores.coupling import gumbel_argmax, gumbel_verify, row_starts
from specdist.cores.device_inputs import HostInputs
from specdist.cores.rejection import VerifyResult, rejection_sample
from specdist.cores.sampling import SamplingRows, process_rows, unusable_rows
from specdist.logprobs import split_rows
from specdist.randomness import ACCEPT_ROLE, SAMPLE_ROLE, draft_seed, target_uniforms


@dataclass
class Decision:
    """What :meth:`VerifyBatch.decide` brings to the host, per request (request order)."""

    num_accepted: list[int]
    final: list[int]
    unusable: list[int]  # 1: its logits cannot be sampled at some position
    bad_q: list[tuple[int, float] | None]  # (j, q(d_j)) of its first draft token its q gave no probability
    logprobs: dict  # request -> [TokenLogprob] per emitted token (requests that asked)


def _logprob_values(
    probs: torch.Tensor,  # [B, K+1, V] processed p
    tokens: torch.Tensor,  # [B, K+1] long: the emitted tokens (accepted drafts, then the final one), -1 after
    rows: torch.Tensor,  # [A] long: the requests that asked for log-probabilities
    num_top: int,  # N top entries per position (<= V; 0: none)
) -> torch.Tensor:  # [A * (K+1) * (1 + 2N)] float64 on probs' device
    """Per request of ``rows`` and position: log p(token), then the N largest log p and their token ids
    (:func:`specdist.logprobs.split_rows` reads them). Logs in float32, the precision of p, so the
    values are the same whether they reach the caller in process or as the wire's float32."""
    p = probs.index_select(0, rows)  # [A, K+1, V]
    tok = tokens.index_select(0, rows).clamp(min=0)  # [A, K+1]; positions past the final token are never read
    parts = [p.gather(-1, tok[..., None]).log()]  # [A, K+1, 1]
    if num_top:
        top_p, top_id = p.topk(num_top, dim=-1)  # [A, K+1, N] each, most likely first
        parts += [top_p.log(), top_id]
    return torch.cat([x.double() for x in parts], -1).view(-1)  # [A, K+1, 1 + 2N] flattened


class VerifyBatch:
    """One verification's host-made inputs (see the module doc). ``requests[b]``: (sequence length L, params,
    seed, coupling) of request b; ``drafts[b]`` its draft tokens; ``order``: the requests in the forward's
    row order (request ``order[i]``'s ``len(drafts) + 1`` logits rows are the i-th block); ``has_q[b]``: its
    drafts came with q rows."""

    def __init__(
        self, requests: list[tuple], drafts: list[list[int]], order: list[int], has_q: list[bool], vocab_size: int
    ):
        bsz = len(requests)
        nd = [len(d) for d in drafts]
        kdim = max(nd)
        self.bsz, self.kdim, self.nd, self.vocab, self.drafts = bsz, kdim, nd, vocab_size, drafts
        has_q = [q and n > 0 for q, n in zip(has_q, nd)]
        self.params = [r[1] for r in requests]
        self.greedy = all(p.temperature <= 0 and p.logprobs is None for p in self.params)
        self.order = order
        self.asked = [p.logprobs for p in self.params]
        self.any_q = any(has_q)
        self.inputs: HostInputs | None = None
        self.sampling: dict = {}
        if self.greedy and not self.any_q:  # decided from the argmax of the logits: nothing to send
            return
        h = self.inputs = HostInputs()
        # integers as int64: the device reads them as index tensors without a conversion each
        h.add("tokens", [d + [-1] * (kdim - len(d)) for d in drafts], np.int64)  # [B, K]
        h.add("num_draft", nd, np.int64)
        h.add("one_hot", [not q for q in has_q], np.int64)  # [B]: q is the one-hot of the token
        if self.greedy:
            return
        start, at = {}, 0
        for b in order:
            start[b], at = at, at + nd[b] + 1
        pairs = [(b, j) for b in range(bsz) for j in range(nd[b] + 1)]  # the N valid (request, position) rows
        h.add("src", [start[b] + j for b, j in pairs], np.int64)  # into the packed logits
        h.add("dst", [b * (kdim + 1) + j for b, j in pairs], np.int64)  # into [B * (K+1)]
        temp = [self.params[b].temperature for b, _ in pairs]
        top_k = [self.params[b].top_k for b, _ in pairs]
        top_p = [self.params[b].top_p for b, _ in pairs]
        h.add("temperature", temp, np.float32)
        h.add("top_k", top_k, np.int64)
        h.add("top_p", top_p, np.float32)
        self.sampling = SamplingRows.decisions(temp, top_k, top_p, vocab_size)
        if self.sampling["top_p_rows"]:
            h.add("top_p_rows", self.sampling["top_p_rows"], np.int64)
        gumbel = [r[3] == "gumbel" for r in requests]
        self.any_gumbel, self.all_gumbel = any(gumbel), all(gumbel)
        h.add("gumbel", gumbel, np.int64)
        # uniforms: acceptance of positions L .. L+nd-1, then sampling of L .. L+nd; 1.0 past them (never read)
        u = []
        for (length, _, seed, _), n in zip(requests, nd):
            pad = [1.0] * (kdim - n)
            u += target_uniforms(seed, ACCEPT_ROLE, range(length, length + n)) + pad
            u += target_uniforms(seed, SAMPLE_ROLE, range(length, length + n + 1)) + pad
        h.add("uniforms", u, np.float64)  # [B, 2K+1]
        # Gumbel noise of the sampled (T > 0) coupled requests' positions L .. L+nd, keyed by their draft seed
        noise_rows, noise_keys = [], []
        for b, (length, params, seed, coupling) in enumerate(requests):
            if coupling == "gumbel" and params.temperature > 0:
                noise_rows += [b * (kdim + 1) + j for j in range(nd[b] + 1)]
                noise_keys += row_starts(draft_seed(seed), range(length, length + nd[b] + 1))
        self.any_noise = bool(noise_rows)
        if noise_rows:
            h.add("noise_rows", noise_rows, np.int64)
            h.add("noise_keys", noise_keys, np.int64)
        self.logprob_rows = [b for b, n in enumerate(self.asked) if n is not None]
        if self.logprob_rows:
            h.add("logprob_rows", self.logprob_rows, np.int64)

    def words(self) -> np.ndarray | None:
        """The int32 words for the forward's copy (``CausalLMRunner.forward(extra=...)``), or None."""
        return self.inputs.words() if self.inputs is not None else None

    # ------------------------------------------------------------ on the device
    def decide(self, logits: torch.Tensor, extra: torch.Tensor | None, qs: list) -> Decision:
        """``logits`` [N, V] packed (row order as given), ``extra``: :meth:`words` on the device, ``qs[b]``: request
        b's q rows [n_b, V] (on any device) or None. One device-to-host copy."""
        d = self.inputs.unpack(extra) if self.inputs is not None else {}
        dev = logits.device
        if "tokens" in d:
            d["tokens"] = d["tokens"].view(self.bsz, self.kdim)  # [B, K]
        q = self._draft_q(qs, d, dev) if self.any_q else None  # [B, K, V]
        checks = [self._q_checks(q, d)] if q is not None else []  # [B, 2] (first bad j or -1, its q)
        if self.greedy:
            return self._decide_greedy(logits, checks)
        probs, unusable = self._target_probs(logits, d)  # [B, K+1, V], [B]
        res = self._decide_rows(probs, q, d)
        final = res.tokens.gather(1, res.num_accepted[:, None])  # [B, 1]
        host = torch.cat([res.num_accepted[:, None], final, unusable[:, None].long()], 1).double()  # [B, 3]
        parts = [host.view(-1)] + [c.view(-1) for c in checks]
        num_top = 0
        if self.logprob_rows:
            num_top = min(max(self.asked[b] for b in self.logprob_rows), self.vocab)
            parts.append(_logprob_values(probs, res.tokens, d["logprob_rows"], num_top))
        flat = torch.cat(parts).tolist()  # the one copy to the host
        bsz = self.bsz
        n_acc, fin, bad = (tuple(int(v) for v in flat[c : 3 * bsz : 3]) for c in range(3))
        at = 3 * bsz
        bad_q = self._bad_q(flat[at : at + 2 * bsz]) if checks else [None] * bsz
        at += 2 * bsz if checks else 0
        logprobs = {}
        if self.logprob_rows:
            values = split_rows(
                flat[at:],
                self.kdim + 1,
                num_top,
                [n_acc[b] + 1 for b in self.logprob_rows],
                [min(self.asked[b], num_top) for b in self.logprob_rows],
            )
            logprobs = dict(zip(self.logprob_rows, values))
        return Decision(list(n_acc), list(fin), list(bad), bad_q, logprobs)

    def _decide_greedy(self, logits: torch.Tensor, checks: list) -> Decision:
        """Every p one-hot on the argmax: under either coupling a draft is accepted iff it is the argmax and the
        token after the run is the argmax there, so the argmax decides the step without materialising p, on the
        host from one copy of the argmaxes (a handful of torch operations on [B, K+1] tensors cost more)."""
        top, arg = logits.max(-1)  # [N] each, row order; max() gives the first maximal index, and NaN as the max
        flat = torch.cat([arg.double(), top.isnan().double()] + [c.view(-1) for c in checks]).tolist()
        n_rows = arg.shape[0]
        y, nan = flat[:n_rows], flat[n_rows : 2 * n_rows]
        rows, at = {}, 0  # request -> its rows of the packed logits
        for b in self.order:
            rows[b], at = slice(at, at + self.nd[b] + 1), at + self.nd[b] + 1
        ys = [[int(v) for v in y[rows[b]]] for b in range(self.bsz)]
        n_acc = gumbel_verify(ys, self.drafts)
        final = [ys[b][n] for b, n in enumerate(n_acc)]
        bad = [int(any(nan[rows[b]])) for b in range(self.bsz)]
        bad_q = self._bad_q(flat[2 * n_rows :]) if checks else [None] * self.bsz
        return Decision(n_acc, final, bad, bad_q, {})

    def _bad_q(self, values: list[float]) -> list[tuple[int, float] | None]:
        return [(int(values[2 * b]), values[2 * b + 1]) if values[2 * b] >= 0 else None for b in range(self.bsz)]

    def _target_probs(self, logits: torch.Tensor, d: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """p of every request's valid positions (request order, rows past a request's drafts 0) [B, K+1, V], and
        unusable [B]: a request with a row :func:`unusable_rows` refuses."""
        bsz, k1, vocab = self.bsz, self.kdim + 1, self.vocab
        raw = logits.reshape(-1, vocab).index_select(0, d["src"])  # [N, V]
        s = self.sampling
        rows = SamplingRows(
            d["temperature"], d["top_k"], d["top_p"], d.get("top_p_rows"), s["kmax"], s["any_greedy"], s["all_greedy"]
        )
        p_valid = process_rows(raw, rows)  # [N, V]
        probs = torch.zeros(bsz * k1, vocab, device=logits.device).index_copy_(0, d["dst"], p_valid)
        unusable = torch.zeros(bsz * k1, dtype=torch.bool, device=logits.device)
        unusable = unusable.index_copy_(0, d["dst"], unusable_rows(raw, p_valid)).view(bsz, k1).any(1)  # [B]
        return probs.view(bsz, k1, vocab), unusable

    def _decide_rows(self, probs: torch.Tensor, q: torch.Tensor | None, d: dict) -> VerifyResult:
        """The rejection rule on the rows of rejection-coupled requests and Gumbel-max agreement on the others."""
        kdim = self.kdim
        tokens, num_draft = d["tokens"], d["num_draft"]
        u = d["uniforms"].view(self.bsz, 2 * kdim + 1)
        res = None
        if not self.all_gumbel:
            res = rejection_sample(probs, q, tokens, num_draft, u[:, :kdim], u[:, kdim:])
        if not self.any_gumbel:
            return res
        vocab = probs.shape[-1]
        y = probs.argmax(-1)  # [B, K+1]: greedy rows take their one-hot token without noise
        if self.any_noise:
            flat = d["noise_rows"]
            y.view(-1)[flat] = gumbel_argmax(probs.view(-1, vocab).index_select(0, flat), d["noise_keys"])
        valid = torch.arange(kdim, device=probs.device)[None, :] < num_draft[:, None]  # [B, K]
        n = ((y[:, :kdim] == tokens) & valid).long().cumprod(-1).sum(-1)  # [B]: the agreeing run
        keep = torch.arange(kdim + 1, device=probs.device)[None, :] <= n[:, None]  # the run and the token after it
        gtokens = torch.where(keep, y, torch.full_like(y, -1))
        if res is None:
            return VerifyResult(gtokens, n)
        g = d["gumbel"].bool()
        return VerifyResult(torch.where(g[:, None], gtokens, res.tokens), torch.where(g, n, res.num_accepted))

    def _draft_q(self, qs: list, d: dict, dev: torch.device) -> torch.Tensor:  # [B, K, V] on the device
        """The batch's q: one-hot rows where a request brought none (scattered on the device from its tokens);
        rows already on the device (an in-process drafter's) copied in place; rows on the host (decoded from the
        wire) moved together, in one copy of their own."""
        bsz, kdim, vocab = self.bsz, self.kdim, self.vocab
        tokens, num_draft = d["tokens"], d["num_draft"]
        valid = torch.arange(kdim, device=dev)[None, :] < num_draft[:, None]  # [B, K]
        one_hot = (valid & d["one_hot"].bool()[:, None]).float()  # [B, K]
        q = torch.zeros(bsz, kdim, vocab, device=dev).scatter_(-1, tokens.clamp(min=0)[..., None], one_hot[..., None])
        moved = [b for b in range(bsz) if qs[b] is not None and qs[b].device != dev]
        if moved:
            rows = torch.cat([qs[b].float().cpu() for b in moved]).to(dev)  # [m, V]
            at = 0
            for b in moved:
                q[b, : self.nd[b]] = rows[at : at + self.nd[b]]
                at += self.nd[b]
        for b in range(bsz):
            if qs[b] is not None and qs[b].device == dev:
                q[b, : self.nd[b]] = qs[b]
        return q

    def _q_checks(self, q: torch.Tensor, d: dict) -> torch.Tensor:  # [B, 2] float64: (first bad j or -1, q there)
        """A draft token its own q gives no positive probability (0 or NaN) cannot have been sampled from it, and
        the acceptance rule ``u q(x) < p(x)`` would misjudge it: each request's first such position and q there."""
        kdim = self.kdim
        tokens, num_draft = d["tokens"], d["num_draft"]
        qx = q.gather(-1, tokens.clamp(min=0)[..., None]).squeeze(-1)  # [B, K]
        valid = torch.arange(kdim, device=q.device)[None, :] < num_draft[:, None]
        bad = valid & ~(qx > 0)  # [B, K]
        j = bad.long().argmax(-1)  # [B]: the first bad position (0 where none)
        first = torch.where(bad.any(-1), j, torch.full_like(j, -1))
        return torch.stack([first.double(), qx.gather(1, j[:, None]).squeeze(1).double()], 1)
