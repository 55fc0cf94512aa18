"""The system's clock: what every call and step timing reads (the cores' CallTiming, the scheduler's phases, the
draft pool's probes, the release retries, the collectives' deadlines).

At the bottom of the layers, so every layer times on one clock; each user imports ``now`` by name, so a test
replaces it in the modules whose schedule it drives (``monkeypatch.setattr(module, "now", ...)``).
"""

from __future__ import annotations

import time


def now() -> float:
    """Seconds on a monotonic, high-resolution clock (``time.perf_counter``); only differences between readings
    mean anything."""
    return time.perf_counter()
