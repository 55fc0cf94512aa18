"""Which replica a request goes to: the policies of ``router.policy``, over the stats the replicas report.

Every replica (one speculative group: its target ranks and draft workers) reports :class:`ReplicaStats`
(``record_routing_stats`` on Ray Serve, a snapshot in the simulator of ``specdist bench router``): the
requests it runs and queues with their remaining tokens and kind, the tokens a target step gives each kind
of request there (measured: accepted drafts + 1), its step time and prefill time a token, the hashes of the
KV blocks its prefix cache holds and the session keys its suffix index holds. A :class:`Router` keeps the
latest report of each replica, adds the requests it sent since (a report lags), and asks its policy:

- ``round-robin``: the next replica in turn;
- ``least-loaded``: power of two choices: two replicas drawn (seeded), the one with fewer requests;
- ``prefix``: the longest cached prefix of the prompt (ties: fewer requests); by load alone while the
  load is imbalanced past ``router.imbalance_threshold`` (SGLang's cache-aware router);
- ``speculative``: the earliest expected finish of this request (:meth:`SpeculativePolicy.expected_finish`), plus
  how far sending it there would push the latest expected end of any request (:meth:`SpeculativePolicy.tail`),
  less what the replica's prefix cache saves its other requests (:meth:`SpeculativePolicy.saved`).

A report older than ``router.stats_period_s`` is not trusted: that replica gets nothing until it reports
again (unless no replica has a fresh report: then every replica is a candidate, in turn). A replica's
measurements (step time, prefill, tokens a step) are its own while younger than that period; past it they
age toward the pool's (:meth:`SpeculativePolicy.costs`), so a replica that read slow once and then got
nothing, measuring nothing more, is not avoided for ever. The pure parts
here import nothing of Ray, so the same code decides on Serve (:mod:`specdist.api.serve_router`) and in
the simulator.

Sessions: a request's session key is its tenant and its session (the OpenAI ``user`` field or the gRPC
``session_id``), or, without one, its tenant and the hash of its prompt's first ``router.session_blocks``
blocks; :func:`session_key` hashes the tenant in, so a key never matches another tenant's session.
"""

from __future__ import annotations

import hashlib
import heapq
import random
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

from specdist.config import ROUTER_POLICIES, RouterConfig

__all__ = [
    "POLICIES",
    "Costs",
    "Pending",
    "ReplicaStats",
    "RouteRequest",
    "Router",
    "block_hashes",
    "cached_prefix_blocks",
    "make_policy",
    "session_key",
]

DEFAULT_KIND = "default"
# Tokens a step assumed for a kind a replica has not measured yet (and no other kind either): plain decoding.
PRIOR_TOKENS_PER_STEP = 1.0
# A target step's seconds for each request in it, assumed while no replica has measured a step (a cold start):
# a step proportional to its batch, so that the requests' steps weigh before the first measurement (with no cost
# at all, every expected finish is 0 and the ties go by load, blind to a full batch of long requests).
PRIOR_STEP_S_PER_REQUEST = 0.01
# A prompt token's prefill seconds, assumed while no replica has measured a prefill (a cold start): what a verified
# token costs in a step (a request verifies about k + 1 = 5 tokens a step). A prompt token costs 0.27 of a request's
# share of a step on the live CPU replicas (measured) and 0.13 in the simulator's GPU cost model (assumed). At none,
# the live bench's first burst sent its two long prompts to one replica (the second waited 2.5 s for the first's
# prefill, docs/performance.md); the first measurement replaces it.
PRIOR_PREFILL_S_PER_TOKEN = PRIOR_STEP_S_PER_REQUEST / 5


