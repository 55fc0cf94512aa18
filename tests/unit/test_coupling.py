"""The Gumbel-max coupling's pieces (specdist/cores/coupling.py): keyed noise, its law, the agreement rule.

Statistical tests use fixed keys (deterministic); each states its sample size, and its
significance level is its false-failure rate for a correct implementation.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import stats
from support.gtest import g_statistic, merge_cells
from support.helpers import devices
from torch.utils._python_dispatch import TorchDispatchMode

from specdist.cores.coupling import (
    _mix64_t,
    exponential_noise,
    gumbel_argmax,
    gumbel_verify,
    row_starts,
)
from specdist.randomness import mix64

ALPHA = 1e-4


def gumbel_noise(starts: torch.Tensor, vocab_size: int) -> torch.Tensor:  # [N] int64 -> [N, V] float64
    """Gumbel(0, 1) noise of every token of each row: ``G = -log E``."""
    return -torch.log(exponential_noise(starts, vocab_size))


def test_device_hash_equals_the_host_hash_bit_for_bit() -> None:
    rng = np.random.default_rng(0)
    xs = [int(v) for v in rng.integers(0, 2**64, size=2000, dtype=np.uint64)] + [0, 1, 2**63, 2**64 - 1]
    signed = torch.tensor([x - (1 << 64) if x >= 1 << 63 else x for x in xs], dtype=torch.int64)
    got = [int(v) & (2**64 - 1) for v in _mix64_t(signed).tolist()]
    assert got == [mix64(x) for x in xs]


def test_rows_are_keyed_by_key_and_position() -> None:
    a, b = row_starts(7, range(100)), row_starts(8, range(100))
    assert len(set(a) | set(b)) == 200  # every (key, position) its own row
    assert row_starts(7, [5, 3]) == [a[5], a[3]]  # a function of the position, in any order
    assert row_starts(7, [3]) != row_starts(7 + 2**32, [3])  # all 64 key bits count


def test_noise_is_exponential_and_gumbel() -> None:
    """E = -log u over 64 rows x 4096 tokens (N = 262,144) against Exp(1), and G = -log E against
    Gumbel(0, 1): Kolmogorov-Smirnov, alpha 1e-4 each."""
    starts = torch.tensor(row_starts(12345, range(64)), dtype=torch.int64)
    e = exponential_noise(starts, 4096).flatten().numpy()
    assert stats.kstest(e, "expon").pvalue > ALPHA
    g = gumbel_noise(starts, 4096).flatten().numpy()
    assert stats.kstest(g, "gumbel_r").pvalue > ALPHA
    # neighbouring tokens and positions are uncorrelated: |r| < 4.4 / sqrt(n) (two-sided 1e-5 each)
    e2 = exponential_noise(starts, 4096).numpy()
    n = e2[:, 1:].size
    assert abs(np.corrcoef(e2[:, 1:].ravel(), e2[:, :-1].ravel())[0, 1]) < 4.4 / math.sqrt(n)
    assert abs(np.corrcoef(e2[1:].ravel(), e2[:-1].ravel())[0, 1]) < 4.4 / math.sqrt(e2[1:].size)


P = torch.tensor([0.35, 0.25, 0.15, 0.1, 0.08, 0.05, 0.02, 0.0], dtype=torch.float64)
Q = torch.tensor([0.1, 0.3, 0.3, 0.05, 0.05, 0.1, 0.05, 0.05], dtype=torch.float64)


def _pairs(n: int, key_of) -> tuple[np.ndarray, np.ndarray]:
    """(target token y, draft token d) of n rows sharing one noise row each: ``key_of(i)`` its key."""
    starts = torch.tensor([row_starts(key_of(i), [17])[0] for i in range(n)], dtype=torch.int64)
    y = gumbel_argmax(P.float().expand(n, -1), starts).numpy()
    d = gumbel_argmax(Q.float().expand(n, -1), starts).numpy()
    return y, d


def test_target_and_draft_tokens_follow_their_laws_and_agree_as_the_formula_says() -> None:
    """N = 40,000 keys: y ~ p and d ~ q (G-tests, alpha 1e-4 each; a zero-probability token never
    drawn), and the agreement rate matches sum_x 1 / sum_j max(p_j / p_x, q_j / q_x) (z-test on a
    binomial, |z| < 3.9: two-sided 1e-4)."""
    n = 40_000
    y, d = _pairs(n, lambda i: 1_000_000 + i)
    for tokens, law in ((y, P.numpy()), (d, Q.numpy())):
        counts = np.bincount(tokens, minlength=len(law))
        assert not np.any((counts > 0) & (law == 0))
        cells = merge_cells(law, n)
        assert g_statistic(counts, law, cells) <= stats.chi2.isf(ALPHA, len(cells) - 1)
    p, q = P.numpy(), Q.numpy()
    both = (p > 0) & (q > 0)
    agree = sum(1.0 / np.maximum(p / p[x], q / q[x]).sum() for x in np.nonzero(both)[0])
    rate = float((y == d).mean())
    z = (rate - agree) / math.sqrt(agree * (1 - agree) / n)
    assert abs(z) < 3.9, f"agreement {rate:.4f} against {agree:.4f} (z = {z:.1f})"


def test_shared_noise_is_detected() -> None:
    """Negative control: every row with the same key (noise shared across requests) draws one token
    over and over; the G-test of y ~ p must fail (N = 2,000)."""
    y, _ = _pairs(2000, lambda i: 5)
    law = P.numpy()
    cells = merge_cells(law, 2000)
    assert g_statistic(np.bincount(y, minlength=8), law, cells) > stats.chi2.isf(ALPHA, len(cells) - 1)


def test_agreement_rule() -> None:
    y = [[4, 5, 6, 7], [1, 2, 3, 9], [8, 8], [3]]  # the target's token at each draft position and the bonus one
    drafts = [[4, 5, 0], [1, 2, 3], [8], []]
    assert gumbel_verify(y, drafts) == [2, 3, 1, 0]
    assert gumbel_verify([[4, 5, 6, 7]], [[0, 5, 6]]) == [0]  # agreement after a disagreement counts for nothing


@pytest.mark.parametrize("vocab", [5, 40_000])
def test_chunked_argmax_equals_one_pass(vocab: int, monkeypatch) -> None:
    import specdist.cores.coupling as coupling

    probs = torch.softmax(torch.randn(6, vocab, generator=torch.Generator().manual_seed(1)), -1)
    starts = torch.tensor(row_starts(3, range(6)), dtype=torch.int64)
    want = (probs.double().log() + gumbel_noise(starts, vocab)).argmax(-1)
    monkeypatch.setattr(coupling, "CHUNK_ELEMENTS", vocab * 2)  # three chunks of two rows
    assert torch.equal(gumbel_argmax(probs, starts), want)


def _host_argmax(probs: torch.Tensor, starts: list[int]) -> list[int]:
    """The coupling's token of each row computed on the host from its definition (coupling.py's module doc): the
    SplitMix64 element ``x + 1`` of the row's stream, ``u = (z >> 12 + 1/2) / 2^52``, ``argmin E / p`` with
    ``E = -log u`` and ``+inf`` where ``p = 0`` (NaN too: never below a number), in Python floats."""
    from specdist.randomness import GOLDEN, M64

    out = []
    for row, start in zip(probs.double().tolist(), starts):
        scores = [
            -math.log(((mix64((start + (x + 1) * GOLDEN) & M64) >> 12) + 0.5) * 2.0**-52) / p if p > 0 else math.inf
            for x, p in enumerate(row)
        ]
        out.append(min(range(len(row)), key=scores.__getitem__))
    return out


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
def test_tokens_do_not_depend_on_the_chunking(device_type: str, monkeypatch) -> None:
    """gumbel_argmax chunked as on the CPU (in chunks of two rows here) and as on a GPU (every row at once): the
    tokens of the noise's definition, computed on the host, row by row; rows with zeros, a one-token row and a
    NaN row (no token with mass: +inf everywhere, token 0) among them."""
    import specdist.cores.coupling as coupling

    vocab = 300
    probs = torch.softmax(3 * torch.randn(7, vocab, generator=torch.Generator().manual_seed(4)), -1)
    probs[1, ::2] = 0
    probs[2] = 0
    probs[2, 17] = 1
    probs[3] = float("nan")
    starts = row_starts(2**63 + 5, range(40, 47))
    monkeypatch.setattr(coupling, "CHUNK_ELEMENTS", 2 * vocab)  # the CPU rule: chunks of two rows
    rule = coupling.rows_per_chunk
    monkeypatch.setattr(coupling, "rows_per_chunk", lambda _device_type, rows, v: rule(device_type, rows, v))
    assert coupling.rows_per_chunk("cpu", 7, vocab) == (2 if device_type == "cpu" else 7)
    got = gumbel_argmax(probs, torch.tensor(starts, dtype=torch.int64)).tolist()
    assert got == _host_argmax(probs, starts)
    assert got[2] == 17 and got[3] == 0 and got[1] % 2 == 1


class _Kernels(TorchDispatchMode):
    """The aten operations dispatched while active that are not views: each a kernel launch on a GPU."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:
            self.ops.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("rows,vocab", [(1, 1_000), (17, 32_000), (1_088, 128_256), (4_096, 262_144)])
