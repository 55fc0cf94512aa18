"""What the CPU kernels (``cpu_kernels.c``) and their Python side (``cpu_kernels.py``) agree on, defined once.

The C file is compiled when the package is installed (``setup.py``), which reads this file without importing the
package (no torch in an isolated build) and passes each value below to the compiler as a ``-D`` macro; the C file
defines none of them itself. The library records a digest of its source and these macros
(:func:`abi_digest`), and ``cpu_kernels`` loads it only where the digest matches the installed source: a library
built from another version of either is refused, not run.

Only the standard library here: this module is executed by ``setup.py`` on its own.
"""

from __future__ import annotations

import hashlib

# How the C file is compiled (x86-64 only; the CPU's features are checked at run time before the library is loaded).
CFLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp")
LDFLAGS = ("-fopenmp", "-lm")
CPU_FEATURES = ("avx2", "fma", "f16c")  # /proc/cpuinfo's names of what CFLAGS let the compiler use

GROUP = 32  # weights per block (GGUF's block size)

# The block kinds: (name, number, code bytes a block of 8 rows, float vectors and int8 vectors of a K-quant
# super-block's scales a block (block_scale), the most rows of x one loaded weight block serves).
#   Q4:     4-bit codes with a scale and an offset per block (GGUF Q4_0 / Q4_1 / Q4_K)
#   Q8:     signed bytes with a scale per block (Q8_0, Q5_0)
#   Q6_16:  6-bit codes with a scale per 16 (Q6_K)
#   Q5:     5-bit codes with a scale and an offset per block (Q5_0 / Q5_1 / Q5_K)
#   Q4_16:  4-bit codes with a scale per 16 (Q3_K)
#   Q2M_16: 2-bit codes with a scale and an offset per 16 (Q2_K)
#   IQ4:    4-bit indices into IQ4_VALUES with a scale per block (IQ4_NL / IQ4_XS)
#   Q7_16:  7-bit codes in bytes with a scale per 16 (IQ2_XS / IQ2_S)
BLOCK_KINDS = (
    ("Q4", 0, 128, 2, 2, 7),
    ("Q8", 1, 256, 1, 1, 4),
    ("Q6_16", 5, 192, 1, 2, 4),
    ("Q5", 6, 160, 2, 2, 7),
    ("Q4_16", 7, 128, 1, 2, 6),
    ("Q2M_16", 8, 64, 2, 4, 5),
    ("IQ4", 9, 128, 1, 1, 4),
    ("Q7_16", 10, 256, 1, 2, 4),
)
# Dense weights [n, K], no scales: float32, or the bfloat16 / float16 that holds it exactly.
DENSE_KINDS = (("F32", 2), ("BF16", 3), ("F16", 4))
# Flags a block kind carries: its packed scales are float16 values, or K-quant super-blocks.
HALF_SCALES, SUPER_SCALES = 16, 32
# The parts of a decoder layer one call of the layer kernel runs: all of it, the attention half, the MLP half.
LAYER_WHOLE, LAYER_ATTENTION, LAYER_MLP = 0, 1, 2
# The signed bytes GGUF's IQ4_NL and IQ4_XS indices stand for.
IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


def macros() -> list[tuple[str, str]]:
    """The ``-D`` macros the C file is compiled with (without the digest), in a fixed order."""
    out = [
        ("QK", str(GROUP)),
        ("LIN_HALF_SCALES", str(HALF_SCALES)),
        ("LIN_SUPER_SCALES", str(SUPER_SCALES)),
        ("LAYER_WHOLE", str(LAYER_WHOLE)),
        ("LAYER_ATTENTION", str(LAYER_ATTENTION)),
        ("LAYER_MLP", str(LAYER_MLP)),
        ("IQ4_VALUES", ",".join(map(str, IQ4_VALUES))),
    ]
    for name, number in DENSE_KINDS:
        out.append((f"LIN_{name}", str(number)))
    for name, number, code_bytes, floats, per_block, tile in BLOCK_KINDS:
        out += [
            (f"LIN_{name}", str(number)),
            (f"{name}_CODE_BYTES", str(code_bytes)),
            (f"{name}_FLOATS", str(floats)),
            (f"{name}_PER_BLOCK", str(per_block)),
            (f"{name}_TILE", str(tile)),
        ]
    return out


def abi_digest(source: bytes) -> str:
    """The digest a library built from ``source`` (the C file's bytes) with :func:`macros` and the flags reports."""
    h = hashlib.sha256(source)
    for part in (*CFLAGS, *LDFLAGS, *(f"{k}={v}" for k, v in macros())):
        h.update(b"\0" + part.encode())
    return h.hexdigest()[:32]
