"""Names live where what they hold belongs, once: the new home has the name and the old one neither keeps it
nor re-exports it (an old import fails loudly instead of reaching a second copy)."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# (module, name, where it was)
MOVED = [
    ("specdist.models.kv.options", "KVOptions", "specdist.models.graphs"),
    ("specdist.models.kv.options", "ACTIVATION_MARGIN", "specdist.models.graphs"),
    ("specdist.cores.collectives", "CollectiveDeadline", "specdist.cores.target"),
    ("specdist.cores.collectives", "apply_op", "specdist.cores.target"),
    ("specdist.clock", "now", "specdist.transport.protocol"),  # the system's clock, at the bottom of the layers
    # api/serving.py was a catch-all: it keeps the serving assembly (Backend, start_backend, start_serving)
    ("specdist.api.serve_args", "add_serve_arguments", "specdist.api.serving"),  # serve's flags
    ("specdist.api.preflight", "check_listen", "specdist.api.serving"),  # what serve checks before loading
    ("specdist.api.preflight", "check_config", "specdist.api.serving"),
    ("specdist.api.preflight", "MissingDependency", "specdist.api.serving"),
    ("specdist.api.serve_command", "run_serve", "specdist.api.serving"),  # the command: signals, drain, tear-down
    ("specdist.api.serve_command", "shut_down", "specdist.api.serving"),
    ("specdist.api.remote_generate", "run_remote_generate", "specdist.api.serving"),  # generate --server
]


@pytest.mark.parametrize(("module", "name", "old"), MOVED)
def test_a_moved_name_lives_in_one_place(module, name, old):
    assert hasattr(importlib.import_module(module), name)
    assert not hasattr(importlib.import_module(old), name), f"{old} still has {name}"


# (module, the module it was): renamed for what it holds
RENAMED = [
    ("specdist.gc_freeze", "specdist.heap"),  # gc.freeze of a serving process's start-up objects
    ("specdist.cores.suffix_index", "specdist.cores.suffix"),  # the suffix index (proposers/suffix.py: the method)
    ("specdist.engine.output_state", "specdist.engine.stopping"),  # a request's output: stops, incremental text
    ("specdist.engine.output_processor", "specdist.engine.output"),  # a step's results onto the requests, events
]


@pytest.mark.parametrize(("module", "old"), RENAMED)
def test_a_renamed_module_has_no_old_name(module, old):
    assert importlib.util.find_spec(module) is not None
    assert importlib.util.find_spec(old) is None, f"{old} still exists beside {module}"


# (module:class, the name it holds it under, the name it held it under): `hidden` and `_call` had several meanings
RENAMED_ATTRIBUTES = [
    ("specdist.engine.request:Request", "pending_hidden", "hidden"),  # states not yet sent to its EAGLE-3 replica
    ("specdist.cores.target:_TargetRequest", "returns_hidden", "hidden"),  # whether its results carry states
    ("specdist.models.metadata:ModelSources", "draft_hidden_layers", "hidden"),  # a draft method's layers, read once
    ("specdist.transport.remote:RemoteVerifier", "_rpc", "_call"),  # one unary RPC to the worker
    ("specdist.transport.remote:RemoteDrafter", "_rpc", "_call"),
]


def _attributes(cls) -> set[str]:
    fields = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
    return fields | set(dir(cls))


@pytest.mark.parametrize(("where", "name", "old"), RENAMED_ATTRIBUTES)
def test_a_renamed_attribute_has_no_old_name(where, name, old):
    module, cls_name = where.split(":")
    attrs = _attributes(getattr(importlib.import_module(module), cls_name))
    assert name in attrs and old not in attrs, f"{where}: {sorted(a for a in attrs if old in a)}"


def _library_trees():
    for top in ("specdist", "workers", "cluster"):
        for path in sorted((ROOT / top).rglob("*.py")):
            if "v1" not in path.relative_to(ROOT).parts:  # generated protobuf code
                yield path.relative_to(ROOT).as_posix(), ast.parse(path.read_text(), str(path))


def test_hidden_names_the_target_states_and_call_nothing_of_its_own():
    """``hidden`` annotated anywhere (a field, a parameter) is a tensor of the target's hidden states, not a flag,
    a list, a size or a cache; no ``_call`` method or attribute (each call says what it calls: ``_rpc``,
    ``_call_isolating``, ``call_local``)."""
    wrong_hidden, calls = [], []
    for path, tree in _library_trees():
        for node in ast.walk(tree):
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == "hidden":
                annotation = node.annotation
            elif isinstance(node, ast.arg) and node.arg == "hidden" and node.annotation is not None:
                annotation = node.annotation
            else:
                annotation = None
            if annotation is not None and "Tensor" not in ast.unparse(annotation):
                wrong_hidden.append(f"{path}:{node.lineno} hidden: {ast.unparse(annotation)}")
            defined = (isinstance(node, ast.FunctionDef) and node.name == "_call") or (
                isinstance(node, ast.Attribute) and node.attr == "_call" and isinstance(node.ctx, ast.Store)
            )
            if defined:
                calls.append(f"{path}:{node.lineno}")
    assert not wrong_hidden, wrong_hidden
    assert not calls, calls