def test_the_noise_launches_a_fixed_number_of_kernels_on_a_device(rows: int, vocab: int) -> None:
    """On a device other than the CPU (the meta device here: shapes only, no memory, so a verification of 64
    requests x 17 positions over a 128k vocabulary costs nothing) one call is one chunk: the same operations
    whatever its rows and vocabulary, about 25 (cache-sized chunks were 2 rows at 128k: 10,000 operations)."""

    def call(rows: int, vocab: int) -> list[str]:
        probs = torch.empty(rows, vocab, device="meta")
        starts = torch.empty(rows, dtype=torch.int64, device="meta")
        gumbel_argmax(probs, starts)  # the token offsets of a vocabulary are made once, then kept
        with _Kernels() as k:
            tokens = gumbel_argmax(probs, starts)
        assert tokens.shape == (rows,)
        return k.ops

    ops = call(rows, vocab)
    assert len(ops) <= 25, f"{len(ops)} operations for {rows} x {vocab}: {ops}"
    assert ops == call(1, 8)


def test_the_cpu_still_computes_the_noise_in_cache_sized_chunks() -> None:
    """The CPU rule: 2^18 (row, token) pairs a chunk (rows of a 128k vocabulary: 2 a chunk; at least one)."""
    from specdist.cores.coupling import CHUNK_ELEMENTS, rows_per_chunk

    assert rows_per_chunk("cpu", 1_088, 128_256) == CHUNK_ELEMENTS // 128_256 == 2
    assert rows_per_chunk("cpu", 5, 1 << 20) == 1
    assert rows_per_chunk("cuda", 1_088, 128_256) == 1_088


