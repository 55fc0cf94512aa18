"""Pipelined drafting: the drafter drafts the next step while the target verifies this one.

:class:`DraftPipeline` wraps a model (or EAGLE-3) :class:`~specdist.cores.draft.DrafterCore` and keeps its
interface (``start`` / ``propose`` / ``release``), so the scheduler, the local transport and
the draft worker's servicer host it unchanged. After answering ``propose`` with drafts
``d_1..d_k`` for a request, it keeps working on a background thread while the target
verifies them:

1. **guess**: one draft pass over ``d_k`` gives ``q(. | x, d_1..d_k)`` (``x``: the committed
   sequence); the guess ``g`` is its mode, the draft's best bet for the target's bonus token;
2. **prepare**: ``k`` more passes sample ``d'_1..d'_k`` after ``x, d_1..d_k, g``, exactly as
   sequential drafting would after that prefix (same q, same uniforms: position keyed,
   :func:`~specdist.randomness.draft_uniform`).

The next ``propose`` says what the target kept. When it accepted all ``k`` drafts and then
emitted ``g`` (a **hit**), the true prefix is the assumed one and ``d'`` is returned at once
(cut to the length asked). Otherwise (a **miss**) the cache rolls back to the true prefix,
and the request is either drafted now (``miss="redraft"``) or gets no drafts this step
(``miss="skip"``: the target emits one token for it, and its preparation for the step after
runs during that verify, so a miss does not hold up the other requests' step). ``miss="auto"``
redrafts a call's misses when nobody would wait for them: no request of the call hit, or the call
drafts now anyway (a request never prepared), so the misses add rows to passes that run regardless;
it skips them when every other request has its drafts ready. At one request a miss is then always
redrafted (``k`` passes that buy ``E(a, k) - 1`` more tokens, which pays wherever sequential drafting
does), and under load a miss beside hits is skipped. A request that was never prepared (its first
step) drafts as usual.

Exactness (``docs/exactness.md``: the verifier keeps the target's law for any
proposal ``(d, q)`` whose tokens are sampled from the q rows it sends, with randomness
independent of the target's acceptance and residual draws, and whose length is fixed before
verification):

- A prepared token ``d'_i`` is sampled from ``r_i = fp16_exact(q(. | y, d'_1..d'_{i-1}))``,
  where ``y = x, d, g`` is the prefix it assumes, with ``draft_uniform(seed, position)``:
  independent of the target's uniforms and of everything the target has seen.
- It is proposed only on a hit, i.e. when the committed sequence *is* ``y``. Conditioned on
  the history up to that step (which fixes ``y``), the uniforms that made ``d'`` were not
  used by anything that shaped the history: ``g`` is a deterministic function of ``q`` (no
  uniform), and whether the step hit depends on ``d``, ``g`` and the target's draws only.
  So ``d'`` has exactly the law sequential drafting gives after ``y``, with the same q rows
  sent, and the verifier's guarantee applies unchanged.
- On a miss ``d'`` is discarded; the redrafted tokens use the uniforms of their positions,
  which only discarded tokens used before (a position drafted in a step that rejected an
  earlier position leaves no trace in the output), so they too are independent of the history.
- The draft length of a step (``k``, the prepared length, or 0 on a skipped miss) is a
  function of the history only, fixed before the step's verification (``auto``'s choice reads
  whether the call's other requests hit or were prepared: the history again).

EAGLE-3 heads: the head drafts from the target's hidden states, which exist only for verified
positions. A preparation feeds the proposal's last token with the head's own state at the
position before (as it drafts every position past the verified ones), and its drafts after the
guess come from its own states too; on a hit they are proposed, and the target's states of the
proposal's positions wait in the core until the next draft made without a preparation (a miss,
or a request not prepared) feeds them. So a prepared draft is not what sequential drafting would
draft after the same prefix (that one reads the target's states): same exactness argument
(tokens from the rows sent, uniforms by position), other q, usually accepted less often. What it
gains is the head's k passes hidden under the verification on a hit.

What exactness rests on is therefore "the tokens come from the rows sent, with uniforms the
target never sees", not the hit rule itself: reusing ``d'`` after a partial acceptance *with the
rows it was sampled from* would still be exact (the verifier's guarantee holds for any proposal
law), only accepted less often, with the drafter's cache holding K/V of a prefix that is not the
request's. Reusing it with q of the *true* prefix (re-scoring prepared tokens) is not exact.
``tests/engine/test_pipeline.py`` enumerates both laws, and runs the second through the engine, where
the frequency test fails it. The hit rule is :func:`prepared_prefix_holds`, the one place that
decides.

Cost model (per request, one draft replica, draft forward ``c_d`` per pass, verification
``c_v``, per-position acceptance ``a``, guess hit rate ``b = P(bonus == g | all accepted)``):

- sequential step: ``T_seq = k c_d + c_v``, emitting ``E(a, k) = 1 + a + ... + a^k`` tokens;
- the next step hits with ``h = a^k b``;
- redraft: ``T_pipe = max(c_v, (k + 1) c_d) + (1 - h) k c_d``, ``E(a, k)`` tokens a step;
- skip: every step costs about ``max(c_v, (k + 1) c_d)``; a step has drafts with the
  stationary probability ``pi = b / (b + 1 - h)`` and emits ``pi E(a, k) + (1 - pi)`` tokens;
- auto: redraft at one request; with ``B`` requests, a step holds for redrafting only when none of
  them hit (probability ``(1 - h)^B``) or one is drafted anyway (its first step), and otherwise skips
  its misses.

:func:`specdist.engine.cost_model.pipelined_report` evaluates these (``specdist cost-model --pipeline``). Preparing
for further outcomes (a second guess, or ``j < k`` accepted followed by a guessed residual
token) would add rows to every prepared pass to win ``k c_d`` with the probability of that
outcome; docs/performance.md (and its git history) has the measured ``a``, ``b`` and hit rates
that this choice rests on.

Timing: ``CallTiming.phases["draft"]`` of a ``propose`` is what the caller waited for
(drafting now, plus the part of the preparation still running when the call arrived);
``CallTiming.hidden_s`` is the preparation that finished under the previous verification.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from specdist.clock import now
from specdist.config import PIPELINE_MISS
from specdist.cores.draft import DrafterCore
from specdist.cores.proposers.base import DraftRequest
from specdist.transport.protocol import HIT, MISS, CallTiming, Proposal, ProposeItem, StartItem

log = logging.getLogger(__name__)


def prepared_prefix_holds(proposed: int, num_accepted: int, new_token_ids: list[int], guess: int) -> bool:
    """The committed sequence is the prefix a preparation assumed: all ``proposed`` drafts were
    accepted and the target's one token after them is the guess."""
    return num_accepted == proposed and list(new_token_ids) == [guess]