def block_hashes(token_ids: Sequence[int], block_size: int, scope: str = "") -> tuple[int, ...]:
    """The chained hashes of the prompt's whole blocks: block i's hash covers tokens [0, (i + 1) x block_size),
    so equal hashes mean equal prefixes (as vLLM's prefix cache keys its blocks). ``scope``: a tenant under
    ``engine.prefix_cache_scope: tenant`` (its blocks never match another tenant's), else empty."""
    out: list[int] = []
    h = hashlib.blake2b(scope.encode(), digest_size=8).digest()
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        block = b"".join(int(t).to_bytes(4, "little", signed=False) for t in token_ids[start : start + block_size])
        h = hashlib.blake2b(h + block, digest_size=8).digest()
        out.append(int.from_bytes(h, "little"))
    return tuple(out)


def session_key(tenant: str, session: str | None, prompt_blocks: Sequence[int], session_blocks: int) -> str:
    """The key a replica's suffix index and the router know a session by: its tenant with its session id, or
    with the hash of its prompt's first ``session_blocks`` blocks when it has none (a conversation's turns
    share their first blocks). Hashed with the tenant, so equal ids of two tenants are two keys."""
    if session is not None:
        body = "s\x00" + session
    else:
        body = "p\x00" + ",".join(str(b) for b in prompt_blocks[:session_blocks])
    return hashlib.blake2b(f"{tenant}\x00{body}".encode(), digest_size=12).hexdigest()


def cached_prefix_blocks(prompt_blocks: Sequence[int], cached: Iterable[int] | frozenset[int]) -> int:
    """How many of the prompt's leading blocks the cache holds (chained hashes: a block counts only after all
    the blocks before it)."""
    held = cached if isinstance(cached, (set, frozenset)) else frozenset(cached)
    n = 0
    for b in prompt_blocks:
        if b not in held:
            break
        n += 1
    return n


@dataclass(frozen=True)
class RouteRequest:
    """What the router knows of a request before it runs: its prompt as block hashes (``block_size`` tokens a
    block), its prompt and most output tokens, its kind (acceptance differs by kind: ``edit``, ``write``,
    ``chat``, ...; ``default`` when the client names none) and its session key (:func:`session_key`)."""

    request_id: str
    prompt_tokens: int
    max_tokens: int
    prompt_blocks: tuple[int, ...] = ()
    kind: str = DEFAULT_KIND
    session: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "prompt_tokens": self.prompt_tokens,
            "max_tokens": self.max_tokens,
            "prompt_blocks": list(self.prompt_blocks),
            "kind": self.kind,
            "session": self.session,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RouteRequest:
        return cls(
            str(d["request_id"]),
            int(d["prompt_tokens"]),
            int(d["max_tokens"]),
            tuple(int(b) for b in d.get("prompt_blocks", ())),
            str(d.get("kind", DEFAULT_KIND)),
            str(d.get("session", "")),
        )


@dataclass(frozen=True)
class Pending:
    """A request queued or running on a replica: tokens it may still produce, its kind, its age (seconds since
    the replica took it, as of the report) and the prompt tokens it has still to prefill (its uncached part until
    its first step, then 0)."""

    request_id: str
    remaining_tokens: int
    kind: str = DEFAULT_KIND
    age_s: float = 0.0
    prefill_tokens: int = 0


def _step_tokens(per_kind: dict[str, float], held_per_kind: dict[str, float], kind: str, held: bool) -> float:
    """Tokens a step of a request of this kind (its session held or not): measured, else the mean over the kinds
    measured, else :data:`PRIOR_TOKENS_PER_STEP`."""
    if held and kind in held_per_kind:
        return held_per_kind[kind]
    if kind in per_kind:
        return per_kind[kind]
    if per_kind:
        return sum(per_kind.values()) / len(per_kind)
    return PRIOR_TOKENS_PER_STEP


