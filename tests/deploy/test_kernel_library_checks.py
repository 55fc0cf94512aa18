"""The kernel library is checked before any of its code runs: a library's constructors run as it is loaded, so its
digest is read from the file's bytes (the C file's ``.specdist_abi`` section), and its owner and mode and those of
the directories above it are checked on the file that is then loaded. A library from elsewhere on ``sys.path`` is
not a candidate at all."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from specdist.models.kernels import cpu_kernels, kernel_abi

pytestmark = pytest.mark.skipif(
    cpu_kernels.library_path() is None or shutil.which(os.environ.get("CC", "cc")) is None,
    reason="needs the installed library and a C compiler (x86-64)",
)

# a library that reports the public digest the way the library used to (a function) and, as it is loaded, writes a
# file: the mark of code that ran
ROGUE = r"""
#include <stdio.h>
__attribute__((constructor)) static void ran_at_load(void) {
    FILE *f = fopen(MARK, "w");
    if (f) { fputs("ran", f); fclose(f); }
}
const char *specdist_abi(void) { return DIGEST; }
"""


def _build(tmp_path: Path, name: str, mark: Path, section: bool) -> Path:
    """ROGUE compiled into ``tmp_path/name``; ``section``: with the installed source's digest in .specdist_abi too."""
    digest = kernel_abi.abi_digest(Path(cpu_kernels.SOURCE).read_bytes())
    src = tmp_path / f"{name}.c"
    src.write_text(
        ROGUE
        + ('__attribute__((used, section(".specdist_abi"))) static const char note[] = DIGEST;\n' if section else "")
    )
    out = tmp_path / name
    subprocess.run(
        [
            os.environ.get("CC", "cc"),
            "-shared",
            "-fPIC",
            f'-DMARK="{mark}"',
            f'-DDIGEST="{digest}"',
            str(src),
            "-o",
            str(out),
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )
    os.chmod(out, 0o755)
    return out


@pytest.fixture
def fresh(monkeypatch):
    cpu_kernels._opened.cache_clear()
    cpu_kernels._library.cache_clear()
    yield monkeypatch
    monkeypatch.undo()
    cpu_kernels._opened.cache_clear()
    cpu_kernels._library.cache_clear()


def test_a_library_whose_constructor_writes_a_file_is_refused_and_never_runs(fresh, tmp_path):
    mark = tmp_path / "constructor-ran"
    rogue = _build(tmp_path, "_cpu_kernels.so", mark, section=False)
    fresh.setattr(cpu_kernels, "library_candidates", lambda: [str(rogue)])
    lib, why = cpu_kernels._open()
    assert lib is None and "was built from another source" in why, why
    assert not mark.exists(), "the library's constructor ran: it was loaded before its digest was checked"


def test_a_library_with_the_public_digest_owned_by_another_user_never_runs(fresh, tmp_path):
    """The digest is public (anyone can compute it from the source): what makes a library trusted is who could have
    written it. Owned by another user, the right digest in its section does not get it loaded."""
    mark = tmp_path / "constructor-ran"
    rogue = _build(tmp_path, "_cpu_kernels.so", mark, section=True)
    if os.geteuid() == 0:
        os.chown(rogue, 65534, 65534)
    else:  # a non-root user cannot give a file away: trust root alone instead
        fresh.setattr(cpu_kernels, "_trusted_uids", lambda: {0})
    fresh.setattr(cpu_kernels, "library_candidates", lambda: [str(rogue)])
    lib, why = cpu_kernels._open()
    assert lib is None and "is owned by uid" in why and "neither root nor this user" in why, why
    assert not mark.exists()


def test_a_library_in_a_directory_others_can_write_is_refused(fresh, tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    copy = shared / os.path.basename(cpu_kernels.library_path())
    shutil.copy(cpu_kernels.library_path(), copy)
    os.chmod(copy, 0o755)
    fresh.setattr(cpu_kernels, "library_candidates", lambda: [str(copy)])
    if cpu_kernels.missing_cpu_features():
        pytest.skip("this CPU does not run the kernels")
    assert cpu_kernels._open()[0] is not None  # the installed library's bytes, in a directory of ours
    cpu_kernels._opened.cache_clear()
    os.chmod(shared, 0o777)  # anyone could now swap the file
    lib, why = cpu_kernels._open()
    assert lib is None and f"{shared} (above {copy}) is writable by others (mode 777)" in why, why
    os.chmod(shared, 0o1777)  # sticky, as /tmp: others cannot replace our entries
    cpu_kernels._opened.cache_clear()
    assert cpu_kernels._open()[0] is not None


def test_the_digest_is_read_from_the_file_without_loading_it(tmp_path):
    mark = tmp_path / "constructor-ran"
    with_section = _build(tmp_path, "with.so", mark, section=True)
    without = _build(tmp_path, "without.so", mark, section=False)
    digest = kernel_abi.abi_digest(Path(cpu_kernels.SOURCE).read_bytes())
    for path, want in ((with_section, digest), (without, None), (cpu_kernels.library_path(), digest)):
        fd = os.open(path, os.O_RDONLY)
        try:
            assert cpu_kernels.embedded_digest(fd) == want, path
        finally:
            os.close(fd)
    fd = os.open(cpu_kernels.SOURCE, os.O_RDONLY)  # not ELF at all
    try:
        assert cpu_kernels.embedded_digest(fd) is None
    finally:
        os.close(fd)
    assert not mark.exists()


def test_sys_path_entries_are_not_searched_for_a_library(fresh, tmp_path):
    """A directory on sys.path (the current one, where a script runs) holding specdist/models/kernels/<library> is
    no source of code: only the module's own directory and the installed specdist's are."""
    planted = tmp_path / "specdist" / "models" / "kernels"
    planted.mkdir(parents=True)
    name = os.path.basename(cpu_kernels.library_path())
    shutil.copy(cpu_kernels.library_path(), planted / name)
    fresh.setattr(cpu_kernels, "library_path", lambda: None)  # as in a copy of the sources without the library
    fresh.setattr(sys, "path", [str(tmp_path), *sys.path])
    found = cpu_kernels.library_candidates()
    assert str(planted / name) not in found
    assert found == [str(Path(cpu_kernels.__file__).resolve().parent / name)]  # the editable install's own
