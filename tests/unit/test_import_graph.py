"""The import graph of the ``specdist`` package: no cycles, and the layers below it stay below.

Every import counts, at module level, inside functions and under ``TYPE_CHECKING`` alike, so
that a module can be read (and moved) with only what it imports below it. Read from the
source with ``ast``; nothing is imported.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _modules(package: str = "specdist") -> dict[str, Path]:
    out = {}
    for path in (ROOT / package).rglob("*.py"):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = path
    return out


def _imports(path: Path) -> set[str]:
    """Every module name an ``import`` or ``from ... import`` of the file names (absolute imports)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def _graph() -> dict[str, set[str]]:
    """module -> the package's modules it imports (a name resolves to its longest module prefix)."""
    mods = _modules()
    graph = {}
    for name, path in mods.items():
        targets = set()
        for imported in _imports(path):
            while imported and imported not in mods:
                imported = imported.rpartition(".")[0]
            if imported and imported != name and not name.startswith(imported + "."):
                targets.add(imported)
        graph[name] = targets
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, on, stack, out = {}, {}, set(), [], []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_the_package_has_no_import_cycles() -> None:
    assert _cycles(_graph()) == []


def test_the_cycle_finder_finds_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert _cycles(graph) == [["a", "b", "c"]]
    graph["b"] = set()
    assert _cycles(graph) == []


def test_specdist_reaches_workers_and_cluster_only_from_the_serving_entry_point() -> None:
    """``specdist`` is importable without Ray: only the serve command brings a deployment up."""
    reaching = {
        name
        for name, path in _modules().items()
        if any(i.split(".")[0] in ("workers", "cluster") for i in _imports(path))
    }
    assert reaching <= {"specdist.api.serving"}, reaching


def test_workers_import_nothing_of_the_api() -> None:
    """A worker hosts cores over the transport: the host strings and devices it needs sit below the servers."""
    reaching = {
        name: sorted(i for i in _imports(path) if i.startswith("specdist.api"))
        for name, path in _modules("workers").items()
    }
    assert {name: found for name, found in reaching.items() if found} == {}


def test_the_api_converts_its_requests_without_the_workers_wire_codecs() -> None:
    """A client's request does not go api -> transport -> api: the servers' conversions are the API's own
    (specdist.api.codecs) or shared below both (specdist.sampling_proto), never specdist.transport.wire's."""
    graph = _graph()
    reaching = sorted(
        name for name in graph if name.startswith("specdist.api") and "specdist.transport.wire" in graph[name]
    )
    assert reaching == []
