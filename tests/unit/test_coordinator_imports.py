"""The coordinator module is imported for the Coordinator alone: the names its API speaks in (deltas, streams,
refusals, prompts, ids) come from the modules that define them, one import path each, and coordinator.py keeps no
list of re-exports; the engine it serves is typed by what the servers read of it (ServedEngine)."""

from __future__ import annotations

import ast
import importlib
import typing
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


def test_the_coordinator_re_exports_nothing_and_serves_a_served_engine():
    from specdist.api.admission import ServedEngine
    from specdist.api.coordinator import Coordinator

    assert not hasattr(importlib.import_module("specdist.api.coordinator"), "__all__")
    assert typing.get_type_hints(Coordinator.__init__)["engine"] is ServedEngine
