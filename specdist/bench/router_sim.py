"""N simulated replicas on a simulated clock, routed by :class:`specdist.api.router.Router` (``bench router
--simulate N``).

A replica is a continuously batched speculative engine whose costs follow :class:`SimModel`:

- a step admits waiting requests (first come, up to ``max_batch_size`` running) and prefills the part of
  their prompts its prefix cache lacks; every running request verifies k drafts; the step lasts
  ``step_base_s + verify_token_s x (k + 1) x verifying requests + prefill_token_s x prefill tokens``;
- a request's drafts are accepted one by one with its kind's probability (``alpha``; ``session_alpha``
  when the replica's suffix index held its session when it started, the same by default): it verifies,
  emits the accepted drafts and one token of the target's, and an admitted request emits its first token
  at the end of its prefill step;
- the prefix cache keeps ``cache_blocks`` blocks (least recently used out): a prompt's blocks from its
  admission on, prompt and answer once it ends (a session's next turn extends them); the suffix index
  keeps the last ``index_sessions`` session keys started there;
- every ``report_s`` (staggered) a replica reports :class:`~specdist.api.router.ReplicaStats`: its queue,
  its running requests' remaining tokens (``max_tokens`` less those emitted: a replica does not know when
  a request will stop), the tokens a step it measured per kind (and per kind with the session held), its
  step time fitted on its batch over the last 64 steps (the decode part), its prefill cost a token, cached block hashes
  and held sessions.

Arrivals: a workload's sessions (or single requests) start at Poisson times whose rate puts the cluster
at ``load`` x its estimated capacity; a session's next turn arrives a pause (exponential, mean
``think_s``) after its last turn ended. At N replicas the workload runs ``ceil(N / 2)`` copies, each copy's
words mapped to other token ids (no copy hits another's cache). Every random draw (arrival times, pauses,
each request's acceptances) comes from seeds of the request's own, so every policy sees the same requests
with the same luck. Nothing sleeps: events run in time order.
"""

from __future__ import annotations

import heapq
import math
import random
import zlib
from collections import deque
from dataclasses import dataclass, field

from specdist.api.replica_stats import ReplicaLedger
from specdist.api.router import (
    Pending,
    ReplicaStats,
    Router,
    RouteRequest,
    block_hashes,
    session_key,
)
from specdist.bench.router_workloads import Turn, first_requests, load
from specdist.config import RouterConfig
from specdist.engine.cost_model import expected_tokens


@dataclass(frozen=True)
class SimModel:
    """The simulated replicas' costs. The step costs are of the order of an 8 B target in bfloat16 on one
    H100-class GPU (assumed; the measured figures are in docs/performance.md); the acceptances (alpha 0.8
    for code editing, 0.35 for chat) give the tokens a step at k = 4 that the task suite measured there.
    ``session_alpha``, a kind's acceptance where the replica's suffix index held the session, is the plain one:
    measured, holding a session drafts its turns no better (its next prompt carries all of its text:
    ``python -m specdist.bench.router_drafting``, docs/performance.md); a workload whose prompts leave out the
    session's earlier answers may set it higher."""

    step_base_s: float = 0.012
    verify_token_s: float = 0.00006
    prefill_token_s: float = 0.00004
    k: int = 4
    alpha: dict[str, float] = field(default_factory=lambda: {"chat": 0.35, "edit": 0.8, "write": 0.3})
    session_alpha: dict[str, float] | None = None  # None: alpha
    max_batch_size: int = 16
    block_size: int = 16
    cache_blocks: int = 8192
    index_sessions: int = 64
    report_s: float = 0.5
    think_s: float = 1.0

    def expected_tokens(self, alpha: float) -> float:
        return expected_tokens(alpha, self.k)


# The cost models ``bench router --simulate N --cost-model`` offers. ``gpu``: :class:`SimModel`'s defaults.
# ``cpu``: a replica of configs/replicas.yaml on one core of the 2-core development VM, as its replicas reported
# their costs in the live mixed bench (docs/performance.md, "Router (real replicas)"): a step 22 ms + 7 ms a
# request, prefill 1.9 ms a token, tokens a step 1.2 (edits), 1.12 (free writing) and about 1.1 (chat), batches
# of at most 8. Suffix drafting proposes only where the text matches, a few tokens a step on average: taken as
# one draft a step (k = 1), so tokens a step are 1 + alpha (its acceptance column is not the live one).
COST_MODELS: dict[str, SimModel] = {
    "gpu": SimModel(),
    "cpu": SimModel(
        step_base_s=0.022,
        verify_token_s=0.0035,
        prefill_token_s=0.0019,
        k=1,
        alpha={"chat": 0.1, "edit": 0.2, "write": 0.12},
        max_batch_size=8,
    ),
}


