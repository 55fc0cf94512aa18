"""Gumbel-max coupling: drafter-invariant exact speculative decoding (docs/exactness.md section 3).

After Daliri, Musco and Suresh, "Coupling without Communication and Drafter-Invariant
Speculative Decoding" (2024). For position ``n`` of a request every token ``x`` of the
vocabulary gets Gumbel(0, 1) noise ``G_n(x)``, a pure function of (key, n, x):

- the target's token at ``n`` is ``y_n = argmax_x log p'_n(x) + G_n(x)``, with ``p'_n`` its
  processed distribution (:func:`specdist.cores.sampling.process_logits`) given the true prefix;
- the draft proposes ``d_n = argmax_x log q'_n(x) + G_n(x)`` with the same noise (model
  drafts; n-gram and suffix drafts propose their token as they would anyway);
- the target accepts ``d_n`` iff ``d_n == y_n``, emits ``y_n`` at the first disagreement and
  ``y_{n+k}`` after ``k`` agreements (the bonus token).

Exactness. By the Gumbel-max trick ``y_n ~ p'_n`` when the ``G_n(x)`` are i.i.d. Gumbel(0, 1),
and the noise of different positions is independent, so ``y_1, y_2, ...`` is ordinary
autoregressive sampling from the target. The emitted tokens are the ``y``'s whatever the draft
proposed: acceptance only decides how many of them one target pass produces. Hence the output
depends on the seed, the prompt, the parameters and the target's numerics alone, not on the
draft method, ``k``, the length rule, pipelining, failover, the batch or the transport. The
noise must be (a) independent across tokens and positions of a request, (b) independent across
requests, (c) a fixed function of (key, position, token), never of how many draws came before:
the tests' negative controls break (a) and (b). Greedy rows (one-hot ``p'``) take their argmax
whatever the noise: the noise-free case. A token with ``p'_n(x) = 0`` has score ``-inf`` and is
never emitted. Agreement probability at a position: ``sum_x 1 / sum_j max(p_j / p_x, q_j / q_x)``.

The noise. Row ``(key, n)`` starts a SplitMix64 stream at ``mix64(key ^ GUMBEL_ROLE) + n *
2^32 * golden`` and token ``x`` takes its element ``x + 1``: ``z = mix64(start + (x + 1) *
golden)`` (64-bit wrapping arithmetic, the same on the host in Python and on any torch device in
int64), ``u = (z >> 12 + 1/2) / 2^52`` strictly inside (0, 1) (52 bits and the half: every value exact
in float64, so no element rounds to 1, which would give ``E = 0``) and ``G = -log(-log u)`` in
float64. Positions
are < 2^32 (far above any context) and vocabularies < 2^32, so no two (position, token) pairs of
a key share an element. The key is the drafter's seed (:func:`specdist.randomness.draft_seed` of
the request seed), which both sides know; the rejection coupling's uniforms use other roles.
The argmax is taken as ``argmin_x E(x) / p'(x)`` with ``E = -log u`` (the same token, one
logarithm per entry), a token with ``p'(x) = 0`` masked to ``+inf`` (never ``0 / 0``). Cost: about 15 int64 operations
and one float64 logarithm per vocabulary entry of each sampled position the target scores (greedy rows need no noise).
"""

from __future__ import annotations

import torch

from specdist.randomness import GOLDEN, M64, MIX_C1, MIX_C2, mix64

GUMBEL_ROLE = 0xA0761D6478BD642F  # xor-ed into the key: the Gumbel stream differs from the uniforms'


def _signed(x: int) -> int:
    """A uint64 as the int64 with the same bits."""
    x &= M64
    return x - (1 << 64) if x >= 1 << 63 else x


def row_starts(key: int, positions: list[int]) -> list[int]:
    """The int64 stream start of each position's noise row (host side, exact)."""
    base = mix64((int(key) ^ GUMBEL_ROLE) & M64)
    return [_signed(base + (int(n) << 32) * GOLDEN) for n in positions]


