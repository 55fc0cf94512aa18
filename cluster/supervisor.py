"""Watch a deployment's workers and bring back what failed.

:class:`Supervisor` is one thread per :class:`~cluster.deployment.Deployment`. Every
``health_interval_s`` it checks:

- **the target group** (:meth:`Deployment.diagnose_target`): a rank that died, does not answer
  its health check within ``health_timeout_s``, stopped following, or reports a failed
  collective. Then it emits ``target_down`` naming the rank (the server fails the requests in
  flight with that reason, answers new ones UNAVAILABLE and turns NOT_SERVING), rebuilds the
  whole group (:meth:`Deployment.rebuild_target`, rank 0 on its old port) up to
  ``rebuild_attempts`` times, 1 s apart and doubling, and emits ``target_up`` with rank 0's
  address, or ``target_lost`` once every attempt failed.
- **each draft worker**: Ray restarts a draft actor whose process died (``max_restarts``); the
  new process answers in state ``created``, and the supervisor loads it, warms it up and
  serves it again (:meth:`Deployment.recover_draft`), then emits ``draft_up`` (the server's
  scheduler probes and re-admits it). A draft that does not answer (hung) or that Ray no longer
  restarts is reported once with ``draft_down``; the scheduler has already left it behind at
  its call deadline, and a hung one that answers again gets ``draft_up``.

Events go to every callable in ``deployment.listeners``, on this thread.
"""

from __future__ import annotations

import logging
import threading
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
            spec.health_interval_s, spec.health_timeout_s, spec.rebuild_attempts)
        self.target_state = "up"  # up | rebuilding | lost
        self.draft_state: dict[int, str] = {}  # index -> up | hung | restarting | recovering | dead
        self.rebuilds = 0  # target groups rebuilt
        self.recoveries = 0  # draft workers brought back after a restart
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="specdist-supervisor", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop checking; waits for a check or rebuild under way (the deployment's stop ends its waits)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(self.deployment.spec.shutdown_timeout_s + self.timeout_s)
        self._thread = None

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.check()
            except Exception:  # noqa: BLE001 - keep supervising
                log.exception("supervisor check failed")

    def _emit(self, event: WorkerEvent) -> None:
        for listener in list(self.deployment.listeners):
            try:
                listener(event)
            except Exception:  # noqa: BLE001 - a listener must not stop the supervisor
                log.exception("worker event listener failed on %s", event)

    # ------------------------------------------------------------ checks
    def check(self) -> None:
        """One round: the target group, then every draft."""
        if self.target_state == "up":
            why = self.deployment.diagnose_target(self.timeout_s)
            if why and not self._stop.is_set():
                self._rebuild_target(why)
        for h in list(self.deployment.drafts):
            if self._stop.is_set():
                return
            self._check_draft(h)

    def _rebuild_target(self, why: str) -> None:
        self.target_state = "rebuilding"
        log.error("target group failed: %s; rebuilding it", why)
        self._emit(WorkerEvent("target_down", "target", why))
        backoff = REBUILD_BACKOFF_S
        for attempt in range(1, self.attempts + 1):
            try:
                address = self.deployment.rebuild_target(same_port=attempt == 1)
            except Exception as e:  # noqa: BLE001
                if self._stop.is_set():
                    return
                log.error("target rebuild %d/%d failed: %s", attempt, self.attempts, e)
                if attempt < self.attempts and self._stop.wait(backoff):
                    return
                backoff *= 2
                continue
            self.target_state = "up"
            self.rebuilds += 1
            log.warning("target group rebuilt (attempt %d); rank 0 at %s", attempt, address)
            self._emit(WorkerEvent("target_up", "target", f"rebuilt after: {why}", address))
            return
        self.target_state = "lost"
        log.error("target group lost: %d rebuild attempts failed", self.attempts)
        self._emit(WorkerEvent("target_lost", "target", f"{self.attempts} rebuild attempts failed after: {why}"))

    def _check_draft(self, h) -> None:
        import ray

        i, state = h.rank, self.draft_state.get(h.rank, "up")
        if state == "dead":
            return
        try:
            health = ray.get(h.actor.health.remote(), timeout=self.timeout_s)
        except ray.exceptions.GetTimeoutError:
            self._draft_down(h, "hung", f"does not answer its health check within {self.timeout_s:g}s")
            return
        except ray.exceptions.ActorUnavailableError:
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
            except Exception as e:  # noqa: BLE001 - let Ray restart it again (one of its max_restarts)
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
