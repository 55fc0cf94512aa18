"""The coordinator module is imported for the Coordinator alone: the names its API speaks in (deltas, streams,
refusals, prompts, ids) come from the modules that define them, one import path each, and coordinator.py keeps no
list of re-exports. The engine it drives is typed as what it is, an EngineBase (Engine, RemoteEngine), and every
name the coordinator and its engine thread use of it is EngineBase's."""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_coordinator_module_is_imported_for_the_coordinator_alone():
    elsewhere = []
    for path in sorted(
        p for d in ("specdist", "cluster", "workers", "tests", "benchmarks") for p in (ROOT / d).rglob("*.py")
    ):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "specdist.api.coordinator":
                elsewhere += [f"{path.relative_to(ROOT)}: {a.name}" for a in node.names if a.name != "Coordinator"]
            elif isinstance(node, ast.ImportFrom) and node.module == "specdist.api":
                elsewhere += [f"{path.relative_to(ROOT)}: the module" for a in node.names if a.name == "coordinator"]
    assert not elsewhere, f"import these from where they are defined: {elsewhere}"


def test_the_coordinator_re_exports_nothing_and_drives_an_engine_base():
    from specdist.api.coordinator import Coordinator
    from specdist.api.engine_thread import EngineThread
    from specdist.engine.base import EngineBase
    from specdist.engine.local import Engine
    from specdist.engine.remote import RemoteEngine

    assert not hasattr(importlib.import_module("specdist.api.coordinator"), "__all__")
    for cls in (Coordinator, EngineThread):  # (the annotations are strings: `from __future__ import annotations`)
        assert inspect.signature(cls.__init__).parameters["engine"].annotation == "EngineBase"
    assert issubclass(Engine, EngineBase) and issubclass(RemoteEngine, EngineBase)
    used = set()  # self.engine.<name> in the modules that drive it
    for module in ("coordinator", "engine_thread"):
        tree = ast.parse((ROOT / "specdist" / "api" / f"{module}.py").read_text())
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Attribute)
                and node.value.attr == "engine"
                and isinstance(node.value.value, ast.Name)
                and node.value.value.id == "self"
            ):
                used.add(node.attr)
    assert used and not {n for n in used if not hasattr(EngineBase, n)}, sorted(used)