@dataclass
class SimRequest:
    rid: str
    turn: Turn
    tokens: tuple[int, ...]  # the prompt's token ids
    route: RouteRequest
    full_blocks: tuple[int, ...]  # block hashes of prompt + answer (what the cache keeps once it ends)
    rng: random.Random
    arrival: float
    next_turn: SimRequest | None = None
    pause: float = 0.0  # before the next turn arrives
    replica: str = ""
    held: bool = False
    emitted: int = 0
    steps: int = 0  # verification steps
    step_tokens: int = 0  # tokens those steps emitted
    drafted: int = 0
    accepted: int = 0
    hit_tokens: int = 0
    first_token: float | None = None
    finished: float | None = None


class SimReplica:
    """A simulated replica: its requests follow :class:`SimModel`; what it reports is kept by the same
    :class:`~specdist.api.replica_stats.ReplicaLedger` a live replica keeps."""

    def __init__(self, rid: str, model: SimModel):
        self.rid, self.m = rid, model
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.ledger = ReplicaLedger(model.cache_blocks, model.index_sessions)
        self.busy = False
        self.admitted: list[SimRequest] = []

    def cached_tokens(self, r: SimRequest) -> int:
        """The prompt tokens of ``r`` its prefix cache holds now (at least one token is always computed)."""
        return min(self.ledger.cached_blocks(r.route.prompt_blocks) * self.m.block_size, len(r.tokens) - 1)

    def start_step(self, now: float) -> float:
        """Admit, draw this step's acceptances; the step's duration (its results apply at its end)."""
        m, ledger = self.m, self.ledger
        self.admitted = []
        prefill = 0
        while self.waiting and len(self.running) + len(self.admitted) < m.max_batch_size:
            r = self.waiting.popleft()
            r.hit_tokens = self.cached_tokens(r)
            prefill += len(r.tokens) - r.hit_tokens
            r.held = ledger.admit(r.route)
            self.admitted.append(r)
        decode = m.step_base_s + m.verify_token_s * (m.k + 1) * len(self.running)
        ledger.step(len(self.running), decode, now)
        return decode + m.prefill_token_s * prefill

    def end_step(self, now: float) -> list[SimRequest]:
        """Apply the step's tokens; the requests that ended."""
        m, done = self.m, []
        for r in self.running:
            alpha = (m.session_alpha if r.held and m.session_alpha is not None else m.alpha)[r.turn.kind]
            acc = 0
            while acc < m.k and r.rng.random() < alpha:
                acc += 1
            n = min(acc + 1, r.turn.output_tokens - r.emitted)
            r.emitted += n
            r.steps += 1
            r.step_tokens += n
            r.drafted += m.k
            r.accepted += acc
            self.ledger.tokens(r.turn.kind, r.held, n)
        for r in self.admitted:
            r.emitted = 1
            r.first_token = now
        self.running += self.admitted
        self.admitted = []
        for r in [r for r in self.running if r.emitted >= r.turn.output_tokens]:
            r.finished = now
            self.running.remove(r)
            self.ledger.finish(r.route.request_id, r.full_blocks)
            done.append(r)
        return done

    def stats(self, now: float) -> ReplicaStats:
        def pend(rs, owed) -> tuple[Pending, ...]:
            return tuple(
                Pending(r.rid, r.route.max_tokens - r.emitted, r.turn.kind, now - r.arrival, owed(r)) for r in rs
            )

        self.ledger.prefill_s_per_token = self.m.prefill_token_s  # (the model's, known exactly here)
        queued = pend(self.waiting, lambda r: len(r.tokens) - self.cached_tokens(r))
        running = pend(self.running, lambda r: 0) + pend(self.admitted, lambda r: len(r.tokens) - r.hit_tokens)
        return self.ledger.stats(self.rid, now, self.m.max_batch_size, queued, running)


