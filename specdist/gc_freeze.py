"""A serving process's start-up objects, kept out of the garbage collector's walks.

A loaded engine holds some 430,000 objects that Python's cyclic garbage collector tracks (torch,
transformers, the tokenizer, the model's modules), alive for the life of the process. A full
collection walks every one of them: about 220 ms on the 2-core development machine (docs/performance.md),
a stall of every request in flight. :func:`freeze` after bring-up moves them into the permanent generation that
collections skip (``gc.freeze``; vLLM and SGLang freeze after loading too). Objects created later are
collected as before, and frozen ones are still freed by reference counting when they die; only
reference cycles among them would wait for :func:`unfreeze`.

The processes specdist owns call it (``specdist serve`` once its backend is up, each Ray worker once its
deployment serves); library users and tests that run engines inside their own processes are left alone.
"""

from __future__ import annotations

import gc

__all__ = ["freeze", "unfreeze"]


def freeze() -> int:
    """Collect garbage, then freeze every object alive now. Returns how many objects the freeze holds
    (counted once here: ``gc.get_freeze_count()`` walks every frozen object, tens of ms for a loaded
    engine, so callers keep this number rather than asking again)."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def unfreeze() -> None:
    """Return the frozen objects to the collector's oldest generation (a process that serves no more)."""
    gc.unfreeze()
