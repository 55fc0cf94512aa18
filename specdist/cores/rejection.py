"""Exact speculative verification (the rejection sampler).

For each request, draft tokens ``x_1..x_k`` were proposed from ``q_1..q_k`` and the
target gave ``p_1..p_{k+1}`` on the same prefixes (both already processed by
:func:`specdist.cores.sampling.process_logits`). Left to right, ``x_i`` is accepted with
probability ``min(1, p_i(x_i) / q_i(x_i))``; at the first rejection a token is drawn
from the residual ``[p_i - q_i]_+ / sum [p_i - q_i]_+`` and every later draft token
is discarded; if all ``k`` are accepted a bonus token is drawn from ``p_{k+1}``.
Each request therefore emits between 1 and ``k+1`` tokens, and every emitted token
is distributed exactly as the target's (Leviathan et al. 2022, Chen et al. 2023).

Randomness is supplied by the caller as uniforms (one per draft position, and for the
final sample either one per request or one per position the final token can land on)
so that every request can use its own seeded uniforms and this module stays pure and
testable. Device-agnostic: every input lives on one device
(the uniforms too) and every tensor made here is made there; nothing leaves it.
Pure maths: no Ray, no gRPC.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdist.cores.sampling import sample_from

# Residual mass at or below this is treated as zero. It is reached only when
# p == q up to rounding, where rejection has probability zero analytically; we
# then sample from p, which equals the residual's limit.
RESIDUAL_EPS = 1e-12


def acceptance_probability(p_x: torch.Tensor, q_x: torch.Tensor) -> torch.Tensor:
    """``min(1, p(x)/q(x))`` elementwise; ``q(x) == 0`` (never proposed) gives 1."""
    ratio = torch.where(q_x > 0, p_x / q_x.clamp(min=torch.finfo(q_x.dtype).tiny), torch.ones_like(p_x))
    return ratio.clamp(max=1.0)


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``[p - q]_+`` normalised over the last axis, falling back to ``p`` where it has no mass.

    Shapes: ``p``, ``q`` [..., V] -> [..., V].
    """
    r = (p - q).clamp(min=0)
    mass = r.sum(-1, keepdim=True)
    return torch.where(mass > RESIDUAL_EPS, r / mass.clamp(min=RESIDUAL_EPS), p)


def final_uniforms(sample_uniforms: torch.Tensor, n: torch.Tensor) -> torch.Tensor:  # [B]
    """The uniform that samples each request's final token, which lands at index ``n`` [B] (its
    accepted drafts): ``sample_uniforms`` [B] as it is, or [B, K+1] at column ``n``."""
    if sample_uniforms.dim() == 1:
        return sample_uniforms
    return sample_uniforms.gather(1, n[:, None]).squeeze(1)


@dataclass
class VerifyResult:
    tokens: torch.Tensor  # [B, K+1] long: accepted drafts then the final sample; -1 after it
    num_accepted: torch.Tensor  # [B] long: draft tokens accepted (0..num_draft); each request emits one more


def rejection_sample(
    target_probs: torch.Tensor,  # [B, K+1, V] processed p at each draft position and the bonus one
    draft_probs: torch.Tensor | None,  # [B, K, V] processed q; None = one-hot q (n-gram drafts)
    draft_tokens: torch.Tensor,  # [B, K] long; entries at or past num_draft are ignored
    num_draft: torch.Tensor,  # [B] long: how many of the K positions each request really drafted
    accept_uniforms: torch.Tensor,  # [B, K] in [0, 1)
    sample_uniforms: torch.Tensor,  # [B], or [B, K+1]: one for each index the final token can land on
) -> VerifyResult:
    """Verify a batch of drafts of different lengths in one vectorised pass."""
    bsz, k = draft_tokens.shape
    dev = target_probs.device
    rows = torch.arange(bsz, device=dev)
    if k == 0:
        final = sample_from(target_probs[:, 0], final_uniforms(sample_uniforms, torch.zeros_like(rows)))
        return VerifyResult(final[:, None], torch.zeros(bsz, dtype=torch.long, device=dev))

    valid = torch.arange(k, device=dev)[None, :] < num_draft[:, None]  # [B, K]
    tok = draft_tokens.clamp(min=0)  # [B, K]
    p_x = target_probs[:, :k].gather(-1, tok[..., None]).squeeze(-1)  # [B, K]
    q_x = draft_probs.gather(-1, tok[..., None]).squeeze(-1) if draft_probs is not None else torch.ones_like(p_x)
    # u < min(1, p/q)  <=>  u * q < p  for u in [0, 1): no division needed.
    accepted = (accept_uniforms * q_x < p_x) & valid  # [B, K]
    n = accepted.long().cumprod(-1).sum(-1)  # [B] length of the accepted run

    p_n = target_probs[rows, n]  # [B, V] target at the first non-accepted position
    at = n.clamp(max=k - 1)
    if draft_probs is not None:
        q_n = draft_probs[rows, at]  # [B, V]
    else:
        q_n = torch.zeros_like(p_n).scatter_(-1, tok[rows, at][:, None], 1.0)
    rejected = (n < num_draft)[:, None]  # [B, 1] False means all drafts accepted: bonus from p
    final_dist = torch.where(rejected, residual_distribution(p_n, q_n), p_n)  # [B, V]
    final = sample_from(final_dist, final_uniforms(sample_uniforms, n))  # [B]

    out = torch.full((bsz, k + 1), -1, dtype=torch.long, device=dev)
    keep = torch.arange(k, device=dev)[None, :] < n[:, None]
    out[:, :k] = torch.where(keep, draft_tokens, out[:, :k])
    out[rows, n] = final
    return VerifyResult(out, n)