@dataclass(frozen=True)
class Costs:
    """A replica's costs as the ``speculative`` policy takes them (:meth:`SpeculativePolicy.costs`): a target step's
    seconds ``step_s`` + ``step_s_per_request`` x requests, a prompt token's prefill seconds, tokens a step by
    kind (and by kind with the session held)."""

    step_s: float = 0.0
    step_s_per_request: float = 0.0
    prefill_s_per_token: float = 0.0
    tokens_per_step: dict[str, float] = field(default_factory=dict)
    session_tokens_per_step: dict[str, float] = field(default_factory=dict)

    def step_tokens(self, kind: str, held: bool = False) -> float:
        return _step_tokens(self.tokens_per_step, self.session_tokens_per_step, kind, held)


@dataclass(frozen=True)
class ReplicaStats:
    """One replica's report, as of ``reported_at`` (seconds on the router's clock).

    ``tokens_per_step``: measured tokens a target step gives a request of each kind (accepted drafts + 1);
    ``session_tokens_per_step``: the same over requests whose session the suffix index held when they
    started; a target step's seconds as measured, fitted on the requests verifying in it: ``step_s`` +
    ``step_s_per_request`` x requests (0 and 0 before any was measured); ``prefill_s_per_token``: seconds a
    prompt token's prefill adds to a step; ``cached_blocks``: block hashes (:func:`block_hashes`) its prefix cache
    holds;
    ``sessions``: the session keys (:func:`session_key`) its suffix index holds; ``measured_age_s``: seconds from
    its last measured step to ``reported_at`` (an idle replica's measurements grow old; 0: fresh or unknown)."""

    replica_id: str
    reported_at: float
    max_batch_size: int = 1
    queued: tuple[Pending, ...] = ()
    running: tuple[Pending, ...] = ()
    tokens_per_step: dict[str, float] = field(default_factory=dict)
    session_tokens_per_step: dict[str, float] = field(default_factory=dict)
    step_s: float = 0.0
    step_s_per_request: float = 0.0
    prefill_s_per_token: float = 0.0
    cached_blocks: frozenset[int] = frozenset()
    sessions: frozenset[str] = frozenset()
    measured_age_s: float = 0.0

    @property
    def load(self) -> int:
        return len(self.queued) + len(self.running)

    def step_tokens(self, kind: str, held: bool = False) -> float:
        """Tokens a step of a request of this kind (its session held or not), as this replica measured them."""
        return _step_tokens(self.tokens_per_step, self.session_tokens_per_step, kind, held)

    def costs(self) -> Costs:
        """Its own measurements as :class:`Costs`."""
        return Costs(
            self.step_s,
            self.step_s_per_request,
            self.prefill_s_per_token,
            self.tokens_per_step,
            self.session_tokens_per_step,
        )

    def to_dict(self) -> dict[str, Any]:
        """Plain data for ``record_routing_stats`` (Serve sends it to every router)."""

        def pend(p: Pending) -> list:
            return [p.request_id, p.remaining_tokens, p.kind, p.age_s, p.prefill_tokens]

        return {
            "replica_id": self.replica_id,
            "reported_at": self.reported_at,
            "max_batch_size": self.max_batch_size,
            "queued": [pend(p) for p in self.queued],
            "running": [pend(p) for p in self.running],
            "tokens_per_step": dict(self.tokens_per_step),
            "session_tokens_per_step": dict(self.session_tokens_per_step),
            "step_s": self.step_s,
            "step_s_per_request": self.step_s_per_request,
            "prefill_s_per_token": self.prefill_s_per_token,
            "cached_blocks": sorted(self.cached_blocks),
            "sessions": sorted(self.sessions),
            "measured_age_s": self.measured_age_s,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any], replica_id: str | None = None) -> ReplicaStats:
        def pend(items) -> tuple[Pending, ...]:
            return tuple(
                Pending(
                    str(x[0]),
                    int(x[1]),
                    str(x[2]),
                    float(x[3]) if len(x) > 3 else 0.0,
                    int(x[4]) if len(x) > 4 else 0,
                )
                for x in items
            )

        return cls(
            replica_id if replica_id is not None else str(d["replica_id"]),
            float(d["reported_at"]),
            int(d.get("max_batch_size", 1)),
            pend(d.get("queued", ())),
            pend(d.get("running", ())),
            {str(k): float(v) for k, v in d.get("tokens_per_step", {}).items()},
            {str(k): float(v) for k, v in d.get("session_tokens_per_step", {}).items()},
            float(d.get("step_s", 0.0)),
            float(d.get("step_s_per_request", 0.0)),
            float(d.get("prefill_s_per_token", 0.0)),
            frozenset(int(b) for b in d.get("cached_blocks", ())),
            frozenset(str(s) for s in d.get("sessions", ())),
            float(d.get("measured_age_s", 0.0)),
        )


