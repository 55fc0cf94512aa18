"""The docs say what the code does: every name they quote as code exists where they say.

The rules that read a backticked span (a config key, a command, a path, a dotted name, a bare name in its
paragraph's context, a proto name, a string of the code) are in :mod:`support.doc_names`. Beside them: the
config's documented shape (specdist/config.py's docstring) holds every config key, and the library's docstrings
(models, cores, bench) carry no timings: measurements live in docs/performance.md.
"""

from __future__ import annotations

import ast
import dataclasses
import re
import textwrap
import typing

import pytest
import yaml
from support.doc_names import REPO, config_key_exists, draft_method_keys, problems

DOCS = ["docs/architecture.md", "docs/configuration.md", "README.md"]


@pytest.mark.parametrize("doc", DOCS)
def test_every_name_the_docs_quote_exists(doc: str) -> None:
    found = problems((REPO / doc).read_text(encoding="utf-8"))
    assert not found, f"{doc} quotes names the code does not have:\n  " + "\n  ".join(found)


def test_the_checker_reports_made_up_names() -> None:
    text = textwrap.dedent("""\
        # Made up

        - `Scheduler` (`specdist/engine/scheduler.py`) runs `Scheduler.step()`, `Scheduler.frobnicate` and
          `step()`; `specdist.engine.scheduler.Scheduler.add_request` and `specdist.engine.scheduler.Nope`.
        - `engine.max_batch_size`, `engine.max_batchsize`, `draft.suffix_max_depth`, `draft.warp: 9`,
          `sampling.coupling: gumbel`.
        - `specdist/transport.py`, `specdist/transport/protocol.py`, `cores/proposers/`, `remote.py`,
          `cluster/placement.replica_bundles`, `cluster/placement.replica_bundle`, `cluster.serve:build_app`.
        - `specdist serve --port 1`, `specdist bench warp`, `python -m specdist.protogen`, `python -m specdist.nope`.
        - `register`, `COUPLINGS`, `Prefilled`, `HiddenStates`, `paged-torch`, `gumbel`, `paged-turbo`,
          `torch.compile`, `torch.compiled`, `/health`, `/v2/health`, `FooBarRouter`, `k_b`.
        """)
    assert problems(text) == [
        "line 3: `Scheduler.frobnicate`: specdist.engine.scheduler has no Scheduler.frobnicate",
        "line 4: `specdist.engine.scheduler.Nope`: specdist.engine.scheduler has no Nope",
        "line 5: `engine.max_batchsize`: no config key engine.max_batchsize",
        "line 5: `draft.warp: 9`: no config key draft.warp",
        "line 7: `specdist/transport.py`: no file specdist/transport.py",
        "line 7: `remote.py`: remote.py is ambiguous: specdist/engine/remote.py, specdist/transport/remote.py",
        "line 8: `cluster/placement.replica_bundle`: cluster/placement.py has no replica_bundle",
        "line 9: `specdist bench warp`: specdist bench has no subcommand warp",
        "line 9: `python -m specdist.nope`: no module specdist.nope",
        "line 10: `register`: register is defined in 3 modules (specdist.api.router, specdist.cores.proposers.base, "
        "specdist.models.backends.base) and the paragraph names none",
        "line 10: `paged-turbo`: paged-turbo: not a name, and no string of the code",
        "line 11: `torch.compiled`: torch has no compiled",
        "line 11: `/v2/health`: /v2/health: no route of the code",
        "line 11: `FooBarRouter`: FooBarRouter: no name of the code, the config, the protos or the paragraph's classes",
    ]


def test_the_old_architecture_doc_fails() -> None:
    """Claims docs/architecture.md made before it was checked: a module that does not exist, a function that
    moved to the tests, a name no paragraph could place."""
    old = (
        "- Blame: `error_for_items` (`transport.py`) turns it into a `TransportError`.\n"
        "- `specdist/cores/rejection.py`: `rejection_sample`, `one_step_distribution` for the enumeration tests.\n"
        "- The remote ones in `remote.py`, next to the scheduler.\n"
    )
    assert problems(old) == [
        "line 1: `transport.py`: no file transport.py",
        "line 2: `one_step_distribution`: one_step_distribution: no name of the code, the config, the protos or the "
        "paragraph's classes",
        "line 3: `remote.py`: remote.py is ambiguous: specdist/engine/remote.py, specdist/transport/remote.py",
    ]


def config_shape() -> dict:
    """The YAML of specdist/config.py's docstring, after ``Shape::``."""
    import specdist.config as config

    return yaml.safe_load(textwrap.dedent(config.__doc__.split("Shape::", 1)[1].strip("\n")))


def test_the_config_docstring_shows_every_key() -> None:
    import specdist.config as config

    shape, missing, unknown = config_shape(), [], []
    hints = typing.get_type_hints(config.Config, vars(config))
    for section in dataclasses.fields(config.Config):
        keys = {f.name for f in dataclasses.fields(hints[section.name])} - {"settings"}
        shown = set(shape.get(section.name) or {})
        missing += [f"{section.name}.{k}" for k in sorted(keys - shown)]
        unknown += [f"{section.name}.{k}" for k in sorted(shown) if not config_key_exists(f"{section.name}.{k}")]
    assert set(shape) == {f.name for f in dataclasses.fields(config.Config)}, sorted(shape)
    assert not missing and not unknown, f"config.py's shape lacks {missing}, shows unknown keys {unknown}"
    assert set(shape["draft"]) & draft_method_keys()  # the methods' own keys are shown as draft. keys


# a timing or a speed-up measured somewhere: "13 ms", "90 us", "1.6x faster", "took it 10 s", "ran 3x"
TIMING = re.compile(
    r"\b\d+(\.\d+)?\s?(ms|µs|us)\b|\b\d+(\.\d+)?(-\d+(\.\d+)?)?x (faster|slower)\b"
    r"|\btook (it )?[\d.]+ ?s\b|\bran \d"
)


def timings_in_docstrings(source: str) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            out += [m.group(0) for m in TIMING.finditer(doc or "")]
    return out


def test_library_docstrings_carry_no_measurements() -> None:
    """A docstring says what and why; figures live in docs/performance.md ("Figures moved from docstrings")."""
    found = {
        str(p.relative_to(REPO)): hits
        for root in ("specdist/models", "specdist/cores", "specdist/bench")
        for p in sorted((REPO / root).rglob("*.py"))
        if (hits := timings_in_docstrings(p.read_text("utf-8")))
    }
    assert not found, f"docstrings with measurements: {found}"


def test_the_timing_check_sees_a_measurement() -> None:
    source = (
        '"""A runner.\n\nAt batch 1 this was 1.6x faster; the head: 13 ms, the parse took it 10 s."""\n\n'
        'def f():\n    """What f does (k = 4, 16-token buckets, 0.5 GiB a bucket)."""\n'
    )
    assert timings_in_docstrings(source) == ["1.6x faster", "13 ms", "took it 10 s"]
