"""The core install holds no benchmark-only package: matplotlib and tqdm are the ``bench`` extra.

pyproject.toml keeps them out of ``dependencies``; the library reaches them only inside the bench commands
that draw plots or progress bars. A fresh interpreter imports ``specdist`` and runs a request through the
in-process engine while every ``import`` statement is watched: matplotlib is never loaded, and no module of
specdist, workers or cluster imports either package (transformers and gguf load tqdm for themselves: their
own dependency, not ours).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
from support.helpers import tiny_config

REPO = Path(__file__).resolve().parents[2]
BENCH_ONLY = ("matplotlib", "tqdm")

# Run in a fresh interpreter: argv[1] a config (JSON) to run one request on, or "" for the import alone;
# argv[2] code to run as a module of specdist after that ("" for none). Prints what was loaded and by whom.
WATCH = r"""
import builtins, importlib, json, sys
OPTIONAL = ("matplotlib", "tqdm")
importers = []
real_import, real_import_module = builtins.__import__, importlib.import_module

def watched_import(name, globals=None, locals=None, fromlist=(), level=0):
    if level == 0 and name.split(".")[0] in OPTIONAL:
        importers.append([name, (globals or {}).get("__name__")])
    return real_import(name, globals, locals, fromlist, level)

def watched_import_module(name, package=None):
    if name.split(".")[0] in OPTIONAL:
        importers.append([name, sys._getframe(1).f_globals.get("__name__")])
    return real_import_module(name, package)

builtins.__import__, importlib.import_module = watched_import, watched_import_module
import specdist
after_import = sorted(m for m in OPTIONAL if m in sys.modules)
if sys.argv[1]:
    from specdist import Engine, SamplingParams
    engine = Engine.from_config(json.loads(sys.argv[1]))
    [out] = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=4, seed=1))
    assert len(out.token_ids) == 4, out
if sys.argv[2]:
    exec(sys.argv[2], {"__name__": "specdist.planted"})
print(json.dumps({"after_import": after_import, "loaded": sorted(m for m in OPTIONAL if m in sys.modules),
                  "importers": importers}))
"""


def watch(config: dict | None, planted: str = "") -> dict:
    done = subprocess.run(
        [sys.executable, "-c", WATCH, json.dumps(config) if config else "", planted],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def ours(importers: list[list[str]]) -> list[list[str]]:
    """The imports of a bench-only package made by a module of this repository."""
    return [[name, by] for name, by in importers if (by or "").split(".")[0] in ("specdist", "workers", "cluster")]


def test_the_core_dependencies_hold_no_bench_package() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]

    def names(specs):
        return {s.split(">")[0].split("=")[0].split("<")[0].split("[")[0].strip() for s in specs}

    extras = project["optional-dependencies"]
    assert not names(project["dependencies"]) & set(BENCH_ONLY)
    assert set(BENCH_ONLY) <= names(extras["bench"])
    assert "specdist[bench]" in extras["test"]  # the bench tests draw plots and bars


@pytest.mark.slow  # a fresh interpreter loads torch and transformers: about 30 s on 2 shared cores
def test_importing_specdist_and_running_the_engine_load_no_bench_package(tiny_models) -> None:
    seen = watch(tiny_config(tiny_models, "model", 2))
    assert seen["after_import"] == []
    assert "matplotlib" not in seen["loaded"]
    assert ours(seen["importers"]) == []


def test_the_watch_sees_an_import_from_specdist() -> None:
    seen = watch(None, planted="import matplotlib\nfrom tqdm import tqdm")
    assert ours(seen["importers"]) == [["matplotlib", "specdist.planted"], ["tqdm", "specdist.planted"]]
    assert seen["loaded"] == ["matplotlib", "tqdm"]


def test_a_plot_without_matplotlib_says_what_to_install(monkeypatch, tmp_path) -> None:
    """`specdist cost-model --plot` on the core install: one line naming the extra, not an ImportError."""
    from specdist.api.preflight import MissingDependency
    from specdist.bench.cost_plot import plot_speedup

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    with pytest.raises(MissingDependency, match=r"specdist\[bench\]"):
        plot_speedup(tmp_path / "s.png")
