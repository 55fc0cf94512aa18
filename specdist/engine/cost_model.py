"""Idealised cost model of speculative decoding (docs/exactness.md, section 7).

Assumptions of the toy model:

* every draft token is accepted with the same probability ``alpha``,
  independently of position and of every other token;
* one target verification costs 1, whatever the draft length ``k``;
* each draft token costs ``c`` (``draft_cost``) in units of one verification.

A ``k``-token draft then emits ``E[L] = 1 + alpha + ... + alpha^k =
(1 - alpha^(k+1)) / (1 - alpha)`` tokens per verification (between 1 and
``k + 1``), and the step costs ``1 + k c``, so the toy speedup over plain
decoding is ``S = E[L] / (1 + k c)``.

Real costs are not constant: verifying ``k + 1`` tokens costs more than one,
and drafting, KV copies, synchronisation, network and scheduling all take
time. The numbers here explain the trade-off; they are never a measured
speedup. :func:`predicted_tokens_per_second` plugs measured times into the same
formula so a benchmark can compare its measured throughput against it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from specdist.config import PIPELINE_MISS

__all__ = [
    "CostReport",
    "PipelinedReport",
    "pipelined_report",
    "acceptance_rate_from_distributions",
    "best_k",
    "expected_tokens",
    "predicted_tokens_per_second",
    "report",
    "speedup",
    "step_cost",
]

# Tolerance on the total mass of a probability vector (float32 sums drift).
_MASS_TOL = 1e-4


def _check_alpha(alpha: float) -> float:
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise ValueError(f"alpha must be a real number in [0, 1], got {alpha!r}")
    if not 0.0 <= alpha <= 1.0:  # also rejects NaN
        raise ValueError(f"alpha must be in [0, 1], got {alpha!r}")
    return float(alpha)


def _check_int(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
    return value


def _check_nonneg(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a real number >= 0, got {value!r}")
    if not (math.isfinite(value) and value >= 0.0):
        raise ValueError(f"{name} must be finite and >= 0, got {value!r}")
    return float(value)


def expected_tokens(alpha: float, k: int) -> float:
    """Expected tokens emitted per verification, ``(1 - alpha^(k+1)) / (1 - alpha)``.

    ``alpha == 1`` gives the exact limit ``k + 1``; ``k == 0`` gives 1.
    Raises ``ValueError`` unless ``alpha`` is in [0, 1] and ``k`` is an
    integer >= 0.
    """
    alpha = _check_alpha(alpha)
    k = _check_int("k", k)
    if alpha == 1.0:
        return float(k + 1)
    if alpha == 0.0 or k == 0:
        return 1.0
    # -expm1((k+1) log alpha) = 1 - alpha^(k+1) without cancellation near alpha = 1.
    return -math.expm1((k + 1) * math.log(alpha)) / (1.0 - alpha)


def step_cost(k: int, draft_cost: float) -> float:
    """Cost of one draft-and-verify step, ``1 + k c``, in verification units."""
    k = _check_int("k", k)
    draft_cost = _check_nonneg("draft_cost", draft_cost)
    return 1.0 + k * draft_cost


def speedup(alpha: float, k: int, draft_cost: float) -> float:
    """Toy speedup over plain decoding, ``E[L] / (1 + k c)``."""
    return expected_tokens(alpha, k) / step_cost(k, draft_cost)


def best_k(alpha: float, draft_cost: float, k_max: int = 32) -> tuple[int, float]:
    """Return ``(k, speedup)`` maximising the toy speedup over ``k = 0 .. k_max``.

    Ties go to the smallest ``k``; ``k = 0`` (no speculation) has speedup 1.
    """
    _check_alpha(alpha)
    _check_nonneg("draft_cost", draft_cost)
    k_max = _check_int("k_max", k_max)
    best = (0, 1.0)
    for k in range(1, k_max + 1):
        s = speedup(alpha, k, draft_cost)
        if s > best[1]:
            best = (k, s)
    return best


def _check_distribution(name: str, dist: Sequence[float]) -> list[float]:
    values = [float(v) for v in dist]
    if not values:
        raise ValueError(f"{name} must not be empty")
    if any(not (math.isfinite(v) and v >= 0.0) for v in values):
        raise ValueError(f"{name} must contain only finite values >= 0")
    total = math.fsum(values)
    if abs(total - 1.0) > _MASS_TOL:
        raise ValueError(f"{name} must sum to 1, got {total!r}")
    return values


def acceptance_rate_from_distributions(p: Sequence[float], q: Sequence[float]) -> float:
    """Per-step acceptance rate ``sum_x min(p(x), q(x))`` = 1 - TV(p, q).

    ``p`` is the target's and ``q`` the draft's processed next-token
    distribution over the same vocabulary (Leviathan et al.). Raises
    ``ValueError`` if either is not a probability vector or their lengths
    differ. The result is clamped to [0, 1].
    """
    if len(p) != len(q):
        raise ValueError(f"p and q must have the same length, got {len(p)} and {len(q)}")
    pv = _check_distribution("p", p)
    qv = _check_distribution("q", q)
    return min(1.0, max(0.0, math.fsum(min(a, b) for a, b in zip(pv, qv))))


def predicted_tokens_per_second(
    alpha: float,
    k: int,
    t_verify: float,
    t_draft_token: float,
    t_overhead: float = 0.0,
) -> float:
    """Analytical throughput ``E[L] / (t_verify + k t_draft_token + t_overhead)``.

    Times are measured seconds per step: one target verification of the
    draft, one draft token, and any fixed per-step overhead (KV copies,
    synchronisation, scheduling). This is what a benchmark compares its
    measured tokens/s against; a large gap means the constant, independent
    ``alpha`` assumption or the cost measurements do not hold.
    """
    e_l = expected_tokens(alpha, k)
    t_verify = _check_nonneg("t_verify", t_verify)
    t_draft_token = _check_nonneg("t_draft_token", t_draft_token)
    t_overhead = _check_nonneg("t_overhead", t_overhead)
    total = t_verify + k * t_draft_token + t_overhead
    if total <= 0.0:
        raise ValueError("t_verify + k * t_draft_token + t_overhead must be > 0")
    return e_l / total


@dataclass(frozen=True)
class CostReport:
    """Toy cost-model figures for one ``(alpha, k, draft_cost)`` setting."""

    alpha: float
    k: int
    draft_cost: float
    expected_tokens: float
    cost: float
    speedup: float

    def format(self) -> str:
        """Short human-readable summary (idealised model, not a measurement)."""
        if self.speedup > 1.0:
            verdict = "faster than"
        elif self.speedup < 1.0:
            verdict = "slower than"
        else:
            verdict = "the same speed as"
        return "\n".join(
            [
                f"alpha={self.alpha:g}, k={self.k}, c={self.draft_cost:g}",
                f"E[L] = {self.expected_tokens:.4f} tokens per verification",
                f"cost = {self.cost:.3f} (verification = 1)",
                f"speedup = {self.speedup:.3f}",
                f"Speculation is {verdict} plain decoding under this idealised model.",
                "Reminder: this is a toy ratio, not a measured speedup.",
            ]
        )


def report(alpha: float, k: int, draft_cost: float) -> CostReport:
    """Compute E[L], cost and speedup for one setting as a :class:`CostReport`."""
    e_l = expected_tokens(alpha, k)
    cost = step_cost(k, draft_cost)
    return CostReport(float(alpha), k, float(draft_cost), e_l, cost, e_l / cost)


@dataclass(frozen=True)
class PipelinedReport:
    """Sequential against pipelined drafting (:mod:`specdist.cores.draft_pipeline`), costs in units of one
    verification: a draft pass costs ``draft_cost``, the guess of the target's bonus token (the
    mode of q) is right with probability ``guess_hit`` when every draft was accepted."""

    alpha: float
    k: int
    draft_cost: float
    guess_hit: float
    miss: str
    hit_rate: float  # h = alpha^k * guess_hit: the next step's drafts are ready
    sequential_time: float  # k c + 1
    sequential_tokens: float  # E(alpha, k)
    pipelined_time: float
    pipelined_tokens: float

    @property
    def gain(self) -> float:
        """Pipelined over sequential tokens per unit time."""
        return (self.pipelined_tokens / self.pipelined_time) / (self.sequential_tokens / self.sequential_time)

    def format(self) -> str:
        return "\n".join(
            [
                f"alpha={self.alpha:g}, k={self.k}, c={self.draft_cost:g}, guess hit={self.guess_hit:g}, "
                f"miss={self.miss}",
                f"next-step hit rate h = alpha^k * guess hit = {self.hit_rate:.4f}",
                f"sequential: {self.sequential_tokens:.4f} tokens per step of {self.sequential_time:.3f}",
                f"pipelined:  {self.pipelined_tokens:.4f} tokens per step of {self.pipelined_time:.3f}",
                f"pipelined / sequential tokens per time = {self.gain:.3f}",
                "Reminder: this is a toy ratio, not a measured speedup.",
            ]
        )


def pipelined_report(
    alpha: float, k: int, draft_cost: float, guess_hit: float, miss: str = "redraft"
) -> PipelinedReport:
    """Expected step time and tokens with and without pipelined drafting (specdist.cores.draft_pipeline).

    While the target verifies step t (cost 1) the drafter guesses the bonus token and drafts
    the next k tokens after it: k + 1 passes, so a step lasts ``max(1, (k + 1) c)`` when the
    next drafts were ready. The next step hits with ``h = alpha^k * guess_hit``.
    ``redraft``: a miss drafts k tokens before verifying, ``T = max(1, (k+1) c) + (1 - h) k c``,
    ``E(alpha, k)`` tokens a step. ``skip``: a miss verifies no drafts, every step lasts
    ``max(1, (k+1) c)``; a step has drafts with the stationary probability
    ``pi = guess_hit / (guess_hit + 1 - h)`` and emits ``pi E + (1 - pi)`` tokens. ``auto``: the
    request alone in its steps redrafts every miss, as ``redraft``.
    """
    alpha = _check_alpha(alpha)
    k = _check_int("k", k)
    c = _check_nonneg("draft_cost", draft_cost)
    if isinstance(guess_hit, bool) or not isinstance(guess_hit, (int, float)) or not 0.0 <= guess_hit <= 1.0:
        raise ValueError(f"guess_hit must be in [0, 1], got {guess_hit!r}")
    b = float(guess_hit)
    if miss not in PIPELINE_MISS:
        raise ValueError(f"miss must be one of {', '.join(PIPELINE_MISS)}, got {miss!r}")
    h = alpha**k * b
    e = expected_tokens(alpha, k)
    overlapped = max(1.0, (k + 1) * c)
    if miss in ("redraft", "auto"):
        t, tokens = overlapped + (1 - h) * k * c, e
    else:
        pi = b / (b + 1 - h) if b + 1 - h > 0 else 1.0
        t, tokens = overlapped, pi * e + (1 - pi)
    return PipelinedReport(alpha, k, c, b, miss, h, step_cost(k, c), e, t, tokens)
