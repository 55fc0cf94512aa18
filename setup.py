"""Builds specdist's CPU kernels (specdist/models/kernels/cpu_kernels.c) when the package is installed.

Everything else about the package is in pyproject.toml. The kernels are a plain shared library that specdist loads
with ctypes (specdist/models/kernels/cpu_kernels.py), built as an optional extension: on a machine that is not x86-64 or has
no C compiler the install goes on without them, says so in one line, and specdist runs torch's kernels instead
(``engine.cpu_kernels: required`` then refuses to start). The build needs only setuptools: the kinds and flags come
from specdist/models/kernels/kernel_abi.py, read here as a file, so an isolated build does not pull torch.
"""

import os
import platform
import runpy
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.path.join("specdist", "models", "kernels", "cpu_kernels.c")
ABI = runpy.run_path(os.path.join(HERE, "specdist", "models", "kernels", "kernel_abi.py"))


def _say(message: str) -> None:
    print(f"specdist: {message}", file=sys.stderr, flush=True)


class BuildKernels(build_ext):
    """build_ext that skips the kernels where they cannot run and reports a failed build in one line."""

    def build_extension(self, ext: Extension) -> None:
        machine = platform.machine().lower()
        if machine not in ("x86_64", "amd64"):
            _say(f"the CPU kernels are for x86-64 with AVX2, not {machine}: not built (torch's kernels run instead)")
            return
        # the compiler alone, without Python's own CFLAGS (-fwrapv, -g, ...): the kernels are compiled with
        # kernel_abi.CFLAGS only, whatever the Python build, so their code (and speed) does not depend on it
        cc = self.compiler.compiler_so  # e.g. ["gcc", "-Wsign-compare", ..., "-fPIC"]; CC may be several words
        first_flag = next((i for i, a in enumerate(cc) if a.startswith("-")), len(cc))
        self.compiler.set_executable("compiler_so", [*cc[:first_flag], "-fPIC"])
        try:
            super().build_extension(ext)
        except Exception as e:  # noqa: BLE001 - any compiler or linker failure leaves the fallback, said once
            reason = " ".join(str(e).split())[-300:]
            _say(f"the CPU kernels were not built ({reason}); torch's kernels run instead")


with open(os.path.join(HERE, SOURCE), "rb") as f:
    digest = ABI["abi_digest"](f.read())

kernels = Extension(
    "specdist.models.kernels._cpu_kernels",
    sources=[SOURCE],
    define_macros=[*ABI["macros"](), ("SPECDIST_ABI", f'"{digest}"')],
    extra_compile_args=list(ABI["CFLAGS"]),
    extra_link_args=list(ABI["LDFLAGS"]),
    optional=True,
)

setup(ext_modules=[kernels], cmdclass={"build_ext": BuildKernels})
