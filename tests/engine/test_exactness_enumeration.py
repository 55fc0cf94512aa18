"""Exactness of speculative verification by exact enumeration (no sampling).

Contract: docs/exactness.md sections 1-2. Three families of checks:

1. ``one_step_distribution(p, q) == p`` entry by entry (float64, atol 1e-12) for many
   random ``(p, q)`` pairs produced by :func:`process_logits` with *independent*
   target / draft settings (so supports differ), and for hand-made boundary cases.
2. The real :func:`rejection_sample` driven through a whole decoding chain: for tiny
   vocabularies, every draft sequence is enumerated with its probability, the
   acceptance uniforms are integrated analytically (and the sampler's decisions are
   checked at deterministic uniforms on both sides of every threshold), and the mass
   the sampler gives each final token is *measured exactly* by locating the
   breakpoints of its inverse-CDF map ``v -> token`` by bisection over the sample
   uniform. The resulting distribution of the first ``m`` emitted tokens must equal
   the target's joint distribution. Deliberately wrong verifiers run through the same
   harness must fail it (negative controls: the harness has power).
3. :func:`sample_from` never returns a zero-probability token.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from support.rejection_law import one_step_distribution

from specdist.cores.rejection import (
    VerifyResult,
    acceptance_probability,
    final_uniforms,
    rejection_sample,
    residual_distribution,
)
from specdist.cores.sampling import process_logits, sample_from

ATOL = 1e-12
TEMPERATURES = (0.5, 1.0, 1.7)
TOP_KS = (0, 1, 3)
TOP_PS = (1.0, 0.9, 0.5)
SETTINGS = list(itertools.product(TEMPERATURES, TOP_KS, TOP_PS))  # 27 (temperature, top_k, top_p)


def _processed(logits: torch.Tensor, settings: list[tuple[float, int, float]]) -> torch.Tensor:
    """process_logits with per-row settings, returned as float64 rows renormalised to sum 1.

    process_logits works in float32, so its rows sum to 1 only up to ~1e-7. The identity
    ``one_step(p, q) == p`` needs ``sum p == sum q`` exactly (otherwise the residual is
    rescaled by ``sum[q-p]_+ / sum[p-q]_+ != 1``), so both are renormalised in float64;
    that changes no support and no ordering.
    """
    temp = torch.tensor([s[0] for s in settings], dtype=torch.float32)
    top_k = torch.tensor([s[1] for s in settings], dtype=torch.long)
    top_p = torch.tensor([s[2] for s in settings], dtype=torch.float32)
    p = process_logits(logits, temp, top_k, top_p).double()
    return p / p.sum(-1, keepdim=True)


def _expected_residual(p: np.ndarray, q: np.ndarray) -> np.ndarray | None:
    r = np.clip(p - q, 0.0, None)
    s = r.sum()
    return r / s if s > 0 else None


# --------------------------------------------------------------------------- 1. one step
@pytest.mark.slow
@pytest.mark.parametrize("vocab", list(range(2, 13)))
def test_one_step_equals_target_random_processed_pairs(vocab: int) -> None:
    """All 27 x 27 (target settings, draft settings) pairs, 3 logit draws each, per V."""
    gen = torch.Generator().manual_seed(1000 + vocab)
    pairs = [(a, b) for a in SETTINGS for b in SETTINGS]
    reps = 3
    rows = len(pairs) * reps
    scale = torch.tensor([0.5, 2.0, 6.0])[torch.randint(0, 3, (rows, 2), generator=gen)]  # [rows, 2]
    logits_t = torch.randn(rows, vocab, generator=gen) * scale[:, :1]
    logits_d = torch.randn(rows, vocab, generator=gen) * scale[:, 1:]
    # A quarter of the rows get quantised logits, so top-k ties at the k-th value occur.
    quant = torch.rand(rows, generator=gen) < 0.25
    logits_t = torch.where(quant[:, None], (logits_t * 2).round() / 2, logits_t)
    # A tenth of the draft rows reuse the target logits: p == q (when settings agree too).
    same = torch.rand(rows, generator=gen) < 0.1
    logits_d = torch.where(same[:, None], logits_t, logits_d)

    p = _processed(logits_t, [a for a, _ in pairs for _ in range(reps)])
    q = _processed(logits_d, [b for _, b in pairs for _ in range(reps)])

    out = one_step_distribution(p, q)
    assert out.dtype == torch.float64
    err = (out - p).abs().max().item()
    assert err <= ATOL, f"one_step_distribution differs from p by {err:.3e} (V={vocab})"

    r = residual_distribution(p, q)
    assert bool((r >= 0).all()), "residual has negative entries"
    assert torch.allclose(r.sum(-1), torch.ones(rows, dtype=torch.float64), atol=ATOL, rtol=0)
    a = acceptance_probability(p, q)
    assert bool(((a >= 0) & (a <= 1)).all())

    pn, qn, rn, an = p.numpy(), q.numpy(), r.numpy(), a.numpy()
    supports_differ = 0
    for i in range(rows):
        supports_differ += bool(((pn[i] > 0) != (qn[i] > 0)).any())
        exp_r = _expected_residual(pn[i], qn[i])
        if exp_r is not None and np.clip(pn[i] - qn[i], 0, None).sum() > 1e-9:
            np.testing.assert_allclose(rn[i], exp_r, rtol=0, atol=1e-12)
        pos = qn[i] > 0
        np.testing.assert_allclose(an[i][pos], np.minimum(1.0, pn[i][pos] / qn[i][pos]), rtol=1e-12, atol=0)
        # The accepted mass of the emitted distribution is min(p, q), the rest is the residual.
        accepted = qn[i] * an[i]
        np.testing.assert_allclose(accepted, np.minimum(pn[i], qn[i]), rtol=0, atol=ATOL)
    # The settings grid really produces pairs whose supports differ (top-k / top-p).
    assert supports_differ > rows // 4, f"only {supports_differ}/{rows} pairs have different supports"


def test_one_step_float32_close_to_target() -> None:
    """What the engine feeds (float32 processed rows, not renormalised): equal to p within 1e-6."""
    gen = torch.Generator().manual_seed(7)
    for vocab in (2, 5, 12):
        logits = torch.randn(2 * len(SETTINGS), vocab, generator=gen) * 3
        temp = torch.tensor([s[0] for s in SETTINGS] * 2)
        top_k = torch.tensor([s[1] for s in SETTINGS] * 2)
        top_p = torch.tensor([s[2] for s in SETTINGS] * 2)
        p = process_logits(logits[: len(SETTINGS)].repeat(2, 1), temp, top_k, top_p)
        q = process_logits(logits.flip(0), temp.flip(0), top_k.flip(0), top_p.flip(0))
        out = one_step_distribution(p, q)
        assert out.dtype == torch.float32
        assert (out - p).abs().max().item() < 1e-6


def _boundary_cases() -> list[tuple[str, list[float], list[float]]]:
    u5 = [0.2] * 5
    cases = [
        ("zeros in p", [0.0, 0.5, 0.0, 0.5, 0.0], u5),
        ("zeros in q", u5, [0.0, 0.6, 0.0, 0.4, 0.0]),
        ("zeros in both, overlapping", [0.0, 0.3, 0.7, 0.0, 0.0], [0.0, 0.0, 0.5, 0.5, 0.0]),
        ("p == q", [0.1, 0.2, 0.3, 0.4, 0.0], [0.1, 0.2, 0.3, 0.4, 0.0]),
        ("p == q uniform", u5, u5),
        ("disjoint supports", [0.5, 0.5, 0.0, 0.0, 0.0], [0.0, 0.0, 0.3, 0.3, 0.4]),
        ("q one-hot (n-gram) on likely token", [0.1, 0.6, 0.1, 0.1, 0.1], [0.0, 1.0, 0.0, 0.0, 0.0]),
        ("q one-hot on zero-p token", [0.5, 0.0, 0.5, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0, 0.0]),
        ("q one-hot, p one-hot, equal", [0.0, 0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0, 0.0]),
        ("q one-hot, p one-hot, different", [0.0, 0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0, 0.0]),
        ("p one-hot (greedy), q spread", [0.0, 0.0, 0.0, 1.0, 0.0], [0.1, 0.2, 0.3, 0.3, 0.1]),
        ("p one-hot (greedy), q misses it", [0.0, 0.0, 0.0, 1.0, 0.0], [0.25, 0.25, 0.25, 0.0, 0.25]),
        ("tiny masses", [1e-30, 1.0 - 1e-30, 0.0, 0.0, 0.0], [0.5, 0.5, 0.0, 0.0, 0.0]),
        ("tiny q on big p", [0.0, 0.0, 0.0, 0.0, 1.0], [1.0 - 1e-20, 0.0, 0.0, 0.0, 1e-20]),
        ("V=2 swap", [0.9, 0.1], [0.1, 0.9]),
        ("V=2 one-hot vs uniform", [1.0, 0.0], [0.5, 0.5]),
    ]
    return cases


@pytest.mark.parametrize("name,p,q", _boundary_cases(), ids=[c[0] for c in _boundary_cases()])
def test_one_step_boundary_cases(name: str, p: list[float], q: list[float]) -> None:
    pt = torch.tensor(p, dtype=torch.float64)
    qt = torch.tensor(q, dtype=torch.float64)
    out = one_step_distribution(pt, qt)
    assert torch.allclose(out, pt, atol=ATOL, rtol=0), f"{name}: {out.tolist()} != {p}"
    r = residual_distribution(pt, qt)
    assert bool((r >= 0).all())
    assert abs(r.sum().item() - 1.0) <= ATOL
    exp_r = _expected_residual(np.array(p), np.array(q))
    if exp_r is not None:
        np.testing.assert_allclose(r.numpy(), exp_r, rtol=0, atol=ATOL)
    else:  # p == q: rejection is impossible; the fallback must still be a distribution on supp(p)
        assert bool((r[pt == 0] == 0).all())
    a = acceptance_probability(pt, qt)
    for x in range(len(p)):
        if q[x] > 0:
            assert a[x].item() == pytest.approx(min(1.0, p[x] / q[x]), abs=1e-15)
            if p[x] == 0:
                assert a[x].item() == 0.0  # p(x) = 0 with q(x) > 0 always rejects


def test_one_step_batched_shapes() -> None:
    gen = torch.Generator().manual_seed(3)
    p = torch.softmax(torch.randn(2, 3, 6, generator=gen, dtype=torch.float64) * 3, -1)
    q = torch.softmax(torch.randn(2, 3, 6, generator=gen, dtype=torch.float64) * 3, -1)
    out = one_step_distribution(p, q)
    assert out.shape == (2, 3, 6)
    assert (out - p).abs().max().item() <= ATOL


# --------------------------------------------------------------------------- 2. chains
# A "chain" is decoding of the first m tokens after a fixed prompt, with the engine's
# draft-length schedule for max_tokens = m: at a state s (tokens emitted so far) the
# draft length is kb = min(k, m - 1 - len(s)), so no emitted token lies beyond m and the
# tables below only need prefixes shorter than m.


class Chain:
    """Random target table P(. | prefix) and draft table Q(. | prefix) over all prefixes."""

    def __init__(self, vocab: int, k: int, m: int, ngram: bool, seed: int):
        self.vocab, self.k, self.m, self.ngram = vocab, k, m, ngram
        gen = torch.Generator().manual_seed(seed)
        rng = np.random.default_rng(seed)
        prefixes = [pre for n in range(m) for pre in itertools.product(range(vocab), repeat=n)]
        n = len(prefixes)
        # Different transforms for target and draft, so supports differ; some rows one-hot.
        s_t = [SETTINGS[i] for i in rng.integers(0, len(SETTINGS), n)]
        s_d = [SETTINGS[i] for i in rng.integers(0, len(SETTINGS), n)]
        lt = torch.randn(n, vocab, generator=gen, dtype=torch.float64) * 2.5
        ld = torch.randn(n, vocab, generator=gen, dtype=torch.float64) * 2.5
        same = torch.from_numpy(rng.random(n) < 0.15)  # q == p at some prefixes (residual has no mass)
        p = _processed(lt, s_t)
        q = _processed(ld, s_d)
        q = torch.where(same[:, None], p, q)
        self.P = {pre: p[i] for i, pre in enumerate(prefixes)}
        self.Q = {pre: q[i] for i, pre in enumerate(prefixes)}
        # n-gram mode: a deterministic proposal per prefix (0..kb tokens, q one-hot on them).
        self.proposal: dict[tuple, tuple] = {}
        if ngram:
            for pre in prefixes:
                kb = self.draft_len(pre)
                length = int(rng.integers(0, kb + 1)) if kb > 0 else 0
                if kb > 0 and length == 0 and rng.random() < 0.7:
                    length = kb  # mostly full proposals, some short or empty
                self.proposal[pre] = tuple(int(t) for t in rng.integers(0, vocab, length))

    def draft_len(self, state: tuple) -> int:
        return max(0, min(self.k, self.m - 1 - len(state)))

    def drafts(self, state: tuple) -> list[tuple[tuple, float]]:
        """Every draft the proposer can make at ``state``, with its probability."""
        kb = self.draft_len(state)
        if self.ngram:
            return [(self.proposal[state], 1.0)]
        out = []
        for x in itertools.product(range(self.vocab), repeat=kb):
            w = 1.0
            for i, t in enumerate(x):
                w *= self.Q[state + x[:i]][t].item()
            if w > 0:
                out.append((x, w))
        return out

    def target_joint(self) -> dict[tuple, float]:
        joint = {}
        for y in itertools.product(range(self.vocab), repeat=self.m):
            w = 1.0
            for i, t in enumerate(y):
                w *= self.P[y[:i]][t].item()
            joint[y] = w
        return joint


def _bisect_breakpoints(verify, args: dict, n_accepted: torch.Tensor, vocab: int, iters: int = 64) -> torch.Tensor:
    """For every row, ``br[:, b] = inf{v : final token(v) >= b}`` for b = 0..V (br[:, 0] = 0, br[:, V] = 1).

    The final token is ``tokens[row, n]``; ``v -> token`` is inverse-CDF sampling and so
    non-decreasing (checked on a grid by the caller), which makes bisection exact up to
    float64 resolution. Token t then has mass ``br[:, t+1] - br[:, t]``.
    """
    rows = n_accepted.shape[0]
    nb = vocab - 1
    rep = {key: (val.repeat_interleave(nb, 0) if isinstance(val, torch.Tensor) else val) for key, val in args.items()}
    n_rep = n_accepted.repeat_interleave(nb)
    bound = torch.arange(1, vocab).repeat(rows)  # [rows * nb]
    lo = torch.zeros(rows * nb, dtype=torch.float64)
    hi = torch.ones(rows * nb, dtype=torch.float64)
    ar = torch.arange(rows * nb)
    at_zero = verify(**rep, sample_uniforms=lo.clone()).tokens[ar, n_rep] >= bound
    hi = torch.where(at_zero, lo, hi)  # the breakpoint is exactly 0 (bisection would stop at 2**-iters)
    for _ in range(iters):
        mid = (lo + hi) / 2
        res = verify(**rep, sample_uniforms=mid)
        tok = res.tokens[ar, n_rep]
        up = tok >= bound
        hi = torch.where(up, mid, hi)
        lo = torch.where(up, lo, mid)
    zero, one = torch.zeros(rows, 1, dtype=torch.float64), torch.ones(rows, 1, dtype=torch.float64)
    br = torch.cat([zero, hi.view(rows, nb), one], 1)
    return br


def chain_distribution(chain: Chain, verify=rejection_sample) -> tuple[dict[tuple, float], dict[str, list[str]]]:
    """Exact distribution of the first m emitted tokens when ``verify`` is the rejection sampler.

    Probabilities of draft sequences and of the acceptance events are computed here
    analytically; which tokens come out of each event, and with what mass over the
    sample uniform, is read off ``verify`` itself. Also returns the problems found on the
    way, by category:

    - ``decision``: an accept/reject decision at deterministic uniforms just below / above
      ``min(1, p_i/q_i)`` (or at u = 0 when p_i(x_i) = 0) that is not the rule's, an event's
      uniforms giving another accepted count, or accepted tokens that are not the draft;
    - ``final``: the sampler's final-token law for an event (measured by bisection) differs
      from the residual ``[p-q]_+ / sum`` (rejection) or from ``p_{j+1}`` (all accepted, bonus)
      by more than 1e-12, or the midpoint of a CDF cell of that law does not return its token;
    - ``monotone``: ``v -> final token`` is not non-decreasing (the bisection needs it).
    """
    V, K = chain.vocab, chain.k
    problems: dict[str, list[str]] = {"decision": [], "final": [], "monotone": []}
    expected_final: list[np.ndarray] = []  # analytic final-token law of each event row
    states = [s for n in range(chain.m) for s in itertools.product(range(V), repeat=n)]

    # One row per (state, draft x, event j), where event j = "x_1..x_j accepted, then stop"
    # (j < len(x): rejection at j; j == len(x): all accepted, bonus token).
    meta: list[tuple[tuple, tuple, int, float]] = []  # (state, x, j, probability of x and event j)
    tp, dp, dt, nd, au = [], [], [], [], []
    # Threshold checks: rows whose accept uniforms sit just below / above one threshold.
    chk_meta: list[tuple[tuple, tuple, int, bool]] = []  # (state, x, position, expect accept)
    ctp, cdp, cdt, cnd, cau = [], [], [], [], []

    for s in states:
        for x, wx in chain.drafts(s):
            nx = len(x)
            p_rows = torch.zeros(K + 1, V, dtype=torch.float64)
            q_rows = torch.zeros(K, V, dtype=torch.float64)
            a = []
            for i in range(nx + 1):
                p_rows[i] = chain.P[s + x[:i]]
                if i < nx:
                    q_i = (
                        chain.Q[s + x[:i]]
                        if not chain.ngram
                        else torch.nn.functional.one_hot(torch.tensor(x[i]), V).double()
                    )
                    q_rows[i] = q_i
                    px, qx = p_rows[i, x[i]].item(), q_i[x[i]].item()
                    a.append(min(1.0, px / qx))  # qx > 0: x was proposed
            toks = torch.full((K,), -1, dtype=torch.long)
            toks[:nx] = torch.tensor(x, dtype=torch.long)

            reach = 1.0
            for j in range(nx + 1):
                if j < nx:
                    prob = reach * (1.0 - a[j])
                else:
                    prob = reach
                if prob > 0:
                    u = torch.full((K,), 0.5, dtype=torch.float64)
                    u[:j] = torch.tensor(a[:j], dtype=torch.float64) / 2  # inside [0, a_i): accept
                    if j < nx:
                        u[j] = (a[j] + 1.0) / 2  # inside [a_j, 1): reject
                    meta.append((s, x, j, wx * prob))
                    if j < nx:
                        pj, qj = p_rows[j].numpy(), q_rows[j].numpy()
                        expected_final.append(np.clip(pj - qj, 0, None) / np.clip(pj - qj, 0, None).sum())
                    else:
                        expected_final.append(p_rows[j].numpy().copy())
                    tp.append(p_rows), dp.append(q_rows), dt.append(toks), nd.append(nx), au.append(u)
                if j < nx:
                    # Deterministic uniforms on both sides of threshold j (earlier positions at u = 0,
                    # which accepts iff p > 0, i.e. a > 0; only reachable positions are checked).
                    if reach > 0:
                        for below, uj in ((True, a[j] * (1 - 1e-9)), (False, a[j] * (1 + 1e-9) + 1e-300)):
                            if (below and a[j] == 0) or (not below and uj >= 1.0):
                                continue
                            u = torch.zeros(K, dtype=torch.float64)
                            u[j] = uj
                            u[j + 1 :] = 0.999
                            chk_meta.append((s, x, j, below))
                            ctp.append(p_rows), cdp.append(q_rows), cdt.append(toks), cnd.append(nx), cau.append(u)
                        if a[j] == 0:  # u = 0 must still reject when p(x) = 0
                            u = torch.zeros(K, dtype=torch.float64)
                            u[j + 1 :] = 0.999
                            chk_meta.append((s, x, j, False))
                            ctp.append(p_rows), cdp.append(q_rows), cdt.append(toks), cnd.append(nx), cau.append(u)
                    reach *= a[j]

    def call_args(tp_, dp_, dt_, nd_, au_):
        return {
            "target_probs": torch.stack(tp_),
            "draft_probs": None if chain.ngram else torch.stack(dp_),
            "draft_tokens": torch.stack(dt_),
            "num_draft": torch.tensor(nd_, dtype=torch.long),
            "accept_uniforms": torch.stack(au_),
        }

    # Acceptance decisions at the thresholds.
    cargs = call_args(ctp, cdp, cdt, cnd, cau)
    cres = verify(**cargs, sample_uniforms=torch.full((len(chk_meta),), 0.5, dtype=torch.float64))
    for row, (s, x, j, expect) in enumerate(chk_meta):
        got = int(cres.num_accepted[row]) > j
        if got != expect:
            problems["decision"].append(f"state {s} draft {x} position {j}: expected accept={expect}, got {got}")

    # Events: accepted count and accepted tokens, then exact final-token masses.
    args = call_args(tp, dp, dt, nd, au)
    rows = len(meta)
    res0 = verify(**args, sample_uniforms=torch.full((rows,), 0.5, dtype=torch.float64))
    n_acc = res0.num_accepted.clone()
    for row, (s, x, j, _) in enumerate(meta):
        if int(n_acc[row]) != j:
            problems["decision"].append(f"state {s} draft {x}: event {j} uniforms gave {int(n_acc[row])} accepted")
        elif res0.tokens[row, :j].tolist() != list(x[:j]):
            problems["decision"].append(f"state {s} draft {x}: accepted tokens {res0.tokens[row, :j].tolist()}")
    # Monotonicity of v -> final token on a grid (needed for the bisection to be exact).
    grid = (torch.arange(33, dtype=torch.float64) + 0.5) / 33
    prev = None
    ar = torch.arange(rows)
    for v in grid:
        tok = verify(**args, sample_uniforms=torch.full((rows,), float(v), dtype=torch.float64)).tokens[ar, n_acc]
        if prev is not None and bool((tok < prev).any()):
            problems["monotone"].append("final token is not monotone in the sample uniform")
            break
        prev = tok
    br = _bisect_breakpoints(verify, args, n_acc, V)
    mass = (br[:, 1:] - br[:, :-1]).numpy()  # [rows, V]

    # Final-token law per event against the analytic one, and CDF-cell midpoints.
    f = np.stack(expected_final)  # [rows, V]
    for row in np.nonzero(np.abs(mass - f).max(1) > ATOL)[0][:20]:
        s, x, j, _ = meta[row]
        problems["final"].append(f"state {s} draft {x} event {j}: law {mass[row].round(6)} != {f[row].round(6)}")
    cdf = np.cumsum(f, 1)
    mids = torch.from_numpy(cdf - f / 2)  # [rows, V] midpoint of each token's cell
    rep_args = {key: (v.repeat_interleave(V, 0) if isinstance(v, torch.Tensor) else v) for key, v in args.items()}
    res_mid = verify(**rep_args, sample_uniforms=mids.reshape(-1).clamp(max=1 - 1e-16))
    tok_mid = res_mid.tokens[torch.arange(rows * V), n_acc.repeat_interleave(V)].view(rows, V).numpy()
    bad = (f > 0) & (tok_mid != np.arange(V)[None, :])
    for row, t in zip(*np.nonzero(bad)):
        if len(problems["final"]) < 40:
            s, x, j, _ = meta[row]
            got_t = tok_mid[row, t]
            problems["final"].append(f"state {s} draft {x} event {j}: midpoint of token {t}'s cell gave {got_t}")

    # Step distribution per state (exact), then compose along the chain.
    step: dict[tuple, dict[tuple, float]] = {s: {} for s in states}
    for row, (s, x, j, w) in enumerate(meta):
        emitted = tuple(res0.tokens[row, : int(n_acc[row])].tolist())
        for t in range(V):
            if mass[row, t] > 0:
                key = emitted + (t,)
                step[s][key] = step[s].get(key, 0.0) + w * mass[row, t]

    memo: dict[tuple, dict[tuple, float]] = {}

    def dist_from(s: tuple) -> dict[tuple, float]:
        if len(s) >= chain.m:
            return {s[: chain.m]: 1.0}
        if s not in memo:
            acc: dict[tuple, float] = {}
            for emitted, w in step[s].items():
                for y, wy in dist_from(s + emitted).items():
                    acc[y] = acc.get(y, 0.0) + w * wy
            memo[s] = acc
        return memo[s]

    return dist_from(()), problems


def _max_diff(a: dict[tuple, float], b: dict[tuple, float]) -> float:
    return max(abs(a.get(key, 0.0) - b.get(key, 0.0)) for key in set(a) | set(b))


CHAINS = [
    # (vocab, k, m, ngram, seed)
    (3, 2, 3, False, 11),
    (3, 2, 4, False, 12),  # two and more verification steps per chain
    (4, 3, 4, False, 13),  # full k = 3 draft, bonus at position 4
    (4, 2, 3, False, 14),
    (3, 3, 4, False, 15),
    (3, 2, 3, True, 21),  # n-gram: q one-hot, draft_probs=None, variable num_draft (incl. 0)
    (4, 3, 4, True, 22),
    (3, 2, 4, True, 23),
]


@pytest.mark.parametrize("vocab,k,m,ngram,seed", CHAINS)
def test_rejection_sample_chain_matches_target_joint(vocab: int, k: int, m: int, ngram: bool, seed: int) -> None:
    chain = Chain(vocab, k, m, ngram, seed)
    got, problems = chain_distribution(chain)
    assert not any(problems.values()), {key: msgs[:3] for key, msgs in problems.items()}
    want = chain.target_joint()
    assert abs(sum(got.values()) - 1.0) <= 1e-12
    impossible = [y for y, w in got.items() if w > 0 and want[y] == 0]
    assert not impossible, f"sequences with target probability 0 are emitted: {impossible[:3]}"
    diff = _max_diff(got, want)
    assert diff <= ATOL, f"first {m} emitted tokens differ from the target joint by {diff:.3e}"


def test_chain_fixture_covers_the_interesting_cases() -> None:
    """The random tables exercise rejection, full acceptance, p == q and disjoint supports."""
    seen = {"p==q": 0, "support differs": 0, "p one-hot": 0}
    for vocab, k, m, ngram, seed in CHAINS:
        chain = Chain(vocab, k, m, ngram, seed)
        for pre, p in chain.P.items():
            q = chain.Q[pre]
            seen["p==q"] += bool(torch.equal(p, q))
            seen["support differs"] += bool(((p > 0) != (q > 0)).any())
            seen["p one-hot"] += bool((p == 1).any())
    assert all(v > 3 for v in seen.values()), seen


# Negative controls: deliberately wrong verifiers, run through the same harness.
def _wrong_verifier(kind: str):
    def verify(target_probs, draft_probs, draft_tokens, num_draft, accept_uniforms, sample_uniforms):
        bsz, k = draft_tokens.shape
        rows = torch.arange(bsz)
        if k == 0:
            final = sample_from(target_probs[:, 0], final_uniforms(sample_uniforms, torch.zeros_like(rows)))
            return VerifyResult(final[:, None], torch.zeros(bsz, dtype=torch.long))
        valid = torch.arange(k)[None, :] < num_draft[:, None]
        tok = draft_tokens.clamp(min=0)
        if kind == "ignore_prefix":  # every position judged with the first position's p
            p_x = target_probs[:, :1].expand(-1, k, -1).gather(-1, tok[..., None]).squeeze(-1)
        else:
            p_x = target_probs[:, :k].gather(-1, tok[..., None]).squeeze(-1)
        q_x = draft_probs.gather(-1, tok[..., None]).squeeze(-1) if draft_probs is not None else torch.ones_like(p_x)
        accepted = (accept_uniforms * q_x < p_x) & valid
        n = accepted.long().cumprod(-1).sum(-1)
        p_n = target_probs[rows, n]
        at = n.clamp(max=k - 1)
        if draft_probs is not None:
            q_n = draft_probs[rows, at]
        else:
            q_n = torch.zeros_like(p_n).scatter_(-1, tok[rows, at][:, None], 1.0)
        rejected = (n < num_draft)[:, None]
        if kind == "resample_from_p":  # on rejection sample p instead of the residual
            final_dist = p_n
        elif kind == "bonus_off_by_one":  # bonus from the last draft position's p (wrong prefix)
            bonus = target_probs[rows, (n - 1).clamp(min=0)]
            final_dist = torch.where(rejected, residual_distribution(p_n, q_n), bonus)
        else:
            final_dist = torch.where(rejected, residual_distribution(p_n, q_n), p_n)
        final = sample_from(final_dist, final_uniforms(sample_uniforms, n))
        out = torch.full((bsz, k + 1), -1, dtype=torch.long)
        keep = torch.arange(k)[None, :] < n[:, None]
        out[:, :k] = torch.where(keep, draft_tokens, out[:, :k])
        out[rows, n] = final
        return VerifyResult(out, n)

    return verify


@pytest.mark.parametrize("kind", ["resample_from_p", "bonus_off_by_one"])
@pytest.mark.parametrize("ngram", [False, True])
def test_negative_control_wrong_final_token_rule_is_detected(kind: str, ngram: bool) -> None:
    """Same decisions, wrong final-token distribution: the harness must see a clear mismatch."""
    chain = Chain(4, 3, 4, ngram, 13 if not ngram else 27)  # seeds whose root step is not degenerate
    got, problems = chain_distribution(chain, _wrong_verifier(kind))
    assert not problems["decision"] and not problems["monotone"]  # acceptance decisions are the right ones...
    assert problems["final"], f"{kind}: wrong final-token law not flagged"  # ...the per-event law is not...
    assert abs(sum(got.values()) - 1.0) <= 1e-12
    diff = _max_diff(got, chain.target_joint())
    assert diff > 1e-3, f"{kind}: wrong rule not detected (max diff {diff:.3e})"  # ...and neither is the joint
    # The correct verifier on the same chain is exact, so the difference is the rule's.
    assert _max_diff(chain_distribution(chain)[0], chain.target_joint()) <= ATOL


def test_negative_control_ignoring_the_accepted_prefix_is_detected() -> None:
    """Judging every position with p at position 1 breaks left-to-right conditioning."""
    chain = Chain(4, 3, 4, False, 13)
    got, problems = chain_distribution(chain, _wrong_verifier("ignore_prefix"))
    assert problems["decision"], "decisions made with the wrong prefix's p were not flagged"


def test_correct_reference_verifier_passes_harness() -> None:
    """The re-implementation used for the negative controls is itself exact when not broken."""
    chain = Chain(3, 2, 4, False, 12)
    got, problems = chain_distribution(chain, _wrong_verifier("none"))
    assert not any(problems.values())
    assert _max_diff(got, chain.target_joint()) <= ATOL


def test_rejection_sample_without_drafts_samples_target() -> None:
    """K = 0 (no request drafted anything): the emitted token's law is p at position 1."""
    gen = torch.Generator().manual_seed(5)
    p = torch.softmax(torch.randn(6, 1, 5, generator=gen, dtype=torch.float64) * 3, -1)
    p[0, 0, 2] = 0
    p[1, 0, :4] = 0
    p = p / p.sum(-1, keepdim=True)
    args = {
        "target_probs": p,
        "draft_probs": torch.zeros(6, 0, 5, dtype=torch.float64),
        "draft_tokens": torch.zeros(6, 0, dtype=torch.long),
        "num_draft": torch.zeros(6, dtype=torch.long),
        "accept_uniforms": torch.zeros(6, 0, dtype=torch.float64),
    }
    res = rejection_sample(**args, sample_uniforms=torch.full((6,), 0.3, dtype=torch.float64))
    assert res.tokens.shape == (6, 1) and bool((res.num_accepted == 0).all())
    br = _bisect_breakpoints(rejection_sample, args, torch.zeros(6, dtype=torch.long), 5)
    mass = br[:, 1:] - br[:, :-1]
    assert (mass - p[:, 0]).abs().max().item() <= ATOL