@dataclass
class View:
    """What a policy sees of one trusted replica: its report, with the requests this router sent it since
    (counted as queued, their prompts as cached and their sessions as held: they will be)."""

    stats: ReplicaStats
    sent: tuple[RouteRequest, ...] = ()

    @property
    def replica_id(self) -> str:
        return self.stats.replica_id

    @property
    def load(self) -> int:
        return self.stats.load + len(self.sent)

    def pending(self) -> list[Pending]:
        return [
            *self.stats.queued,
            *self.stats.running,
            *(Pending(r.request_id, r.max_tokens, r.kind) for r in self.sent),
        ]

    def cached_blocks(self, request: RouteRequest) -> int:
        n = cached_prefix_blocks(request.prompt_blocks, self.stats.cached_blocks)
        for r in self.sent:  # a prompt sent there is cached there once it runs
            m = 0
            for a, b in zip(request.prompt_blocks, r.prompt_blocks):
                if a != b:
                    break
                m += 1
            n = max(n, m)
        return n

    def holds_session(self, request: RouteRequest) -> bool:
        return bool(request.session) and (
            request.session in self.stats.sessions or any(r.session == request.session for r in self.sent)
        )


POLICIES: dict[str, type[Policy]] = {}


def register(name: str) -> Callable[[type[Policy]], type[Policy]]:
    def deco(cls: type[Policy]) -> type[Policy]:
        POLICIES[name] = cls
        cls.name = name
        return cls

    return deco


class Policy(ABC):
    """Picks one of the trusted replicas (at least one) for a request."""

    name = ""

    def __init__(self, config: RouterConfig, block_size: int, seed: int = 0):
        self.config = config
        self.block_size = block_size
        self.rng = random.Random(seed)

    @abstractmethod
    def choose(self, request: RouteRequest, replicas: Sequence[View], now: float) -> str:
        """The chosen replica's id."""


@register("round-robin")
class RoundRobinPolicy(Policy):
    def __init__(self, config: RouterConfig, block_size: int, seed: int = 0):
        super().__init__(config, block_size, seed)
        self.turn = 0

    def choose(self, request: RouteRequest, replicas: Sequence[View], now: float) -> str:
        ids = sorted(v.replica_id for v in replicas)
        chosen = ids[self.turn % len(ids)]
        self.turn += 1
        return chosen


@register("least-loaded")
class LeastLoadedPolicy(Policy):
    """Power of two choices (Serve's default router): two replicas drawn, the one with fewer requests."""

    def choose(self, request: RouteRequest, replicas: Sequence[View], now: float) -> str:
        if len(replicas) == 1:
            return replicas[0].replica_id
        a, b = self.rng.sample(range(len(replicas)), 2)
        return (replicas[b] if replicas[b].load < replicas[a].load else replicas[a]).replica_id


@register("prefix")
class PrefixPolicy(Policy):
    """Longest cached prefix (ties: fewer requests, then the replica's id); by load alone past the imbalance
    threshold (max - min requests > absolute and max > relative x min)."""

    def choose(self, request: RouteRequest, replicas: Sequence[View], now: float) -> str:
        loads = [v.load for v in replicas]
        th = self.config.imbalance_threshold
        if max(loads) - min(loads) > th.absolute and max(loads) > th.relative * min(loads):
            return min(replicas, key=lambda v: (v.load, v.replica_id)).replica_id
        return min(replicas, key=lambda v: (-v.cached_blocks(request), v.load, v.replica_id)).replica_id


