"""specdist.gc_freeze: a serving process's start-up objects frozen out of the garbage collector's walks."""

from __future__ import annotations

import gc
import weakref

from specdist import gc_freeze


class _Node:
    pass


def test_freeze_takes_the_live_objects_out_of_the_walks_and_unfreeze_returns_them() -> None:
    assert gc.get_freeze_count() == 0  # nothing left this process frozen
    tracked = len(gc.get_objects())  # what a full collection walks
    try:
        frozen = gc_freeze.freeze()
        # Frozen objects still die by reference counting, and the worker's other threads (xdist's
        # execnet) free a few at any moment, so the count read again may only have shrunk a little.
        assert 0 <= frozen - gc.get_freeze_count() < frozen // 100 and frozen > tracked // 2
        assert len(gc.get_objects()) < tracked - frozen // 2  # the walks skip them now
        later = [[i] for i in range(1000)]  # containers made afterwards are tracked as before
        assert len(gc.get_objects()) >= len(later)
        node = _Node()
        node.self = node  # a reference cycle made after the freeze is still collected
        dead = weakref.ref(node)
        del node
        gc.collect()
        assert dead() is None
    finally:
        gc_freeze.unfreeze()
    assert gc.get_freeze_count() == 0 and len(gc.get_objects()) >= frozen