@pytest.mark.parametrize("device", devices())
def test_noise_is_the_same_on_every_device(device: str) -> None:
    """The hash bits on the device equal the CPU's, and so do the tokens the noise picks (the float64
    logarithm may differ in its last bit between devices; a pick that close to a tie would show here)."""
    starts = torch.tensor(row_starts(99, range(16)), dtype=torch.int64)
    x = torch.arange(1, 4097, dtype=torch.int64)
    cpu = _mix64_t(starts[:, None] + x[None, :])
    dev = _mix64_t(starts.to(device)[:, None] + x.to(device)[None, :])
    assert torch.equal(dev.cpu(), cpu)
    probs = torch.softmax(torch.randn(16, 4096, generator=torch.Generator().manual_seed(2)), -1)
    assert torch.equal(gumbel_argmax(probs.to(device), starts.to(device)).cpu(), gumbel_argmax(probs, starts))


def _unmix64(z: int) -> int:
    """The inverse of SplitMix64's output function (mix64): the hash is a bijection, so a client can aim it."""
    m = (1 << 64) - 1

    def unxorshift(x: int, s: int) -> int:
        y = x
        for _ in range(64 // s + 1):
            y = x ^ (y >> s)
        return y & m

    z = unxorshift(z, 31)
    z = (z * pow(0x94D049BB133111EB, -1, 1 << 64)) & m
    z = unxorshift(z, 27)
    z = (z * pow(0xBF58476D1CE4E5B9, -1, 1 << 64)) & m
    return unxorshift(z, 30)


def test_the_noise_never_lets_a_zero_probability_token_win() -> None:
    """The stream element whose top bits are all ones (a client can find the seed that lands on it: the hash is
    invertible) must still give a uniform strictly below 1: E = -log u > 0, and a token of probability 0 never
    wins (E / p = 0 / 0 would be NaN, which argmin picks). The same on the draft's side, which uses the same
    noise."""
    from specdist.cores.coupling import _signed
    from specdist.randomness import GOLDEN

    x = _unmix64((1 << 64) - 1)
    assert mix64(x) == (1 << 64) - 1
    start = _signed(x - GOLDEN)  # token 0's element (start + 1 * golden) is x
    starts = torch.tensor([start, start], dtype=torch.int64)
    e = exponential_noise(starts, 3)  # [2, 3]
    assert torch.isfinite(e).all() and (e > 0).all(), e
    probs = torch.tensor([[0.0, 0.3, 0.7], [0.0, 1.0, 0.0]])  # token 0 impossible; row 2 one token possible
    assert gumbel_argmax(probs, starts).tolist()[1] == 1
    assert gumbel_argmax(probs, starts).tolist()[0] in (1, 2)
    # the smallest element too: u > 0, E finite
    x0 = _unmix64(0)
    e0 = exponential_noise(torch.tensor([_signed(x0 - GOLDEN)], dtype=torch.int64), 1)
    assert torch.isfinite(e0).all() and (e0 > 0).all()