@dataclass
class _Prepared:
    guess: int  # the token assumed after the proposal
    tokens: list[int]  # drafts after proposal + guess
    q: torch.Tensor | None  # [len(tokens), V] fp16-exact rows; None: greedy (one-hot)


@dataclass
class _Job:
    """One background preparation, over the requests of one propose call."""

    request_ids: list[str]
    passes: int  # draft passes it runs (the guess pass included)
    rows: int  # request-passes over all its requests
    abort: set[str] = field(default_factory=set)
    done: threading.Event = field(default_factory=threading.Event)
    started: float = field(default_factory=now)
    finished: float = 0.0


@dataclass
class PipelineCounters:
    hits: int = 0  # proposals answered from a preparation
    misses: int = 0  # prepared requests whose assumed prefix did not hold
    skipped: int = 0  # of those, given no drafts for their step (skip, or auto beside hits)
    prepare_s: float = 0.0  # seconds of background preparation
    hidden_s: float = 0.0  # of those, done before the next propose arrived
    draft_s: float = 0.0  # seconds of drafting inside propose calls (cold requests, redrafted misses)

    @property
    def overlap(self) -> float:
        """Draft time hidden under verification / all draft time."""
        total = self.prepare_s + self.draft_s
        return self.hidden_s / total if total > 0 else 0.0


