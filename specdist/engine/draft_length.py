"""How many tokens each request drafts this step: a fixed k, or the adaptive rule below.

Pure arithmetic on measured numbers (no torch, Ray or gRPC), used by the scheduler
(:mod:`specdist.engine.scheduler`) whatever the transports.

``fixed`` (``draft.length_policy: fixed``): every request drafts
``k_b = min(k, cap_b)``, where ``k = draft.num_speculative_tokens`` and ``cap_b`` keeps
``max_tokens`` and the context limit from being overrun inside a draft. Seeded requests
reproduce exactly.

``adaptive``: ``k`` becomes the maximum, and each step picks the vector ``k_1..k_B``
(``0 <= k_b <= cap_b``) that maximises the predicted goodput
``sum_b E(alpha_b, k_b) / T(k)`` (expected emitted tokens per second of step), where

- ``E(a, k) = 1 + a + ... + a^k`` is the expected number of tokens a request emits in a
  step with ``k`` drafts when each position is accepted with probability ``a``
  (docs/exactness.md section 7: the i.i.d. acceptance model);
- ``alpha_b`` is the request's observed acceptance: its accepted and tried draft
  positions, decayed by ``REQUEST_DECAY`` per step and pulled towards the draft's global
  acceptance (decayed by ``GLOBAL_DECAY`` per step) with ``PRIOR_WEIGHT`` pseudo-positions.
  A position is *tried* when it is accepted or is the first rejected one. A request that
  drafts nothing for a while drifts back to the global rate, so it is tried again;
- ``T(k) = overhead + max_r D_r + V`` is the step time predicted from measured costs:
  draft replica ``r`` (one for the in-process engine) costs
  ``D_r = a_r * passes_r + b_r * rows_r`` (``passes_r = max k_b`` of its requests, one
  sequential draft forward each; ``rows_r = sum k_b``; 0 when nobody on it drafts, as no
  call is made; ``D_r`` also has a per-call term, e.g. the network round trip, so
  ``D_r = e_r + a_r * passes_r + b_r * rows_r``), the verification of ``N = sum (k_b + 1)``
  tokens for ``B`` requests costs its measured time for that ``(B, N)`` (the median of its last
  ``TABLE_SAMPLES`` calls: robust to a call slowed by other work) when one was seen, else ``V = c_0 + c_1 * N`` (GEMM
  times are far from linear at small sizes on CPU: 3 tokens can cost more than 5)
  tokens, and ``overhead`` is the rest of a step. Replicas draft in parallel, so the
  slowest one sets the draft time. The coefficients are exponentially weighted least-squares
  fits (forgetting ``COST_DECAY`` per sample) of the measured wall times, with a ridge of
  ``RIDGE`` pseudo-samples towards a prior that puts most of the first sample on the
  per-pass / fixed terms (small batches are bound by reading the weights).

The maximisation: the draft phase lasts as long as its slowest replica, so we enumerate
the draft-time budget ``tau`` over every value ``D_r(K)`` (``K = 1..k``) plus 0; under a
budget each replica may run the most passes ``K_r`` that fit, and inside that each request
keeps the draft positions worth their marginal cost: position ``j`` stays when
``alpha_b^j >= lambda * (b_r + c_1)``, where ``lambda`` is the goodput itself (Dinkelbach's
iteration, a few rounds). The best budget wins; all zeros (no drafting) is always a
candidate, and it wins unless drafting is predicted to beat it by ``DRAFT_MARGIN``, so under
load, with a poor draft or a slow replica, requests fall back to ``k_b = 0`` (plain decoding)
instead of slowing the batch.

Model-free drafts (``draft.method`` ngram or suffix: lookups in an index, no model pass) are proposed
before the choice, as long as ``cap_b`` allows (:mod:`specdist.engine.scheduler`), so ``D_r`` is spent,
not predicted, and ``k_b`` only cuts each proposal; its known length caps ``k_b``. A suffix draft's
positions carry the length of the match each token was read after, and position ``j`` is then priced
by its own conditional rate ``a_bj`` (accepted given positions ``1..j-1`` were) learned per
match-length bucket (``MATCH_EDGES``, all requests, prior ``MATCH_PRIOR``, decayed like the global
rate): ``E`` becomes ``1 + sum_j prod_{i <= j} a_bi`` and a position stays when
``prod_{i <= j} a_bi >= lambda * c_1``. The match length predicts acceptance far better than a
request's recent rate (docs/performance.md: 14% after a one-token match, 86-100% after 9 or more), so deep
matches are drafted under load, where an i.i.d. rate averaged over a request's shallow and deep
matches would price them all out.

While no request waits for a slot, a request's first step drafts nothing: its first token
then costs one plain target step after the prefill, as without speculation, and the draft
catches up on the prompt's last token with its next pass. Under a backlog (requests queued) this costs more
throughput than it saves latency, so it is off. Before the first cost measurements the rule
drafts ``min(k, cap_b)``. On the steps in
``EXPLORE_EARLY`` and every ``EXPLORE_EVERY``-th step it caps its choice at the next value
of ``EXPLORE_CAPS`` (in units of ``k``) so that the cost fits see several draft lengths
even at batch size 1 (about 6% of steps); a replica that has not drafted for
``PROBE_EVERY`` steps (its drafts were not worth their cost) drafts one token per request
once, so a replica that was slow and recovered is noticed. Prefills do not feed the verification fit:
a prompt token computes no logits and, with prefix caching, may not be computed at all, so prompt
tokens cost a fraction of a verified token (16 chat requests here: about 1.8 ms against 12 ms),
and a fit that mixed them would take drafting for cheap at large batches.
With pipelined drafting (``draft.pipeline``, :mod:`specdist.cores.draft_pipeline`) a drafter prepares the
next step's drafts (a guess pass, then ``K`` passes) while the target verifies, and a request
whose prepared prefix holds (probability ``h_b = alpha_b^k_b * beta``, ``beta`` the measured
rate at which the drafter's guess of the bonus token was right) needs no drafting in its step.
The rule then predicts ``T(k) = overhead + max(V, P) + (1 - prod_b h_b) * max_r D_r``, where
``P = max_r D_r(K_r + 1 passes, rows_r + requests_r)`` is the preparation, hidden under the
verification up to ``V``, and the last term the redrafting of misses; the draft-cost fits
learn from the drafter's own compute of each preparation and redraft (reported with each
call), not from the wall time of a call, most of which the preparation hid.
The chosen lengths depend on wall times, so a seeded request reproduces its output
*distribution* exactly (speculative decoding is exact for any k) but not its exact tokens;
use ``fixed`` for token-for-token reproducibility.
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from specdist.config import LENGTH_POLICIES

REQUEST_DECAY = 0.8  # per step: a request's acceptance memory is ~5 steps
GLOBAL_DECAY = 0.98  # per step: the draft's overall acceptance memory is ~50 steps
PRIOR_WEIGHT = 2.0  # pseudo-positions of the global rate in each request's estimate
GLOBAL_PRIOR = 0.7  # the global rate before any draft was verified
ALPHA_MIN, ALPHA_MAX = 0.01, 0.99
COST_DECAY = 0.9  # per sample: cost fits remember ~10 steps (a replica turning slow shows within a few)
RIDGE = 0.01  # pseudo-samples (the first sample's size) pulling the fit towards the first-sample prior
EXPLORE_EVERY = 16
EXPLORE_EARLY = (3, 6, 9, 12)
EXPLORE_CAPS = (0.5, 0.0, 0.25, 1.0)  # fractions of k, cycled
TABLE_SAMPLES = 5  # verification times kept per (batch, tokens); the table holds their median
PROBE_EVERY = 64  # steps without a draft call before a replica's requests draft one token
GUESS_PRIOR = 0.5  # pipelined drafting: the guess hit rate before any was observed (PRIOR_WEIGHT samples)
DINKELBACH_ROUNDS = 4
# Model-free drafts: a position's acceptance given the positions before it were accepted, by the length of
# the match its token was read after (Proposal.match_lengths). Buckets [1], [2], [3], [4], [5, 8], [9, 16],
# [17, ...); the priors are the rates measured over the task suite's five tasks (docs/performance.md: suffix
# positions by match length), held with PRIOR_WEIGHT pseudo-positions and then learned like the global
# rate (GLOBAL_DECAY).
MATCH_EDGES = (1, 2, 3, 4, 5, 9, 17)
MATCH_PRIOR = (0.17, 0.37, 0.5, 0.66, 0.78, 0.9, 0.98)
# A step drafts only when its predicted goodput beats drafting nothing by this fraction: the cost fits
# and acceptance estimates err by a few percent, so a predicted gain smaller than that is a loss as
# often as a gain, and every drafted row costs a sure row of verification.
DRAFT_MARGIN = 0.05


@dataclass
class Acceptance:
    """A request's decayed count of accepted / tried draft positions (on ``Request.acceptance``)."""

    accepted: float = 0.0
    tried: float = 0.0

    def update(self, drafted: int, accepted: int) -> None:
        self.accepted *= REQUEST_DECAY
        self.tried *= REQUEST_DECAY
        self.accepted += accepted
        self.tried += accepted + (1 if accepted < drafted else 0)


