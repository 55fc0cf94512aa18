"""The one logits-processing pipeline, applied identically to target and draft.

The distributions that speculative decoding compares (``p`` for the target, ``q``
for the draft) are the ones *after* this transform, so both models go through
exactly this function with the same per-request settings on the same prefix.

Order: temperature -> top-k -> top-p, then renormalise. A row with temperature 0
(greedy) becomes the one-hot distribution on its argmax; the standard acceptance
rule on one-hot ``p`` and ``q`` is exactly "accept while the draft token equals
the target argmax", so greedy needs no separate verification code.

Device-agnostic: the logits stay on their device and every tensor made here is made
there. The per-request settings may be host tensors (the callers build them from
SamplingParams): which optional stages run is then decided on the host without a
device sync, and the settings are copied to the logits' device once.

Pure maths: no Ray, no gRPC.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class SamplingRows:
    """Per-row settings of :func:`process_rows` on the logits' device, and the host's decisions of which
    stages run (read off the settings where they were made, so that no decision waits for the device)."""

    temperature: torch.Tensor  # [N] float32, 0 = greedy
    top_k: torch.Tensor  # [N] long, 0 = off
    top_p: torch.Tensor  # [N] float32 in (0, 1], 1 = off
    top_p_rows: torch.Tensor | None  # [M] long: the rows top-p cuts (None: none)
    kmax: int  # the largest k a row keeps (0: top-k off everywhere)
    any_greedy: bool
    all_greedy: bool

    @staticmethod
    def decisions(temperature: list[float], top_k: list[int], top_p: list[float], vocab: int) -> dict:
        """The host's decisions for rows with these settings (float32, as the rows hold them): kmax,
        any_greedy, all_greedy, and the rows top-p cuts (``top_p_rows`` as a list)."""
        t32 = np.asarray(temperature, dtype=np.float32)
        p32 = np.asarray(top_p, dtype=np.float32)
        use_top_k = any(k > 0 for k in top_k)
        return dict(
            kmax=max(min(k, vocab) if k > 0 else vocab for k in top_k) if use_top_k else 0,
            any_greedy=bool((t32 <= 0).any()),
            all_greedy=bool((t32 <= 0).all()),
            top_p_rows=np.flatnonzero(p32 < 1).tolist(),
        )


def process_logits(
    logits: torch.Tensor,  # [N, V] any float dtype, on any device
    temperature: torch.Tensor,  # [N] float, 0 = greedy (host or logits' device)
    top_k: torch.Tensor,  # [N] long, 0 = off
    top_p: torch.Tensor,  # [N] float in (0, 1], 1 = off
) -> torch.Tensor:  # [N, V] float32 probabilities on the logits' device, each row sums to 1
    """Turn raw logits into the sampling distribution each row's request uses."""
    n, vocab = logits.shape
    d = SamplingRows.decisions(temperature.tolist(), top_k.tolist(), top_p.tolist(), vocab)
    dev = logits.device
    rows = d.pop("top_p_rows")
    temperature, top_k, top_p = (x.to(dev, non_blocking=True) for x in (temperature, top_k, top_p))
    return process_rows(
        logits,
        SamplingRows(
            temperature.float(), top_k.long(), top_p.float(), torch.tensor(rows, device=dev) if rows else None, **d
        ),
    )


def process_rows(logits: torch.Tensor, s: SamplingRows) -> torch.Tensor:  # [N, V] -> [N, V] float32 probabilities
    """:func:`process_logits` with its settings on the device already (no copy, no device sync)."""
    logits = logits.float()
    n, vocab = logits.shape
    if s.all_greedy:  # every row one-hot: no softmax to compute
        return torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    greedy = s.temperature <= 0  # [N]
    safe_t = torch.where(greedy, torch.ones_like(s.temperature), s.temperature).float()
    # Subtract the row max first: a tiny temperature then sends non-max entries to -inf
    # instead of overflowing the max itself to +inf (which would make softmax NaN).
    scaled = (logits - logits.max(-1, keepdim=True).values) / safe_t[:, None]  # [N, V], max entry 0

    if s.kmax:
        k = torch.where(s.top_k > 0, s.top_k.clamp(max=vocab), torch.full_like(s.top_k, vocab))  # [N]
        top_vals = scaled.topk(s.kmax, dim=-1).values  # [N, kmax] descending
        kth = top_vals.gather(-1, (k - 1)[:, None])  # [N, 1] k-th largest value
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))  # ties at the k-th value are kept

    probs = torch.softmax(scaled, dim=-1)  # [N, V]

    if s.top_p_rows is not None:  # only those rows: the others keep their probabilities bit for bit
        idx = s.top_p_rows
        probs = probs.index_copy(0, idx, _top_p(probs.index_select(0, idx), s.top_p.index_select(0, idx)))

    if s.any_greedy:
        onehot = torch.zeros_like(probs)
        onehot.scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
        probs = torch.where(greedy[:, None], onehot, probs)
    return probs


def _top_p(
    probs: torch.Tensor,  # [M, V] float32, rows sum to 1
    top_p: torch.Tensor,  # [M] float in (0, 1)
) -> torch.Tensor:  # [M, V] the smallest best-ranked prefix whose mass reaches top_p, renormalised
    # A stable sort ranks equal probabilities by token id, so a cut-off among ties keeps the lowest ids.
    sorted_p, order = probs.sort(dim=-1, descending=True, stable=True)  # [M, V]
    mass_before = sorted_p.cumsum(-1) - sorted_p  # [M, V] mass of strictly better-ranked tokens
    keep_sorted = mass_before < top_p.float()[:, None]  # [M, V]
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    kept = torch.where(keep, probs, torch.zeros_like(probs))
    return kept / kept.sum(-1, keepdim=True)


def unusable_rows(
    logits: torch.Tensor,  # [N, V] the logits given to process_logits
    probs: torch.Tensor,  # [N, V] what it returned
) -> torch.Tensor:  # [N] bool, on their device
    """Rows no token can be sampled from: a NaN logit (a greedy row would otherwise take the NaN's
    position as its argmax) or probabilities without positive finite mass."""
    mass = probs.sum(-1)  # [N]
    return logits.isnan().any(-1) | ~(torch.isfinite(mass) & (mass > 0))


def sample_from(
    probs: torch.Tensor,  # [N, V] non-negative, rows with positive mass (need not sum to 1)
    uniforms: torch.Tensor,  # [N] in [0, 1)
) -> torch.Tensor:  # [N] long token ids
    """Inverse-CDF sampling with one caller-supplied uniform per row.

    Returns the first index whose cumulative mass exceeds ``u * total``; that index
    always has positive probability, so a zero-probability token is never drawn.
    Cumulative sums are in float64 so a 50k-entry vocabulary keeps its precision.
    """
    cdf = probs.double().cumsum(-1)  # [N, V]
    target = uniforms.double() * cdf[:, -1]  # [N]
    idx = torch.searchsorted(cdf, target[:, None], right=True).squeeze(-1)  # [N]
    # A uniform that rounded up to 1 would run past the end: stop at the last positive entry.
    last_positive = probs.shape[-1] - 1 - (probs > 0).flip(-1).long().argmax(-1)  # [N]
    return torch.minimum(idx, last_positive)
