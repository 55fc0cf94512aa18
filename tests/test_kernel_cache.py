"""The compiled CPU kernels are loaded only from a cache this user alone can write.

The kernel library is named by a hash anyone can compute, in ``~/.cache/specdist/kernels`` or
``$SPECDIST_KERNEL_CACHE``. Where another user can write there (a shared temporary folder, a group
volume), they could plant a library of their own under that name, and loading it runs their code in
the server. Each case plants a library whose constructor writes a marker file at that name, in a cache
another user can write (or owned by another user), starts a fresh process that asks for the kernels, and
checks that the planted code never ran. Those processes' compiler is ``false`` (it fails at once: the test
needs no real build, which takes seconds; the library's name hashes the compiler, so the planted file bears
the name they look for); one real build checks that a fresh cache is made private and its library loads.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from specdist.models import cpu_kernels

pytestmark = pytest.mark.skipif(not cpu_kernels.available() or shutil.which(os.environ.get("CC", "cc")) is None,
                                reason="needs the CPU kernels (x86 with AVX2) and a C compiler")

EVIL = r"""
#include <stdio.h>
#include <stdlib.h>
__attribute__((constructor)) static void planted(void) {
    FILE *f = fopen(getenv("PLANTED_MARKER"), "w");
    if (f) { fputs("ran", f); fclose(f); }
}
"""


def _plant(cache: str, tmp_path, monkeypatch) -> str:
    src = tmp_path / "evil.c"
    src.write_text(EVIL)
    with monkeypatch.context() as m:
        m.setenv("CC", "false")  # the name the asking process (compiler false) looks for
        target = os.path.join(cache, cpu_kernels.library_name())
    subprocess.run([os.environ.get("CC", "cc"), "-shared", "-fPIC", "-o", target, str(src)], check=True)
    return target


def _ask_for_kernels(cache: str, marker: str, cc: str | None = None) -> str:
    code = "from specdist.models import cpu_kernels; print(cpu_kernels.available())"
    env = {**os.environ, "SPECDIST_KERNEL_CACHE": cache, "PLANTED_MARKER": marker,
           "PYTHONPATH": os.pathsep.join(sys.path), **({"CC": cc} if cc else {})}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600).stdout


@pytest.mark.parametrize("how", ["cache writable by others", "library writable by others", "cache of another user",
                                 "library of another user"])
def test_a_library_planted_where_others_can_write_is_never_loaded(tmp_path, monkeypatch, how):
    cache = str(tmp_path / "cache")
    os.makedirs(cache)
    os.chmod(cache, 0o700)
    planted = _plant(cache, tmp_path, monkeypatch)
    if how == "cache writable by others":
        os.chmod(cache, 0o777)
    elif how == "library writable by others":
        os.chmod(planted, 0o666)
    else:
        if os.getuid() != 0:
            pytest.skip("giving a file to another user needs root")
        os.chown(cache if how == "cache of another user" else planted, 54321, 54321)
    marker = str(tmp_path / "marker")
    out = _ask_for_kernels(cache, marker, cc="false")
    assert not os.path.exists(marker), "the planted library's code ran in the process"
    assert out.strip() == "False"  # refused, and the private build (compiler false) failed: torch's kernels run


def test_a_fresh_cache_is_created_private(tmp_path):
    cache = str(tmp_path / "new" / "kernels")
    assert _ask_for_kernels(cache, str(tmp_path / "marker")).strip() == "True"
    st = os.stat(cache)
    assert st.st_uid == os.getuid() and st.st_mode & 0o777 == 0o700
    lib = os.path.join(cache, cpu_kernels.library_name())
    assert os.path.isfile(lib) and not os.stat(lib).st_mode & 0o022
