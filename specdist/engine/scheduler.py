"""The speculative step, written once, over a verifier and drafter replicas on any transport.

:class:`Scheduler` holds the requests and runs one ``step()`` at a time:

1. **admit** waiting requests while the target has room (and, after the first, while their
   prompts fit ``engine.max_prefill_tokens``): pick a draft replica
   (:meth:`~specdist.engine.draft_pool.DraftPool.choose`: by measured speed, then load),
   ``verifier.prefill`` (every prompt token but the last goes into the target's cache),
   ``drafter.start`` with :func:`~specdist.randomness.draft_seed` of the request seed;
2. **choose** each request's draft length ``k_b`` (:mod:`specdist.engine.draft_length`: a fixed k, or
   adaptive from its observed acceptance and the measured costs, down to 0), capped so
   neither ``max_tokens`` nor the context limit can be overrun inside a draft; the rule learns
   from what each step measured, which the step's :class:`StepEvent` carries (``costs``);
3. **propose**: one call per replica with its requests that draft (replicas in parallel),
   each item carrying what the target emitted since that request's last proposal. Model-free
   drafts (n-gram, suffix: lookups, no model pass) under the adaptive rule swap 2 and 3: they
   are proposed as long as the caps allow, the rule prices each position (by its match length
   where the proposal carries one) and each proposal is cut to the chosen length;
4. **verify**: one call for the whole batch; the verifier runs the target forward, the
   rejection sampler and the KV rollback, and returns accepted counts and next tokens;
5. **output**: :class:`~specdist.engine.output_processor.OutputProcessor` applies them (stop tokens / strings,
   ``max_tokens`` and the context limit cut the output; metrics, stats, step events); finished
   requests are released everywhere.

The scheduler never knows which transport it talks to (:mod:`specdist.transport.protocol`). A
transport failure names the requests it concerns: a verifier failure ends them with
``finish_reason="error"`` (the call is retried without an item the core blamed,
:func:`~specdist.engine.calls.call_isolating`); a drafter failure detaches them from their
drafter, and they go on without drafts (k = 0), so the output stays exact; a drafter call that
failed as a whole (the worker down, hung past its deadline, erroring) also ejects the replica
from the :class:`~specdist.engine.draft_pool.DraftPool` (which probes and re-admits it; new
requests go to the others, or run without drafts). No room (RESOURCE_EXHAUSTED) at admission puts
requests back in the queue. A ``release`` that failed (a worker briefly down, a call past its
deadline) is not forgotten (:class:`~specdist.engine.calls.PendingReleases`, one per core: the
target's here, each replica's in the pool): at the start of a step it is released again, when
due; :meth:`Scheduler.retarget` forgets the target's (its group was rebuilt) and
:meth:`Scheduler.releases_pending` counts them; a request requeued after admission gets a new core
id, so a retried release of its old one cannot free its next admission. A verifier call that
failed as a whole asks ``target_diagnosis`` (when set: a deployment's check of its target ranks)
what failed, and the requests' error names it.
``step()`` does not raise for transport failures.

Timing (``stats.phase_s``): "prefill", "draft", "verify" (the target forward), "sampling"
(logits processing and rejection sampling, inside the verifier), "cache" (rollback,
releases), "output" (this process's bookkeeping) and, for remote transports, "network"
(each call's wall time minus the compute its core reports). Step events: see
:mod:`specdist.engine.output_processor`.
"""

from __future__ import annotations

import functools
import itertools
import logging
import random
import threading
import uuid
from collections import deque
from collections.abc import Callable, Sequence

import torch

from specdist.clock import now
from specdist.config import Config
from specdist.engine.calls import REFUSED_CODES, PendingReleases, call_isolating, per_item
from specdist.engine.draft_length import DraftLengthPolicy, StepCosts
from specdist.engine.draft_pool import DraftPool, Replica
from specdist.engine.output_processor import EngineStats, OutputProcessor, RequestFinished, StepEvent
from specdist.engine.prompts import EncodedPrompt
from specdist.engine.request import Request
from specdist.errors import ErrorCode, InvalidArgument
from specdist.randomness import draft_seed
from specdist.sampling_params import SamplingParams
from specdist.transport.protocol import (
    HIT,
    CallTiming,
    Drafter,
    DraftTraits,
    ProposeItem,
    StartItem,
    TransportError,
    Verifier,
    VerifyItem,
)

log = logging.getLogger(__name__)