@dataclass
class StepCosts:
    """What one step measured for the rule: its :class:`~specdist.engine.output_processor.StepEvent` carries it
    (``costs``), and :meth:`DraftLengthPolicy.observe` learns from it."""

    # each draft call's measured compute: (replica, passes, rows, seconds)
    draft_runs: list[tuple[int, int, int, float]] = field(default_factory=list)
    guesses: list[bool] = field(default_factory=list)  # pipelined: each guess of a bonus token tested, whether it held
    verify_tokens: int = 0  # tokens the verification priced (each with its logits)
    verify_s: float = 0.0  # its wall seconds
    overhead_s: float = 0.0  # the step's own seconds besides drafting and verifying
    # per verified request: (its acceptance, positions it drafted, of those accepted, their match lengths or None)
    acceptance: list[tuple[Acceptance, int, int, Sequence[int] | None]] = field(default_factory=list)


class MatchAcceptance:
    """Decayed accepted / tried draft positions per match-length bucket (``MATCH_EDGES``), all requests."""

    def __init__(self) -> None:
        self.accepted = [0.0] * len(MATCH_EDGES)
        self.tried = [0.0] * len(MATCH_EDGES)

    @staticmethod
    def bucket(length: int) -> int:
        return max(0, bisect.bisect_right(MATCH_EDGES, length) - 1)

    def rate(self, length: int) -> float:
        """P(a position read after a match of ``length`` is accepted | the positions before it were)."""
        b = self.bucket(length)
        a = (self.accepted[b] + PRIOR_WEIGHT * MATCH_PRIOR[b]) / (self.tried[b] + PRIOR_WEIGHT)
        return min(ALPHA_MAX, max(ALPHA_MIN, a))

    def update(self, lengths: Sequence[int], accepted: int) -> None:
        """One verified proposal: its first ``accepted`` positions were accepted, the next (if any) rejected."""
        for j, length in enumerate(lengths[: accepted + 1]):
            b = self.bucket(length)
            self.tried[b] += 1
            self.accepted[b] += j < accepted

    def decay(self) -> None:
        self.accepted = [a * GLOBAL_DECAY for a in self.accepted]
        self.tried = [t * GLOBAL_DECAY for t in self.tried]

    def snapshot(self) -> dict:
        return {
            f"{lo}+" if i == len(MATCH_EDGES) - 1 else f"{lo}-{MATCH_EDGES[i + 1] - 1}": round(self.rate(lo), 4)
            for i, lo in enumerate(MATCH_EDGES)
        }


