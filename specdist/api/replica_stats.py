"""What a replica reports to the router (:class:`~specdist.api.router.ReplicaStats`), kept as it serves.

:class:`ReplicaLedger` is the replica's side of routing, shared by the live replica (:class:`EngineLedger`, fed
by the engine's step events) and the simulated ones of ``specdist bench router --simulate``:

- the prompts' KV blocks it has seen, as the router hashes them (:func:`~specdist.api.router.block_hashes`),
  least recently used first out past the blocks its cache holds: what its prefix cache holds, as far as the
  router can tell (a view like Ray Serve's ``PrefixCacheAffinityRouter`` keeps of the prompts it routed, here
  kept by the replica itself, so that every router sees the same);
- the session keys its suffix index holds (the sessions it served, least recently used first out);
- tokens a target step gave each kind of request, apart for requests whose session it held when they started;
- its recent steps' seconds against the requests verifying in them (:func:`fit_steps`; the last steps at each
  batch size), and a prefill token's seconds; when it last measured a step (an idle replica's figures age, and
  the router trusts them less: :meth:`~specdist.api.router.SpeculativePolicy.costs`);
- the requests it holds, queued or running, with the tokens each may still produce.

Not thread-safe: the live replica calls it under its own lock (:class:`EngineLedger`).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from specdist.api.router import DEFAULT_KIND, Pending, ReplicaStats, RouteRequest, block_hashes

__all__ = ["EngineLedger", "ReplicaLedger", "fit_steps"]

RECENT_STEPS = 16  # steps the step-time fit looks back on, at each batch size
PREFILL_EMA = 0.2  # weight of the newest prefill measurement in the prefill-seconds-a-token average


def fit_steps(samples: Iterable[tuple[int, float]]) -> tuple[float, float]:
    """Least squares of a step's seconds on its verifying requests: (intercept, slope >= 0); 0 and 0 without
    samples. While every sample had the same batch the slope cannot be told from the intercept: the step is
    taken as proportional to its requests (intercept 0, the mean over the batch), the cost of a compute-bound
    replica, so that load counts on a replica until it measured otherwise (with the mean as the intercept and
    slope 0, the router would see a replica as fast with any number of requests as with its first)."""
    samples = list(samples)
    if not samples:
        return 0.0, 0.0
    n = len(samples)
    mb = sum(b for b, _ in samples) / n
    ms = sum(s for _, s in samples) / n
    var = sum((b - mb) ** 2 for b, _ in samples)
    if var == 0:
        return (0.0, ms / mb) if mb >= 1 else (ms, 0.0)
    slope = max(0.0, sum((b - mb) * (s - ms) for b, s in samples) / var)
    return max(0.0, ms - slope * mb), slope


@dataclass
class _Held:
    route: RouteRequest
    held: bool  # the suffix index held its session when it started
    emitted: int = 0
    running: bool = False
    admitted_at: float | None = None  # when it was admitted (the clock of stats' now; None: untimed)
    prefill_tokens: int = 0  # its prompt's uncached tokens (reported until its first step)


class ReplicaLedger:
    """One replica's routing state (module docstring). ``cache_blocks``: KV blocks its prefix cache holds;
    ``index_sessions``: sessions its suffix index keeps."""

    def __init__(self, cache_blocks: int, index_sessions: int = 1024):
        self.cache_blocks = max(0, int(cache_blocks))
        self.index_sessions = max(0, int(index_sessions))
        self.cache: OrderedDict[int, None] = OrderedDict()
        self.index: OrderedDict[str, None] = OrderedDict()
        self.measured: dict[tuple[str, bool], list[float]] = {}  # (kind, held) -> [tokens, request steps]
        # requests verifying -> seconds of the last steps at that batch: kept apart, so that a replica running one
        # batch size for long (a full batch) still has the other sizes it ran, and the fit its slope
        self.recent_steps: dict[int, deque[float]] = {}
        self.prefill_s_per_token = 0.0
        self.measured_at: float | None = None  # when the last step was measured (the caller's clock)
        self.requests: dict[str, _Held] = {}
        self._cache_view: frozenset[int] | None = frozenset()

    # ------------------------------------------------------------ what the replica learns
    def remember(self, blocks: Sequence[int]) -> None:
        """These prompt blocks are in the prefix cache now (most recently used)."""
        for b in blocks:
            self.cache[b] = None
            self.cache.move_to_end(b)
        while len(self.cache) > self.cache_blocks:
            self.cache.popitem(last=False)
        self._cache_view = None

    def cached_blocks(self, blocks: Sequence[int]) -> int:
        """How many of these leading blocks the cache holds."""
        n = 0
        for b in blocks:
            if b not in self.cache:
                break
            n += 1
        return n

    def admit(self, route: RouteRequest, at: float | None = None, prefill_tokens: int = 0) -> bool:
        """A request starts here (queued) at ``at`` (the clock of :meth:`stats`' ``now``; None: untimed, reported
        as age 0), ``prefill_tokens`` of its prompt not cached: its prompt's blocks enter the cache and its session
        the index. Whether the index held its session already (its drafts then come from that session's earlier
        turns)."""
        held = bool(route.session) and route.session in self.index
        self.remember(route.prompt_blocks)
        if route.session and self.index_sessions:
            self.index[route.session] = None
            self.index.move_to_end(route.session)
            while len(self.index) > self.index_sessions:
                self.index.popitem(last=False)
        self.requests[route.request_id] = _Held(route, held, admitted_at=at, prefill_tokens=max(0, prefill_tokens))
        return held

    def tokens(self, kind: str, held: bool, tokens: int, steps: int = 1) -> None:
        """A request of ``kind`` got ``tokens`` from ``steps`` target steps."""
        got = self.measured.setdefault((kind, held), [0.0, 0.0])
        got[0] += tokens
        got[1] += steps

    def step(self, requests: int, seconds: float, at: float | None = None) -> None:
        """A target step verified ``requests`` requests in ``seconds`` (prefill left out), measured at ``at`` (on
        the clock of :meth:`stats`' ``now``; None: untimed, the figures then never read as old)."""
        if at is not None:
            self.measured_at = at
        self.recent_steps.setdefault(int(requests), deque(maxlen=RECENT_STEPS)).append(float(seconds))

    def prefill(self, tokens: int, seconds: float) -> None:
        """``tokens`` prompt tokens were prefilled in ``seconds``."""
        if tokens > 0 and seconds > 0:
            x = seconds / tokens
            p = self.prefill_s_per_token
            self.prefill_s_per_token = x if p == 0 else (1 - PREFILL_EMA) * p + PREFILL_EMA * x

    def stepped(self, request_id: str, kept: int) -> None:
        """A held request verified once and kept ``kept`` tokens (it runs from now on)."""
        h = self.requests.get(request_id)
        if h is None:
            return
        h.running = True
        h.emitted += kept
        self.tokens(h.route.kind, h.held, kept)

    def finish(self, request_id: str, full_blocks: Sequence[int] = ()) -> None:
        """A request ended; ``full_blocks``: its prompt and answer's blocks, now cached (a session's next turn
        extends them)."""
        self.requests.pop(request_id, None)
        if full_blocks:
            self.remember(full_blocks)

    # ------------------------------------------------------------ what it reports
    def stats(
        self,
        replica_id: str,
        now: float,
        max_batch_size: int,
        queued: Sequence[Pending] | None = None,
        running: Sequence[Pending] | None = None,
    ) -> ReplicaStats:
        """The report (``queued`` / ``running``: as the caller knows them; default: the requests held here)."""
        if queued is None or running is None:
            q, r = [], []
            for rid, h in self.requests.items():
                age = 0.0 if h.admitted_at is None else max(0.0, now - h.admitted_at)
                owed = 0 if h.running else h.prefill_tokens
                p = Pending(rid, max(0, h.route.max_tokens - h.emitted), h.route.kind, age, owed)
                (r if h.running else q).append(p)
            queued, running = q, r
        if self._cache_view is None:
            self._cache_view = frozenset(self.cache)
        tps = {k: t / s for (k, held), (t, s) in self.measured.items() if not held and s}
        held_tps = {k: t / s for (k, held), (t, s) in self.measured.items() if held and s}
        step_s, per_request = fit_steps((b, x) for b, xs in self.recent_steps.items() for x in xs)
        age = 0.0 if self.measured_at is None else max(0.0, now - self.measured_at)
        return ReplicaStats(
            replica_id,
            now,
            max_batch_size,
            tuple(queued),
            tuple(running),
            tps,
            held_tps,
            step_s,
            per_request,
            self.prefill_s_per_token,
            self._cache_view,
            frozenset(self.index),
            age,
        )


class EngineLedger:
    """A :class:`ReplicaLedger` kept by a live engine: :meth:`admit` on the event loop as a request is opened,
    the rest from the engine's step events (a listener, on the engine thread), under one lock.

    ``block_size``: the engine's KV block size; ``scope_of``: the prefix-cache scope of a tenant (its blocks
    hash with it under ``engine.prefix_cache_scope: tenant``, as the router hashes them)."""

    def __init__(self, cache_blocks: int, block_size: int, index_sessions: int = 1024):
        self.ledger = ReplicaLedger(cache_blocks, index_sessions)
        self.block_size = block_size
        self.lock = threading.Lock()
        self._prompts: dict[str, tuple[list[int], str]] = {}  # request key -> (prompt ids, hash scope)
        self._prefill_tokens = 0  # admitted prompt tokens not prefilled yet (measured at the next step)

    def admit(
        self,
        key: str,
        prompt_ids: Sequence[int],
        max_tokens: int,
        session: str = "",
        kind: str = DEFAULT_KIND,
        scope: str = "",
    ) -> bool:
        blocks = block_hashes(prompt_ids, self.block_size, scope)
        route = RouteRequest(key, len(prompt_ids), max_tokens, blocks, kind or DEFAULT_KIND, session)
        with self.lock:
            uncached = max(1, len(prompt_ids) - self.ledger.cached_blocks(blocks) * self.block_size)
            self._prefill_tokens += uncached
            self._prompts[key] = (list(prompt_ids), scope)
            return self.ledger.admit(route, time.time(), uncached)

    def __call__(self, event) -> None:
        """The engine's listener (:class:`~specdist.engine.output_processor.StepEvent` / ``RequestFinished``)."""
        from specdist.engine.output_processor import RequestFinished

        with self.lock:
            if isinstance(event, RequestFinished):
                prompt = self._prompts.pop(event.request_id, None)
                h = self.ledger.requests.get(event.request_id)
                full = ()
                if prompt is not None and h is not None and event.finish_reason in ("stop", "length"):
                    # the answer's ids are not in the event: the prompt's blocks stay the ones known cached
                    full = block_hashes(prompt[0], self.block_size, prompt[1])
                self.ledger.finish(event.request_id, full)
                return
            prefill_s = event.phase_s.get("prefill", 0.0)
            if prefill_s > 0 and self._prefill_tokens:
                self.ledger.prefill(self._prefill_tokens, prefill_s)
                self._prefill_tokens = 0
            if any(s.request_id in self.ledger.requests for s in event.requests):
                # (a step only of requests not opened through the replica, its engine's warm-up, is left out: its
                # first-call costs would stand in the fit as this replica's step time)
                self.ledger.step(len(event.requests), max(0.0, event.step_s), time.time())
            for s in event.requests:
                self.ledger.stepped(s.request_id, s.kept)

    def forget(self, key: str) -> None:
        """A request refused after :meth:`admit` (it never reached the engine)."""
        with self.lock:
            self._prompts.pop(key, None)
            self.ledger.requests.pop(key, None)

    def stats(self, replica_id: str, now: float, max_batch_size: int) -> ReplicaStats:
        with self.lock:
            return self.ledger.stats(replica_id, now, max_batch_size)
