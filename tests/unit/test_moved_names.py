"""Names live where what they hold belongs, once: the new home has the name and the old one neither keeps it
nor re-exports it (an old import fails loudly instead of reaching a second copy)."""

from __future__ import annotations

import importlib
import importlib.util

import pytest

# (module, name, where it was)
MOVED = [
    ("specdist.models.kv.options", "KVOptions", "specdist.models.graphs"),
    ("specdist.models.kv.options", "ACTIVATION_MARGIN", "specdist.models.graphs"),
    ("specdist.cores.collectives", "CollectiveDeadline", "specdist.cores.target"),
    ("specdist.cores.collectives", "apply_op", "specdist.cores.target"),
]


@pytest.mark.parametrize(("module", "name", "old"), MOVED)
def test_a_moved_name_lives_in_one_place(module, name, old):
    assert hasattr(importlib.import_module(module), name)
    assert not hasattr(importlib.import_module(old), name), f"{old} still has {name}"


# (module, the module it was): renamed for what it holds
RENAMED = [
    ("specdist.gc_freeze", "specdist.heap"),  # gc.freeze of a serving process's start-up objects
    ("specdist.cores.suffix_index", "specdist.cores.suffix"),  # the suffix index (proposers/suffix.py: the method)
]


@pytest.mark.parametrize(("module", "old"), RENAMED)
def test_a_renamed_module_has_no_old_name(module, old):
    assert importlib.util.find_spec(module) is not None
    assert importlib.util.find_spec(old) is None, f"{old} still exists beside {module}"