class LinearFit:
    """``t ~ w . x`` over a few features, exponentially weighted least squares with a ridge of
    ``RIDGE`` pseudo-samples (each the size of the first sample) towards the first sample's
    time split by ``prior_shares``. Weights stay >= 0 (a negative one is dropped and the
    rest refitted)."""

    def __init__(self, prior_shares: tuple[float, ...]):
        self.shares = prior_shares
        self.dim = len(prior_shares)
        self.n = 0
        self.xx = [[0.0] * self.dim for _ in range(self.dim)]
        self.xt = [0.0] * self.dim
        self.prior = [0.0] * self.dim
        self.ridge = [0.0] * self.dim
        self.w = tuple([0.0] * self.dim)

    @property
    def ready(self) -> bool:
        return self.n > 0

    def add(self, *args: float) -> None:
        *x, t = args
        if not math.isfinite(t) or t < 0 or all(v <= 0 for v in x):
            return
        if self.n == 0:
            self.ridge = [RIDGE * max(v * v, 1e-12) for v in x]
            self.prior = [sh * t / v if v > 0 else 0.0 for sh, v in zip(self.shares, x)]
        g = COST_DECAY
        for a in range(self.dim):
            self.xt[a] = g * self.xt[a] + x[a] * t
            for b in range(self.dim):
                self.xx[a][b] = g * self.xx[a][b] + x[a] * x[b]
        self.n += 1
        self.w = self._solve()

    def _solve(self) -> tuple[float, ...]:
        active = list(range(self.dim))
        while True:
            m = [[self.xx[a][b] + (self.ridge[a] if a == b else 0.0) for b in active] for a in active]
            rhs = [self.xt[a] + self.ridge[a] * self.prior[a] for a in active]
            sol = _solve_linear(m, rhs)
            if all(v >= 0 for v in sol) or len(active) == 1:
                w = [0.0] * self.dim
                for a, v in zip(active, sol):
                    w[a] = max(0.0, v)
                return tuple(w)
            active = [a for a, v in zip(active, sol) if v >= 0] or [active[max(range(len(sol)), key=sol.__getitem__)]]

    def predict(self, *x: float) -> float:
        return sum(w * v for w, v in zip(self.w, x))