# --------------------------------------------------------------------------- 3. sample_from
def _uniform_sweep() -> torch.Tensor:
    fine = (torch.arange(1000, dtype=torch.float64) + 0.5) / 1000
    edges = torch.tensor(
        [0.0, 1e-300, 5e-324, 1e-16, 1e-9, 0.5, 1 - 1e-9, 1 - 1e-16, math.nextafter(1.0, 0.0)], dtype=torch.float64
    )
    return torch.cat([edges, fine])


def _zero_patterned_rows(vocab: int, gen: torch.Generator) -> torch.Tensor:
    rows = []
    for pattern in ("start", "middle", "end", "start+end", "alternate", "single"):
        w = torch.rand(vocab, generator=gen, dtype=torch.float64) + 0.01
        if pattern == "start":
            w[: vocab // 3 + 1] = 0
        elif pattern == "middle":
            w[vocab // 3 : 2 * vocab // 3 + 1] = 0
        elif pattern == "end":
            w[-(vocab // 3 + 1) :] = 0
        elif pattern == "start+end":
            w[0] = 0
            w[-1] = 0
        elif pattern == "alternate":
            w[::2] = 0
        else:
            w[:] = 0
            w[vocab // 2] = 0.7
        rows.append(w)
    base = torch.stack(rows)
    tiny = base.clone()
    tiny[tiny > 0] *= 1e-30  # total mass far from 1 (the residual is passed unnormalised)
    big = base * 7.1
    with_tiny_entry = base.clone()
    nz = with_tiny_entry[0].nonzero()[:, 0]
    with_tiny_entry[0, nz[-1]] = 1e-300  # a positive entry too small to move the float64 CDF
    return torch.cat([base, base / base.sum(-1, keepdim=True), tiny, big, with_tiny_entry])


@pytest.mark.parametrize("vocab", [3, 8, 50, 300])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_sample_from_never_returns_zero_probability_token(vocab: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(vocab)
    probs = _zero_patterned_rows(vocab, gen).to(dtype)
    probs = probs[probs.sum(-1) > 0]  # 1e-300 underflows in float32; rows must have positive mass
    u = _uniform_sweep()
    n_rows, n_u = probs.shape[0], u.shape[0]
    tok = sample_from(probs.repeat_interleave(n_u, 0), u.repeat(n_rows))  # [rows * n_u]
    picked = probs.repeat_interleave(n_u, 0).gather(-1, tok[:, None]).squeeze(-1)
    bad = (picked <= 0).nonzero()[:, 0]
    assert bad.numel() == 0, (
        f"zero-probability token drawn: row {int(bad[0]) // n_u}, u={u[int(bad[0]) % n_u].item()!r}, "
        f"token {int(tok[bad[0]])}"
    )
    assert bool(((tok >= 0) & (tok < vocab)).all())


def test_sample_from_is_inverse_cdf() -> None:
    """Midpoints of the CDF cells return that cell's token (so each token gets exactly its mass)."""
    probs = torch.tensor([[0.0, 0.25, 0.0, 0.5, 0.25, 0.0]], dtype=torch.float64)
    cdf = probs.cumsum(-1)[0]
    for t in range(6):
        if probs[0, t] > 0:
            lo = cdf[t] - probs[0, t]
            for v in (lo + 1e-12, (lo + cdf[t]) / 2, cdf[t] - 1e-12):
                assert sample_from(probs, torch.tensor([float(v)], dtype=torch.float64)).item() == t