class DraftPipeline:
    """A model drafter that prepares each request's next drafts in the background (see module doc).

    Thread safety: ``start`` / ``propose`` / ``release`` come from one caller thread at a time
    (the scheduler, or the worker's call thread); the preparation thread and those calls take
    the core one draft pass or one call at a time.
    """

    def __init__(self, core: DrafterCore, miss: str = "redraft"):
        if not core.proposer.drafts_ahead:
            raise ValueError(
                f"pipelined drafting needs a method that drafts ahead (model or EAGLE-3 drafts), not "
                f"{core.method!r} (lookups cost nothing to prepare)"
            )
        if miss not in PIPELINE_MISS:
            raise ValueError(f"miss policy must be one of {PIPELINE_MISS}, got {miss!r}")
        self.core = core
        self.miss = miss
        self.prepared: dict[str, _Prepared] = {}
        self.counters = PipelineCounters()
        self._lock = threading.Lock()  # the core's state: one pass or call at a time
        self._job: _Job | None = None
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="specdist-prepare")

    # the DrafterCore surface its hosts read
    @property
    def vocab_size(self) -> int:
        return self.core.vocab_size

    @property
    def max_model_len(self) -> int:
        return self.core.max_model_len

    @property
    def cache(self):
        return self.core.cache

    @property
    def method(self) -> str:
        return self.core.method

    @property
    def hidden_layers(self) -> tuple[int, ...]:
        return self.core.hidden_layers

    @property
    def hidden_width(self) -> int:
        return self.core.hidden_width

    @property
    def requests(self) -> dict:
        return self.core.requests

    def kv_slots_in_use(self) -> int:
        return self.core.kv_slots_in_use()

    def health(self) -> dict:
        out = self.core.health()
        c = self.counters
        out.update(
            pipeline=True,
            pipeline_miss=self.miss,
            prepared=len(self.prepared),
            preparing=self._job is not None and not self._job.done.is_set(),
            pipeline_hits=c.hits,
            pipeline_misses=c.misses,
            pipeline_skipped=c.skipped,
            overlap=round(c.overlap, 4),
        )
        return out

    # ------------------------------------------------------------ calls
    def start(self, items: list[StartItem]) -> CallTiming:
        with self._lock:
            return self.core.start(items)

    def release(self, request_ids: list[str]) -> None:
        job = self._job
        if job is not None:
            job.abort.update(request_ids)  # its next pass skips them
        with self._lock:
            self.core.release(request_ids)
            for rid in request_ids:
                self.prepared.pop(rid, None)

    def propose(self, items: list[ProposeItem]) -> tuple[list[Proposal], CallTiming]:
        arrived = now()
        job, self._job = self._job, None
        waited = hidden_s = 0.0
        runs: list[tuple[int, int, float]] = []  # (passes, rows, seconds) of each drafting run, for the cost fit
        if job is not None:
            waited, hidden_s = self._await_preparation(job, items, arrived, runs)
        prepared_for = set(job.request_ids) if job is not None else set()  # whatever became of them
        with self._lock:
            plan = self.core.validate_propose(items)
            t0 = now()
            out, todo, status = self._answer_from_preparations(items, plan, prepared_for)
            if todo:
                self._draft_now(items, plan, todo, status, out, runs)
            draft_s = now() - t0
            self.counters.draft_s += draft_s
            self._schedule([(it.request_id, r, it.num_tokens) for it, (r, *_) in zip(items, plan) if it.num_tokens > 0])
        return out, CallTiming({"draft": draft_s + waited}, hidden_s=hidden_s, runs=runs)

    _holds = staticmethod(prepared_prefix_holds)

    def _await_preparation(
        self, job: _Job, items: list[ProposeItem], arrived: float, runs: list[tuple[int, int, float]]
    ) -> tuple[float, float]:
        """Wait for the last preparation, cutting short the requests that certainly missed:
        (seconds this call waited for it, seconds of it hidden under the verification). A whole
        preparation adds its run to ``runs``."""
        for it in items:  # certain misses (whatever the guess) stop preparing now
            r = self.core.requests.get(it.request_id)
            new = list(it.new_token_ids)
            if r is None or len(new) != 1 or not self._holds(len(r.proposal), it.num_accepted, new, new[0]):
                job.abort.add(it.request_id)
        job.done.wait()
        waited = max(0.0, job.finished - arrived)
        hidden_s = max(0.0, min(job.finished, arrived) - job.started)
        self.counters.hidden_s += hidden_s
        if not job.abort:  # a whole preparation: its cost, for the caller's draft-cost fit
            runs.append((job.passes, job.rows, job.finished - job.started))
        return waited, hidden_s

    def _answer_from_preparations(
        self, items: list[ProposeItem], plan: list, prepared_for: set[str]
    ) -> tuple[list[Proposal | None], list[int], list[str | None]]:
        """Answer the hits from their preparations and commit the rest (lock held): (proposals, None
        where still to draft; the indices to draft now; each item's pipeline outcome, MISS or None)."""
        out: list[Proposal | None] = [None] * len(items)
        todo: list[int] = []  # items drafted now
        misses: list[int] = []
        status: list[str | None] = [None] * len(items)
        hits = 0
        for i, (it, (r, n_acc, new, k)) in enumerate(zip(items, plan)):
            prep = self.prepared.pop(it.request_id, None)
            if prep is not None and self._holds(len(r.proposal), n_acc, new, prep.guess):
                out[i] = self._use_prepared(it.request_id, r, prep, n_acc, new, k, it.hidden)
                hits += 1
                continue
            self.core.commit(r, n_acc, new, hidden=it.hidden)
            # a miss whether its preparation finished or was cut short as a certain miss, so
            # that the counts (and the skip policy) do not depend on when the preparation ended
            if prep is not None or it.request_id in prepared_for:
                status[i] = MISS
                misses.append(i)
            else:
                todo.append(i)
        self.counters.hits += hits
        self.counters.misses += len(misses)
        # auto: skip only where drafting the misses now would hold up requests whose drafts are ready
        drafting_anyway = any(plan[i][3] > 0 for i in todo)
        if self.miss == "skip" or (self.miss == "auto" and hits and not drafting_anyway):
            for i in misses:
                out[i] = Proposal(items[i].request_id, [], pipeline=MISS)
            self.counters.skipped += len(misses)
        else:
            todo = sorted(todo + misses)
        return out, todo, status

    def _draft_now(
        self,
        items: list[ProposeItem],
        plan: list,
        todo: list[int],
        status: list[str | None],
        out: list[Proposal | None],
        runs: list[tuple[int, int, float]],
    ) -> None:
        """Draft items ``todo`` into ``out`` (lock held); a run of at least one pass adds to ``runs``."""
        t1 = now()
        ks = [plan[i][3] for i in todo]
        drafted = self.core.draft([items[i] for i in todo], [plan[i][0] for i in todo], ks)
        for i, p in zip(todo, drafted):
            p.pipeline = status[i]
            out[i] = p
        if max(ks) > 0:
            runs.append((max(ks), sum(ks), now() - t1))

    def _use_prepared(
        self, rid: str, r: DraftRequest, prep: _Prepared, n_acc: int, new: list[int], k: int, hidden=None
    ) -> Proposal:
        """Commit a hit and propose its prepared drafts, cut to ``k`` (lock held). ``hidden``: the target's
        states the item brought (EAGLE-3)."""
        n = min(k, len(prep.tokens))
        # committed: proposal + guess, which the cache holds, then the prepared drafts (a shorter cut drops the rest)
        self.core.commit(r, n_acc, new, prepared=prep.tokens[:n], hidden=hidden)
        q = prep.q[:n] if prep.q is not None and n else None
        return Proposal(rid, prep.tokens[:n], q, pipeline=HIT)

    def close(self) -> None:
        job = self._job
        if job is not None:
            job.abort.update(job.request_ids)
        self._executor.shutdown(wait=True)

    # ------------------------------------------------------------ preparation
    def _schedule(self, work: list[tuple[str, DraftRequest, int]]) -> None:
        """Prepare each request's next drafts after its proposal and a guess (lock held)."""
        core = self.core
        todo = []
        for rid, r, k in work:
            # room for the guess and k drafts after the proposal (each drafted token's successor fits)
            k = min(k, core.max_model_len - len(r.seq) - len(r.proposal) - 2)
            if k >= 0:
                todo.append((rid, r, k))
        if not todo:
            return
        job = _Job([rid for rid, _, _ in todo], 1 + max(k for _, _, k in todo), sum(1 + k for _, _, k in todo))
        self._job = job
        self._executor.submit(self._prepare, job, todo)

    def _prepare(self, job: _Job, todo: list) -> None:
        core = self.core
        ids = [rid for rid, _, _ in todo]
        reqs = [r for _, r, _ in todo]
        try:

            def alive(b: int) -> bool:
                return ids[b] not in job.abort and core.requests.get(ids[b]) is reqs[b]

            toks, qs, guesses = core.draft_ahead(reqs, [k for _, _, k in todo], gate=alive, each_pass=self._lock)
            with self._lock:
                for b, rid in enumerate(ids):
                    if guesses[b] is not None and alive(b):
                        self.prepared[rid] = _Prepared(guesses[b], toks[b], qs[b])
        except Exception:  # a failed preparation only costs its hits
            log.exception("pipelined drafting: preparing %d requests failed; they draft on demand", len(ids))
        finally:
            job.finished = now()
            self.counters.prepare_s += job.finished - job.started
            job.done.set()


def pipelined(core: DrafterCore, pipeline: bool, miss: str = "redraft") -> "DrafterCore | DraftPipeline":
    """The core to host: wrapped in a DraftPipeline (``draft.pipeline``) when its method drafts ahead (a model
    only, an EAGLE-3 head)."""
    if not pipeline or not core.proposer.drafts_ahead:
        return core
    return DraftPipeline(core, miss)