class Price(NamedTuple):
    """What sending a request to a replica costs, in seconds (:meth:`SpeculativePolicy.price`)."""

    finish: float  # its expected finish there
    with_it: float  # the latest expected end of the replica's requests with it sent there (its own included)
    without: float  # ... as the replica is
    saved: float  # what the replica's prefix cache saves its other requests on this one


@register("speculative")
class SpeculativePolicy(Policy):
    """The earliest expected finish of this request (:meth:`expected_finish`), kept from pushing back the latest
    expected end in the cluster (:meth:`tail`), affinity worth what a cached prefix saves the batch (:meth:`saved`):
    :meth:`choose`."""

    def expected_finish(self, request: RouteRequest, view: View, costs: Costs | None = None) -> float:
        """Seconds until this request would finish on the replica: (the target steps before it gets a batch
        slot + its own steps) x the replica's step time with it + the prefill of this prompt's part its cache
        lacks + the prefill the replica still owes (:meth:`owed_prefill`). ``costs``: the replica's costs
        (:meth:`costs`; default: its own measurements as reported).

        Steps before a slot: the replica's pending work in target steps (each queued or running request's
        remaining tokens over the tokens a step gives its kind there), laid on its ``max_batch_size`` slots:
        the running requests hold theirs, the queued ones (then those this router sent since the report)
        take the first slots to free, and this request the next (0 while a slot is free: a batch runs its
        requests side by side). Step time with it: the fit at the batch it joins (the running, queued
        and sent requests and itself, at most ``max_batch_size``; kept for its whole run: under load a slot
        that frees is taken again), so that requests sent between two reports do not all pile onto the
        replica that reported the fastest steps. Its own steps: its ``max_tokens`` over the tokens a step
        gives its kind there, more where the suffix index holds its session (measured on such requests).
        Affinity is this term and the prefill (the replica holding the session drafts better and prefills less),
        and in :meth:`choose` what the cached prefix saves the replica's other requests (:meth:`saved`)."""
        return self.price(request, view, costs or view.stats.costs()).finish

    @staticmethod
    def laid_out(view: View, c: Costs) -> tuple[float, list[tuple[float, float]]]:
        """The replica's requests on its ``max_batch_size`` slots, in target steps from now: the steps until a slot
        is free for one more, and each request's (age in seconds, target steps until it ends). The running ones
        hold their slots, the queued ones (then those this router sent since the report, of age 0) take the first
        slots to free."""
        s = view.stats
        ends = [(p.age_s, p.remaining_tokens / c.step_tokens(p.kind)) for p in s.running]
        slots = [steps for _, steps in ends] + [0.0] * max(0, s.max_batch_size - len(s.running))
        heapq.heapify(slots)
        for p in [*s.queued, *(Pending(r.request_id, r.max_tokens, r.kind) for r in view.sent)]:
            end = heapq.heappop(slots) + p.remaining_tokens / c.step_tokens(p.kind)
            ends.append((p.age_s, end))
            heapq.heappush(slots, end)
        return slots[0], ends

    @staticmethod
    def step_s(view: View, c: Costs, joining: bool) -> float:
        """A step's seconds at the batch the replica runs (its running, queued and sent requests, at most
        ``max_batch_size``), with one more request if ``joining``."""
        s = view.stats
        n = len(s.running) + len(s.queued) + len(view.sent) + int(joining)
        return c.step_s + c.step_s_per_request * min(max(1, s.max_batch_size), max(1, n))

    def tail(self, request: RouteRequest, view: View, costs: Costs | None = None) -> tuple[float, float]:
        """The latest expected end to end of the replica's requests (each one's age + its steps until it ends x
        the step time + the prefill the replica owes), as it is and with this request sent there: (with it,
        without it). With it, each step of theirs that this request shares (until it ends) is one request longer,
        and this prompt's prefill comes before them all; and this request's own finish counts."""
        p = self.price(request, view, costs or view.stats.costs())
        return p.with_it, p.without

    def saved(self, request: RouteRequest, view: View, costs: Costs | None = None) -> float:
        """Seconds the replica's prefix cache saves its other requests on this one: each of them would wait
        through the prefill of the prompt's cached part, so that part's prefill time once for each (the saving
        to this request itself is in :meth:`expected_finish`)."""
        return self.price(request, view, costs or view.stats.costs()).saved

    def owed_prefill(self, view: View, c: Costs) -> float:
        """Seconds of prefill the replica still owes its requests (the uncached prompts of those that have not
        stepped yet, less the time since they came, and of those this router sent since the report): its steps
        wait for them, and so does a request sent there now."""
        s = view.stats
        owed = sum(max(0.0, p.prefill_tokens * c.prefill_s_per_token - p.age_s) for p in (*s.queued, *s.running))
        for r in view.sent:
            cached = cached_prefix_blocks(r.prompt_blocks, s.cached_blocks) * self.block_size
            owed += max(0, r.prompt_tokens - cached) * c.prefill_s_per_token
        return owed

    def price(self, request: RouteRequest, view: View, c: Costs) -> Price:
        """:meth:`expected_finish`, :meth:`tail` (with it, without it) and :meth:`saved`, the replica's requests laid
        out once."""
        wait, ends = self.laid_out(view, c)
        before, after = self.step_s(view, c, joining=False), self.step_s(view, c, joining=True)
        cached = min(request.prompt_tokens, view.cached_blocks(request) * self.block_size)
        prefill = (request.prompt_tokens - cached) * c.prefill_s_per_token
        owed = self.owed_prefill(view, c)
        until = wait + request.max_tokens / c.step_tokens(request.kind, held=view.holds_session(request))
        finish = until * after + prefill + owed
        without = max((age + steps * before + owed for age, steps in ends), default=0.0)
        with_it = max(
            (age + steps * before + min(steps, until) * (after - before) + prefill + owed for age, steps in ends),
            default=0.0,
        )
        return Price(finish, max(with_it, finish), without, cached * c.prefill_s_per_token * len(ends))

    def choose(self, request: RouteRequest, replicas: Sequence[View], now: float) -> str:
        """The least of: this request's expected finish there - what the replica's prefix cache saves its other
        requests (:meth:`saved`) + the latest expected end of any request in the cluster once it is sent there.
        The last term is the same wherever the request leaves the cluster's latest end where it is (then the
        earliest finish decides), and grows by as much as a replica would push it: a request is not sent beside
        the one most at risk of being the tail (an old, long, slow-drafting request) unless it saves itself more
        there than it costs that one. The saving makes affinity worth what a cached prefix spares the whole
        batch, not this request alone: on a GPU a prefill is short beside a busier replica's wait, and counted
        for one request only, affinity gave way to balance (docs/performance.md, "Router (simulated)"). Without
        cache hits it is 0 everywhere. (Ties: fewer requests, then the id.)"""
        costs = self.costs(replicas, now)
        rows = [(v, self.price(request, v, costs[v.replica_id])) for v in replicas]
        latest = max(p.without for _, p in rows)
        v, _ = min(
            rows, key=lambda r: (r[1].finish - r[1].saved + max(r[1].with_it, latest), r[0].load, r[0].replica_id)
        )
        return v.replica_id

    def costs(self, replicas: Sequence[View], now: float) -> dict[str, Costs]:
        """Each replica's costs: its measurements, trusted in full while younger than ``router.stats_period_s``
        (P) and past that half as much every further P, the rest taken from the pool: the mean of the
        replicas' measurements of the same thing (a step fit, a prefill cost, a kind's tokens a step), each
        weighted by that same trust, relative to the freshest. A measurement's age: the replica's
        ``measured_age_s`` and its report's age since.

        The replicas run the same group, so what one measured stands for another's until that one measures
        again: a replica without a step (prefill) measured yet takes the pool's rather than costing
        nothing, and one that has not run a kind yet takes what the others measured of that kind (not its
        mean over the kinds it ran: a replica that ran only edits would take free writing for as fast); and
        a replica whose first measurements read slow (a noisy step, a prefill with another process on its
        core) and that then got nothing, so measured nothing more, comes back to the pool's figures as it
        idles and gets a request once that makes it the earliest finish, instead of being avoided for ever.
        A replica that stays busy measures all the time and keeps its own figures."""
        period = self.config.stats_period_s
        excess = {
            v.replica_id: max(0.0, v.stats.measured_age_s + max(0.0, now - v.stats.reported_at) - period)
            for v in replicas
        }
        least = min(excess.values(), default=0.0)
        trust = {rid: 0.5 ** (x / period) for rid, x in excess.items()}
        weight = {rid: 0.5 ** ((x - least) / period) for rid, x in excess.items()}  # (> 0 for the freshest)

        def pooled(values: dict[str, Any]) -> Any:
            """The trust-weighted mean of the replicas' values (a float or a tuple of floats); None: none."""
            if not values:
                return None
            total = sum(weight[rid] for rid in values)
            first = next(iter(values.values()))
            if isinstance(first, tuple):
                return tuple(sum(weight[rid] * x[i] for rid, x in values.items()) / total for i in range(len(first)))
            return sum(weight[rid] * x for rid, x in values.items()) / total

        def aged(rid: str, own: Any, pool: Any) -> Any:
            """``own`` toward ``pool`` by the replica's trust (``own`` None: not measured, the pool's)."""
            if own is None:
                return pool
            if pool is None:
                return own
            t = trust[rid]
            if isinstance(own, tuple):
                return tuple(t * a + (1 - t) * b for a, b in zip(own, pool))
            return t * own + (1 - t) * pool

        steps = {
            v.replica_id: (v.stats.step_s, v.stats.step_s_per_request)
            for v in replicas
            if v.stats.step_s > 0 or v.stats.step_s_per_request > 0
        }
        prefills = {v.replica_id: v.stats.prefill_s_per_token for v in replicas if v.stats.prefill_s_per_token > 0}
        step_pool, prefill_pool = pooled(steps), pooled(prefills)

        def per_kind(attr: str) -> dict[str, dict[str, float]]:
            """Replica -> kind -> tokens a step, for every kind some replica measured."""
            own = {v.replica_id: getattr(v.stats, attr) for v in replicas}
            kinds = {k for d in own.values() for k in d}
            pool = {k: pooled({rid: d[k] for rid, d in own.items() if k in d}) for k in kinds}
            return {rid: {k: aged(rid, d.get(k), pool[k]) for k in kinds} for rid, d in own.items()}

        tps, held_tps = per_kind("tokens_per_step"), per_kind("session_tokens_per_step")
        out = {}
        for v in replicas:
            rid = v.replica_id
            step = aged(rid, steps.get(rid), step_pool) or (0.0, PRIOR_STEP_S_PER_REQUEST)
            prefill = aged(rid, prefills.get(rid), prefill_pool) or PRIOR_PREFILL_S_PER_TOKEN
            out[rid] = Costs(step[0], step[1], prefill, tps[rid], held_tps[rid])
        return out


