"""The G-test machinery of the frequency tests: exact target laws of tiny models, cells, statistics.

Shared by the frequency tests (test_exactness_frequency, test_dynamic_draft, test_remote_engine);
a helper module, not a test module.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

import numpy as np
import torch
from scipy import stats

VOCAB = 8
K = 3  # num_speculative_tokens
ALPHA = 1e-4  # false-failure rate of each G-test for a correct sampler
N = 4000  # sequences per case
BATCH = 256  # engine max_batch_size: one generate() call per case, the engine streams N prompts through 256 slots
MAX_MODEL_LEN = 32
PROMPT_MODEL = [1, 2, 3]
PROMPT_NGRAM = [1, 2, 3, 1, 2, 3]  # repeats, so prompt lookup proposes (first proposal: token 1)
NGRAM_MIN, NGRAM_MAX = 1, 3  # the config defaults
MIN_POWER_WRONG_RULE = 0.99  # asserted power against "resample from p instead of the residual"


@dataclass(frozen=True)
class Case:
    method: str  # "model" | "ngram"
    max_tokens: int
    window: int  # the first `window` tokens are compared (window <= max_tokens)
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    coupling: str = "gumbel"  # sampling.coupling of the engine that samples

    @property
    def prompt(self) -> list[int]:
        return PROMPT_MODEL if self.method == "model" else PROMPT_NGRAM

    @property
    def id(self) -> str:
        s = f"{self.method}-T{self.temperature}-L{self.max_tokens}"
        s += f"-top_k{self.top_k}" if self.top_k else ""
        s += f"-top_p{self.top_p}" if self.top_p < 1 else ""
        s += f"-first{self.window}" if self.window < self.max_tokens else ""
        return s + f"-{self.coupling}"


@functools.lru_cache(maxsize=None)
def _hf_logits(path: str, prompt: tuple[int, ...], window: int) -> dict[tuple, np.ndarray]:
    """Raw next-token logits (float64) after ``prompt + prefix`` for every prefix shorter than ``window``.

    Plain Hugging Face forward over all ``8**window`` continuations at once.
    """
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path).double().eval()
    seqs = list(itertools.product(range(VOCAB), repeat=window))
    ids = torch.tensor([list(prompt) + list(s) for s in seqs])
    with torch.no_grad():
        logits = model(input_ids=ids).logits.double().numpy()  # [S, P + W, V]
    table: dict[tuple, np.ndarray] = {}
    for si, s in enumerate(seqs):
        for i in range(window):
            table.setdefault(s[:i], logits[si, len(prompt) - 1 + i])
    return table


def transform(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> tuple[np.ndarray, float]:
    """Temperature -> top-k -> top-p (nucleus), in float64. Returns (probs, decision margin).

    top-k keeps every token whose scaled logit is >= the k-th largest; top-p keeps the
    smallest set of most likely tokens whose mass reaches top_p (a token is kept iff the
    mass of the tokens ranked strictly before it is < top_p). The margin is how far the
    inputs are from flipping a keep/drop decision (gap at the k-th logit, distance of
    every "mass before" from top_p); the engine computes in float32, so a margin of
    1e-5 or more means its supports are the same as these.
    """
    z = logits / temperature
    margin = np.inf
    if top_k and top_k < len(z):
        desc = np.sort(z)[::-1]
        kth = desc[top_k - 1]
        margin = min(margin, kth - desc[top_k])
        z = np.where(z >= kth, z, -np.inf)
    p = np.exp(z - z.max())
    p /= p.sum()
    if top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        sp = p[order]
        before = np.cumsum(sp) - sp
        margin = min(margin, np.abs(before - top_p).min())
        drop = order[before >= top_p]
        p[drop] = 0.0
        p /= p.sum()
    return p, float(margin)


def _prob_table(path: str, case: Case) -> tuple[dict[tuple, np.ndarray], float]:
    raw = _hf_logits(path, tuple(case.prompt), case.window)
    table, margin = {}, np.inf
    for pre, lg in raw.items():
        table[pre], m = transform(lg, case.temperature, case.top_k, case.top_p)
        margin = min(margin, m)
    return table, margin


def joint(table: dict[tuple, np.ndarray], window: int) -> np.ndarray:
    """P(y_1..y_W) = prod_i table[y_<i][y_i], in itertools.product order (index = base-8 number)."""
    return np.array(
        [np.prod([table[y[:i]][y[i]] for i in range(window)]) for y in itertools.product(range(VOCAB), repeat=window)]
    )


def seq_index(tokens: list[int]) -> int:
    idx = 0
    for t in tokens:
        idx = idx * VOCAB + t
    return idx


# ----------------------------------------------------------------------------- statistics
def merge_cells(p: np.ndarray, n: int, min_expected: float = 5.0) -> list[np.ndarray]:
    """Cells of positive probability; those with expected count < min_expected pooled."""
    pos = np.nonzero(p > 0)[0]
    order = pos[np.argsort(-p[pos], kind="stable")]
    big = [np.array([i]) for i in order if n * p[i] >= min_expected]
    small = np.array([i for i in order if n * p[i] < min_expected], dtype=int)
    cells = big + ([small] if small.size else [])
    if small.size and n * p[small].sum() < min_expected:
        cells = big[:-1] + [np.concatenate([big[-1], small])]
    return cells


def g_statistic(counts: np.ndarray, p: np.ndarray, cells: list[np.ndarray]) -> float:
    n = counts.sum()
    obs = np.array([counts[c].sum() for c in cells], dtype=float)
    exp = np.array([p[c].sum() for c in cells]) * n
    nz = obs > 0
    return float(2.0 * np.sum(obs[nz] * np.log(obs[nz] / exp[nz])))


def power(alt: np.ndarray, p: np.ndarray, cells: list[np.ndarray], n: int) -> tuple[float, float]:
    """(non-centrality, power) of the test at level ALPHA against samples from ``alt``."""
    a = np.array([alt[c].sum() for c in cells])
    e = np.array([p[c].sum() for c in cells])
    lam = n * float(np.sum((a - e) ** 2 / e))
    df = len(cells) - 1
    return lam, float(stats.ncx2.sf(stats.chi2.isf(ALPHA, df), df, lam))


# ----------------------------------------------------------------------------- the algorithm, analytically


def draft_stats(outs) -> dict:
    """Acceptance of sampled outputs: the rate, draft tokens, requests with every draft accepted (the bonus
    drawn) and with none accepted (a rejection at the first position)."""
    drafted = np.array([o.metrics.drafted for o in outs])
    accepted = np.array([o.metrics.accepted for o in outs])
    return {
        "acceptance": accepted.sum() / max(1, drafted.sum()),
        "drafted": int(drafted.sum()),
        "all": int(((drafted > 0) & (accepted == drafted)).sum()),
        "none": int(((drafted > 0) & (accepted == 0)).sum()),
    }


def g_test_outputs(outs, p: np.ndarray, window: int) -> tuple[float, float, int]:
    """(G, threshold at ALPHA, df) of the outputs' first ``window`` tokens against the law ``p``; a sequence
    of probability 0 fails at once."""
    counts = np.bincount([seq_index(o.token_ids[:window]) for o in outs], minlength=VOCAB**window)
    assert not np.any((counts > 0) & (p == 0)), "sequences of target probability 0 were drawn"
    cells = merge_cells(p, len(outs))
    return g_statistic(counts, p, cells), stats.chi2.isf(ALPHA, len(cells) - 1), len(cells) - 1


def speculative_law(ptab, qtab, case: Case, rule: str) -> np.ndarray:
    """Exact law of the first ``window`` tokens under the engine's schedule and a verification rule.

    ``rule``: "exact" (residual on rejection) or "resample_from_p" (a wrong sampler).
    Draft length per step: min(k, max_tokens - 1 - emitted); model drafts are enumerated
    with their q-probabilities, n-gram drafts are the lookup (q one-hot). Draft
    positions past the window are dropped: they cannot change the first ``window`` tokens.
    """
    w = case.window
    size = VOCAB**w
    memo: dict[tuple, np.ndarray] = {}

    def dist_from(state: tuple) -> np.ndarray:
        if state in memo:
            return memo[state]
        out = np.zeros(size)

        def emit(seq: tuple, weight: float) -> None:
            if weight <= 0:
                return
            if len(seq) >= w:  # a whole window: one cell (no vector per sequence: this runs ~10^5 times)
                out[seq_index(list(seq[:w]))] += weight
            else:
                out[:] += weight * dist_from(seq)

        kb = max(0, min(K, case.max_tokens - 1 - len(state)))
        keep = w - len(state)
        if qtab is None:
            full = tuple(ngram_lookup(case.prompt + list(state), kb)) if kb else ()
            drafts = [(full[:keep], 1.0, len(full))]
        else:
            drafts = []

            def rec(x: tuple, wx: float) -> None:
                if len(x) == min(kb, keep):
                    drafts.append((x, wx, kb))
                    return
                q = qtab[state + x]
                for t in np.nonzero(q)[0]:
                    rec(x + (int(t),), wx * q[t])

            rec((), 1.0)
        for x, wx, n_full in drafts:
            reach = 1.0
            for j in range(len(x) + 1):
                pre = state + x[:j]
                if len(pre) >= w:
                    emit(pre, wx * reach)
                    break
                p = ptab[pre]
                if j == n_full:  # every draft accepted: bonus token from p
                    for t in np.nonzero(p)[0]:
                        emit(pre + (int(t),), wx * reach * p[t])
                    break
                q = qtab[pre] if qtab is not None else np.eye(VOCAB)[x[j]]
                a = min(1.0, p[x[j]] / q[x[j]])
                if reach * (1 - a) > 0:
                    r = np.clip(p - q, 0, None)
                    final = r / r.sum() if rule == "exact" else p
                    for t in np.nonzero(final)[0]:
                        emit(pre + (int(t),), wx * reach * (1 - a) * final[t])
                reach *= a
                if reach == 0:
                    break
        memo[state] = out
        return out

    return dist_from(())


# ----------------------------------------------------------------------------- laws
def ngram_lookup(seq: list[int], k: int) -> list[int]:
    """Prompt lookup as documented: continuation of the latest earlier match of the longest suffix."""
    length = len(seq)
    for n in range(min(NGRAM_MAX, length - 1), NGRAM_MIN - 1, -1):
        for start in range(length - n - 1, -1, -1):
            if seq[start : start + n] == seq[length - n :]:
                return seq[start + n : start + n + k]
    return []
