"""The draft replicas a scheduler drafts with, and their health.

:class:`DraftPool` holds one :class:`Replica` per drafter transport and decides:

- **choice**: which replica a new request goes to (by predicted speed, then load);
- **calls**: a replica's ``start`` and ``propose`` go through :meth:`DraftPool.call`, the replicas' proposals
  in parallel (:meth:`DraftPool.propose`);
- **ejection**: a replica that failed a whole call (the worker down, hung past its deadline,
  erroring) or was reported down (:meth:`DraftPool.replica_down`) takes no new requests;
- **probing**: at the start of a step an ejected replica is probed off the step's thread (a
  ``release`` of the ids whose release failed meanwhile) after ``PROBE_FIRST_S``, backing off to
  ``PROBE_MAX_S``, and re-admitted when it answers; :meth:`DraftPool.readmit` probes it at once
  (a deployment restarted its worker);
- **releases**: each replica's failed releases (:class:`~specdist.engine.calls.PendingReleases`)
  are retried when due, except an ejected replica's, which its probe releases; a replica reported
  down is not called at all until it answers a probe.

It knows requests only by the fields the scheduler gives them for drafting (``replica``,
``on_drafter``, ``core_id``) and calls nothing of the scheduler: it returns each call's results, and
what a request does with them, or without drafts, is the scheduler's business.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from specdist.clock import now
from specdist.engine.calls import Call, PendingReleases, per_item
from specdist.transport.protocol import Drafter, ProposeItem, TransportError

log = logging.getLogger(__name__)

PROBE_FIRST_S, PROBE_MAX_S = 0.5, 30.0  # an ejected draft replica is probed after 0.5 s, backing off x2 to 30 s
REPLICA_SPEED_SLACK = 2.0  # replicas predicted within 2x of the fastest count as equally fast (fits are noisy)


@dataclass
class Replica:
    """One draft replica: its transport, its load and measured speed, and its health."""

    drafter: Drafter
    live: int = 0  # requests started on it and not yet released
    propose_s: float = 0.0
    proposed_tokens: int = 0
    ejected_at: float | None = None  # a whole call failed: no new requests until a probe succeeds
    next_probe: float = 0.0
    probe_backoff: float = 0.0
    orphans: PendingReleases = field(default_factory=PendingReleases)  # released again when due, or by the probe
    down: bool = False  # its worker was reported down (replica_down): only its probe calls it, until it answers

    @property
    def latency_per_token(self) -> float:
        return self.propose_s / self.proposed_tokens if self.proposed_tokens else 0.0


class DraftPool:
    """The draft replicas: which one a new request gets, which are ejected, their probes and
    readmission, and the releases each still owes. ``call``: the scheduler's transport call
    (:func:`~specdist.engine.calls.call_isolating`, counted in its stats)."""

    def __init__(self, drafters: Sequence[Drafter], max_batch_size: int, call: Call):
        self.replicas = [Replica(d) for d in drafters]
        self.max_batch_size = max_batch_size  # requests each replica holds at most
        self._call_isolating = call
        self._lock = threading.Lock()  # ejection runs on the propose threads and from replica_down's thread
        self._executor: ThreadPoolExecutor | None = None  # parallel calls when several replicas work
        self._probe_executor: ThreadPoolExecutor | None = None  # probes of ejected replicas
        self.probes: dict[int, tuple] = {}  # replica -> (future of its probe in flight, ids it releases)

    def __len__(self) -> int:
        return len(self.replicas)

    # ---------------------------------------------------------------- choice
    def room(self) -> list[int]:
        """Requests each replica can take now."""
        return [self.max_batch_size - rep.live for rep in self.replicas]

    def waits_for_room(self, room: list[int]) -> bool:
        """Whether a new request must wait: some replica is healthy, and none of those has room."""
        healthy = [i for i, rep in enumerate(self.replicas) if rep.ejected_at is None]
        return bool(healthy) and not any(room[i] > 0 for i in healthy)

    def choose(self, room: list[int], draft_s: Callable[[int, int], float]) -> int | None:
        """The replica for a new request, taken from ``room`` (this admission's so far); None: no
        healthy replica has room (every one is ejected: it decodes without drafts).

        ``draft_s(i, n)``: the predicted seconds of a full draft of n requests on replica i (the draft-length
        rule's, :meth:`~specdist.engine.draft_length.DraftLengthPolicy.draft_s`: 0 while unmeasured, so every
        replica gets tried), asked with one more request than each holds; the replicas within
        ``REPLICA_SPEED_SLACK`` of the fastest compete on fewest live requests, then the lower measured Propose
        time per token, then the lower index.
        """
        free = [i for i, rep in enumerate(self.replicas) if rep.ejected_at is None and room[i] > 0]
        if not free:
            return None
        live = [self.max_batch_size - c for c in room]
        pred = {i: draft_s(i, live[i] + 1) for i in free}
        best = min(pred.values())
        near = [i for i in free if pred[i] <= best * REPLICA_SPEED_SLACK + 1e-9]
        i = min(near, key=lambda i: (live[i], self.replicas[i].latency_per_token, i))
        room[i] -= 1
        return i

    # ---------------------------------------------------------------- calls
    def call(self, i: int, method: str, items: list) -> tuple:
        """``method`` ("start" or "propose") of replica i's drafter on ``items``, through the scheduler's
        transport call (:func:`~specdist.engine.calls.call_isolating`: results, failed items, timing, wall);
        a call that failed as a whole (no item blamed: the worker down, hung past its deadline, erroring)
        ejects the replica."""
        out = self._call_isolating(getattr(self.replicas[i].drafter, method), items)
        failed = out[1]
        if failed and len(failed) == len(items) and not per_item(failed.values()):
            self.eject(i, next(iter(failed.values())).describe())
        return out

    def propose(self, work: dict[int, list[ProposeItem]]) -> dict[int, tuple]:
        """Propose ``work[i]`` on each replica i (:meth:`call`), the replicas in parallel (a thread each when
        several); each replica's result, by replica."""
        if len(work) == 1:
            [(i, items)] = work.items()
            return {i: self.call(i, "propose", items)}
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=len(self.replicas), thread_name_prefix="specdist-propose")
        futures = {i: self._executor.submit(self.call, i, "propose", items) for i, items in work.items()}
        return {i: f.result() for i, f in futures.items()}

    # ---------------------------------------------------------------- health
    def eject(self, i: int, message: str) -> None:
        """Replica i failed a whole call: no new requests until it answers a probe."""
        rep = self.replicas[i]
        with self._lock:  # also runs on the propose threads, and from replica_down's thread
            if rep.ejected_at is None:
                t = now()
                rep.probe_backoff = PROBE_FIRST_S
                rep.next_probe = t + rep.probe_backoff
                rep.ejected_at = t  # last: the step reads it without the lock
                log.warning("draft %s ejected (%s); its requests continue without drafts", rep.drafter.name, message)

    def replica_down(self, i: int, reason: str) -> None:
        """Replica i's worker is down: ejected now, its calls in flight cut (a remote drafter's ``cut``:
        they fail at once, not at their deadlines); nothing but its probe calls it from now on."""
        rep = self.replicas[i]
        rep.down = True
        self.eject(i, reason)
        cut = getattr(rep.drafter, "cut", None)
        if cut is not None:
            cut()

    def probe(self) -> None:
        """Probe the ejected replicas that are due, off the step's thread (a probe may wait for its
        deadline): a release of the ids whose release failed, which a worker that was hung may
        still hold. Re-admit those whose probe came back."""
        t = now()
        for i, rep in enumerate(self.replicas):
            if rep.ejected_at is None:
                continue
            probe = self.probes.get(i)
            if probe is not None:
                future, sent = probe
                if not future.done():
                    continue
                del self.probes[i]
                error = future.exception()
                if error is None:
                    log.warning(
                        "draft %s answers again after %.1f s: re-admitted", rep.drafter.name, t - rep.ejected_at
                    )
                    rep.ejected_at, rep.down = None, False
                    rep.orphans.answered(sent, t)
                    continue
                rep.probe_backoff = min(PROBE_MAX_S, 2 * rep.probe_backoff)
                rep.next_probe = t + rep.probe_backoff
                log.info("draft %s still down (%s); next probe in %.1f s", rep.drafter.name, error, rep.probe_backoff)
            elif t >= rep.next_probe:
                if self._probe_executor is None:
                    self._probe_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="specdist-probe")
                sent = sorted(rep.orphans.ids)
                self.probes[i] = (self._probe_executor.submit(rep.drafter.release, sent), sent)

    def readmit(self, i: int, address: str | None = None) -> bool:
        """Replica i's worker was restarted (at ``address``, when it moved): probe it now.
        Returns whether it answered (then it is admitted again; else probing goes on)."""
        rep = self.replicas[i]
        reconnect = getattr(rep.drafter, "reconnect", None)  # remote transports: a fresh channel
        if reconnect is not None:
            reconnect(address or rep.drafter.address)
        self.probes.pop(i, None)  # an older probe's outcome says nothing of the new worker
        sent = sorted(rep.orphans.ids)
        try:
            rep.drafter.release(sent)
        except TransportError as e:
            log.warning("draft %s restarted but does not answer (%s)", rep.drafter.name, e)
            self.eject(i, str(e))
            return False
        rep.orphans.answered(sent, now())
        if rep.ejected_at is not None:
            log.warning("draft %s restarted: re-admitted", rep.drafter.name)
        rep.ejected_at, rep.down = None, False
        return True

    # ---------------------------------------------------------------- releases
    def release(self, i: int, ids: list[str]) -> None:
        """Release ``ids`` on replica i; a failed release is retried later. A replica reported down is
        not called: its probe releases them (the step waits on no worker down)."""
        rep = self.replicas[i]
        if rep.down:
            rep.orphans.add(ids, now())
        else:
            rep.orphans.release(rep.drafter, ids, self._call_isolating)

    def release_requests(self, reqs) -> None:
        """Release the requests that hold state on a replica, one call per replica."""
        by_rep: dict[int, list] = {}
        for r in reqs:
            if r.on_drafter:
                by_rep.setdefault(r.replica, []).append(r)
        for i, rs in by_rep.items():
            self.release(i, [r.core_id for r in rs])
            for r in rs:
                r.on_drafter = False
                self.replicas[i].live -= 1

    def retry_releases(self, force: bool = False) -> None:
        """Release again, one call per replica, what failed releases left behind, where due (``force``:
        now, on every replica). An ejected replica's are its probe's (:meth:`probe`)."""
        for i, rep in enumerate(self.replicas):
            if force or (rep.ejected_at is None and i not in self.probes):
                rep.orphans.retry(rep.drafter, self._call_isolating, force)

    def per_replica(self, counts: list[int]) -> dict[str, int]:
        """Per-replica counts as the scheduler reports them: "draft" (their sum) and, with several
        replicas, "draft/<i>" each; {} without replicas."""
        if not self.replicas:
            return {}
        out = {"draft": sum(counts)}
        if len(self.replicas) > 1:
            out.update({f"draft/{i}": n for i, n in enumerate(counts)})
        return out

    def close(self) -> None:
        """Wait for the calls in flight, then close the transports."""
        for executor in (self._executor, self._probe_executor):
            if executor is not None:
                executor.shutdown(wait=True)
        for rep in self.replicas:
            rep.drafter.close()
