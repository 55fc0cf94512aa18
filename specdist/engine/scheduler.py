"""The speculative step, written once, over a verifier and drafter replicas on any transport.

:class:`Scheduler` holds the requests and runs one ``step()`` at a time:

1. **admit** waiting requests while the target has room (and, after the first, while their
   prompts fit ``engine.max_prefill_tokens``): pick a draft replica (by measured
   speed, then load), ``verifier.prefill`` (every prompt token but the last goes into the
   target's cache), ``drafter.start`` with :func:`~specdist.transport.protocol.draft_seed` of the
   request seed;
2. **choose** each request's draft length ``k_b`` (:mod:`specdist.engine.draft_length`: a fixed k, or
   adaptive from its observed acceptance and the measured costs, down to 0), capped so
   neither ``max_tokens`` nor the context limit can be overrun inside a draft;
3. **propose**: one call per replica with its requests that draft (replicas in parallel),
   each item carrying what the target emitted since that request's last proposal. Model-free
   drafts (n-gram, suffix: lookups, no model pass) under the adaptive rule swap 2 and 3: they
   are proposed as long as the caps allow, the rule prices each position (by its match length
   where the proposal carries one) and each proposal is cut to the chosen length;
4. **verify**: one call for the whole batch; the verifier runs the target forward, the
   rejection sampler and the KV rollback, and returns accepted counts and next tokens;
5. **output**: stop tokens / strings, ``max_tokens`` and the context limit cut the output
   (:class:`~specdist.engine.stopping.OutputState`); finished requests are released everywhere.

The scheduler never knows which transport it talks to (:mod:`specdist.transport.protocol`). A
transport failure names the requests it concerns: a verifier failure ends them with
``finish_reason="error"`` (the call is retried without an item the core blamed); a
drafter failure detaches them from their drafter, and they go on without drafts (k = 0),
so the output stays exact; a drafter call that failed as a whole (the worker down, hung past
its deadline, erroring) also **ejects** the replica: new requests go to the others (or run
without drafts), and at the start of a step an ejected replica is probed (a ``release`` of
the requests whose release failed meanwhile, after ``PROBE_FIRST_S``, backing off to
``PROBE_MAX_S``) and re-admitted when it answers; :meth:`Scheduler.readmit` probes a replica
at once (a deployment restarted its worker). No room (RESOURCE_EXHAUSTED) at admission puts
requests back in the queue. A ``release`` that failed (a worker briefly down, a call past its
deadline) is not forgotten: the core may still hold those requests' slots, so their ids stay
pending per core and, at the start of a step, are released again in one call per core (after
``RELEASE_RETRY_FIRST_S``, backing off to ``RELEASE_RETRY_MAX_S``; an ejected replica's probe is
that call) until the core answers or refuses them (NOT_FOUND: already gone);
:meth:`Scheduler.retarget` forgets the target's (its group was rebuilt) and
:meth:`Scheduler.releases_pending` counts them; a request requeued after admission gets a new core
id, so a retried release of its old one cannot free its next admission. A verifier call that
failed as a whole asks ``target_diagnosis`` (when set: a deployment's check of its target ranks)
what failed, and the requests' error names it.
``step()`` does not raise for transport failures.

Timing (``stats.phase_s``): "prefill", "draft", "verify" (the target forward), "sampling"
(logits processing and rejection sampling, inside the verifier), "cache" (rollback,
releases), "output" (this process's bookkeeping) and, for remote transports, "network"
(each call's wall time minus the compute its core reports).

Step events: after every step that verified something, each callable in ``listeners`` gets
one :class:`StepEvent` (this step's phase times, batch, and per request a
:class:`~specdist.engine.request.RequestStep`), and once per finished request a
:class:`RequestFinished` (its final metrics), on the thread that runs the step. The
per-request metrics and ``stats`` are summed from the same records; Prometheus
(:mod:`specdist.api.metrics`) and benchmarks read the events instead of timing anything
themselves. A listener that raises is logged and the step goes on.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import random
import threading
import uuid
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from specdist.config import Config
from specdist.engine.draft_length import DraftLengthPolicy
from specdist.errors import ErrorCode, InvalidArgument
from specdist.engine.prompts import encode_prompt
from specdist.engine.request import Request, RequestMetrics, RequestOutput, RequestStep
from specdist.sampling_params import SamplingParams
from specdist.engine.stopping import OutputState
from specdist.transport.protocol import (
    HIT,
    CallTiming,
    Drafter,
    ProposeItem,
    StartItem,
    TransportError,
    Verifier,
    VerifyItem,
    draft_seed,
    now,
)

log = logging.getLogger(__name__)

PHASES = ("prefill", "draft", "verify", "sampling", "cache", "output", "network")
PROBE_FIRST_S, PROBE_MAX_S = 0.5, 30.0  # an ejected draft replica is probed after 0.5 s, backing off x2 to 30 s
# a failed release is retried after 0.1 s, backing off x2 to 10 s (a down worker is not hammered)
RELEASE_RETRY_FIRST_S, RELEASE_RETRY_MAX_S = 0.1, 10.0
REPLICA_SPEED_SLACK = 2.0  # replicas predicted within 2x of the fastest count as equally fast (fits are noisy)
# a core refused the item it blamed (a bad or stale item): the rest of the call can be retried without it
_PER_ITEM_CODES = frozenset({ErrorCode.INVALID_ARGUMENT, ErrorCode.NOT_FOUND, ErrorCode.FAILED_PRECONDITION,
                            ErrorCode.ALREADY_EXISTS})
_REFUSED_CODES = _PER_ITEM_CODES | {ErrorCode.RESOURCE_EXHAUSTED}  # the core refused the call before changing state
_TARGET_DOWN_CODES = frozenset({ErrorCode.UNAVAILABLE, ErrorCode.DEADLINE_EXCEEDED})  # rank 0 unreachable or hung


def _joined(parts: list):  # [m_i, nD] each -> [sum m_i, nD], or None for none
    if not parts:
        return None
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _per_item(failed) -> bool:
    """Whether any of the failures (TransportErrors) was a per-item refusal."""
    return any(e.code in _PER_ITEM_CODES for e in failed)


@dataclass
class EngineStats:
    """Wall time per phase (seconds), token counters and transport calls since the last reset."""

    phase_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0
    calls: int = 0
    pipeline_hits: int = 0  # request steps whose drafts were prepared during the previous verification
    pipeline_misses: int = 0
    draft_hidden_s: float = 0.0  # pipelined drafting done under verification (not in phase_s: no step waited)

    def reset(self) -> None:
        self.__init__()

    def add_step(self, s: RequestStep) -> None:
        self.drafted += s.drafted
        self.accepted += s.accepted
        self.emitted += s.kept
        self.pipeline_hits += s.pipeline == "hit"
        self.pipeline_misses += s.pipeline == "miss"


@dataclass
class StepEvent:
    """What one step did, emitted once after it (see the module docstring)."""

    batch_size: int  # requests verified
    phase_s: dict[str, float]  # seconds per phase (PHASES) spent in this step, its admissions included
    step_s: float  # wall seconds of the step after admission: choose, propose, verify, output, release
    plain_step_s: float  # predicted seconds of a step without drafts for this batch (the measured costs)
    requests: list[RequestStep]  # the verified requests, in batch order
    draft_hidden_s: float = 0.0  # pipelined drafting for this step that ran under the previous verification


@dataclass
class RequestFinished:
    """A request ended (any finish reason) and was released; ``metrics`` are final."""

    request_id: str
    finish_reason: str
    metrics: RequestMetrics


@dataclass
class _Unreleased:
    """Core ids whose release failed on one core, which may still hold their slots: released again
    (one call) once ``due``, backing off from RELEASE_RETRY_FIRST_S to RELEASE_RETRY_MAX_S."""

    ids: set[str] = field(default_factory=set)
    due: float = 0.0
    backoff: float = 0.0

    def add(self, ids, t: float) -> None:
        if not self.ids:  # the first of a run of failures: retry soon
            self.backoff = RELEASE_RETRY_FIRST_S
            self.due = t + self.backoff
        self.ids.update(ids)

    def answered(self, gone, t: float) -> None:
        """The core released (or did not know) ``gone``."""
        self.ids.difference_update(gone)
        self.backoff = RELEASE_RETRY_FIRST_S
        self.due = t

    def failed(self, t: float) -> None:
        self.backoff = min(RELEASE_RETRY_MAX_S, 2 * max(self.backoff, RELEASE_RETRY_FIRST_S / 2))
        self.due = t + self.backoff

    def clear(self) -> None:
        self.ids.clear()
        self.backoff = self.due = 0.0


@dataclass
class _Replica:
    drafter: Drafter
    live: int = 0  # requests started on it and not yet released
    propose_s: float = 0.0
    proposed_tokens: int = 0
    ejected_at: float | None = None  # a whole call failed: no new requests until a probe succeeds
    next_probe: float = 0.0
    probe_backoff: float = 0.0
    orphans: _Unreleased = field(default_factory=_Unreleased)  # released again when due, or by the probe
    down: bool = False  # its worker was reported down (replica_down): only its probe calls it, until it answers

    @property
    def latency_per_token(self) -> float:
        return self.propose_s / self.proposed_tokens if self.proposed_tokens else 0.0


class Scheduler:
    """Continuous batching of speculative decoding over one verifier and any drafter replicas."""

    def __init__(
        self,
        config: Config,
        verifier: Verifier,
        drafters: Sequence[Drafter] = (),
        tokenizer=None,
        eos_ids: frozenset[int] | Sequence[int] = frozenset(),
        draft_max_batch_size: int | None = None,
    ):
        ec = config.engine
        self.config = config
        self.verifier = verifier
        self.tokenizer = tokenizer
        self.vocab_size = int(verifier.vocab_size)
        self.eos_ids = frozenset(int(e) for e in eos_ids)
        self.max_model_len = ec.max_model_len
        self.max_batch_size = ec.max_batch_size
        self.max_prefill_tokens = ec.max_prefill_tokens  # None: no bound
        self.draft_max_batch_size = draft_max_batch_size or ec.max_batch_size
        self.replicas = [_Replica(d) for d in (drafters if config.draft.enabled else ())]
        self.k = config.draft.num_speculative_tokens if self.replicas else 0
        # model-free drafts (lookups) under the adaptive rule are proposed first, as long as each request may
        # draft, and the rule keeps the positions worth verifying, priced by their match lengths
        self._propose_first = (bool(self.replicas) and config.draft.model_free
                               and config.draft.length_policy == "adaptive")
        self.length_policy = DraftLengthPolicy(self.k, config.draft.length_policy,
                                               num_replicas=max(1, len(self.replicas)),
                                               pipelined=config.draft.pipelined and bool(self.replicas),
                                               model_free=self._propose_first)
        # The cost fits steer later lengths, so they must not see what a step's uniforms decided. Where
        # the draft's own samples cut its length (confidence threshold), the tokens past a rejection are
        # sampled with uniforms of positions the next steps draft again: the fits then take the planned
        # lengths, not the realised ones.
        self._planned_costs = config.draft.sampled_lengths
        self.coupling = config.sampling.coupling  # both cores of every request get it at admission
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.stats = EngineStats()
        self.listeners: list[Callable[[StepEvent | RequestFinished], None]] = []  # step events
        self._target_live = 0
        self._target_unreleased = _Unreleased()  # core ids whose release on the target failed
        self._ids = itertools.count()
        self._core_ids = itertools.count()
        self._uid = uuid.uuid4().hex[:8]
        # seeds of requests that bring none: the OS's randomness, or a stream of the configured seed (64 bits each)
        self._seeds = random.SystemRandom() if ec.seed is None else random.Random(ec.seed)
        self._pool: ThreadPoolExecutor | None = None  # parallel Propose when several replicas draft
        self._probe_pool: ThreadPoolExecutor | None = None  # probes of ejected draft replicas
        self._probes: dict[int, tuple] = {}  # replica -> (future of its probe, ids it releases)
        self._lock = threading.Lock()  # counters touched from the pool
        # () -> what failed ("target rank 1 died: ...") or None: asked when a target call fails as a whole
        self.target_diagnosis: Callable[[], str | None] | None = None

    @property
    def num_draft_replicas(self) -> int:
        return len(self.replicas)

    # ---------------------------------------------------------------- requests
    def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                    request_id: str | None = None, chat: bool = False, tenant: str = "") -> Request:
        """Queue a request. ``chat``: wrap a text prompt in the model's chat template (specdist.engine.prompts).
        ``tenant``: who it belongs to (the servers pass the caller's, :func:`specdist.transport.security.tenant_of`)."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidArgument("params", f"must be SamplingParams, got {type(params).__name__}")
        text, ids = encode_prompt(self.tokenizer, prompt, vocab_size=self.vocab_size,
                                  max_model_len=self.max_model_len, chat=chat)
        if params.stop and self.tokenizer is None:
            raise InvalidArgument("stop", "stop strings need a model with a tokenizer")
        seed = params.seed if params.seed is not None else self._seeds.getrandbits(64)
        req = Request(
            request_id=request_id if request_id is not None else str(next(self._ids)),
            prompt=text,
            prompt_ids=ids,
            params=params,
            output=OutputState(params, self.eos_ids, self.tokenizer),
            seed=int(seed),
            core_id=self._new_core_id(),
            tenant=tenant,
        )
        req.metrics.prompt_tokens = len(ids)
        req.metrics.arrival_time = now()
        req.queued = True
        self.waiting.append(req)
        return req

    def _new_core_id(self) -> str:
        return f"{self._uid}-{next(self._core_ids)}"

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free everything it holds. False if it is unknown or done."""
        for req in list(self.waiting) + self.running:
            if req.request_id == request_id:
                self._abort([req])
                return True
        return False

    def _abort(self, reqs: list[Request]) -> None:
        """End ``reqs`` with finish_reason "abort" and free everything they hold."""
        for r in reqs:
            r.output.finish("abort")
        self.release(reqs)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def generate(self, prompts: Sequence[str | Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 chat: bool = False) -> list[RequestOutput]:
        """Run a batch of prompts together to completion; outputs in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            raise InvalidArgument("prompts", "must be a list of prompts (text or token-id lists)")
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise InvalidArgument("params", f"got {len(plist)} SamplingParams for {len(prompts)} prompts")
        reqs = []
        try:
            for p, sp in zip(prompts, plist):
                reqs.append(self.add_request(p, sp, chat=chat))
            done = 0  # reqs[:done] are finished (a scan of every request per step would be quadratic)
            while done < len(reqs):
                if reqs[done].finished:
                    done += 1
                else:
                    self.step()
        finally:  # an exception or interrupt mid-run must not leave slots or queue entries behind
            self._abort([r for r in reqs if not r.finished])
        return [r.to_output() for r in reqs]

    def stream(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
               chat: bool = False) -> Iterator[str]:
        """Yield text pieces as they are produced; the final output is then ``self.last_output``."""
        req = self.add_request(prompt, params, chat=chat)
        try:
            while not req.finished:
                self.step()
                delta = req.output.take_delta()
                if delta:
                    yield delta
            tail = req.output.take_delta()
            if tail:
                yield tail
        finally:
            if not req.finished:
                self.abort(req.request_id)
        self.last_output = req.to_output()

    def release(self, r: Request | Sequence[Request]) -> None:
        """Free everything the request(s) hold (queue entry, target and draft state), one call per
        worker. Idempotent."""
        self._release([r] if isinstance(r, Request) else list(r))

    def kv_slots_in_use(self) -> dict[str, int]:
        """Requests admitted on the target and on each draft replica (each holds a slot there)."""
        used = {"target": self._target_live}
        if self.replicas:
            used["draft"] = sum(rep.live for rep in self.replicas)
            if len(self.replicas) > 1:
                for i, rep in enumerate(self.replicas):
                    used[f"draft/{i}"] = rep.live
        return used

    def releases_pending(self) -> dict[str, int]:
        """Requests whose release failed and is retried, per core (keys as :meth:`kv_slots_in_use`):
        each may still hold a slot there."""
        pending = {"target": len(self._target_unreleased.ids)}
        if self.replicas:
            pending["draft"] = sum(len(rep.orphans.ids) for rep in self.replicas)
            if len(self.replicas) > 1:
                for i, rep in enumerate(self.replicas):
                    pending[f"draft/{i}"] = len(rep.orphans.ids)
        return pending

    def retarget(self, address: str | None = None) -> None:
        """The target group was rebuilt (rank 0 now at ``address``, when given): reconnect the
        verifier (a remote one) and forget the releases still owed to the old group, whose
        requests the new cores do not hold."""
        reconnect = getattr(self.verifier, "reconnect", None)
        if reconnect is not None and address is not None:
            reconnect(address)
        with self._lock:
            self._target_unreleased.clear()

    def close(self) -> None:
        """Release every live request, then close the transports."""
        self._abort(list(self.waiting) + list(self.running))
        self._retry_releases(force=True)  # a last try for what a failed release left behind
        for pool in (self._pool, self._probe_pool):
            if pool is not None:
                pool.shutdown(wait=True)
        self.verifier.close()
        for rep in self.replicas:
            rep.drafter.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------- the step
    def step(self) -> list[Request]:
        """One verification for every running request. Returns the requests that advanced."""
        t = self.stats.phase_s
        phase0 = dict(t)
        hidden0 = self.stats.draft_hidden_s
        self._probe_ejected()
        self._leave_down()
        self._retry_releases()
        self._admit()
        if not self.running:
            return []
        policy = self.length_policy
        tc = now()
        reqs = list(self.running)
        caps = [self._draft_len(r) for r in reqs]
        first = [r.metrics.steps == 0 and not self.waiting for r in reqs]
        lengths, proposing_s = None, 0.0
        if self._propose_first:  # lookups cost no model pass: propose all a request may draft, price, cut
            tp = now()
            self._propose(reqs, [0 if f else c for c, f in zip(caps, first)])
            proposing_s = now() - tp
            caps = [len(r.proposal) if r.proposal is not None else 0 for r in reqs]
            lengths = [r.proposal.match_lengths if r.proposal is not None else None for r in reqs]
        ks = policy.choose(caps, [r.acceptance for r in reqs], [r.replica or 0 for r in reqs], first, lengths)

        t0 = now()
        if self._propose_first:
            for r, k in zip(reqs, ks):
                if r.proposal is not None:  # a prefix of a proposal is a proposal; none left: a plain step
                    r.proposal = r.proposal.truncated(k) if k > 0 else None
        else:
            self._propose(reqs, ks)

        items = [VerifyItem(r.core_id, r.seq_len, r.proposal) for r in reqs]
        results, failed, timing, wall = self._call_isolating(self.verifier.verify, items)
        self._account(timing, wall, self.verifier.is_remote, main="verify")
        for i, (msg, code) in self._target_errors(failed, len(items)).items():
            self._fail(reqs[i], msg, code)
        if self._planned_costs:
            ntok = sum((k if it.proposal is not None else 0) + 1 for it, k in zip(items, ks))
        else:
            ntok = sum(len(it.proposal or ()) + 1 for it in items)
        policy.observe_verify(ntok, wall, len(items))
        t2 = now()

        advanced, records = [], []
        done = [i for i in range(len(reqs)) if i not in failed]
        for i, res in zip(done, results or []):
            r = reqs[i]
            advanced.append(r)
            records.append(self._apply(r, res.num_accepted, res.next_token, res.logprobs, res.hidden))
        self.stats.steps += 1
        t3 = now()
        t["output"] += t3 - t2
        policy.end_step()
        policy.observe_overhead((t0 - tc - proposing_s) + (t3 - t2))
        self._release([r for r in self.running if r.finished])
        plain = policy.step_time([0] * len(reqs), [0] * len(reqs))
        phases = {name: t.get(name, 0.0) - phase0.get(name, 0.0) for name in t}
        self._emit(StepEvent(len(reqs), phases, now() - tc, plain, records, self.stats.draft_hidden_s - hidden0))
        return advanced

    def _emit(self, event: StepEvent | RequestFinished) -> None:
        for listener in list(self.listeners):
            try:
                listener(event)
            except Exception:  # noqa: BLE001 - an observer must not break the step
                log.exception("step-event listener %r failed", listener)

    def _apply(self, r: Request, n_acc: int, next_token: int, logprobs: list | None = None,
               hidden=None) -> RequestStep:
        """Fold one verification result into the request: output (with the kept tokens' log-probabilities
        when it asked), counters, the next ProposeItem (with the kept positions' hidden states, for an
        EAGLE-3 replica)."""
        p = r.proposal
        drafted = list(p.token_ids) if p is not None else []
        if p is not None:  # its drafter holds this proposal: the next ProposeItem says how much survived
            r.num_accepted = n_acc
        r.full_accept = p is not None and n_acc == len(drafted)  # a pipelined drafter's guess is tested next
        r.new_tokens.append(next_token)  # emitted since the last proposal (several when it skipped steps)
        if hidden is not None and r.replica is not None:
            r.hidden.append(hidden)
        r.proposal = None
        self.length_policy.observe_acceptance(r.acceptance, len(drafted), n_acc,
                                              p.match_lengths if p is not None else None)
        out = r.output
        kept = out.append(drafted[:n_acc] + [next_token])
        if r.logprobs is not None and logprobs is not None:  # the kept tokens are the first ``kept`` emitted
            r.logprobs.extend(logprobs[:kept])
        # tokens of this step the output consumed: the kept ones, plus a stop token that ended it
        used = kept + (1 if out.finished and isinstance(out.stop_reason, int) else 0)
        # draft positions that counted: all of them, unless the output ended inside the draft
        tried = min(len(drafted), used) if out.finished else len(drafted)
        accepted = min(n_acc, used)
        m = r.metrics
        step = RequestStep(r.request_id, r.replica, tried, accepted, used, kept,
                           pipeline=p.pipeline if p is not None else None)
        if kept or r.finished:
            t = now()
            if m.first_token_time is None:
                m.first_token_time = t
                step.ttft_s = t - m.arrival_time
            elif m.last_token_time is not None:
                step.inter_step_s = t - m.last_token_time
            m.last_token_time = t
        m.add_step(step)
        self.stats.add_step(step)
        if not r.finished and r.seq_len >= self.max_model_len:
            out.finish("length")
        return step

    def _draft_len(self, r: Request) -> int:
        """The most request r may draft: max_tokens and the context limit hold even if all are accepted."""
        if r.replica is None:
            return 0
        remaining = r.params.max_tokens - len(r.output.token_ids)  # tokens it may still emit
        room = self.max_model_len - r.seq_len  # context left
        return max(0, min(self.k, remaining - 1, room - 1))

    # ---------------------------------------------------------------- propose
    def _propose(self, reqs: list[Request], ks: list[int]) -> None:
        by_rep: dict[int, list[tuple[Request, int]]] = {}
        for r, k in zip(reqs, ks):
            if k > 0:
                by_rep.setdefault(r.replica, []).append((r, k))
        if not by_rep:
            return
        t0 = now()
        if len(by_rep) == 1:
            [(i, work)] = by_rep.items()
            spans = [self._propose_on(i, work)]
        else:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=len(self.replicas), thread_name_prefix="specdist-propose")
            futures = [self._pool.submit(self._propose_on, i, work) for i, work in by_rep.items()]
            spans = [f.result() for f in futures]
        wall = now() - t0
        compute = max((c for c, _ in spans), default=0.0)  # replicas draft in parallel: the slowest counts
        remote = any(rem for _, rem in spans)
        self.stats.phase_s["draft"] += min(compute, wall) if remote else wall
        if remote:
            self.stats.phase_s["network"] += wall - min(compute, wall)

    def _propose_on(self, i: int, work: list[tuple[Request, int]]) -> tuple[float, bool]:
        """Propose on replica i (may run on the pool). Returns (its compute seconds, is remote)."""
        rep = self.replicas[i]
        items = [ProposeItem(r.core_id, r.num_accepted, list(r.new_tokens), k, r.seq_len,
                             hidden=_joined(r.hidden)) for r, k in work]
        proposals, failed, timing, wall = self._call_isolating(rep.drafter.propose, items)
        ok = [r for j, (r, _) in enumerate(work) if j not in failed]
        ntok = 0
        policy = self.length_policy
        for r, p in zip(ok, proposals or []):
            if p.pipeline is not None and r.full_accept and len(r.new_tokens) == 1:
                policy.observe_guess(p.pipeline == HIT)  # the guess of its bonus token was tested
            r.proposal = p
            r.num_accepted, r.new_tokens, r.hidden = 0, [], []  # committed on the drafter
            ntok += len(p)
        if timing.hidden_s:
            with self._lock:
                self.stats.draft_hidden_s += timing.hidden_s
        if ntok:
            rep.propose_s += wall
            rep.proposed_tokens += ntok
        if timing.runs:  # a pipelined drafter reports its draft compute: most of it was hidden
            for passes, rows, seconds in timing.runs:
                policy.observe_draft(i, passes, rows, seconds)
        elif ntok:  # a first draft's prompt prefill ("prefill") is not a cost of drafting
            lengths = [k for j, (_, k) in enumerate(work) if j not in failed] if self._planned_costs \
                else [len(p) for p in proposals]
            policy.observe_draft(i, max(lengths), sum(lengths), wall - timing.phases.get("prefill", 0.0))
        if failed and len(failed) == len(items) and not _per_item(failed.values()):
            self._eject(i, next(iter(failed.values())).describe())
        for j, e in failed.items():  # detached from the drafter; released by the step afterwards
            self._detach(work[j][0], f"draft {rep.drafter.name}: {e.describe()}")
        compute = timing.total if rep.drafter.is_remote else wall
        return min(compute, wall), rep.drafter.is_remote

    # ---------------------------------------------------------------- admission
    def _pick_replica(self, free: list[int], live: list[int]) -> int:
        """The replica for a new request (``live``: its requests incl. this admission's so far).

        Predicted time of a full draft (k passes) with one more request, from the fitted
        per-replica costs (0 while unmeasured, so every replica gets tried); the replicas within
        ``REPLICA_SPEED_SLACK`` of the fastest compete on fewest live requests, then the lower
        measured Propose time per token, then the lower index.
        """
        fits = self.length_policy.draft_cost
        k = max(1, self.k)
        pred = {i: fits[i].predict(1, k, k * (live[i] + 1)) if fits[i].ready else 0.0 for i in free}
        best = min(pred.values())
        near = [i for i in free if pred[i] <= best * REPLICA_SPEED_SLACK + 1e-9]
        return min(near, key=lambda i: (live[i], self.replicas[i].latency_per_token, i))

    def _admit(self) -> None:
        """Move waiting requests onto the cores: prefill on the target, start on their replicas."""
        new = self._take_waiting()
        if not new:
            return
        t0 = now()
        admitted, requeue = self._prefill(new)
        requeue += self._start_drafts(admitted)
        self._requeue(requeue)
        for r in admitted:
            if r not in requeue and not r.finished:
                r.metrics.scheduled_time = t0
                self.running.append(r)
        self._release([r for r in new if r.finished])
        self.stats.phase_s["prefill"] += now() - t0

    def _take_waiting(self) -> list[Request]:
        """The waiting requests this step admits, off the queue, each given its replica (None: no drafts).

        While the target has room; after the first, while their prompts fit ``max_prefill_tokens``
        and, while any replica is healthy, while one of those has room."""
        new: list[Request] = []
        cap = [self.draft_max_batch_size - rep.live for rep in self.replicas]
        tokens = 0  # prompt tokens admitted this step: at most max_prefill_tokens (or one request)
        while self.waiting and self._target_live + len(new) < self.max_batch_size:
            r = self.waiting[0]
            tokens += len(r.prompt_ids)
            if new and self.max_prefill_tokens is not None and tokens > self.max_prefill_tokens:
                break
            if self.replicas:
                healthy = [i for i, rep in enumerate(self.replicas) if rep.ejected_at is None]
                free = [i for i in healthy if cap[i] > 0]
                if healthy and not free:
                    break  # wait for room on a healthy replica
                if free:
                    i = self._pick_replica(free, [self.draft_max_batch_size - c for c in cap])
                    cap[i] -= 1
                    r.replica = i
                else:  # every replica is ejected: decode without drafts
                    r.replica = None
            new.append(self.waiting.popleft())
            r.queued = False
        return new

    def _prefill(self, new: list[Request]) -> tuple[list[Request], list[Request]]:
        """``verifier.prefill`` of the new requests: (prefilled, out of room (to requeue)); the others failed."""
        ok, requeue, errors, prefilled = self._start_on(self.verifier, self._target_unreleased, self.verifier.prefill,
                                                        new, int)
        for r, p in zip(ok, prefilled):
            r.on_target = True
            self._target_live += 1
            r.hidden = [p.hidden] if p.hidden is not None and r.replica is not None else []
        messages = self._target_errors({j: e for j, (_, e) in enumerate(errors)}, len(new))
        for j, (r, _) in enumerate(errors):
            self._fail(r, *messages[j])
        return ok, requeue

    def _start_drafts(self, admitted: list[Request]) -> list[Request]:
        """``drafter.start`` of the admitted requests, one call per replica: those out of room there
        (to requeue). A failed one goes on without drafts; a call failed as a whole ejects its replica."""
        requeue: list[Request] = []
        by_rep: dict[int, list[Request]] = {}
        for r in admitted:
            if r.replica is not None:
                by_rep.setdefault(r.replica, []).append(r)
        for i, rs in by_rep.items():
            rep = self.replicas[i]
            started, full, errors, _ = self._start_on(rep.drafter, rep.orphans, rep.drafter.start, rs, draft_seed)
            if errors and len(errors) == len(rs) and not _per_item(e for _, e in errors):
                self._eject(i, errors[0][1].describe())
            for r in started:
                r.on_drafter = True
                rep.live += 1
            requeue += full
            for r, e in errors:
                self._detach(r, f"draft {rep.drafter.name}: {e.describe()}")
        return requeue

    def _requeue(self, requeue: list[Request]) -> None:
        """Back to the queue front, in order, everything they took freed."""
        for r in reversed(requeue):
            self._release_remote([r])
            r.core_id = self._new_core_id()  # a retried release of the old id must not hit its next admission
            r.replica = None
            r.queued = True
            self.waiting.appendleft(r)

    def _start_on(self, transport, unreleased: _Unreleased, method, rs: list[Request], seed_of):
        """Start requests on one core: (started, out of room (to requeue), [(request, TransportError)],
        the call's results for the started ones (the verifier's Prefilled; None for a drafter's start)).

        A call that failed without blaming an item (a worker down, a deadline) may have started
        them before it failed: they are released there (retried later if that fails too).
        """
        items = [StartItem(r.core_id, r.prompt_ids, r.params, seed_of(r.seed), self.coupling,
                           self._hidden_layers(r), r.tenant) for r in rs]
        results, failed, _, _ = self._call_isolating(method, items)
        unknown = [items[j].request_id for j, e in failed.items() if e.code not in _REFUSED_CODES]
        if unknown:
            self._release_on(transport, unreleased, unknown)
        full = [r for j, r in enumerate(rs) if j in failed and failed[j].code == ErrorCode.RESOURCE_EXHAUSTED]
        errors = [(rs[j], e) for j, e in failed.items() if e.code != ErrorCode.RESOURCE_EXHAUSTED]
        started = [r for j, r in enumerate(rs) if j not in failed]
        return started, full, errors, results if results is not None else [None] * len(started)

    def _hidden_layers(self, r: Request) -> tuple[int, ...]:
        """The target layers whose hidden states request r's replica drafts from (EAGLE-3), or ()."""
        return self.replicas[r.replica].drafter.hidden_layers if r.replica is not None else ()

    # ---------------------------------------------------------------- calls and failures
    def _call_isolating(self, method, items: list):
        """``method(items)``; a failure blaming one item drops that item and retries the rest.

        Returns (results or None, {index: its TransportError}, the core's timing, wall seconds).
        A failure naming no single item fails every remaining item.
        """
        idx = list(range(len(items)))
        failed: dict[int, TransportError] = {}
        t0 = now()
        while idx:
            with self._lock:
                self.stats.calls += 1
            try:
                out = method([items[i] for i in idx])
            except TransportError as e:
                if e.item is not None and e.code in _PER_ITEM_CODES and e.item < len(idx):
                    failed[idx.pop(e.item)] = e
                    continue
                for i in idx:
                    failed[i] = e
                return None, failed, CallTiming(), now() - t0
            results, timing = out if isinstance(out, tuple) else (None, out)
            return results, failed, timing, now() - t0
        return None, failed, CallTiming(), now() - t0

    def _account(self, timing: CallTiming, wall: float, remote: bool, main: str) -> None:
        """Book a call's wall time: the core's own phases, the rest to the network (remote) or ``main``."""
        t = self.stats.phase_s
        core = 0.0
        for name, s in timing.phases.items():
            key = "verify" if name == "forward" else name
            s = min(s, wall - core)
            t[key] = t.get(key, 0.0) + s
            core += s
        t["network" if remote else main] += max(0.0, wall - core)

    def _target_errors(self, failed: dict[int, TransportError], n: int) -> dict[int, tuple[str, ErrorCode]]:
        """(error message, code) of each request a target call failed (of ``n``). A call that failed
        as a whole (no item blamed) also names what failed, when ``target_diagnosis`` can tell; its
        code is UNAVAILABLE (a retry may succeed) when a rank failed or rank 0 was unreachable or
        past its deadline, else INTERNAL."""
        whole = len(failed) == n and not _per_item(failed.values())
        why = None
        if failed and whole and self.target_diagnosis is not None:
            try:
                why = self.target_diagnosis()
            except Exception:  # noqa: BLE001 - the diagnosis is a courtesy; the failure stands
                log.exception("target diagnosis failed")
        return {i: (f"target: {why} ({e.describe()})" if why else f"target: {e.describe()}",
                    ErrorCode.UNAVAILABLE if whole and (why or e.code in _TARGET_DOWN_CODES) else ErrorCode.INTERNAL)
                for i, e in failed.items()}

    def _fail(self, r: Request, message: str, code: ErrorCode = ErrorCode.INTERNAL) -> None:
        if not r.finished:
            r.error, r.error_code = message, code
            r.output.finish("error")
        log.warning("request %s failed: %s", r.request_id, message)

    def _eject(self, i: int, message: str) -> None:
        """Replica i failed a whole call: no new requests until it answers a probe."""
        rep = self.replicas[i]
        with self._lock:  # also runs on the propose pool, and from replica_down's thread
            if rep.ejected_at is None:
                t = now()
                rep.probe_backoff = PROBE_FIRST_S
                rep.next_probe = t + rep.probe_backoff
                rep.ejected_at = t  # last: the step reads it without the lock
                log.warning("draft %s ejected (%s); its requests continue without drafts", rep.drafter.name, message)

    def _probe_ejected(self) -> None:
        """Probe the ejected replicas that are due, off the step's thread (a probe may wait for its
        deadline): a release of the ids whose release failed, which a worker that was hung may
        still hold. Re-admit those whose probe came back."""
        t = now()
        for i, rep in enumerate(self.replicas):
            if rep.ejected_at is None:
                continue
            probe = self._probes.get(i)
            if probe is not None:
                future, sent = probe
                if not future.done():
                    continue
                del self._probes[i]
                error = future.exception()
                if error is None:
                    log.warning("draft %s answers again after %.1f s: re-admitted", rep.drafter.name, t - rep.ejected_at)
                    rep.ejected_at, rep.down = None, False
                    with self._lock:
                        rep.orphans.answered(sent, t)
                    continue
                rep.probe_backoff = min(PROBE_MAX_S, 2 * rep.probe_backoff)
                rep.next_probe = t + rep.probe_backoff
                log.info("draft %s still down (%s); next probe in %.1f s", rep.drafter.name, error, rep.probe_backoff)
            elif t >= rep.next_probe:
                if self._probe_pool is None:
                    self._probe_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="specdist-probe")
                sent = sorted(rep.orphans.ids)
                self._probes[i] = (self._probe_pool.submit(rep.drafter.release, sent), sent)

    def replica_down(self, i: int, reason: str) -> None:
        """Draft replica i's worker is down (a deployment's supervisor found it dead, hung, restarting
        or without a node). Safe from any thread: it is ejected now and its calls in flight are cut
        (a remote drafter's ``cut``: they fail at once, not at their deadlines); its requests go on
        without drafts from the next step, nothing but its probe calls it (what they hold there is
        released by the probe), and the probe's answer (or :meth:`readmit`) brings it back."""
        rep = self.replicas[i]
        rep.down = True
        self._eject(i, reason)
        cut = getattr(rep.drafter, "cut", None)
        if cut is not None:
            cut()

    def _leave_down(self) -> None:
        """Requests still on a replica reported down (:meth:`replica_down`) go on without drafts."""
        for r in self.running:
            if r.replica is not None and self.replicas[r.replica].down:
                self._detach(r, f"draft {self.replicas[r.replica].drafter.name} is down")

    def readmit(self, i: int, address: str | None = None) -> bool:
        """Draft replica i's worker was restarted (at ``address``, when it moved): probe it now.
        Returns whether it answered (then it is admitted again; else probing goes on)."""
        rep = self.replicas[i]
        reconnect = getattr(rep.drafter, "reconnect", None)  # remote transports: a fresh channel
        if reconnect is not None:
            reconnect(address or rep.drafter.address)
        self._probes.pop(i, None)  # an older probe's outcome says nothing of the new worker
        sent = sorted(rep.orphans.ids)
        try:
            rep.drafter.release(sent)
        except TransportError as e:
            log.warning("draft %s restarted but does not answer (%s)", rep.drafter.name, e)
            self._eject(i, str(e))
            return False
        with self._lock:
            rep.orphans.answered(sent, now())
        if rep.ejected_at is not None:
            log.warning("draft %s restarted: re-admitted", rep.drafter.name)
        rep.ejected_at, rep.down = None, False
        return True

    def _detach(self, r: Request, message: str) -> None:
        """Its drafter failed: release it there (best effort) and go on without drafts."""
        log.warning("request %s continues without drafts: %s", r.request_id, message)
        r.proposal = None
        r.hidden = []
        self._release_drafter([r])
        r.replica = None

    # ---------------------------------------------------------------- release
    def _release(self, reqs: list[Request]) -> None:
        if not reqs:
            return
        t0 = now()
        ended = []
        gone = {id(r) for r in reqs}  # one pass over each queue, whatever their lengths
        if any(r.queued for r in reqs):
            kept = [r for r in self.waiting if id(r) not in gone]
            self.waiting.clear()
            self.waiting.extend(kept)
        self.running[:] = [r for r in self.running if id(r) not in gone]
        for r in reqs:
            r.queued = False
            if r.metrics.finish_time is None:
                r.metrics.finish_time = now()
                ended.append(r)
        self._release_remote(reqs)
        self.stats.phase_s["cache"] += now() - t0
        for r in ended:
            if r.finished:
                r.metrics.output_tokens = len(r.output.token_ids)
                self._emit(RequestFinished(r.request_id, r.output.finish_reason, dataclasses.replace(r.metrics)))

    def _release_on(self, transport, unreleased: _Unreleased, ids: list[str]) -> None:
        """Release ``ids`` on one core. Those whose release failed (not refused: a worker down, a
        deadline) are kept in ``unreleased`` and released again later (:meth:`_retry_releases`). A
        replica reported down is not called: its probe releases them (the step waits on no worker down)."""
        if any(rep.orphans is unreleased and rep.down for rep in self.replicas):
            with self._lock:
                unreleased.add(ids, now())
            return
        _, failed, _, _ = self._call_isolating(transport.release, ids)
        kept = [ids[j] for j, e in failed.items() if e.code not in _PER_ITEM_CODES]
        if kept:
            e = next(e for e in failed.values() if e.code not in _PER_ITEM_CODES)
            log.warning("%s: release of %d requests failed (%s); retried later (they may hold slots there)",
                        transport.name, len(kept), e.describe())
            with self._lock:  # also runs on the propose pool (a detach)
                unreleased.add(kept, now())

    def _retry_releases(self, force: bool = False) -> None:
        """Release again, one call per core, what failed releases left behind, where due (``force``:
        now, on every core). An ejected replica's are its probe's (:meth:`_probe_ejected`)."""
        t0 = t = now()
        cores = [(self.verifier, self._target_unreleased)]
        cores += [(rep.drafter, rep.orphans) for i, rep in enumerate(self.replicas)
                  if force or (rep.ejected_at is None and i not in self._probes)]
        for transport, unreleased in cores:
            if not unreleased.ids or not (force or t >= unreleased.due):
                continue
            sent = sorted(unreleased.ids)
            _, failed, _, _ = self._call_isolating(transport.release, sent)
            t = now()
            down = [e for e in failed.values() if e.code not in _PER_ITEM_CODES]
            with self._lock:
                # released, or refused (NOT_FOUND: the core does not hold them): nothing left to free
                gone = [rid for j, rid in enumerate(sent) if j not in failed or failed[j].code in _PER_ITEM_CODES]
                if gone:
                    unreleased.answered(gone, t)
                if down:
                    unreleased.failed(t)
            if down:
                log.info("%s: release of %d requests failed again (%s); next try in %.1f s", transport.name,
                         len(unreleased.ids), down[0].describe(), unreleased.backoff)
            else:
                log.info("%s: released %d requests whose release had failed", transport.name, len(sent))
        self.stats.phase_s["cache"] += now() - t0

    def _release_remote(self, reqs: list[Request]) -> None:
        """Release on the target and each drafter (one call per core); failed releases are retried."""
        tgt = [r for r in reqs if r.on_target]
        if tgt:
            self._release_on(self.verifier, self._target_unreleased, [r.core_id for r in tgt])
            for r in tgt:
                r.on_target = False
                self._target_live -= 1
        self._release_drafter(reqs)

    def _release_drafter(self, reqs: list[Request]) -> None:
        by_rep: dict[int, list[Request]] = {}
        for r in reqs:
            if r.on_drafter:
                by_rep.setdefault(r.replica, []).append(r)
        for i, rs in by_rep.items():
            rep = self.replicas[i]
            self._release_on(rep.drafter, rep.orphans, [r.core_id for r in rs])
            for r in rs:
                r.on_drafter = False
                rep.live -= 1
