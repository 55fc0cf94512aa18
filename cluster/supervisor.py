"""Watch a deployment's workers and bring back what failed.

:class:`Supervisor` checks every ``health_interval_s``, each part on a thread of its own, so a
target rebuild (minutes) holds up no draft check, and a draft's recovery no target check nor
another draft's:

- **the target group** (thread ``specdist-supervisor-target``,
  :meth:`Deployment.diagnose_target`): a rank that died, does not answer its health check within
  ``health_timeout_s``, stopped following, or reports a failed collective. Then it emits
  ``target_down`` naming the rank (the server fails the requests in flight with that reason,
  answers new ones UNAVAILABLE and turns NOT_SERVING). If the group's node was lost, it waits
  until Ray places the group's placement group again on a node where the whole group fits
  (:meth:`Deployment.target_unplaced`); meanwhile it emits ``target_down`` again with the reason
  (what the group needs, what is missing) each time that changes, and spends no rebuild attempt.
  Then it rebuilds the whole group (:meth:`Deployment.rebuild_target`, rank 0 on its old port) up
  to ``rebuild_attempts`` times, 1 s apart and doubling, and emits ``target_up`` with rank 0's
  address, or ``target_lost`` once every attempt failed.
- **each draft worker** (thread ``specdist-supervisor-draft-<i>``): Ray restarts a draft actor
  whose process died (``max_restarts``), also on another node when its node was lost (Ray places
  its placement group again where there is room; until then ``draft_down`` says what it waits
  for, :meth:`Deployment.draft_unplaced`). The new process answers in state ``created``, and the
  supervisor loads it, warms it up and serves it again (:meth:`Deployment.recover_draft`), then
  emits ``draft_up`` (the server's scheduler probes and re-admits it). A draft that does not
  answer (hung) or that Ray no longer restarts is reported once with ``draft_down`` (the server's
  scheduler ejects it at once: its requests go on without drafts), and a hung one that answers
  again gets ``draft_up``.

Events go to every callable in ``deployment.listeners``, on the thread of the check that found
them: listeners must be thread-safe.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from dataclasses import dataclass

log = logging.getLogger("specdist.supervisor")

REBUILD_BACKOFF_S = 1.0  # wait before the second rebuild attempt; doubles after each failed one


@dataclass(frozen=True)
class WorkerEvent:
    kind: str  # target_down | target_up | target_lost | draft_down | draft_up
    worker: str  # "target", "draft 0", ...
    message: str
    address: str | None = None  # target_up, draft_up: where it serves now
    index: int | None = None  # draft events: the draft's index


class Supervisor:
    def __init__(self, deployment):
        self.deployment = deployment
        spec = deployment.spec
        self.interval_s, self.timeout_s, self.attempts = (
            spec.health_interval_s,
            spec.health_timeout_s,
            spec.rebuild_attempts,
        )
        self.target_state = "up"  # up | waiting (for a node) | rebuilding | lost
        self.target_reason: str | None = None  # why the group failed, while it is not up
        self.draft_state: dict[int, str] = {}  # index -> up | hung | restarting | unplaced | recovering | dead
        self.rebuilds = 0  # target groups rebuilt
        self.recoveries = 0  # draft workers brought back after a restart
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        """One checking thread for the target group and one per draft worker."""
        checks = [("target", self.check_target)]
        checks += [(f"draft-{h.rank}", functools.partial(self.check_draft, h)) for h in self.deployment.drafts]
        self._threads = [
            threading.Thread(target=self._run, args=(check,), name=f"specdist-supervisor-{name}", daemon=True)
            for name, check in checks
        ]
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        """Stop checking; waits for the checks and rebuilds under way (the deployment's stop ends their waits)."""
        self._stop.set()
        deadline = time.monotonic() + self.deployment.spec.shutdown_timeout_s + self.timeout_s
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(max(0.0, deadline - time.monotonic()))
        self._threads = []

    def _run(self, check) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                check()
            except Exception:  # keep supervising
                log.exception("supervisor check failed")

    def _emit(self, event: WorkerEvent) -> None:
        for listener in list(self.deployment.listeners):
            try:
                listener(event)
            except Exception:  # a listener must not stop the supervisor
                log.exception("worker event listener failed on %s", event)

    # ------------------------------------------------------------ the target group
    def check_target(self) -> None:
        """One check of the target group; a failed one is rebuilt (on this thread)."""
        if self.target_state != "up":
            return
        why = self.deployment.diagnose_target(self.timeout_s)
        if why and not self._stop.is_set():
            self._rebuild_target(why)

    def _rebuild_target(self, why: str) -> None:
        self.target_state, self.target_reason = "rebuilding", why
        log.error("target group failed: %s; rebuilding it", why)
        self._emit(WorkerEvent("target_down", "target", why))
        backoff = REBUILD_BACKOFF_S
        for attempt in range(1, self.attempts + 1):
            if not self._wait_for_target_node(why):
                return
            try:
                address = self.deployment.rebuild_target(same_port=attempt == 1)
            except Exception as e:
                if self._stop.is_set():
                    return
                log.error("target rebuild %d/%d failed: %s", attempt, self.attempts, e)
                if attempt < self.attempts and self._stop.wait(backoff):
                    return
                backoff *= 2
                continue
            self.target_state, self.target_reason = "up", None
            self.rebuilds += 1
            log.warning("target group rebuilt (attempt %d); rank 0 at %s", attempt, address)
            self._emit(WorkerEvent("target_up", "target", f"rebuilt after: {why}", address))
            return
        self.target_state = "lost"
        log.error("target group lost: %d rebuild attempts failed", self.attempts)
        self._emit(WorkerEvent("target_lost", "target", f"{self.attempts} rebuild attempts failed after: {why}"))

    def _wait_for_target_node(self, why: str) -> bool:
        """Until the target's placement group is placed (a lost node's group waits for one that fits),
        telling the listeners what it waits for whenever that changes. False: stopped meanwhile."""
        told = None
        while not self._stop.is_set():
            waiting = self.deployment.target_unplaced()
            if waiting is None:
                self.target_state = "rebuilding"
                return True
            if waiting != told:
                told, self.target_state = waiting, "waiting"
                log.error("target group cannot be rebuilt yet: %s", waiting)
                self._emit(WorkerEvent("target_down", "target", f"{why}; {waiting}"))
            self._stop.wait(self.interval_s)
        return False

    # ------------------------------------------------------------ draft workers
    def check_draft(self, h) -> None:
        """One check of draft worker ``h`` (a deployment's handle); a restarted one is recovered (on this thread)."""
        import ray

        i, state = h.rank, self.draft_state.get(h.rank, "up")
        if state == "dead":
            return
        try:
            health = ray.get(h.actor.health.remote(), timeout=self.timeout_s)
        except (ray.exceptions.GetTimeoutError, ray.exceptions.ActorUnavailableError) as e:
            waiting = self.deployment.draft_unplaced(i)
            if waiting:
                self._draft_down(h, "unplaced", f"lost its node: {waiting}")
            elif isinstance(e, ray.exceptions.GetTimeoutError):
                self._draft_down(h, "hung", f"does not answer its health check within {self.timeout_s:g}s")
            else:
                self._draft_down(h, "restarting", "is restarting")
            return
        except ray.exceptions.RayActorError as e:
            self._draft_down(h, "dead", f"died and is not restarted (max_restarts): {str(e).splitlines()[0]}")
            return
        pid, old_pid = health.get("pid"), h.pid
        h.pid = pid
        if health.get("state") == "created":  # Ray restarted its process: bring it up again
            self._draft_down(h, "recovering", f"was restarted by Ray (pid {old_pid} -> {pid})")
            try:
                address = self.deployment.recover_draft(i)
            except Exception as e:  # let Ray restart it again (one of its max_restarts)
                log.error("%s: recovery failed (%s); restarting it", h.name, e)
                ray.kill(h.actor, no_restart=False)
                return
            self.recoveries += 1
            self._draft_up(h, address, "restarted, reloaded and warmed up")
        elif state != "up" and health.get("ok"):
            self._draft_up(h, h.address, "answers again")

    def _draft_down(self, h, state: str, why: str) -> None:
        if self.draft_state.get(h.rank, "up") != state:
            self.draft_state[h.rank] = state
            log.warning("%s %s", h.name, why)
            self._emit(WorkerEvent("draft_down", h.name, why, h.address, h.rank))

    def _draft_up(self, h, address: str, why: str) -> None:
        self.draft_state[h.rank] = "up"
        log.warning("%s %s at %s", h.name, why, address)
        self._emit(WorkerEvent("draft_up", h.name, why, address, h.rank))