def _srl(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's >> on int64 is arithmetic)."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def _mix64_t(z: torch.Tensor, scratch: torch.Tensor | None = None) -> torch.Tensor:
    """The bits of mix64 of int64 ``z`` (wrapping), computed in place in ``z``; ``scratch``: a tensor like ``z``
    for the shifted copies (allocated when not given)."""
    t = torch.empty_like(z) if scratch is None else scratch
    for shift, mult in ((30, _signed(MIX_C1)), (27, _signed(MIX_C2)), (31, None)):
        z.bitwise_xor_(torch.bitwise_right_shift(z, shift, out=t).bitwise_and_((1 << (64 - shift)) - 1))
        if mult is not None:
            z.mul_(mult)
    return z


_OFFSETS: dict[tuple, torch.Tensor] = {}  # (vocab, device) -> [V] int64: (x + 1) * golden, wrapped


def _offsets(vocab_size: int, device: torch.device) -> torch.Tensor:
    key = (vocab_size, str(device))
    if key not in _OFFSETS:
        _OFFSETS[key] = torch.arange(1, vocab_size + 1, dtype=torch.int64, device=device) * _signed(GOLDEN)
    return _OFFSETS[key]


def exponential_noise(starts: torch.Tensor, vocab_size: int) -> torch.Tensor:  # [N] int64 -> [N, V] float64
    """``E = -log u`` ~ Exp(1) of every token of each row (``G = -log E`` is its Gumbel noise). Made in place in
    the hash's own storage: two [N, V] int64 tensors at the peak (the hash and its shifted copies)."""
    z = starts[:, None] + _offsets(vocab_size, starts.device)[None, :]  # [N, V] int64
    scratch = torch.empty_like(z)
    _mix64_t(z, scratch)
    bits = torch.bitwise_right_shift(z, 12, out=scratch).bitwise_and_((1 << 52) - 1)  # [N, V] the top 52 bits
    e = z.view(torch.float64).copy_(bits)  # [N, V] in z's storage: integers < 2^52 are exact in float64
    del scratch, bits
    return e.add_(0.5).mul_(2.0**-52).log_().neg_()  # u in (0, 1): 52 bits + 1/2 are exact


# On the CPU the noise is computed for at most this many (row, token) pairs at once: the int64 temporaries
# (2 MiB) stay in the cache, about 3x faster than whole batches on the development machine.
CHUNK_ELEMENTS = 1 << 18


def rows_per_chunk(device_type: str, rows: int, vocab: int) -> int:
    """Rows of noise computed at once on a device of ``device_type``: a cache-sized chunk on the CPU; every row
    elsewhere. A chunk costs a fixed number of kernels (about 20), so on a GPU a call launches that many whatever
    its rows and vocabulary, where cache-sized chunks (2 rows at a 128k vocabulary) would launch over a thousand
    for a sampled verification. The price is the whole call's temporaries at once: two [rows, V] int64 tensors
    and a [rows, V] bool (2.4 GB for 1,088 rows of a 128k vocabulary), which the memory plan's sampler
    profile counts. The tokens do not depend on the chunking: each row's noise and argmin are its own."""
    if device_type == "cpu":
        return max(1, CHUNK_ELEMENTS // max(1, vocab))
    return max(1, rows)


def gumbel_argmax(probs: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:  # [N, V], [N] -> [N] long
    """``argmax_x log probs(x) + G(x)``: a sample from each row, fixed by its noise. Computed as
        ``argmin_x E(x) / probs(x)`` (the same token: ``log`` is increasing; one logarithm per entry
        instead of three); a token with ``probs(x) = 0`` scores ``+inf`` (masked, not divided: ``E > 0`` holds by
    construction, the mask keeps it so whatever the noise), never the minimum of a row with mass."""
    n, vocab = probs.shape
    if n == 0:
        return torch.zeros(0, dtype=torch.long, device=probs.device)
    step = rows_per_chunk(probs.device.type, n, vocab)

    def pick(i: int) -> torch.Tensor:  # [step] the rows' tokens
        p = probs[i : i + step]  # [step, V]
        scores = exponential_noise(starts[i : i + step], vocab).div_(p)  # [step, V] float64 E / p (p exact in float64)
        return scores.masked_fill_((p > 0).logical_not_(), torch.inf).argmin(-1)  # +inf where p = 0 (or NaN)

    return pick(0) if step >= n else torch.cat([pick(i) for i in range(0, n, step)])


def gumbel_verify(target_tokens: list[list[int]], draft_tokens: list[list[int]]) -> list[int]:
    """The drafts each request keeps: how many of its drafts ``draft_tokens[b]`` equal ``y``
    (``target_tokens[b]``: the target's Gumbel-max token at each draft position and the bonus one,
    ``len(draft_tokens[b]) + 1`` of them) from the first on. The request then emits ``y`` up to and
    including index ``n``: the token at the first disagreement, or the bonus token. On the host:
    the rule reads a few ints a request, and torch's per-operation cost on tensors this small is
    larger than the loop's."""
    accepted = []
    for y, d in zip(target_tokens, draft_tokens):
        n = 0
        while n < len(d) and d[n] == y[n]:
            n += 1
        accepted.append(n)
    return accepted