_TARGET_DOWN_CODES = frozenset({ErrorCode.UNAVAILABLE, ErrorCode.DEADLINE_EXCEEDED})  # rank 0 unreachable or hung


def _joined(parts: list):  # [m_i, nD] each -> [sum m_i, nD], or None for none
    if not parts:
        return None
    return parts[0] if len(parts) == 1 else torch.cat(parts)


class Scheduler:
    """Continuous batching of speculative decoding over one verifier and any drafter replicas.

    Holds the requests (``waiting``, ``running``), the target's transport and bookkeeping, the
    draft-length rule, the draft replicas (``pool``: :class:`~specdist.engine.draft_pool.DraftPool`)
    and what applies results to the requests (``output``:
    :class:`~specdist.engine.output_processor.OutputProcessor`, with ``stats`` and ``listeners``)."""

    def __init__(
        self,
        config: Config,
        verifier: Verifier,
        drafters: Sequence[Drafter] = (),
        tokenizer=None,
        eos_ids: frozenset[int] | Sequence[int] = frozenset(),
        draft_max_batch_size: int | None = None,
        traits: DraftTraits = DraftTraits(),
    ):
        """``traits``: what the draft method is like (:func:`specdist.cores.proposers.draft_traits`: the engines
        read them off the method; the default is a method with none of them)."""
        ec = config.engine
        self.config = config
        self.traits = traits
        self.verifier = verifier
        self.tokenizer = tokenizer
        self.vocab_size = int(verifier.vocab_size)
        self.eos_ids = frozenset(int(e) for e in eos_ids)
        self.max_model_len = ec.max_model_len
        self.max_batch_size = ec.max_batch_size
        self.max_prefill_tokens = ec.max_prefill_tokens  # None: no bound
        self.stats = EngineStats()
        self._lock = threading.Lock()  # stats.calls: also counted on the propose threads (DraftPool.propose)
        self._call_isolating = functools.partial(call_isolating, count=self._count_call)  # every transport call
        self.pool = DraftPool(
            drafters if config.draft.enabled else (), draft_max_batch_size or ec.max_batch_size, self._call_isolating
        )
        self.k = config.draft.num_speculative_tokens if self.pool else 0
        # model-free drafts (lookups) under the adaptive rule are proposed first, as long as each request may
        # draft, and the rule keeps the positions worth verifying, priced by their match lengths
        self._propose_first = bool(self.pool) and traits.model_free and config.draft.length_policy == "adaptive"
        self.length_policy = DraftLengthPolicy(
            self.k,
            config.draft.length_policy,
            num_replicas=max(1, len(self.pool)),
            pipelined=traits.pipelined and bool(self.pool),
            model_free=self._propose_first,
        )
        # The cost fits steer later lengths, so they must not see what a step's uniforms decided. Where
        # the draft's own samples cut its length (confidence threshold), the tokens past a rejection are
        # sampled with uniforms of positions the next steps draft again: the fits then take the planned
        # lengths, not the realised ones.
        self._planned_costs = traits.sampled_lengths
        self.coupling = config.sampling.coupling  # both cores of every request get it at admission
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.listeners: list[Callable[[StepEvent | RequestFinished], None]] = []  # step events
        self.output = OutputProcessor(self.stats, self.listeners, tokenizer, self.eos_ids, self.max_model_len)
        self._target_live = 0
        self._target_unreleased = PendingReleases()  # core ids whose release on the target failed
        self._ids = itertools.count()
        self._core_ids = itertools.count()
        self._uid = uuid.uuid4().hex[:8]
        # seeds of requests that bring none: the OS's randomness, or a stream of the configured seed (64 bits each)
        self._seeds = random.SystemRandom() if ec.seed is None else random.Random(ec.seed)
        # () -> what failed ("target rank 1 died: ...") or None: asked when a target call fails as a whole
        self.target_diagnosis: Callable[[], str | None] | None = None

    @property
    def replicas(self) -> list[Replica]:
        return self.pool.replicas

    @property
    def num_draft_replicas(self) -> int:
        return len(self.pool)

    # ---------------------------------------------------------------- requests
    def add_request(
        self,
        prompt: EncodedPrompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        tenant: str = "",
    ) -> Request:
        """Queue a request whose prompt was encoded and checked where it arrived (:class:`EncodedPrompt`:
        :meth:`EngineBase.add_request <specdist.engine.base.EngineBase.add_request>`, the coordinator's
        tokenizer threads); its arrival time is the prompt's. ``tenant``: who it belongs to (the servers
        pass the caller's, :func:`specdist.transport.security.tenant_of`)."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidArgument("params", f"must be SamplingParams, got {type(params).__name__}")
        output = self.output.output_state(params)
        seed = params.seed if params.seed is not None else self._seeds.getrandbits(64)
        req = Request(
            request_id=request_id if request_id is not None else str(next(self._ids)),
            prompt=prompt.text,
            prompt_ids=prompt.ids,
            params=params,
            output=output,
            seed=int(seed),
            core_id=self._new_core_id(),
            tenant=tenant,
        )
        req.metrics.prompt_tokens = len(prompt.ids)
        req.metrics.arrival_time = prompt.arrival
        req.queued = True
        self.waiting.append(req)
        return req

    def _new_core_id(self) -> str:
        return f"{self._uid}-{next(self._core_ids)}"

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free everything it holds. False if it is unknown or done."""
        for req in list(self.waiting) + self.running:
            if req.request_id == request_id:
                self.abort_requests([req])
                return True
        return False

    def abort_requests(self, reqs: Sequence[Request]) -> None:
        """End ``reqs`` with finish_reason "abort" and free everything they hold."""
        for r in reqs:
            r.output.finish("abort")
        self.release(reqs)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def release(self, r: Request | Sequence[Request]) -> None:
        """Free everything the request(s) hold (queue entry, target and draft state), one call per
        worker. Idempotent."""
        reqs = [r] if isinstance(r, Request) else list(r)
        if not reqs:
            return
        t0 = now()
        gone = {id(r) for r in reqs}  # one pass over each queue, whatever their lengths
        if any(r.queued for r in reqs):
            kept = [r for r in self.waiting if id(r) not in gone]
            self.waiting.clear()
            self.waiting.extend(kept)
        self.running[:] = [r for r in self.running if id(r) not in gone]
        for r in reqs:
            r.queued = False
        ended = self.output.stamp_finish(reqs)
        self._release_remote(reqs)
        self.stats.phase_s["cache"] += now() - t0
        self.output.report_finished(ended)

    def kv_slots_in_use(self) -> dict[str, int]:
        """Requests admitted on the target and on each draft replica (each holds a slot there)."""
        return {"target": self._target_live, **self.pool.per_replica([rep.live for rep in self.replicas])}

    def releases_pending(self) -> dict[str, int]:
        """Requests whose release failed and is retried, per core (keys as :meth:`kv_slots_in_use`):
        each may still hold a slot there."""
        return {
            "target": len(self._target_unreleased.ids),
            **self.pool.per_replica([len(rep.orphans.ids) for rep in self.replicas]),
        }

    def retarget(self, address: str | None = None) -> None:
        """The target group was rebuilt (rank 0 now at ``address``, when given): reconnect the
        verifier (a remote one) and forget the releases still owed to the old group, whose
        requests the new cores do not hold."""
        reconnect = getattr(self.verifier, "reconnect", None)
        if reconnect is not None and address is not None:
            reconnect(address)
        self._target_unreleased.clear()

    def replica_down(self, i: int, reason: str) -> None:
        """Draft replica i's worker is down (a deployment's supervisor found it dead, hung, restarting
        or without a node). Safe from any thread: :meth:`DraftPool.replica_down`; its requests go on
        without drafts from the next step, and the probe's answer (or :meth:`readmit`) brings it back."""
        self.pool.replica_down(i, reason)

    def readmit(self, i: int, address: str | None = None) -> bool:
        """Draft replica i's worker was restarted (at ``address``, when it moved): probe it now
        (:meth:`DraftPool.readmit`). Returns whether it answered."""
        return self.pool.readmit(i, address)

    def close(self) -> None:
        """Release every live request, then close the transports."""
        self.abort_requests(list(self.waiting) + list(self.running))
        self._retry_releases(force=True)  # a last try for what a failed release left behind
        self.verifier.close()
        self.pool.close()

    # ---------------------------------------------------------------- the step
    def step(self) -> list[Request]:
        """One verification for every running request. Returns the requests that advanced."""
        t = self.stats.phase_s
        phase0 = dict(t)
        hidden0 = self.stats.draft_hidden_s
        self.pool.probe()
        self._leave_down()
        self._retry_releases()
        self.admit()
        if not self.running:
            return []
        costs = StepCosts()  # what this step measures for the draft-length rule: its StepEvent carries it
        tc = now()
        reqs = list(self.running)
        caps = [self._draft_len(r) for r in reqs]
        first = [r.metrics.steps == 0 and not self.waiting for r in reqs]
        lengths, proposing_s = None, 0.0
        if self._propose_first:  # lookups cost no model pass: propose all a request may draft, price, cut
            tp = now()
            self._propose(reqs, [0 if f else c for c, f in zip(caps, first)], costs)
            proposing_s = now() - tp
            caps = [len(r.proposal) if r.proposal is not None else 0 for r in reqs]
            lengths = [r.proposal.match_lengths if r.proposal is not None else None for r in reqs]
        ks = self.length_policy.choose(
            caps, [r.acceptance for r in reqs], [r.replica or 0 for r in reqs], first, lengths
        )

        t0 = now()
        if self._propose_first:
            for r, k in zip(reqs, ks):
                if r.proposal is not None:  # a prefix of a proposal is a proposal; none left: a plain step
                    r.proposal = r.proposal.truncated(k) if k > 0 else None
        else:
            self._propose(reqs, ks, costs)

        items = [VerifyItem(r.core_id, r.seq_len, r.proposal) for r in reqs]
        results, failed, timing, wall = self._call_isolating(self.verifier.verify, items)
        self._account(timing, wall, self.verifier.is_remote, main="verify")
        for i, (msg, code) in self._target_errors(failed, len(items)).items():
            self.output.fail(reqs[i], msg, code)
        if self._planned_costs:
            costs.verify_tokens = sum((k if it.proposal is not None else 0) + 1 for it, k in zip(items, ks))
        else:
            costs.verify_tokens = sum(len(it.proposal or ()) + 1 for it in items)
        costs.verify_s = wall
        t2 = now()

        advanced, records = [], []
        done = [i for i in range(len(reqs)) if i not in failed]
        for i, res in zip(done, results or []):
            r = reqs[i]
            advanced.append(r)
            proposal = self._fold_verified(r, res.num_accepted, res.next_token, res.hidden, costs)
            records.append(self.output.apply(r, proposal, res.num_accepted, res.next_token, res.logprobs))
        self.stats.steps += 1
        t3 = now()
        t["output"] += t3 - t2
        costs.overhead_s = (t0 - tc - proposing_s) + (t3 - t2)
        self.release([r for r in self.running if r.finished])
        phases = {name: t.get(name, 0.0) - phase0.get(name, 0.0) for name in t}
        event = StepEvent(len(reqs), phases, now() - tc, 0.0, records, self.stats.draft_hidden_s - hidden0, costs)
        self.length_policy.observe(event)  # learns from it, and predicts the step without drafts (plain_step_s)
        self.output.emit(event)
        return advanced

    def _fold_verified(self, r: Request, n_acc: int, next_token: int, hidden, costs: StepCosts):
        """Fold one verification into request r's drafting state (what its next ProposeItem says, with
        the kept positions' hidden states for an EAGLE-3 replica) and into the step's ``costs`` (what the
        draft-length rule learns). Returns the proposal it verified (None: none)."""
        p = r.proposal
        if p is not None:  # its drafter holds this proposal: the next ProposeItem says how much survived
            r.num_accepted = n_acc
        r.full_accept = p is not None and n_acc == len(p)  # a pipelined drafter's guess is tested next
        r.new_tokens.append(next_token)  # emitted since the last proposal (several when it skipped steps)
        if hidden is not None and r.replica is not None:
            r.pending_hidden.append(hidden)
        r.proposal = None
        costs.acceptance.append(
            (r.acceptance, len(p) if p is not None else 0, n_acc, p.match_lengths if p is not None else None)
        )
        return p

    def _draft_len(self, r: Request) -> int:
        """The most request r may draft: max_tokens and the context limit hold even if all are accepted."""
        if r.replica is None:
            return 0
        remaining = r.params.max_tokens - len(r.output.token_ids)  # tokens it may still emit
        room = self.max_model_len - r.seq_len  # context left
        return max(0, min(self.k, remaining - 1, room - 1))

    # ---------------------------------------------------------------- propose
    def _propose(self, reqs: list[Request], ks: list[int], costs: StepCosts) -> None:
        """Propose ``ks[b]`` tokens for each request b that drafts: one call per replica, the replicas in
        parallel (:meth:`DraftPool.propose`), then each replica's proposals folded into its requests and
        its measured costs into ``costs``."""
        work: dict[int, list[tuple[Request, int]]] = {}
        for r, k in zip(reqs, ks):
            if k > 0:
                work.setdefault(r.replica, []).append((r, k))
        if not work:
            return
        t0 = now()
        results = self.pool.propose(
            {
                i: [
                    ProposeItem(
                        r.core_id, r.num_accepted, list(r.new_tokens), k, r.seq_len, hidden=_joined(r.pending_hidden)
                    )
                    for r, k in w
                ]
                for i, w in work.items()
            }
        )
        wall = now() - t0
        spans = [self._proposed(i, work[i], costs, *results[i]) for i in work]
        compute = max((c for c, _ in spans), default=0.0)  # replicas draft in parallel: the slowest counts
        remote = any(rem for _, rem in spans)
        self.stats.phase_s["draft"] += min(compute, wall) if remote else wall
        if remote:
            self.stats.phase_s["network"] += wall - min(compute, wall)

    def _proposed(
        self,
        i: int,
        work: list[tuple[Request, int]],
        costs: StepCosts,
        proposals,
        failed,
        timing: CallTiming,
        wall: float,
    ) -> tuple[float, bool]:
        """Replica i's answer to ``work`` (its requests and lengths): each proposal onto its request, a
        request whose item failed detached. Returns (the replica's compute seconds, is remote)."""
        rep = self.replicas[i]
        ok = [r for j, (r, _) in enumerate(work) if j not in failed]
        ntok = 0
        for r, p in zip(ok, proposals or []):
            if p.pipeline is not None and r.full_accept and len(r.new_tokens) == 1:
                costs.guesses.append(p.pipeline == HIT)  # the guess of its bonus token was tested
            r.proposal = p
            r.num_accepted, r.new_tokens, r.pending_hidden = 0, [], []  # committed on the drafter
            ntok += len(p)
        self.stats.draft_hidden_s += timing.hidden_s
        if ntok:
            rep.propose_s += wall
            rep.proposed_tokens += ntok
        if timing.runs:  # a pipelined drafter reports its draft compute: most of it was hidden
            costs.draft_runs += [(i, passes, rows, seconds) for passes, rows, seconds in timing.runs]
        elif ntok:  # a first draft's prompt prefill ("prefill") is not a cost of drafting
            lengths = (
                [k for j, (_, k) in enumerate(work) if j not in failed]
                if self._planned_costs
                else [len(p) for p in proposals]
            )
            costs.draft_runs.append((i, max(lengths), sum(lengths), wall - timing.phases.get("prefill", 0.0)))
        for j, e in failed.items():  # detached from the drafter; released by the step afterwards
            self._detach(work[j][0], f"draft {rep.drafter.name}: {e.describe()}")
        compute = timing.total if rep.drafter.is_remote else wall
        return min(compute, wall), rep.drafter.is_remote

    # ---------------------------------------------------------------- admission
    def admit(self) -> None:
        """Move waiting requests onto the cores: prefill on the target, start on their replicas (the
        first part of :meth:`step`)."""
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
        self.release([r for r in new if r.finished])
        self.stats.phase_s["prefill"] += now() - t0

    def _take_waiting(self) -> list[Request]:
        """The waiting requests this step admits, off the queue, each given its replica (None: no drafts).

        While the target has room; after the first, while their prompts fit ``max_prefill_tokens``
        and, while any replica is healthy, while one of those has room."""
        new: list[Request] = []
        room = self.pool.room()
        tokens = 0  # prompt tokens admitted this step: at most max_prefill_tokens (or one request)
        while self.waiting and self._target_live + len(new) < self.max_batch_size:
            r = self.waiting[0]
            tokens += len(r.prompt_ids)
            if new and self.max_prefill_tokens is not None and tokens > self.max_prefill_tokens:
                break
            if self.pool.waits_for_room(room):
                break  # wait for room on a healthy replica
            r.replica = self.pool.choose(room, self.length_policy.draft_s)  # None: decode without drafts
            new.append(self.waiting.popleft())
            r.queued = False
        return new

    def _prefill(self, new: list[Request]) -> tuple[list[Request], list[Request]]:
        """``verifier.prefill`` of the new requests: (prefilled, out of room (to requeue)); the others failed."""
        ok, requeue, errors, prefilled = self._start_on(
            functools.partial(self._call_isolating, self.verifier.prefill), self._release_target, new, int
        )
        for r, p in zip(ok, prefilled):
            r.on_target = True
            self._target_live += 1
            r.pending_hidden = [p.hidden] if p.hidden is not None and r.replica is not None else []
        messages = self._target_errors({j: e for j, (_, e) in enumerate(errors)}, len(new))
        for j, (r, _) in enumerate(errors):
            self.output.fail(r, *messages[j])
        return ok, requeue

    def _start_drafts(self, admitted: list[Request]) -> list[Request]:
        """``drafter.start`` of the admitted requests, one call per replica: those out of room there
        (to requeue). A failed one goes on without drafts (a call failed as a whole ejected its replica:
        :meth:`DraftPool.call`)."""
        requeue: list[Request] = []
        by_rep: dict[int, list[Request]] = {}
        for r in admitted:
            if r.replica is not None:
                by_rep.setdefault(r.replica, []).append(r)
        for i, rs in by_rep.items():
            rep = self.replicas[i]
            started, full, errors, _ = self._start_on(
                functools.partial(self.pool.call, i, "start"), functools.partial(self.pool.release, i), rs, draft_seed
            )
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

    def _start_on(
        self, call: Callable[[list[StartItem]], tuple], release: Callable[[list[str]], None], rs: list[Request], seed_of
    ):
        """Start requests on one core (``call``: a transport call of its prefill or start): (started, out of room
        (to requeue), [(request, TransportError)], the call's results for the started ones (the verifier's
        Prefilled; None for a drafter's start)).

        A call that failed without blaming an item (a worker down, a deadline) may have started
        them before it failed: they are released there (``release``; retried later if that fails too).
        """
        items = [
            StartItem(
                r.core_id, r.prompt_ids, r.params, seed_of(r.seed), self.coupling, self._hidden_layers(r), r.tenant
            )
            for r in rs
        ]
        results, failed, _, _ = call(items)
        unknown = [items[j].request_id for j, e in failed.items() if e.code not in REFUSED_CODES]
        if unknown:
            release(unknown)
        full = [r for j, r in enumerate(rs) if j in failed and failed[j].code == ErrorCode.RESOURCE_EXHAUSTED]
        errors = [(rs[j], e) for j, e in failed.items() if e.code != ErrorCode.RESOURCE_EXHAUSTED]
        started = [r for j, r in enumerate(rs) if j not in failed]
        return started, full, errors, results if results is not None else [None] * len(started)

    def _hidden_layers(self, r: Request) -> tuple[int, ...]:
        """The target layers whose hidden states request r's replica drafts from (EAGLE-3), or ()."""
        return self.replicas[r.replica].drafter.hidden_layers if r.replica is not None else ()

    # ---------------------------------------------------------------- calls and failures
    def _count_call(self) -> None:
        with self._lock:  # also counted on the propose threads
            self.stats.calls += 1

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
        whole = len(failed) == n and not per_item(failed.values())
        why = None
        if failed and whole and self.target_diagnosis is not None:
            try:
                why = self.target_diagnosis()
            except Exception:  # the diagnosis is a courtesy; the failure stands
                log.exception("target diagnosis failed")
        return {
            i: (
                f"target: {why} ({e.describe()})" if why else f"target: {e.describe()}",
                ErrorCode.UNAVAILABLE if whole and (why or e.code in _TARGET_DOWN_CODES) else ErrorCode.INTERNAL,
            )
            for i, e in failed.items()
        }

    def _leave_down(self) -> None:
        """Requests still on a replica reported down (:meth:`replica_down`) go on without drafts."""
        for r in self.running:
            if r.replica is not None and self.replicas[r.replica].down:
                self._detach(r, f"draft {self.replicas[r.replica].drafter.name} is down")

    def _detach(self, r: Request, message: str) -> None:
        """Its drafter failed: release it there (best effort) and go on without drafts."""
        log.warning("request %s continues without drafts: %s", r.request_id, message)
        r.proposal = None
        r.pending_hidden = []
        self.pool.release_requests([r])
        r.replica = None

    # ---------------------------------------------------------------- release
    def _release_target(self, ids: list[str]) -> None:
        self._target_unreleased.release(self.verifier, ids, self._call_isolating)

    def _retry_releases(self, force: bool = False) -> None:
        """Release again, one call per core, what failed releases left behind, where due (``force``:
        now, on every core)."""
        t0 = now()
        self._target_unreleased.retry(self.verifier, self._call_isolating, force)
        self.pool.retry_releases(force)
        self.stats.phase_s["cache"] += now() - t0

    def _release_remote(self, reqs: list[Request]) -> None:
        """Release on the target and each drafter (one call per core); failed releases are retried."""
        tgt = [r for r in reqs if r.on_target]
        if tgt:
            self._release_target([r.core_id for r in tgt])
            for r in tgt:
                r.on_target = False
                self._target_live -= 1
        self.pool.release_requests(reqs)
