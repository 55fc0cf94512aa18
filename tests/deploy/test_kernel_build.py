"""The CPU kernels are built when the package is installed, checked before they load, and chosen by
``engine.cpu_kernels``.

``pip install -e .`` (the README's commands, ``.ci/run``) compiles ``specdist/models/kernels/cpu_kernels.c`` into a
library beside the module (``setup.py``); without a C compiler the install goes on and says so in one line. At run time
the library loads only where the CPU has the features it was compiled for and its digest matches the installed source;
``auto`` says once on stderr which kernels run, ``required`` refuses to start without them.
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from support.helpers import tiny_config

from specdist.cli import main
from specdist.errors import ConfigError
from specdist.models.kernels import cpu_kernels, kernel_abi

REPO = Path(__file__).resolve().parents[2]
X86 = platform.machine().lower() in ("x86_64", "amd64")


@pytest.fixture
def fresh_kernels(monkeypatch):
    """cpu_kernels' per-process state cleared before and after the test (what it loaded, the mode, the lines said)."""

    def clear():
        cpu_kernels._opened.cache_clear()
        cpu_kernels._library.cache_clear()
        cpu_kernels._said.clear()
        cpu_kernels._mode, cpu_kernels._available = "auto", None

    clear()
    yield monkeypatch
    monkeypatch.undo()
    clear()


@pytest.mark.skipif(
    not X86 or shutil.which(os.environ.get("CC", "cc")) is None,
    reason="the kernels are built for x86-64, with a C compiler",
)
def test_the_install_built_the_kernels_beside_the_module(fresh_kernels):
    path = cpu_kernels.library_path()
    assert path is not None, "pip install -e . built no library (setup.py's build_ext)"
    assert os.path.dirname(path) == os.path.dirname(os.path.abspath(cpu_kernels.__file__))
    lib, why = cpu_kernels._open()
    if cpu_kernels.missing_cpu_features():
        assert lib is None and "this CPU lacks" in why
    else:
        assert lib is not None, why
        assert why == "specdist's C kernels (AVX2, FMA, F16C)" == cpu_kernels.backend()


def test_the_kinds_are_defined_once():
    """kernel_abi.py defines the kinds, the layer parts and the IQ4 table; the C file takes them as macros and the
    Python side reads them from there (a number written in both would have to be kept equal by hand)."""
    c = Path(cpu_kernels.SOURCE).read_text()
    assert not re.search(r"\bLIN_\w+\s*=\s*\d|#define\s+(LIN_|LAYER_|IQ4_VALUES|QK\b)|\bLAYER_\w+\s*=\s*\d", c)
    assert re.search(r"#ifndef SPECDIST_ABI\s+#error", c)
    names = dict(kernel_abi.macros())
    for name in (
        "LIN_Q4",
        "LIN_Q8",
        "LIN_F32",
        "LIN_BF16",
        "LIN_F16",
        "LIN_Q6_16",
        "LIN_Q5",
        "LIN_Q4_16",
        "LIN_Q2M_16",
        "LIN_IQ4",
        "LIN_Q7_16",
        "LIN_HALF_SCALES",
        "LIN_SUPER_SCALES",
    ):
        assert getattr(cpu_kernels, name) == int(names[name]), name
        assert re.search(rf"\b{name}\b", c), f"{name} is defined for the C file but it never uses it"
    assert cpu_kernels.IQ4_VALUES == tuple(int(v) for v in names["IQ4_VALUES"].split(","))
    python = Path(cpu_kernels.__file__).read_text()
    assert not re.search(r"LIN_\w+\s*(,\s*LIN_\w+\s*)*=\s*(range\(|\d)", python)