def make_policy(config: RouterConfig, block_size: int, seed: int = 0) -> Policy:
    """The policy ``config.policy`` names (validated: one of :data:`specdist.config.ROUTER_POLICIES`)."""
    return POLICIES[config.policy](config, block_size, seed)


assert tuple(POLICIES) == ROUTER_POLICIES, "the config's policy names and the registry's must agree"


class Router:
    """The latest report of each replica, the requests sent since, and the policy deciding.

    ``report(stats)`` takes a replica's report (an older one than held is ignored); ``choose(request, now,
    candidates)`` picks among ``candidates`` (default: every replica that reported) and books the request
    on the chosen replica; ``done(replica_id, request_id, now)`` when it ends. A booked request stays counted
    until it ends or a report made after it was sent lists it or not (then the report speaks for it); a
    request that ended is taken out of the replica's report until a report made after its end: a report lags,
    and a closed-loop client's next request, sent the moment its last one ended, would otherwise see that
    one still running where it ran, the very replica with a free slot."""

    def __init__(self, config: RouterConfig, block_size: int, seed: int = 0):
        self.config = config
        self.policy = make_policy(config, block_size, seed)
        self.stats: dict[str, ReplicaStats] = {}
        self.sent: dict[str, dict[str, tuple[float, RouteRequest]]] = {}  # replica -> request id -> (sent, req)
        self.ended: dict[str, dict[str, float]] = {}  # replica -> request id -> when it ended (after its report)
        self.turn = 0  # round-robin over every candidate when none is trusted

    def report(self, stats: ReplicaStats) -> None:
        held = self.stats.get(stats.replica_id)
        if held is not None and held.reported_at > stats.reported_at:
            return
        self.stats[stats.replica_id] = stats
        sent = self.sent.get(stats.replica_id)
        if sent:  # the report speaks for what was sent before it was made
            for rid in [rid for rid, (t, _) in sent.items() if t <= stats.reported_at]:
                del sent[rid]
        ended = self.ended.get(stats.replica_id)
        if ended:  # and for what ended before it was made
            for rid in [rid for rid, t in ended.items() if t <= stats.reported_at]:
                del ended[rid]

    def forget(self, replica_id: str) -> None:
        """A replica gone (dead, scaled down)."""
        self.stats.pop(replica_id, None)
        self.sent.pop(replica_id, None)
        self.ended.pop(replica_id, None)

    def trusted(self, now: float, candidates: Iterable[str] | None = None) -> list[View]:
        ids = self.stats.keys() if candidates is None else candidates
        out = []
        for rid in ids:
            s = self.stats.get(rid)
            if s is not None and now - s.reported_at <= self.config.stats_period_s:
                ended = self.ended.get(rid)
                if ended:
                    s = replace(
                        s,
                        queued=tuple(p for p in s.queued if p.request_id not in ended),
                        running=tuple(p for p in s.running if p.request_id not in ended),
                    )
                out.append(View(s, tuple(r for _, r in self.sent.get(rid, {}).values())))
        return out

    def choose(
        self, request: RouteRequest, now: float, candidates: Sequence[str] | None = None, book: bool = True
    ) -> str:
        """The replica for ``request``; ``book``: count it there now (else :meth:`book` once it is sent)."""
        views = self.trusted(now, candidates)
        if views:
            chosen = self.policy.choose(request, views, now)
        else:
            ids = sorted(self.stats if candidates is None else candidates)
            if not ids:
                raise LookupError("no replica to route to")
            chosen = ids[self.turn % len(ids)]
            self.turn += 1
        if book:
            self.book(chosen, request, now)
        return chosen

    def book(self, replica_id: str, request: RouteRequest, now: float) -> None:
        """Count ``request`` on ``replica_id`` (moved there if it was booked on another: the caller sent it
        elsewhere than chosen)."""
        for rid, sent in self.sent.items():
            if rid != replica_id:
                sent.pop(request.request_id, None)
        self.sent.setdefault(replica_id, {})[request.request_id] = (now, request)

    def done(self, replica_id: str, request_id: str, now: float | None = None) -> None:
        """The request ended (or was never sent): counted nowhere any more. ``now``: when it ended; then the
        replica's report, until one made after that, is read without it (None: the report stays as it is)."""
        for sent in self.sent.values():
            sent.pop(request_id, None)
        held = self.stats.get(replica_id)
        if now is not None and held is not None and held.reported_at < now:
            self.ended.setdefault(replica_id, {})[request_id] = now