def _solve_linear(m: list[list[float]], rhs: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting for the few-by-few systems above."""
    n = len(rhs)
    a = [row[:] + [r] for row, r in zip(m, rhs)]
    for c in range(n):
        p = max(range(c, n), key=lambda i: abs(a[i][c]))
        a[c], a[p] = a[p], a[c]
        if abs(a[c][c]) < 1e-300:
            continue
        for i in range(c + 1, n):
            f = a[i][c] / a[c][c]
            for j in range(c, n + 1):
                a[i][j] -= f * a[c][j]
    x = [0.0] * n
    for i in range(n - 1, -1, -1):
        x[i] = (a[i][n] - sum(a[i][j] * x[j] for j in range(i + 1, n))) / a[i][i] if abs(a[i][i]) > 1e-300 else 0.0
    return x


@dataclass
class DraftLengthPolicy:
    """Chooses ``k_b`` per request (see the module docstring) and learns from each step."""

    k: int
    mode: str = "fixed"
    num_replicas: int = 1
    pipelined: bool = False  # drafters prepare the next drafts during verification (module docstring)
    model_free: bool = False  # drafts are lookups proposed before the choice: their cost is spent, not predicted
    draft_cost: list[LinearFit] = field(init=False)  # per replica: (1, passes, rows) -> seconds
    verify_cost: LinearFit = field(init=False)  # (1, tokens) -> seconds
    overhead_s: float | None = None
    verify_table: dict = field(default_factory=dict)  # (batch, tokens) -> seconds, measured (median of the last few)
    verify_samples: dict = field(default_factory=dict)  # (batch, tokens) -> deque of its last TABLE_SAMPLES times
    global_accepted: float = 0.0
    global_tried: float = 0.0
    guess_hits: float = 0.0  # pipelined: prepared prefixes that held, after an all-accepted step (decayed)
    guess_tries: float = 0.0
    steps: int = 0
    explored: int = 0
    match: MatchAcceptance = field(default_factory=MatchAcceptance)  # model-free drafts: rates by match length

    def __post_init__(self) -> None:
        if self.mode not in LENGTH_POLICIES:
            raise ValueError(f"length policy must be one of {LENGTH_POLICIES}, got {self.mode!r}")
        self.draft_cost = [LinearFit((0.1, 0.8, 0.1)) for _ in range(max(1, self.num_replicas))]
        self.verify_cost = LinearFit((0.9, 0.1))
        self.last_drafted = [0] * max(1, self.num_replicas)

    # ------------------------------------------------------------------ estimates
    @property
    def global_alpha(self) -> float:
        return (self.global_accepted + PRIOR_WEIGHT * GLOBAL_PRIOR) / (self.global_tried + PRIOR_WEIGHT)

    @property
    def guess_hit(self) -> float:
        """Pipelined drafting: P(the drafter's guess of the bonus token is right | every draft accepted)."""
        return (self.guess_hits + PRIOR_WEIGHT * GUESS_PRIOR) / (self.guess_tries + PRIOR_WEIGHT)

    def alpha(self, acc: Acceptance) -> float:
        a = (acc.accepted + PRIOR_WEIGHT * self.global_alpha) / (acc.tried + PRIOR_WEIGHT)
        return min(ALPHA_MAX, max(ALPHA_MIN, a))

    # ------------------------------------------------------------------ the choice
    def choose(
        self,
        caps: Sequence[int],
        accs: Sequence[Acceptance],
        replicas: Sequence[int] | None = None,
        first: Sequence[bool] | None = None,
        match_lengths: Sequence[Sequence[int] | None] | None = None,
    ) -> list[int]:
        """Draft lengths for one step. ``caps[b]``: the most request b may draft (limits);
        ``replicas[b]``: the draft replica it lives on (default 0); ``first[b]``: this is the
        request's first step (adaptive: it drafts nothing, so its first token comes as soon as
        without speculation); ``match_lengths[b]``: request b's proposal was drafted already
        (model-free) and its positions' match lengths are these (``caps[b]`` is then at most
        their count): each position is priced by its bucket's rate instead of ``alpha_b``."""
        self.steps += 1
        caps = [max(0, min(self.k, c)) for c in caps]
        if self.mode == "fixed" or not caps:
            return caps
        if first is not None:
            caps = [0 if f else c for c, f in zip(caps, first)]
        reps = list(replicas) if replicas is not None else [0] * len(caps)
        if not (self.verify_cost.ready and all(self.draft_cost[r].ready for r in set(reps))):
            return caps  # no measurements yet: draft fully, which measures the costs
        lengths = match_lengths or [None] * len(caps)
        cums = [
            _cumulative([self.match.rate(m) for m in ms[:c]]) if ms is not None else _cumulative([self.alpha(a)] * c)
            for a, c, ms in zip(accs, caps, lengths)
        ]
        ks = self._maximise(caps, cums, reps)
        if self.steps % EXPLORE_EVERY == 0 or self.steps in EXPLORE_EARLY:
            self.explored += 1
            limit = int(round(EXPLORE_CAPS[self.explored % len(EXPLORE_CAPS)] * self.k))
            ks = [min(k, limit) for k in ks]
        for r in set(reps):  # re-measure a replica left idle for PROBE_EVERY steps: one token each
            if self.steps - self.last_drafted[r] >= PROBE_EVERY:
                ks = [max(k, min(1, c)) if rr == r else k for k, c, rr in zip(ks, caps, reps)]
        return ks

    def _maximise(self, caps: list[int], cums: list[list[float]], reps: list[int]) -> list[int]:
        """``cums[b][j - 1]``: P(request b's positions 1..j are all accepted), j = 1..caps[b]."""
        bsz = len(caps)
        rset = sorted(set(reps))
        c1 = self.verify_cost.w[1]
        marginal = {r: (0.0 if self.model_free else self.draft_cost[r].w[2]) + c1 for r in rset}

        def rows_upto(r: int, K: int) -> int:
            return sum(min(K, caps[b]) for b in range(bsz) if reps[b] == r)

        budgets = {0.0}
        if not self.model_free:  # model-free drafts were proposed already: the one budget is "all of them"
            for r in rset:
                for K in range(1, max((caps[b] for b in range(bsz) if reps[b] == r), default=0) + 1):
                    budgets.add(self.draft_cost[r].predict(1, K, rows_upto(r, K)))
        best_ks, best_rate = [0] * bsz, self._rate([0] * bsz, cums, reps) * (1 + DRAFT_MARGIN)
        for tau in sorted(budgets):
            kr = {}
            for r in rset:
                K = 0
                while K < self.k and (
                    self.model_free or self.draft_cost[r].predict(1, K + 1, rows_upto(r, K + 1)) <= tau * (1 + 1e-9)
                ):
                    K += 1
                kr[r] = K
            lim = [min(caps[b], kr[reps[b]]) for b in range(bsz)]
            ks = lim
            for _ in range(DINKELBACH_ROUNDS):
                lam = self._rate(ks, cums, reps)
                new = [_keep(cums[b], lim[b], lam * marginal[reps[b]]) for b in range(bsz)]
                if new == ks:
                    break
                ks = new
            rate = self._rate(ks, cums, reps)
            if rate > best_rate * (1 + 1e-9):
                best_ks, best_rate = ks, rate
        return best_ks

    def step_time(self, ks: Sequence[int], reps: Sequence[int], alphas: Sequence | None = None) -> float:
        """Predicted seconds of a step with these draft lengths (pipelined: given the requests' acceptance,
        each an i.i.d. rate or per-position rates as in :meth:`rate`)."""
        cums = None if alphas is None else [_as_cumulative(a, k) for a, k in zip(alphas, ks)]
        return self._step_time(ks, reps, cums)

    def _step_time(self, ks: Sequence[int], reps: Sequence[int], cums: Sequence[list[float]] | None) -> float:
        draft = prepare = 0.0
        for r in set(reps) if not self.model_free else ():  # model-free: proposed before the choice
            mine = [k for k, rr in zip(ks, reps) if rr == r]
            if mine and max(mine) > 0:
                fit = self.draft_cost[r]
                draft = max(draft, fit.predict(1, max(mine), sum(mine)))
                prepare = max(prepare, fit.predict(1, max(mine) + 1, sum(mine) + sum(k > 0 for k in mine)))
        n = sum(ks) + len(ks)
        seen = self.verify_table.get((len(ks), n))
        verify = seen if seen is not None else self.verify_cost.predict(1, n)
        if self.pipelined and cums is not None:
            held = math.prod(c[k - 1] * self.guess_hit for c, k in zip(cums, ks) if k > 0)
            return (self.overhead_s or 0.0) + max(verify, prepare) + (1.0 - held) * draft
        return (self.overhead_s or 0.0) + draft + verify

    def rate(self, ks: Sequence[int], alphas: Sequence, reps: Sequence[int]) -> float:
        """Predicted emitted tokens per second. ``alphas[b]``: request b's i.i.d. acceptance rate, or its
        positions' rates (each given the positions before it were accepted), at least ``ks[b]`` of them."""
        return self._rate(ks, [_as_cumulative(a, k) for a, k in zip(alphas, ks)], reps)

    def _rate(self, ks: Sequence[int], cums: Sequence[list[float]], reps: Sequence[int]) -> float:
        # a request with k drafts emits 1 + sum_{j <= k} P(positions 1..j accepted) tokens on average
        tokens = sum(1.0 + sum(c[:k]) for c, k in zip(cums, ks))
        return tokens / max(self._step_time(ks, reps, cums), 1e-9)

    # ------------------------------------------------------------------ learning
    def observe(self, event) -> None:
        """Learn from one step: its :class:`~specdist.engine.output_processor.StepEvent` (``event.costs``: a
        :class:`StepCosts`; ``event.batch_size``), then set ``event.plain_step_s``, the predicted seconds
        of the same batch without drafts (with what was just learnt)."""
        c = event.costs
        for held in c.guesses:
            self.observe_guess(held)
        for run in c.draft_runs:
            self.observe_draft(*run)
        self.observe_verify(c.verify_tokens, c.verify_s, event.batch_size)
        for acc, drafted, accepted, lengths in c.acceptance:
            self.observe_acceptance(acc, drafted, accepted, lengths)
        self.end_step()
        self.observe_overhead(c.overhead_s)
        event.plain_step_s = self.step_time([0] * event.batch_size, [0] * event.batch_size)

    def draft_s(self, replica: int, requests: int) -> float:
        """Predicted seconds of a full draft (k passes) of ``requests`` requests on ``replica``; 0 while unmeasured
        (:meth:`specdist.engine.draft_pool.DraftPool.choose`)."""
        fit, k = self.draft_cost[replica], max(1, self.k)
        return fit.predict(1, k, k * requests) if fit.ready else 0.0

    def observe_acceptance(
        self, acc: Acceptance, drafted: int, accepted: int, match_lengths: Sequence[int] | None = None
    ) -> None:
        """One request's verification result (call once per request per step); ``match_lengths``: those of
        its proposal's positions (model-free drafts), which the match-length rates learn from."""
        if drafted <= 0:
            acc.update(0, 0)
            return
        acc.update(drafted, accepted)
        if match_lengths is not None:
            self.match.update(match_lengths[:drafted], accepted)
        self.global_accepted += accepted
        self.global_tried += accepted + (1 if accepted < drafted else 0)

    def observe_guess(self, held: bool) -> None:
        """Pipelined drafting: after a step that accepted every draft, whether the prepared prefix held."""
        self.guess_hits += held
        self.guess_tries += 1

    def end_step(self) -> None:
        """Decay the global acceptance (and guess hit rate) once per step."""
        self.global_accepted *= GLOBAL_DECAY
        self.global_tried *= GLOBAL_DECAY
        self.guess_hits *= GLOBAL_DECAY
        self.guess_tries *= GLOBAL_DECAY
        self.match.decay()

    def observe_draft(self, replica: int, passes: int, rows: int, seconds: float) -> None:
        if passes > 0 and rows > 0:
            self.draft_cost[replica].add(1, passes, rows, seconds)
            self.last_drafted[replica] = self.steps

    def observe_verify(self, tokens: int, seconds: float, batch: int | None = None) -> None:
        """A verification of ``tokens`` tokens (each with its logits) took ``seconds``; ``batch``: its
        request count, which also files the time in the measured table (None: the fit only)."""
        if tokens > 0:
            self.verify_cost.add(1, tokens, seconds)
            if batch is not None and math.isfinite(seconds) and seconds >= 0:
                # the median: one call slowed by something else on the machine does not move it
                key = (batch, tokens)
                recent = self.verify_samples.setdefault(key, deque(maxlen=TABLE_SAMPLES))
                recent.append(seconds)
                self.verify_table[key] = statistics.median(recent)

    def observe_overhead(self, seconds: float) -> None:
        if seconds >= 0:
            self.overhead_s = seconds if self.overhead_s is None else 0.9 * self.overhead_s + 0.1 * seconds

    def snapshot(self) -> dict:
        """The policy's current estimates, for logs and benchmarks."""
        return {
            "mode": self.mode,
            "k_max": self.k,
            "global_alpha": round(self.global_alpha, 4),
            "match_alpha": self.match.snapshot(),
            "pipelined": self.pipelined,
            "guess_hit": round(self.guess_hit, 4),
            "draft_s_per_call": [round(f.w[0], 6) for f in self.draft_cost],
            "draft_s_per_pass": [round(f.w[1], 6) for f in self.draft_cost],
            "draft_s_per_row": [round(f.w[2], 6) for f in self.draft_cost],
            "verify_s_fixed": round(self.verify_cost.w[0], 6),
            "verify_s_per_token": round(self.verify_cost.w[1], 6),
            "overhead_s": round(self.overhead_s or 0.0, 6),
        }


def _cumulative(rates: Sequence[float]) -> list[float]:
    """[n] running products: P(positions 1..j all accepted) from each position's conditional rate."""
    out, p = [], 1.0
    for a in rates:
        p *= a
        out.append(p)
    return out


def _as_cumulative(a, k: int) -> list[float]:
    """An i.i.d. rate or a list of per-position rates, as the running products of its first k positions."""
    return _cumulative([a] * k if isinstance(a, (int, float)) else list(a)[:k])


def _keep(cum: Sequence[float], limit: int, threshold: float) -> int:
    """The most positions j <= limit with P(1..j accepted) = cum[j - 1] >= threshold (cum is decreasing)."""
    j = 0
    while j < limit and cum[j] >= threshold:
        j += 1
    return j