def test_a_build_without_a_compiler_goes_on_and_says_so_in_one_line(tmp_path):
    """setup.py's build_ext with a compiler that does not exist: the build succeeds without the library and says
    so in one line (pip shows it with -v; specdist says it again at run time, next test)."""
    env = {**os.environ, "CC": str(tmp_path / "no-such-cc")}
    out = subprocess.run(
        [sys.executable, "setup.py", "-q", "build_ext", "-b", str(tmp_path / "lib"), "-t", str(tmp_path / "tmp")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    said = [line for line in out.stderr.splitlines() if line.startswith("specdist:")]
    assert len(said) == 1 and "not built" in said[0] and "torch's kernels run instead" in said[0], out.stderr
    assert "Traceback" not in out.stderr
    assert not list((tmp_path / "lib").rglob("_cpu_kernels*"))


def test_without_the_kernels_auto_says_so_once_and_required_refuses(fresh_kernels, capsys):
    fresh_kernels.setattr(cpu_kernels, "library_candidates", lambda: [])  # no compiler built them
    fresh_kernels.setattr(cpu_kernels, "library_path", lambda: None)
    assert cpu_kernels.configure("auto") == cpu_kernels.configure("auto") == cpu_kernels.backend()
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("specdist:")]
    assert said == [
        "specdist: CPU kernels: torch's kernels: the C kernels were not built with this install (no C "
        "compiler, or not x86-64); reinstall with one: pip install ."
    ]
    assert not cpu_kernels.available() and cpu_kernels.library() is None
    with pytest.raises(
        ConfigError,
        match=r"engine.cpu_kernels: required, but they do not run here: the C kernels "
        r"were not built",
    ):
        cpu_kernels.configure("required")
    assert cpu_kernels.built_problem().startswith("specdist: the C kernels were not built")  # (what fails an image)


def test_the_image_builds_the_kernels_and_fails_without_them():
    """The Dockerfile installs a C compiler before `pip install .` and ends its build with built_problem(), which
    exits non-zero where the library is missing or does not match its source; .dockerignore keeps a library built
    in place out of the context, so the image's is its own."""
    docker = (REPO / "Dockerfile").read_text()
    install_cc = docker.index("apt-get install -y --no-install-recommends gcc")
    assert docker.index('pip install --no-cache-dir ".[distributed,http]"') > install_cc
    assert "sys.exit(k.built_problem())" in docker and docker.index("cd / &&") < docker.index("built_problem")
    assert "**/*.so" in (REPO / ".dockerignore").read_text().splitlines()


def test_required_without_the_kernels_stops_the_cli_in_one_line(fresh_kernels, tiny_models, tmp_path, capsys):
    fresh_kernels.setattr(cpu_kernels, "library_candidates", lambda: [])
    cfg = tiny_config(tiny_models, "none", 1)
    cfg.setdefault("engine", {})["cpu_kernels"] = "required"
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    with pytest.raises(SystemExit) as stop:
        main(["generate", "--config", str(path), "--max-tokens", "2", "a b c"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("specdist: error:")]
    assert len(lines) == 1 and "engine.cpu_kernels: required, but they do not run here" in lines[0], err
    assert "Traceback" not in err


def test_off_runs_torch_kernels_and_says_so(fresh_kernels, capsys):
    assert cpu_kernels.configure("off") == "torch's kernels (engine.cpu_kernels: off)"
    assert not cpu_kernels.available() and cpu_kernels.library() is None
    assert "specdist: CPU kernels: torch's kernels (engine.cpu_kernels: off)" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="engine.cpu_kernels: must be one of auto, required, off"):
        cpu_kernels.configure("fast")


@pytest.mark.skipif(cpu_kernels.library_path() is None, reason="needs the installed library to copy")
def test_a_library_from_another_source_or_writable_by_others_is_refused(fresh_kernels, tmp_path):
    copy = tmp_path / os.path.basename(cpu_kernels.library_path())
    shutil.copy(cpu_kernels.library_path(), copy)
    os.chmod(copy, 0o755)
    fresh_kernels.setattr(cpu_kernels, "library_candidates", lambda: [str(copy)])
    if cpu_kernels.missing_cpu_features():
        pytest.skip("this CPU does not run the kernels")
    assert cpu_kernels._open()[0] is not None  # the same bytes at another path: its digest matches the source
    assert cpu_kernels.built_problem() is None
    edited = tmp_path / "cpu_kernels.c"
    edited.write_bytes(Path(cpu_kernels.SOURCE).read_bytes() + b"\n/* edited after the build */\n")
    with fresh_kernels.context() as m:
        m.setattr(cpu_kernels, "SOURCE", str(edited))
        lib, why = cpu_kernels._open()
        assert lib is None and "was built from another source" in why and "pip install -e ." in why
    os.chmod(copy, 0o777)
    lib, why = cpu_kernels._open()
    assert lib is None and "is writable by others (mode 777)" in why


@pytest.mark.slow
@pytest.mark.skipif(
    not X86 or shutil.which(os.environ.get("CC", "cc")) is None,
    reason="the kernels are built for x86-64, with a C compiler",
)
def test_a_wheel_carries_the_kernels_and_they_load_from_where_it_is_installed(tmp_path):
    """What a non-editable install (the Docker image's `pip install .`) gets: the wheel holds the library beside the
    C source and kernel_abi.py, and specdist imported from the unpacked wheel loads that library."""
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path / "wheel"),
            str(REPO),
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    (wheel,) = (tmp_path / "wheel").glob("specdist-*.whl")
    import zipfile

    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        z.extractall(tmp_path / "site")
    assert any(re.fullmatch(r"specdist/models/kernels/_cpu_kernels\..*\.so", n) for n in names), names
    assert {"specdist/models/kernels/cpu_kernels.c", "specdist/models/kernels/kernel_abi.py"} <= set(names)
    probe = (
        "from specdist.models.kernels import cpu_kernels as k; print(k.__file__); print(k.library_path()); "
        "print(k.built_problem()); print(k.backend())"
    )
    run = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(tmp_path / "site")},
    )
    assert run.returncode == 0, run.stderr[-2000:]
    module, library, problem, backend = run.stdout.splitlines()[-4:]
    assert module.startswith(str(tmp_path / "site")) and library.startswith(str(tmp_path / "site")), run.stdout
    assert problem == "None"
    if not cpu_kernels.missing_cpu_features():
        assert backend == "specdist's C kernels (AVX2, FMA, F16C)"


@pytest.mark.slow
@pytest.mark.skipif(
    cpu_kernels.library_path() is None or bool(cpu_kernels.missing_cpu_features()),
    reason="needs the installed library, on a CPU that runs it",
)
def test_a_copy_of_the_sources_without_the_library_loads_the_installed_one(tmp_path):
    """A Ray job's working_dir is such a copy (Ray leaves out what .gitignore names, the built library among them):
    its workers import specdist from the copy and load the library the machine's install built from the same
    source; an edited copy's source does not match it and gets torch's kernels, saying why."""
    shutil.copytree(REPO / "specdist", tmp_path / "specdist", ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    probe = (
        "from specdist.models.kernels import cpu_kernels as k; print(k.__file__); print(k.library_path()); "
        "print(k.library_candidates()[0]); print(k.backend())"
    )

    def run() -> list[str]:
        out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        return out.stdout.splitlines()[-4:]

    module, own, loaded, backend = run()
    assert module.startswith(str(tmp_path)) and own == "None", (module, own)
    assert loaded == cpu_kernels.library_path() and backend == "specdist's C kernels (AVX2, FMA, F16C)"
    with open(tmp_path / "specdist" / "models" / "kernels" / "cpu_kernels.c", "a") as f:
        f.write("\n/* a change the install was not built from */\n")
    backend = run()[-1]
    assert backend.startswith("torch's kernels: ") and "was built from another source" in backend