def build_requests(
    workload: str,
    replicas: int,
    model: SimModel,
    load_factor: float,
    seed: int,
    session_blocks: int,
    copies: int | None = None,
) -> list[SimRequest]:
    """The workload's first turns (later turns hang off them), with arrival times, for N replicas."""
    groups = load(workload)
    copies = copies or max(1, math.ceil(replicas / 2))
    keyed = [(c, gi) for c in range(copies) for gi in range(len(groups))]
    random.Random(f"{seed}-order").shuffle(keyed)
    firsts = chains(groups, keyed, model, seed, session_blocks)
    turns = [t for g in groups for t in g]
    # a request's target steps: its output over its kind's tokens a step (the mean of the ratios, not the ratio
    # of the means: a workload of long low-acceptance and short high-acceptance requests costs the former's steps)
    mean_steps = sum(t.output_tokens / model.expected_tokens(model.alpha[t.kind]) for t in turns) / len(turns)
    mean_prompt = sum(len(t.prompt) for t in turns) / len(turns)
    b = model.max_batch_size
    full_step = model.step_base_s + model.verify_token_s * (model.k + 1) * b
    # a replica's requests a second at full batch: decode steps plus each request's prefill (no cache hits)
    per_request_s = mean_steps * full_step / b + mean_prompt * model.prefill_token_s
    rate = load_factor * replicas / per_request_s / (len(turns) / len(groups))  # sessions (groups) a second
    arrivals = random.Random(f"{seed}-arrivals")
    t = 0.0
    for r in firsts:
        t += arrivals.expovariate(rate)
        r.arrival = t
    return firsts


def closed_loop_requests(
    workload: str, model: SimModel, seed: int, session_blocks: int, requests: int, output_scale: float
) -> list[SimRequest]:
    """The live bench's requests (:func:`specdist.bench.router_live.plan`): the workload's first ``requests`` requests
    in file order (whole sessions, the last one cut short), each asking for ``max(1, round(output_tokens x
    output_scale))`` tokens and making that many (``ignore_eos``), its next turn sent the moment it ends."""
    groups = first_requests(workload, requests, output_scale)
    heads = chains(groups, [(0, gi) for gi in range(len(groups))], model, seed, session_blocks)
    for r in heads:
        while r is not None:
            r.pause, r = 0.0, r.next_turn
    return heads


def chains(
    groups: list[list[Turn]], keyed: list[tuple[int, int]], model: SimModel, seed: int, session_blocks: int
) -> list[SimRequest]:
    """Each (copy, group)'s turns as requests chained by ``next_turn``, in ``keyed``'s order (their heads); copy c's
    words map to token ids of its own (no copy hits another's cache)."""
    firsts: list[SimRequest] = []
    vocab: dict[tuple[int, str], int] = {}
    for c, gi in keyed:
        chain: list[SimRequest] = []
        pauses = random.Random(f"{seed}-pause-{c}-{gi}")
        for turn in groups[gi]:
            rid = f"c{c}-g{gi}-t{turn.turn}"
            ids = tuple(vocab.setdefault((c, w), zlib.crc32(f"{c}:{w}".encode()) & 0x7FFFFFFF) for w in turn.prompt)
            answer = tuple(vocab.setdefault((c, w), zlib.crc32(f"{c}:{w}".encode()) & 0x7FFFFFFF) for w in turn.answer)
            blocks = block_hashes(ids, model.block_size)
            sess = session_key("default", None, blocks, session_blocks)
            route = RouteRequest(rid, len(ids), turn.max_tokens, blocks, turn.kind, sess)
            full = block_hashes(ids + answer, model.block_size) if answer else blocks
            r = SimRequest(
                rid,
                turn,
                ids,
                route,
                full,
                random.Random(f"{seed}-{rid}"),
                0.0,
                pause=pauses.expovariate(1 / model.think_s),
            )
            if chain:
                chain[-1].next_turn = r
            chain.append(r)
        firsts.append(chain[0])
    return firsts


@dataclass
class PolicyResult:
    policy: str
    requests: int
    output_tokens: int
    tokens_per_step: float
    acceptance: float
    prefix_hit_tokens: int | None  # None: not measured
    prompt_tokens: int
    ttft_p50: float
    ttft_p99: float
    e2e_p50: float
    e2e_p99: float
    tokens_per_s: float
    seconds: float
    choices: dict[str, int]

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def percentile(xs: list[float], q: float) -> float:
    """The q-th percentile, nearest rank."""
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))]


