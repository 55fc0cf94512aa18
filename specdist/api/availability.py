"""Whether a coordinator takes requests, and whether it is ready: draining, the target's faults, the engine thread.

New requests are refused while draining or closed (:class:`~specdist.api.refusals.ShuttingDown`), while the
target is down (:class:`~specdist.api.refusals.TargetDown`, until it is back) and for good once the target group
is lost or the engine thread has died (:class:`~specdist.api.refusals.EngineDown`). Readiness (``accepting``:
health SERVING) is False in each of those cases and also while engine steps keep failing, when requests are still
admitted (one that succeeds makes the server ready again); liveness is not touched. ``listeners`` hear each change
on the event loop (the servers' health checks).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from specdist.api.engine_thread import EngineThread
from specdist.api.refusals import ShuttingDown, TargetDown, engine_down, failed_ranks, target_lost_message

log = logging.getLogger(__name__)


class Availability:
    """What the server takes, from its own state and the engine thread's (module docstring)."""

    def __init__(self, engine_thread: EngineThread):
        self._thread = engine_thread
        self.draining = False
        self.closed = False
        self.target_down: str | None = None  # why the target is down (Coordinator.target_down), until it is up
        self.target_lost: str | None = None  # why the target is lost for good (Coordinator.target_lost)
        self.listeners: list[Callable[[bool], None]] = []  # (accepting), on the event loop

    @property
    def accepting(self) -> bool:
        """Whether the server is ready (health SERVING)."""
        return (
            not self.draining
            and self.target_down is None
            and self._thread.engine_error is None
            and not self._thread.steps_failing
        )

    @property
    def unrecoverable(self) -> str | None:
        """Why this server cannot recover by itself (the engine thread died, the target group is lost
        for good), or None: a restart is the only way back (liveness NOT_SERVING)."""
        if self._thread.engine_error is not None:
            return f"the engine thread died ({self._thread.engine_error})"
        if self.target_lost is not None:
            return f"the target group is lost ({self.target_lost})"
        return None

    def check_serving(self) -> None:
        """Refuse any request while draining or closed, the target down or lost, the engine thread dead."""
        if self.draining:
            raise ShuttingDown("the server is shutting down")
        if self.target_lost is not None:
            raise TargetDown(target_lost_message(self.target_lost))
        if self.target_down is not None:
            raise TargetDown(
                f"the target is down ({failed_ranks(self.target_down) or 'a target worker'} failed); "
                "it is being rebuilt, retry later"
            )
        if self._thread.engine_error is not None:
            raise engine_down()

    def changed(self) -> None:
        """Tell the listeners (on the event loop) whether the server is ready now."""
        for listener in list(self.listeners):
            try:
                listener(self.accepting)
            except Exception:  # a listener must not break the loop
                log.exception("availability listener failed")