def simulate(
    policy: str,
    workload: str,
    replicas: int,
    seed: int = 0,
    load_factor: float = 0.7,
    model: SimModel | None = None,
    router_config: RouterConfig | None = None,
    clients: int | None = None,
    requests: int = 32,
    output_scale: float = 0.1,
) -> PolicyResult:
    """One workload through N simulated replicas routed by ``policy``: sessions arriving at Poisson times at
    ``load_factor`` of the estimated capacity (open loop), or with ``clients``, as the live bench sends them (closed
    loop, :func:`closed_loop_requests`): each client sends a session's turns one after the other and takes the next
    session when its last one ended."""
    m = model or SimModel()
    base = router_config or RouterConfig()
    cfg = RouterConfig(policy, base.imbalance_threshold, base.stats_period_s, base.session_blocks)
    if clients is None:
        firsts = build_requests(workload, replicas, m, load_factor, seed, cfg.session_blocks)
        queue: list[SimRequest] = []
    else:
        queue = closed_loop_requests(workload, m, seed, cfg.session_blocks, requests, output_scale)[::-1]
        firsts = queue[-clients:][::-1]  # (the first clients' sessions start at 0)
        del queue[-clients:]
    router = Router(cfg, m.block_size, seed)
    reps = {f"r{i:03d}": SimReplica(f"r{i:03d}", m) for i in range(replicas)}
    events: list = []
    seq = 0

    def push(t: float, kind: str, payload) -> None:
        nonlocal seq
        heapq.heappush(events, (t, seq, kind, payload))
        seq += 1

    for i, rid in enumerate(reps):  # reports staggered over one period; the first at 0
        router.report(reps[rid].stats(0.0))
        push(m.report_s * (1 + i / replicas), "report", rid)
    for r in firsts:
        push(r.arrival, "arrive", r)
    done: list[SimRequest] = []
    open_requests = sum(1 + _later(r) for r in [*firsts, *queue])
    while events and len(done) < open_requests:
        now, _, kind, payload = heapq.heappop(events)
        if kind == "arrive":
            r = payload
            r.replica = router.choose(r.route, now)
            rep = reps[r.replica]
            rep.waiting.append(r)
            if not rep.busy:
                rep.busy = True
                push(now + rep.start_step(now), "step", rep.rid)
        elif kind == "step":
            rep = reps[payload]
            for r in rep.end_step(now):
                done.append(r)
                router.done(rep.rid, r.rid, now)
                if r.next_turn is not None:
                    r.next_turn.arrival = now + r.pause
                    push(r.next_turn.arrival, "arrive", r.next_turn)
                elif queue:  # (closed loop: this client's session ended, it takes the next)
                    queue[-1].arrival = now
                    push(now, "arrive", queue.pop())
            if rep.waiting or rep.running:
                push(now + rep.start_step(now), "step", rep.rid)
            else:
                rep.busy = False
        else:
            router.report(reps[payload].stats(now))
            push(now + m.report_s, "report", payload)
    assert len(done) == open_requests, "every request ends"
    return summarize(policy, done)


def _later(r: SimRequest) -> int:
    n = 0
    while r.next_turn is not None:
        r, n = r.next_turn, n + 1
    return n


def summarize(policy: str, done: list[SimRequest]) -> PolicyResult:
    out = sum(r.emitted for r in done)
    t0 = min(r.arrival for r in done)
    t1 = max(r.finished for r in done)
    choices: dict[str, int] = {}
    for r in done:
        choices[r.replica] = choices.get(r.replica, 0) + 1
    steps = sum(r.steps for r in done)
    drafted = sum(r.drafted for r in done)
    return PolicyResult(
        policy,
        len(done),
        out,
        sum(r.step_tokens for r in done) / max(1, steps),
        sum(r.accepted for r in done) / max(1, drafted),
        sum(r.hit_tokens for r in done),
        sum(len(r.tokens) for r in done),
        percentile([r.first_token - r.arrival for r in done], 50),
        percentile([r.first_token - r.arrival for r in done], 99),
        percentile([r.finished - r.arrival for r in done], 50),
        percentile([r.finished - r.arrival for r in done], 99),
        out / (t1 - t0),
        t1 - t0,
        dict(sorted(choices.items())),
    )
