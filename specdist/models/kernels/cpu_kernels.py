"""CPU kernels for x86 with AVX2 (``cpu_kernels.c``): matmuls on GGUF's 4- and 8-bit blocks as llama.cpp
computes them, and attention over the slot KV cache whose rows do not depend on the batch.

**Block matmuls.** torch's CPU int4 kernel (``_weight_int4pack_mm_for_cpu``) reads a GGUF model's Q4
blocks at a few GB/s and has no Q8 kernel (Q8_0 runs as two int4 halves, twice the work).
:func:`block_mm` computes ``x @ W.T`` on the blocks themselves, by the weight's kind: nibbles with a scale and an
offset per block (Q4_0 / Q4_1 / Q4_K), signed bytes with a scale per block (Q8_0 / Q5_0) or per 16 (Q6_K), bytes
with an offset per block (Q5_1 / Q5_K), nibbles with a scale per 16 (Q3_K) or with both per 16 (Q2_K): each row of ``x``
is quantized per block of 32 to signed bytes (scale ``max |x| / 127``), and a block's dot product is
an exact sum of byte products (``vpmaddubsw``) scaled by the two blocks' floats. :func:`pack_q4` /
:func:`pack_q8` repack the weights once, at load, in groups of 8 rows whose codes interleave 4 at a
time, so that one vector multiply-add yields partial sums of 8 outputs side by side and each loaded
weight vector serves up to four rows of ``x`` (prefill and verification rows share the weight traffic).
Calls of at most 4 rows (a decode step, a short verification) are bound by reading the weights, and
prefetch them a few kB ahead of the block being multiplied.
Weights keep the file's scales, nothing rounded, in the fewest bytes that hold them exactly: float16 where every
scale (and offset) of the weight is a float16 value, as GGUF's Q4_0 / Q4_1 / Q8_0 / Q5_0 / Q5_1 store them
(:func:`packed_scales`); a K-quant's in its file's form, a float16 factor per 256 elements times an int8 per block
or per 16, multiplied on load (:func:`pack_super_scales`; the product is exact in float32); else float32. A Q4 block
reads 0.625 bytes a weight with float16 scales and 0.59 with Q4_K's, instead of 0.75; a Q6_K weight 1.08 instead
of 1.25.

**Dense float32.** :func:`f32_mm` computes ``x @ W.T`` on a Linear's own float32 weight for a few rows (a
decode or verification step): tiles of 3 rows of ``x`` against 4 rows of ``W``, each output a dot product over
``K`` in a fixed order (rows batch-invariant), ``W`` streamed from memory once for all the rows and
prefetched 64 kB ahead. torch's GEMM re-packs the weights at every call, which costs more than this at a few
rows; past about :data:`F32_MAX_ROWS` rows torch's GEMM is the faster one, and the runner uses it there.
The weight may be held in bfloat16 or float16 where that dtype holds it exactly (a bf16 or fp16 checkpoint
loaded in float32, :class:`specdist.models.dtypes.HalfStoredLinear`): each element converts exactly to float32
as it is loaded, the arithmetic is the same, and the bits are those of the float32 weight at half the bytes.

**Attention.** :func:`attention` computes each (request, head, query) row from the cache itself (no
gathered copy of the keys, no mask tensor): scores 4 keys at a time, softmax, the weighted sum of
values, each sum in an order fixed by the row's own key count. The query heads of one KV head (GQA's
group) run together, so each key and value is loaded and converted once for up to 3 of them; a row's
arithmetic is the same whichever heads run beside it. A fused kernel (SDPA's flash attention) blocks its sums by the
shape of the call, so a position's output moves in its last bits with the number of queries and requests
in the call; byte-rounded activations then carry such a bit into a different rounding. The cache
may hold float16 (``engine.kv_cache_dtype``): half the bytes to read, which is what attention costs
at many requests or long contexts on a CPU; each element converts exactly to float32 on load.

**Layers.** :func:`decoder_layer` runs a whole Llama-style decoder layer on blocks (RMS norms, the fused
q/k/v and gate/up matmuls, rotary, cache write and attention, SiLU, the residual adds) in one call, so a
layer costs one Python-level call instead of about ten: at batch 1 the operations between the kernels
took over a third of a forward's time. The runner uses it wherever every matmul of a layer runs on blocks,
or on dense float32 weights for calls of up to :data:`F32_MAX_ROWS` tokens (``CausalLMRunner.layer_kernels``).
A matmul's bias (Qwen2's q/k/v) is added to each output row after it, one float32 add an element, as torch
adds it after a block matmul.

**Batch invariance.** A row's result is computed by the same instructions in the same order
whatever the rows around it, in every kernel here. With native blocks and this attention the whole
forward is invariant: a position's logits are the same bits whether it is decoded alone,
verified among k drafts or batched with other requests (``tests/unit/test_cpu_kernels.py``), so greedy
speculative output equals plain decoding and a seed's tokens do not depend on the drafts.

The C file is compiled when the package is installed (``setup.py``: ``pip install .`` or ``pip install -e .``)
into a library beside this module, which is loaded with ctypes on first use. The kinds, the block layouts and the
flags it is compiled with are defined once, in :mod:`specdist.models.kernels.kernel_abi`; the library carries their
digest with its source's in an ELF section, read from the file before it is loaded, and a library that does not match
the installed source, or that anyone but root or this user could have written, is refused before any of its code runs
(:func:`_load`; rebuild with ``pip install -e .``). Before loading it, the CPU's features are checked (AVX2, FMA, F16C).
``engine.cpu_kernels`` chooses (:func:`configure`): ``auto`` runs the kernels where they load and torch's kernels
elsewhere, ``required`` refuses to start without them, ``off`` runs torch's; the backend that runs is said once on
stderr, and in gRPC's ``GetServerInfo`` (:func:`backend`). The library runs its threads in the process's OpenMP runtime
(the ``libgomp`` torch already loaded), so ``torch.set_num_threads`` governs both.

Under ``torch.compile`` the block matmul is the custom op ``specdist::block_mm`` (opaque to inductor); eager calls
go straight to the library.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.machinery
import importlib.metadata
import json
import os
import platform
import stat
import struct
import sys
import urllib.parse
from collections.abc import Callable

import torch

from specdist.config import CPU_KERNEL_MODES
from specdist.errors import ConfigError
from specdist.models.kernels import kernel_abi as abi

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_kernels.c")
LIBRARY = "_cpu_kernels"  # the extension setup.py builds, beside this module
GROUP = abi.GROUP  # weights per block (GGUF's block size)
# The kinds of a matmul (kernel_abi.BLOCK_KINDS, DENSE_KINDS): Q4 blocks (GGUF Q4_0 / Q4_1 / Q4_K), Q8 blocks (Q8_0),
# dense weights (float32, bfloat16, float16), 6-bit codes with a scale per 16 (Q6_K), 5-bit codes with a scale and an
# offset per block (Q5_0 / Q5_1 / Q5_K), Q4 codes with a scale per 16 (Q3_K), 2-bit codes with a scale and an offset
# per 16 (Q2_K), 4-bit indices into IQ4_VALUES with a scale per block (IQ4_NL / IQ4_XS), 7-bit codes in bytes with a
# scale per 16 (IQ2_XS / IQ2_S)
_NUMBER = {name: number for name, number, *_ in abi.BLOCK_KINDS} | dict(abi.DENSE_KINDS)
LIN_Q4, LIN_Q8, LIN_F32, LIN_BF16, LIN_F16, LIN_Q6_16, LIN_Q5, LIN_Q4_16, LIN_Q2M_16, LIN_IQ4, LIN_Q7_16 = (
    _NUMBER[n] for n in ("Q4", "Q8", "F32", "BF16", "F16", "Q6_16", "Q5", "Q4_16", "Q2M_16", "IQ4", "Q7_16")
)
IQ4_VALUES = abi.IQ4_VALUES  # the signed bytes GGUF's IQ4_NL and IQ4_XS indices stand for
# a block kind's flags: its packed scales are float16 values, or K-quant super-blocks
LIN_HALF_SCALES, LIN_SUPER_SCALES = abi.HALF_SCALES, abi.SUPER_SCALES
DENSE_KINDS = (LIN_F32, LIN_BF16, LIN_F16)  # dense weights [n, K] (float32, bfloat16, float16), no scales
Q4_KINDS = (LIN_Q4, LIN_Q4_16, LIN_IQ4)  # codes packed by pack_q4 (128 bytes a block of 8 rows)
# each block kind's code bytes a block of 8 rows (pack_q4's, pack_q8's, pack_q2's, pack_q5's, pack_q6's, pack_q7's)
CODE_BYTES = {number: code_bytes for _, number, code_bytes, *_ in abi.BLOCK_KINDS}
# packed floats a block of a group of 8 rows: 8 a scale or offset vector
_SCALE_FLOATS = {number: 8 * per_block for _, number, _, _, per_block, _ in abi.BLOCK_KINDS}
# kind -> (factor vectors, int8 vectors a block) of its super-block scales (pack_super_scales; the C file's block_scale)
SUPER_LAYOUT = {number: (floats, per_block) for _, number, _, floats, per_block, _ in abi.BLOCK_KINDS}


def _library_in(models_dir: str) -> str | None:
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = os.path.join(models_dir, LIBRARY + suffix)
        if os.path.isfile(path):
            return path
    return None


def library_path() -> str | None:
    """The kernels' library as the install built it beside this module, or None where none was built."""
    return _library_in(os.path.dirname(os.path.abspath(__file__)))


def library_candidates() -> list[str]:
    """The libraries this process may load, in order: beside this module; else that of the installed specdist
    (where its install put its files, or an editable install's project). The second case is a copy of the sources
    without the library, as a Ray job's ``working_dir`` is (it leaves out what ``.gitignore`` names): the workers
    then load the library the machine's install built, which :func:`_load` accepts only if it was built from the
    very source this copy holds. No other ``sys.path`` entry is searched (the current directory is one): a library
    runs only from where specdist is."""
    own = library_path()
    if own is not None:
        return [own]
    dirs = []
    for dist in importlib.metadata.distributions(name="specdist"):
        dirs.append(str(dist.locate_file(os.path.join("specdist", "models", "kernels"))))
        try:
            url = json.loads(dist.read_text("direct_url.json") or "{}")
        except ValueError:
            continue
        if url.get("dir_info", {}).get("editable") and url.get("url", "").startswith("file://"):
            dirs.append(
                os.path.join(urllib.parse.unquote(url["url"][len("file://") :]), "specdist", "models", "kernels")
            )
    found = (_library_in(d) for d in dict.fromkeys(os.path.abspath(d) for d in dirs))
    return list(dict.fromkeys(p for p in found if p is not None))


def missing_cpu_features() -> list[str]:
    """The CPU features the kernels are compiled for (kernel_abi.CPU_FEATURES) that this CPU lacks, read from
    ``/proc/cpuinfo`` (the kernel lists only what the OS enables); elsewhere from torch's CPU capability."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return list(abi.CPU_FEATURES)
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return [] if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512") else list(abi.CPU_FEATURES)
    return [f for f in abi.CPU_FEATURES if f not in flags]


_NOT_BUILT = (
    "the C kernels were not built with this install (no C compiler, or not x86-64); reinstall with one: pip install ."
)


def _open() -> tuple[ctypes.CDLL | None, str]:
    """The loaded library (the first of :func:`library_candidates` :func:`_load` accepts), or None and why not: none
    built, this CPU lacks a feature, or :func:`_load` refuses each."""
    paths = library_candidates()
    if not paths:
        return None, _NOT_BUILT
    missing = missing_cpu_features()
    if missing:
        return None, f"this CPU lacks {', '.join(missing)}, which the C kernels need"
    refusals = []
    for path in paths:
        lib, why = _load(path)
        if lib is not None:
            return lib, why
        refusals.append(why)
    return None, "; ".join(refusals)


def built_problem() -> str | None:
    """Why this install has no kernel library it would load (not built, or built from another source), else None.
    The CPU's features are not asked: an image is built on one machine and runs on others (the Dockerfile runs
    this)."""
    path = library_path()
    lib, why = (None, _NOT_BUILT) if path is None else _load(path)
    return None if lib is not None else f"specdist: {why}"


def _load(path: str) -> tuple[ctypes.CDLL | None, str]:
    """The library at ``path`` loaded, or None and why not. Everything is decided before any of its code runs (its
    constructors run as it loads), on one open file: that file must be a regular file owned by root or this user
    that no one else can write, in directories no one else can change (:func:`_unsafe`), and the digest in its
    bytes (:func:`embedded_digest`) must be that of the source installed beside this module
    (:func:`kernel_abi.abi_digest`). Then that same open file is loaded, through ``/proc/self/fd``: a file put at
    ``path`` after the checks is not what runs."""
    real = os.path.realpath(path)
    try:
        fd = os.open(real, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError as e:
        return None, f"{path} does not open ({e.strerror or e})"
    try:
        why = _unsafe(fd, real)
        if why is not None:
            return None, why
        with open(SOURCE, "rb") as f:
            if embedded_digest(fd) != abi.abi_digest(f.read()):
                return None, f"{path} was built from another source than {SOURCE}: rebuild it with pip install -e ."
        through = f"/proc/self/fd/{fd}"
        if not os.path.exists(through):
            return None, f"{path}: no /proc/self/fd here to load the checked file through: not loaded"
        lib = ctypes.CDLL(through)
    except OSError as e:
        return None, f"{path} does not load ({e})"
    finally:
        os.close(fd)
    return lib, f"specdist's C kernels ({', '.join(f.upper() for f in abi.CPU_FEATURES)})"


def _trusted_uids() -> set[int]:
    """Who may own the library and the directories above it: root and this process's user."""
    return {0, os.geteuid()}


def _unsafe(fd: int, path: str) -> str | None:
    """Why the file open at ``fd`` (``path``: its real path) may hold code that someone other than root or this user
    put there, else None: its type, owner and mode, and the owner and mode of every directory above it (one that
    others can write lets them replace the file; with the sticky bit, as /tmp has, only their own entries)."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        return f"{path} is not a regular file: not loaded"
    if st.st_mode & 0o022:
        return f"{path} is writable by others (mode {st.st_mode & 0o777:o}): not loaded"
    trusted = _trusted_uids()
    if st.st_uid not in trusted:
        return f"{path} is owned by uid {st.st_uid}, neither root nor this user: not loaded"
    parent = os.path.dirname(path)
    while True:
        d = os.stat(parent)
        if d.st_uid not in trusted:
            return f"{parent} (above {path}) is owned by uid {d.st_uid}, neither root nor this user: not loaded"
        if d.st_mode & 0o022 and not d.st_mode & stat.S_ISVTX:
            return f"{parent} (above {path}) is writable by others (mode {d.st_mode & 0o777:o}): not loaded"
        if os.path.dirname(parent) == parent:
            return None
        parent = os.path.dirname(parent)


ABI_SECTION = b".specdist_abi"  # the ELF section the C file keeps its digest in (kernel_abi.abi_digest)


def embedded_digest(fd: int) -> str | None:
    """The digest in the ``.specdist_abi`` section of the library open at ``fd``, read from its bytes (nothing of it
    runs), or None where it has none: not a 64-bit little-endian ELF file, or built without the section."""
    size = os.fstat(fd).st_size
    head = os.pread(fd, 64, 0)  # the ELF header
    if len(head) < 64 or head[:6] != b"\x7fELF\x02\x01":
        return None
    (table_at,) = struct.unpack_from("<Q", head, 0x28)
    entry_size, count, names_index = struct.unpack_from("<HHH", head, 0x3A)
    if entry_size != 64 or not 0 < count <= 4096 or names_index >= count or table_at + 64 * count > size:
        return None
    table = os.pread(fd, 64 * count, table_at)
    # each section header: name (offset into the names section), type, flags, address, offset, size
    sections = [struct.unpack_from("<IIQQQQ", table, 64 * i) for i in range(count)]

    def content(index: int, most: int) -> bytes:
        at, n = sections[index][4:6]
        return os.pread(fd, n, at) if n <= most and at + n <= size else b""

    names = content(names_index, 1 << 20)
    for index, (name, *_) in enumerate(sections):
        if names[name : name + len(ABI_SECTION) + 1] == ABI_SECTION + b"\0":
            return content(index, 256).rstrip(b"\0").decode("ascii", "replace")
    return None


_mode = "auto"  # engine.cpu_kernels, as configure() last set it
_said: set[str] = set()  # the backend lines said on stderr in this process


def configure(mode: str) -> str:
    """Apply ``engine.cpu_kernels`` (``auto``, ``required`` or ``off``) in this process, before a model loads; returns
    the backend that runs (:func:`backend`), said once on stderr. ``required`` without the kernels raises ConfigError
    saying why they do not run here."""
    global _mode, _available
    if mode not in CPU_KERNEL_MODES:
        raise ConfigError("engine.cpu_kernels", f"must be one of {', '.join(CPU_KERNEL_MODES)}, not {mode!r}")
    if mode == "required" and _opened()[0] is None:
        raise ConfigError("engine.cpu_kernels", f"required, but they do not run here: {_opened()[1]}")
    if mode != _mode:
        _mode, _available = mode, None
    line = backend()
    if line not in _said:
        _said.add(line)
        print(f"specdist: CPU kernels: {line}", file=sys.stderr, flush=True)
    return line


def backend() -> str:
    """Which kernels run the CPU's matmuls and attention in this process, in one line."""
    lib, why = _opened()
    if _mode == "off":
        return "torch's kernels (engine.cpu_kernels: off)"
    return why if lib is not None else f"torch's kernels: {why}"


_opened = functools.cache(_open)


def library() -> ctypes.CDLL | None:
    """The loaded kernels, or None where they do not run here (engine.cpu_kernels: off, or :func:`backend` says why)."""
    return None if _mode == "off" else _library()


@functools.cache
def _library() -> ctypes.CDLL | None:
    lib = _opened()[0]
    if lib is None:
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.specdist_block_mm.argtypes = [ptr, i64, i64, ptr, ptr, i64, i64, ptr]  # (x, M, K, codes, scales, kind, N, y)
    lib.specdist_block_mm.restype = ctypes.c_int
    for fn in (lib.specdist_f32_mm, lib.specdist_bf16_mm, lib.specdist_f16_mm):
        fn.argtypes = [ptr, i64, i64, ptr, i64, ptr]  # (x, M, K, w, N, y)
        fn.restype = ctypes.c_int
    f32, i32 = ctypes.c_float, ctypes.c_int
    # (q, B, Hq, T, hd, q strides x3, k cache, v cache, kv16, Hkv, S, L1, slots, qpos, window, scale, cap, out)
    lib.specdist_attention.argtypes = [
        ptr,
        i64,
        i64,
        i64,
        i64,
        i64,
        i64,
        i64,
        ptr,
        ptr,
        i32,
        i64,
        i64,
        i64,
        ptr,
        ptr,
        i64,
        f32,
        f32,
        ptr,
    ]
    lib.specdist_attention.restype = ctypes.c_int
    lib.specdist_rms_norm.argtypes = [ptr, i64, i64, ptr, f32, ptr]  # (x, M, D, w, eps, out)
    lib.specdist_rms_norm.restype = None
    # (q, k, v, B, T, Hq, Hkv, hd, strides q/k/v (request, token) x3, cos, sin, k cache, v cache, kv16, S, L1, slots,
    #  write_pos, qpos, window, scale, cap, out)
    lib.specdist_rope_attention.argtypes = [
        ptr,
        ptr,
        ptr,
        i64,
        i64,
        i64,
        i64,
        i64,
        i64,
        i64,
        i64,
        i64,
        i64,
        i64,
        ptr,
        ptr,
        ptr,
        ptr,
        i32,
        i64,
        i64,
        ptr,
        ptr,
        ptr,
        i64,
        f32,
        f32,
        ptr,
    ]
    lib.specdist_rope_attention.restype = ctypes.c_int
    # (h, B, T, D, norm1, norm2, eps, q_norm, k_norm, qk_eps, lin[6], Hq, Hkv, hd, cos, sin, k cache, v cache, kv16,
    #  S, L1, slots, write_pos, qpos, window, scale, cap, scratch, part)
    lib.specdist_decoder_layer.argtypes = [
        ptr,
        i64,
        i64,
        i64,
        ptr,
        ptr,
        f32,
        ptr,
        ptr,
        f32,
        ptr,
        i64,
        i64,
        i64,
        ptr,
        ptr,
        ptr,
        ptr,
        i32,
        i64,
        i64,
        ptr,
        ptr,
        ptr,
        i64,
        f32,
        f32,
        ptr,
        i32,
    ]
    lib.specdist_decoder_layer.restype = ctypes.c_int
    return lib


_available: bool | None = None  # library() loaded, once known (until configure() changes the mode)


def available() -> bool:
    """Whether the kernels run here. The answer is kept in a module global, so code that
    torch.compile traces after the first call reads a constant (compile_runner asks first);
    no torch._dynamo decorator, whose import costs seconds in every process that loads a model."""
    global _available
    if _available is None:
        _available = library() is not None
    return _available


def pack_q4(codes: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """GGUF's Q4 blocks in :func:`block_mm`'s Q4 layout. ``codes [N, G, 16]`` uint8 (byte i of a block: element i
    in the low nibble, i + 16 in the high), ``scales [N, 2, G]`` float32 (each row's d, then its m).
    Returns ``codes [ceil(N/8), G, 128]`` uint8 and ``scales [ceil(N/8), G, 16]`` (:func:`packed_scales`'
    dtype): rows in groups of 8 (zero rows pad the last), a block's vector j holding 4 elements of each row (the
    C file's ``q4_group``)."""
    n, g, _ = codes.shape
    pad = -n % 8
    if pad:
        codes = torch.cat([codes, codes.new_zeros(pad, g, 16)])
        scales = torch.cat([scales, scales.new_zeros(pad, 2, g)])
    elems = torch.cat([codes & 15, codes >> 4], -1).reshape(-1, 8, g, 32).transpose(1, 2)  # [N/8, G, 8 rows, 32]
    lo = elems[..., :16].reshape(-1, g, 8, 4, 4)  # [N/8, G, row, j, e]: element 4 j + e
    hi = elems[..., 16:].reshape(-1, g, 8, 4, 4)  # element 16 + 4 j + e
    packed = (lo | hi << 4).permute(0, 1, 3, 2, 4).reshape(-1, g, 128)  # byte 32 j + 4 row + e
    return packed.contiguous(), packed_scales(
        scales.float().reshape(-1, 8, 2, g).permute(0, 3, 2, 1).reshape(-1, g, 16)
    )


def pack_super_scales(factors: torch.Tensor, ints: torch.Tensor) -> torch.Tensor:
    """K-quant scales in their file's form, as the kernels read them (the C file's ``block_scale``, mode
    ``SCALES_SUPER``): ``factors [N, G / 8, F]`` float32 (float16 values: a super-block's d, and -dmin where F = 2)
    and ``ints [N, G, P]`` int8 (each block's multipliers: Q4_K's sc and m, Q6_K's two scales per 16, Q2_K's two
    scales and two mins). Scale vector ``j`` of block ``g`` is ``factors[:, g // 8, j * F // P] * ints[:, g, j]``.
    Returns ``[ceil(N/8), G / 8, 32 F + 64 P]`` uint8: per group of 8 rows and super-block, the factors (float32, [F, 8
    rows])
    then the 8 blocks' multipliers ([block, P, 8 rows]); zero rows pad the last group."""
    n, sb, f = factors.shape
    p = ints.shape[2]
    if ints.shape[:2] != (n, 8 * sb):
        raise ValueError(f"pack_super_scales: {tuple(ints.shape)} multipliers for {tuple(factors.shape)} factors")
    pad = -n % 8
    factors = torch.cat([factors.float(), factors.new_zeros(pad, sb, f, dtype=torch.float32)])  # [N8, SB, F]
    ints = torch.cat([ints.to(torch.int8), ints.new_zeros(pad, 8 * sb, p, dtype=torch.int8)])  # [N8, G, P]
    fb = factors.reshape(-1, 8, sb, f).permute(0, 2, 3, 1).contiguous().view(torch.uint8)  # [N8/8, SB, F, 8 rows * 4]
    ib = ints.reshape(-1, 8, sb, 8, p).permute(0, 2, 3, 4, 1).contiguous().view(torch.uint8)  # [.., SB, block, P, row]
    groups = fb.shape[0]
    return torch.cat([fb.reshape(groups, sb, -1), ib.reshape(groups, sb, -1)], -1).contiguous()


def packed_scales(scales: torch.Tensor) -> torch.Tensor:
    """Float32 block scales as the kernels read them: float16 where every one is a float16 value (each converts
    back exactly, so the products are the same bits at half the scale bytes), else float32. Contiguous."""
    half = scales.to(torch.float16)
    exact = bool(torch.equal(half.float(), scales)) and scales.numel() > 0
    return (half if exact else scales).contiguous()


def pack_q2(codes: torch.Tensor) -> torch.Tensor:
    """2-bit codes ``[N, G, 32]`` (0..3, element order) in :func:`block_mm`'s ``LIN_Q2M_16`` layout:
    ``[ceil(N/8), G, 64]`` uint8, per block two vectors (one a half of it) whose byte ``4 c + e`` holds element
    ``16 h + 4 j + e`` of row ``c`` at bits ``2 j`` (the C file's ``halves_16``); zero rows pad the last group."""
    n, g, _ = codes.shape
    codes = torch.cat([codes.to(torch.uint8), codes.new_zeros(-n % 8, g, GROUP, dtype=torch.uint8)])
    c = codes.reshape(-1, 8, g, 2, 4, 4)  # [N/8, row, G, half, j, e]
    packed = c[..., 0, :] | c[..., 1, :] << 2 | c[..., 2, :] << 4 | c[..., 3, :] << 6  # [N/8, row, G, half, e]
    return packed.permute(0, 2, 3, 1, 4).reshape(-1, g, 64).contiguous()  # byte 32 h + 4 row + e


def pack_q5(codes: torch.Tensor) -> torch.Tensor:
    """5-bit codes ``[N, G, 32]`` (0..31, element order) in :func:`block_mm`'s ``LIN_Q5`` layout: ``[ceil(N/8), G,
    160]`` uint8, per block the low 4 bits as :func:`pack_q4` packs codes, then a vector of the high bits whose byte
    ``4 c + e`` holds element ``4 j + e`` of row ``c`` at bit ``j`` and element ``16 + 4 j + e`` at bit ``4 + j`` (the C
    file's ``q5_group``); zero rows pad the last group."""
    n, g, _ = codes.shape
    c = codes.to(torch.uint8)
    low = c & 15
    nibbles, _ = pack_q4(low[..., :16] | low[..., 16:] << 4, torch.zeros(n, 2, g))
    high = torch.cat([c >> 4, c.new_zeros(-n % 8, g, GROUP)]).reshape(-1, 8, g, 2, 4, 4)  # [N/8, row, G, half, j, e]
    shifts = torch.arange(8, dtype=torch.uint8).reshape(2, 4, 1)  # [half, j, -]: bit 4 half + j
    bits = (high << shifts).sum(dim=(3, 4), dtype=torch.uint8)  # [N/8, row, G, e] (distinct bits: the sum is an or)
    return torch.cat([nibbles, bits.permute(0, 2, 1, 3).reshape(-1, g, 32)], -1).contiguous()  # byte 4 row + e


def pack_q6(codes: torch.Tensor) -> torch.Tensor:
    """6-bit codes ``[N, G, 32]`` (0..63, element order) in :func:`block_mm`'s ``LIN_Q6_16`` layout:
    ``[ceil(N/8), G, 192]`` uint8, per block the low 4 bits as :func:`pack_q4` packs codes, then the high 2 bits as
    :func:`pack_q2` does (the C file's ``halves_16``); zero rows pad the last group."""
    n, g, _ = codes.shape
    c = codes.to(torch.uint8)
    low = c & 15
    nibbles, _ = pack_q4(low[..., :16] | low[..., 16:] << 4, torch.zeros(n, 2, g))
    return torch.cat([nibbles, pack_q2(c >> 4)], -1).contiguous()


def pack_q7(codes: torch.Tensor) -> torch.Tensor:
    """7-bit codes ``[N, G, 32]`` (0..127, element order) in :func:`block_mm`'s ``LIN_Q7_16`` layout: a byte each,
    placed as :func:`pack_q8` places its codes, ``[ceil(N/8), G, 256]`` uint8; zero rows pad the last group."""
    n, g, _ = codes.shape
    packed, _ = pack_q8(codes.to(torch.int8).reshape(n, g * GROUP), torch.zeros(n, g))
    return packed.view(torch.uint8)


def pack_q8(codes: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8 blocks in :func:`block_mm`'s Q8 layout. ``codes [N, K]`` int8, ``scales [N, K/32]`` float32 (GGUF Q8_0, kind
    ``LIN_Q8``). Returns ``codes [ceil(N/8), G, 256]`` int8 and ``scales [ceil(N/8), G, 8]`` (:func:`packed_scales`'
    dtype; the C file's ``q8_blocks``: the 8 rows' scales; zero rows pad the last group)."""
    n, k = codes.shape
    g = k // GROUP
    if scales.shape[1] != g:
        raise ValueError(f"pack_q8: {scales.shape[1]} scales a row for {g} blocks (one a block)")
    per_block = scales.float().reshape(n, g, 1)  # [N, G, 1]
    pad = -n % 8
    if pad:
        codes = torch.cat([codes, codes.new_zeros(pad, k)])
    packed = codes.reshape(-1, 8, g, 8, 4).permute(0, 2, 3, 1, 4).reshape(-1, g, 256)  # byte 32 j + 4 row + e
    return packed.contiguous(), pack_scale_vectors(per_block)


def pack_scale_vectors(per_block: torch.Tensor) -> torch.Tensor:
    """Each block's scale vectors ``[N, G, P]`` float32 (in the kernel's order) as the kernels read them:
    ``[ceil(N/8), G, 8 P]`` (:func:`packed_scales`' dtype), vector j of a block holding the 8 rows' j-th float; zero
    rows pad the last group."""
    n, g, f = per_block.shape
    per_block = torch.cat([per_block.float(), per_block.new_zeros(-n % 8, g, f, dtype=torch.float32)])
    sc = per_block.reshape(-1, 8, g, f).permute(0, 2, 3, 1)  # [N/8, G, f, row]
    return packed_scales(sc.reshape(-1, g, 8 * f))


def unpack_q8(codes: torch.Tensor, n: int) -> torch.Tensor:
    """:func:`pack_q8`'s codes back to ``[n, K]`` int8, row by row."""
    groups, g, _ = codes.shape
    rows = codes.reshape(groups, g, 8, 8, 4).permute(0, 3, 1, 2, 4)  # [N/8, row, G, j, e]
    return rows.reshape(groups * 8, g * GROUP)[:n]


def _dense(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` as a contiguous ``dtype`` tensor the C code can read; ``t`` itself when it is one already
    (checked here: a no-op ``.to`` / ``.contiguous`` still costs a dispatch, several hundred times a forward)."""
    return t if t.dtype == dtype and t.is_contiguous() else t.to(dtype).contiguous()


# packed block scales the kernels read, by dtype: float32 or float16 values, or super-block bytes (pack_super_scales);
# the C file's scale modes
SCALE_MODES = {torch.float32: 0, torch.float16: 1, torch.uint8: 2}
_MODE_FLAGS = (0, LIN_HALF_SCALES, LIN_SUPER_SCALES)


def scales_kind(kind: int, scales: torch.Tensor | None, n: int, k: int) -> int:
    """A block kind with its scales' flag (float16 scales: ``LIN_HALF_SCALES``; super-blocks: ``LIN_SUPER_SCALES``),
    after checking that ``scales`` are that kind's layout for ``n`` rows of ``k`` inputs: ``[ceil(n/8), k / 32, ...]``
    packed per block, ``[ceil(n/8), k / 256, ...]`` per super-block (the C code reads them unchecked)."""
    mode = SCALE_MODES.get(scales.dtype) if scales is not None else None
    if mode is None or not scales.is_contiguous():
        raise ValueError(
            f"block kernel: scales must be contiguous float32, float16 or uint8 super-blocks, not "
            f"{None if scales is None else scales.dtype}"
        )
    f, p = SUPER_LAYOUT[kind]
    want = (
        -(-n // 8),
        k // (8 * GROUP) if mode == 2 else k // GROUP,
        32 * f + 64 * p if mode == 2 else _SCALE_FLOATS[kind],
    )
    if tuple(scales.shape) != want:
        raise ValueError(
            f"block kernel: scales {tuple(scales.shape)} {scales.dtype} are not those of kind {kind} "
            f"for {n} rows of {k} inputs ({want})"
        )
    return kind | _MODE_FLAGS[mode]


def block_mm(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, n: int, kind: int) -> torch.Tensor:
    """``x [M, K] @ W.T -> [M, n]`` float32, W's ``n`` rows in blocks of ``kind``: ``LIN_Q4`` (``w = d * c + m``),
    ``LIN_Q4_16`` (``w = d * (c - 8)``, ``d`` per 16), ``LIN_IQ4`` (``w = d * IQ4_VALUES[c]``) on :func:`pack_q4`'s
    codes; ``LIN_Q5`` (``w = d * c + m``) on :func:`pack_q5`'s; ``LIN_Q6_16`` (``w = d * (c - 32)``, ``d`` per 16) on
    :func:`pack_q6`'s; ``LIN_Q7_16`` (``w = d * (c - 64)``, ``d`` per 16) on :func:`pack_q7`'s; ``LIN_Q8``
    (``w = d * c``) on :func:`pack_q8`'s; ``LIN_Q2M_16`` (``w = d * c + m``, both per 16) on :func:`pack_q2`'s. The
    scales: :func:`pack_q8`'s or :func:`pack_scale_vectors`' layout for the kind (vectors a block: ``d`` / ``d``, ``m``
    / each half's ``d`` / ``d_0, d_1, m_0, m_1``), or
    :func:`pack_super_scales`'."""
    if torch.compiler.is_compiling():
        return torch.ops.specdist.block_mm(x, codes, scales, n, kind)
    return _block_mm(x, codes, scales, n, kind)


def _block_mm(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, n: int, kind: int) -> torch.Tensor:
    x = _dense(x, torch.float32)  # [M, K]
    m, k = x.shape
    if kind not in CODE_BYTES:
        raise ValueError(f"block_mm: kind {kind} is not a block kind ({tuple(CODE_BYTES)})")
    if codes.shape != (-(-n // 8), k // GROUP, CODE_BYTES[kind]) or k % GROUP:
        raise ValueError(f"block_mm: codes {tuple(codes.shape)} do not hold {n} rows of {k} inputs of kind {kind}")
    flagged = scales_kind(kind, scales, n, k)
    y = torch.empty(m, n, dtype=torch.float32)  # [M, N]
    rc = (
        library().specdist_block_mm(x.data_ptr(), m, k, codes.data_ptr(), scales.data_ptr(), flagged, n, y.data_ptr())
        if m
        else 0
    )
    if rc == -2:
        raise ValueError(f"block_mm: super-block scales need inputs in multiples of 256, not {k}")
    if rc:
        raise MemoryError(f"block_mm: no memory to quantize a [{m}, {k}] input")
    return y


# Rows up to which f32_mm runs a float32 model's layers and head. Default model's layers, torch's GEMM over
# f32_mm: 48 rows 1.7x, 64 rows 1.5x, 128 rows 1.2x on two threads; 64 rows 1.0x, 128 rows 0.87x on one
# (docs/performance.md).
F32_MAX_ROWS = 64


DENSE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # weights f32_mm reads (converted exactly on load)


def f32_mm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x [M, K] @ weight.T -> [M, N]`` float32, ``weight [N, K]`` as a Linear holds it (no repacking): each
    output a dot product summed in an order fixed by K alone, so rows do not depend on the batch, and the
    weights read once for up to a few dozen rows (torch's GEMM re-packs them for every call, where this costs
    about what reading the weights does). ``weight`` may be
    float32, bfloat16 or float16: each element converts exactly to float32 as it is loaded and the arithmetic
    is the same, so the result has the bits of ``f32_mm(x, weight.float())`` at half the bytes read."""
    x = _dense(x, torch.float32)
    if weight.dtype not in DENSE_DTYPES:
        raise ValueError(f"f32_mm: weight dtype {weight.dtype} is not one of {DENSE_DTYPES}")
    weight = _dense(weight, weight.dtype)
    m, k = x.shape
    n = weight.shape[0]
    if weight.shape[1] != k:
        raise ValueError(f"f32_mm: weight {tuple(weight.shape)} does not take {k} inputs")
    y = torch.empty(m, n, dtype=torch.float32)
    if m:
        lib = library()
        fn = {
            torch.float32: lib.specdist_f32_mm,
            torch.bfloat16: lib.specdist_bf16_mm,
            torch.float16: lib.specdist_f16_mm,
        }[weight.dtype]
        fn(x.data_ptr(), m, k, weight.data_ptr(), n, y.data_ptr())
    return y


def attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    query_pos: torch.Tensor,
    window: int | None,
    scale: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal attention of each query over its own slot's keys, from the KV cache itself.

    ``q`` [B, Hq, T, hd] float32 (any strides, ``hd`` contiguous); ``k_cache`` / ``v_cache``
    [slots, Hkv, L + 1, hd] float32 or float16 (:data:`KV_DTYPES`), contiguous; ``slots`` [B] and ``query_pos`` [B, T]
    int64: the query at position p of request b sees keys ``max(0, p - window + 1) .. p`` of slot ``slots[b]``. Returns
    ``[B, Hq, T, hd]`` (a view of a [B, T, Hq, hd] tensor). Each output row depends on its query and
    keys only (module doc), unlike a fused kernel's blocking."""
    if torch.compiler.is_compiling():
        return torch.ops.specdist.attention(q, k_cache, v_cache, slots, query_pos, window or 0, scale, softcap or 0.0)
    return _attention(q, k_cache, v_cache, slots, query_pos, window or 0, scale, softcap or 0.0)


KV_DTYPES = (torch.float32, torch.float16)  # cache dtypes the attention kernels read


def _kv16(k_cache: torch.Tensor, v_cache: torch.Tensor) -> int:
    """1 for a float16 cache, 0 for float32; ValueError for anything else (or a mixed pair)."""
    if k_cache.dtype != v_cache.dtype or k_cache.dtype not in KV_DTYPES:
        raise ValueError(
            f"attention kernel: the KV cache must be float32 or float16, got {k_cache.dtype} / {v_cache.dtype}"
        )
    return int(k_cache.dtype == torch.float16)


# the last index tensors found in range, held (so no other tensor can take their identity) with their versions and
# the call's sizes: the layers of a forward pass the same ones, checked once
_checked: list = [None]


def _check_cache_call(
    what: str,
    q_dtype: torch.dtype,
    q_hd: int,
    hq: int,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    bsz: int,
    t: int,
    query_pos: torch.Tensor,
    write_pos: torch.Tensor | None = None,
) -> None:
    """ValueError unless a kernel call's shapes agree and its indices lie inside the cache: ``slots`` [B] in
    [0, slots), ``query_pos`` (and ``write_pos``) [B, T] in [0, L + 1). The C code indexes with them unchecked.
    O(B * T), and once for the index tensors that every layer of a forward gets (kept by identity and version)."""
    if q_dtype != torch.float32:
        raise ValueError(f"{what}: queries must be float32, not {q_dtype}")
    if (
        k_cache.dim() != 4
        or k_cache.shape != v_cache.shape
        or not (k_cache.is_contiguous() and v_cache.is_contiguous())
    ):
        raise ValueError(
            f"{what}: k and v caches must be contiguous [slots, kv heads, length, head size] of one "
            f"shape, got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    n_slots, hkv, l1, hd = k_cache.shape
    if q_hd != hd or hq % hkv:
        raise ValueError(f"{what}: {hq} query heads of {q_hd} do not fit a cache of {hkv} heads of {hd}")
    held = (slots, query_pos, write_pos)
    # torch's mutation counter where it keeps one (inference tensors have none: the same object is taken as unchanged,
    # as nothing writes a forward's index tensors in place between its layers)
    versions = tuple(x._version if x is not None and not x.is_inference() else 0 for x in held)  # noqa: SLF001
    last = _checked[0]
    if last is not None and all(a is b for a, b in zip(last[0], held)) and last[1:] == (versions, n_slots, l1, bsz, t):
        return
    if slots.shape != (bsz,):
        raise ValueError(f"{what}: slots {tuple(slots.shape)} for {bsz} requests")
    if bsz and not (0 <= int(slots.min()) and int(slots.max()) < n_slots):
        raise ValueError(f"{what}: slots {slots.tolist()} outside the cache's {n_slots}")
    for name, pos in (("query_pos", query_pos), ("write_pos", write_pos)):
        if pos is None:
            continue
        if pos.shape != (bsz, t):
            raise ValueError(f"{what}: {name} {tuple(pos.shape)} for {bsz} requests of {t} tokens")
        if pos.numel() and not (0 <= int(pos.min()) and int(pos.max()) < l1):
            raise ValueError(
                f"{what}: {name} from {int(pos.min())} to {int(pos.max())}, outside the cache's positions 0..{l1 - 1}"
            )
    _checked[0] = (held, versions, n_slots, l1, bsz, t)


_BAD_INDEX = -3  # what the C code returns for a slot or position outside the cache (it then reads and writes nothing)


def _refuse_indices(what: str, slots: torch.Tensor, *positions: torch.Tensor) -> None:
    """The ValueError for indices the C code found outside the cache after :func:`_check_cache_call` had let them by
    (index tensors edited in place since: under inference mode torch keeps no version to tell)."""
    _checked[0] = None  # that verdict no longer holds
    spans = ", ".join(f"{int(p.min())}..{int(p.max())}" for p in positions if p.numel())
    raise ValueError(
        f"{what}: slots {slots.tolist()} or positions ({spans}) lie outside the cache (index tensors "
        "changed in place after they were checked?)"
    )


def _attention(q, k_cache, v_cache, slots, query_pos, window: int, scale: float, softcap: float) -> torch.Tensor:
    bsz, hq, t, hd = q.shape
    _check_cache_call("attention kernel", q.dtype, hd, hq, k_cache, v_cache, slots, bsz, t, query_pos)
    kv16 = _kv16(k_cache, v_cache)
    if q.stride(3) != 1:
        q = q.contiguous()
    slots, query_pos = _dense(slots, torch.int64), _dense(query_pos, torch.int64)
    out = torch.empty(bsz, t, hq, hd, dtype=torch.float32)  # [B, T, Hq, hd]
    n_slots, hkv, l1, _ = k_cache.shape
    rc = library().specdist_attention(
        q.data_ptr(),
        bsz,
        hq,
        t,
        hd,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        kv16,
        hkv,
        n_slots,
        l1,
        slots.data_ptr(),
        query_pos.data_ptr(),
        window,
        scale,
        softcap,
        out.data_ptr(),
    )
    if rc == _BAD_INDEX:
        _refuse_indices("attention kernel", slots, query_pos)
    if rc:
        raise MemoryError("attention kernel: no memory for its scores")
    return out.transpose(1, 2)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last dim, float32, each row on its own."""
    if torch.compiler.is_compiling():
        return torch.ops.specdist.rms_norm(x, weight, eps)
    return _rms_norm(x, weight, eps)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dim() == 0 or weight.shape != (x.shape[-1],):  # the C code reads D weights for rows of D
        raise ValueError(f"rms_norm: weight {tuple(weight.shape)} for rows of {tuple(x.shape[-1:])}")
    x, w = _dense(x, torch.float32), _dense(weight, torch.float32)
    out = torch.empty_like(x)
    library().specdist_rms_norm(x.data_ptr(), x.numel() // x.shape[-1], x.shape[-1], w.data_ptr(), eps, out.data_ptr())
    return out


def rope_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    write_pos: torch.Tensor,
    query_pos: torch.Tensor,
    window: int | None,
    scale: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """One layer's rotary embedding, cache write and :func:`attention`, in one call (the C file's doc).

    ``q`` [B, T, Hq, hd], ``k`` / ``v`` [B, T, Hkv, hd] (views of the fused projection: each token's heads
    contiguous), ``cos`` / ``sin`` [B, T, hd] (rotation over the whole head), ``write_pos`` and ``query_pos``
    [B, T]. Writes the rotated keys and the values into ``k_cache`` / ``v_cache`` [slots, Hkv, L + 1, hd]
    (float32, or float16 rounded to nearest even);
    returns the attention output [B, T, Hq, hd]."""
    if torch.compiler.is_compiling():
        return torch.ops.specdist.rope_attention(
            q, k, v, cos, sin, k_cache, v_cache, slots, write_pos, query_pos, window or 0, scale, softcap or 0.0
        )
    return _rope_attention(
        q, k, v, cos, sin, k_cache, v_cache, slots, write_pos, query_pos, window or 0, scale, softcap or 0.0
    )


def _rope_attention(
    q, k, v, cos, sin, k_cache, v_cache, slots, write_pos, query_pos, window: int, scale: float, softcap: float
) -> torch.Tensor:
    bsz, t, hq, hd = q.shape
    hkv = k.shape[2]
    _check_cache_call("rope_attention kernel", q.dtype, hd, hq, k_cache, v_cache, slots, bsz, t, query_pos, write_pos)
    for name, x in (("k", k), ("v", v)):
        if x.dtype != torch.float32 or x.shape != (bsz, t, k_cache.shape[1], hd):
            raise ValueError(
                f"rope_attention kernel: {name} {tuple(x.shape)} {x.dtype}; the cache wants float32 "
                f"{(bsz, t, k_cache.shape[1], hd)}"
            )
    for name, x in (("cos", cos), ("sin", sin)):
        if x.shape != (bsz, t, hd):
            raise ValueError(f"rope_attention kernel: {name} {tuple(x.shape)} for {(bsz, t, hd)}")
    kv16 = _kv16(k_cache, v_cache)
    views = []
    for x in (q, k, v):  # rows of hd contiguous, heads adjacent: (request, token) strides are free
        if x.stride(3) != 1 or x.stride(2) != hd:
            x = x.contiguous()
        views.append(x)
    q, k, v = views
    cos, sin = _dense(cos, torch.float32), _dense(sin, torch.float32)
    slots, write_pos, query_pos = (_dense(t, torch.int64) for t in (slots, write_pos, query_pos))
    out = torch.empty(bsz, t, hq, hd, dtype=torch.float32)
    rc = library().specdist_rope_attention(
        q.data_ptr(),
        k.data_ptr(),
        v.data_ptr(),
        bsz,
        t,
        hq,
        hkv,
        hd,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        cos.data_ptr(),
        sin.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        kv16,
        k_cache.shape[0],
        k_cache.shape[2],
        slots.data_ptr(),
        write_pos.data_ptr(),
        query_pos.data_ptr(),
        window,
        scale,
        softcap,
        out.data_ptr(),
    )
    if rc == _BAD_INDEX:
        _refuse_indices("rope_attention kernel", slots, query_pos, write_pos)
    if rc:
        raise MemoryError("attention kernel: no memory for its queries")
    return out


class BlockLinear(ctypes.Structure):
    """One matmul of :func:`decoder_layer`: codes and scales packed for a block kind (:func:`block_mm`), or a dense
    weight ``[n, K]`` run by :func:`f32_mm`
    (``LIN_F32``, ``LIN_BF16``, ``LIN_F16``: float32, or the bfloat16 / float16 that holds it exactly).
    ``n = 0``: no matmul (the k and v slots beside a fused q/k/v). A block kind carries its scales' flag
    (:func:`scales_kind`)."""

    _fields_ = [
        ("codes", ctypes.c_void_p),
        ("scales", ctypes.c_void_p),
        ("n", ctypes.c_int64),
        ("kind", ctypes.c_int64),
        ("bias", ctypes.c_void_p),
    ]


# (codes, scales, rows, kind, bias) of one matmul of a layer
Matmul = tuple[torch.Tensor, "torch.Tensor | None", int, int, "torch.Tensor | None"]


class LayerWeights:
    """A Llama-style decoder layer's weights as :func:`decoder_layer` reads them: the two RMS norms' weights
    (float32, contiguous) and eps, and ``(codes, scales, rows, kind, bias)`` of W_qkv, W_o, W_gate_up (gate rows
    first) and W_down (dense kinds: the weight ``[rows, K]`` and None; ``bias``: a float32 ``[rows]`` added
    to every output row, or None). W_qkv may be a list of three, W_q, W_k and W_v, where they do not fuse (their
    kinds differ). It keeps the tensors, so the pointers it hands the C code stay valid.
    ``dense``: some matmul is dense (the runner calls such a layer for up to :data:`F32_MAX_ROWS` rows).
    ``reduce``: on a tensor-parallel rank whose W_o and W_down hold its input columns (no biases in ``linears``),
    ``(sum_over_ranks, o bias, down bias)``: :func:`decoder_layer` sums each projection's partial output over the ranks
    with ``sum_over_ranks`` (in place), adds the bias (or None), then the residual."""

    def __init__(
        self,
        norm1: torch.Tensor,
        norm2: torch.Tensor,
        eps: float,
        linears: list[Matmul | list[Matmul]],
        qk_norms: tuple[torch.Tensor, torch.Tensor, float] | None = None,
        reduce: tuple[Callable[[torch.Tensor], object], torch.Tensor | None, torch.Tensor | None] | None = None,
    ):
        self.reduce = reduce
        self.norm1, self.norm2 = _dense(norm1, torch.float32), _dense(norm2, torch.float32)
        self.eps = float(eps)
        # Qwen3: the per-head RMS norms of queries and keys ([hd] weights each) and their eps, or None
        self.qk_norms = (
            None
            if qk_norms is None
            else (_dense(qk_norms[0], torch.float32), _dense(qk_norms[1], torch.float32), float(qk_norms[2]))
        )
        qkv = linears[0] if isinstance(linears[0], list) else [linears[0]]
        if len(qkv) not in (1, 3):
            raise ValueError(f"decoder_layer: {len(qkv)} q/k/v matmuls (one fused, or three)")
        flat = [
            (c, s, n, k, _dense(b, torch.float32) if b is not None else None)
            for c, s, n, k, b in qkv + list(linears[1:])
        ]
        self.tensors = [t for lin in flat for t in (lin[0], lin[1], lin[4]) if t is not None]
        for t in self.tensors:
            if not t.is_contiguous():
                raise ValueError("decoder_layer: block codes and scales must be contiguous")
        slots = flat[: len(qkv)] + [None] * (3 - len(qkv)) + flat[len(qkv) :]  # q (or qkv), k, v, o, gate_up, down
        self.linears = (BlockLinear * 6)(
            *(
                BlockLinear()
                if lin is None
                # n = 0: no such part
                else BlockLinear(
                    lin[0].data_ptr(),
                    lin[1].data_ptr() if lin[1] is not None else None,
                    lin[2],
                    int(lin[3]) if lin[3] in DENSE_KINDS else scales_kind(int(lin[3]), lin[1], lin[2], _inputs(lin)),
                    lin[4].data_ptr() if lin[4] is not None else None,
                )
                for lin in slots
            )
        )
        self.dense = any(lin[3] in DENSE_KINDS for lin in flat)
        if self.norm1.dim() != 1 or self.norm2.shape != self.norm1.shape:
            raise ValueError(
                f"decoder_layer: norm weights {tuple(self.norm1.shape)} and {tuple(self.norm2.shape)}; both must be [D]"
            )
        self.d = self.norm1.shape[0]
        o, gate_up, down = flat[len(qkv) :]
        # the C code writes o's and down's rows into the residual [M, D] and splits gate_up's in two halves
        if o[2] != self.d or down[2] != self.d or gate_up[2] % 2:
            raise ValueError(
                f"decoder_layer: W_o has {o[2]} rows, W_down {down[2]}, for a residual of {self.d}; "
                f"W_gate_up {gate_up[2]} (gate and up rows: an even number)"
            )
        self.nqkv, self.i = sum(lin[2] for lin in flat[: len(qkv)]), gate_up[2] // 2
        self.attn = _inputs(o)  # W_o's inputs: query heads x head size
        self.split = len(qkv) == 3
        for lin, k in zip(flat, [self.d] * len(qkv) + [self.attn, self.d, self.i]):
            codes, scales, n, kind, bias = lin
            rows = n if kind in DENSE_KINDS else -(-n // 8)
            if codes.shape[0] != rows or _inputs(lin) != k or (kind in DENSE_KINDS) != (scales is None):
                raise ValueError(
                    f"decoder_layer: weights {tuple(codes.shape)} (kind {kind}) do not hold {n} rows of {k} inputs"
                )
            if bias is not None and bias.shape != (n,):
                raise ValueError(f"decoder_layer: a bias of shape {tuple(bias.shape)} for {n} output rows")
        if self.split and qkv[0][2] != self.attn:
            raise ValueError(f"decoder_layer: W_q has {qkv[0][2]} rows for {self.attn} attention outputs")

    def scratch(self, rows: int) -> int:
        """Floats of scratch :func:`decoder_layer` needs for ``rows`` tokens (separate q, k, v: a part's output too)."""
        return rows * (2 * self.d + self.nqkv + self.attn + 3 * self.i + (self.attn if self.split else 0))

    def projection_out(self, rows: int) -> tuple[int, int]:
        """Where in the scratch a part of the layer leaves its projection's output: ``(offset, floats)``."""
        return rows * (self.d + self.nqkv + self.attn), rows * self.d


def _inputs(linear: tuple) -> int:
    """The input width of a ``(codes, scales, rows, kind, bias)`` matmul."""
    codes, kind = linear[0], linear[3]
    return codes.shape[1] if kind in DENSE_KINDS else codes.shape[1] * GROUP


def decoder_layer(
    h: torch.Tensor,
    weights: LayerWeights,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    write_pos: torch.Tensor,
    query_pos: torch.Tensor,
    window: int | None,
    scale: float,
    softcap: float | None = None,
    scratch: torch.Tensor | None = None,
) -> torch.Tensor:
    """One Llama-style decoder layer on blocks in one call (the C file's ``specdist_decoder_layer``): RMS norm,
    the fused q/k/v matmul (then each head's q and k RMS-normed where ``weights.qk_norms``: Qwen3),
    :func:`rope_attention`, the output projection and its residual add, RMS norm,
    the gate/up matmul, ``silu(gate) * up``, the down projection and its residual add. Updates ``h``
    [B, T, D] (contiguous float32) in place and returns it; the cache arguments are :func:`rope_attention`'s
    (the head counts come from the weights and the cache). ``scratch``: at least ``weights.scratch(B * T)``
    floats, reusable across the layers of a forward. With ``weights.reduce`` (a tensor-parallel rank) the layer
    runs in two calls, each projection's partial output summed over the ranks between them: the residual adds
    ``sum + bias``, as the row-parallel linear computes it op by op."""
    bsz, t, d = h.shape
    hd = k_cache.shape[-1]
    hq, hkv = weights.attn // hd, k_cache.shape[1]
    if not h.is_contiguous() or h.dtype != torch.float32 or d != weights.d or weights.nqkv != (hq + 2 * hkv) * hd:
        raise ValueError(f"decoder_layer: h {tuple(h.shape)} {h.dtype} does not fit the layer's weights")
    qn = weights.qk_norms
    if qn is not None and not qn[0].shape == qn[1].shape == (hd,):
        raise ValueError(f"decoder_layer: q/k norms {tuple(qn[0].shape)}, {tuple(qn[1].shape)} for heads of {hd}")
    _check_cache_call("decoder_layer", h.dtype, hd, hq, k_cache, v_cache, slots, bsz, t, query_pos, write_pos)
    for name, x in (("cos", cos), ("sin", sin)):
        if x.shape != (bsz, t, hd):
            raise ValueError(f"decoder_layer: {name} {tuple(x.shape)} for {(bsz, t, hd)}")
    kv16 = _kv16(k_cache, v_cache)
    need = weights.scratch(bsz * t)
    if scratch is None or scratch.numel() < need:
        scratch = torch.empty(need, dtype=torch.float32)
    cos, sin = _dense(cos, torch.float32), _dense(sin, torch.float32)
    slots, write_pos, query_pos = (_dense(x, torch.int64) for x in (slots, write_pos, query_pos))

    def run(part: int) -> None:
        rc = library().specdist_decoder_layer(
            h.data_ptr(),
            bsz,
            t,
            d,
            weights.norm1.data_ptr(),
            weights.norm2.data_ptr(),
            weights.eps,
            qn[0].data_ptr() if qn else None,
            qn[1].data_ptr() if qn else None,
            qn[2] if qn else 0.0,
            weights.linears,
            hq,
            hkv,
            hd,
            cos.data_ptr(),
            sin.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            kv16,
            k_cache.shape[0],
            k_cache.shape[2],
            slots.data_ptr(),
            write_pos.data_ptr(),
            query_pos.data_ptr(),
            window or 0,
            scale,
            softcap or 0.0,
            scratch.data_ptr(),
            part,
        )
        if rc == _BAD_INDEX:
            _refuse_indices("decoder_layer", slots, query_pos, write_pos)
        if rc:
            raise MemoryError("decoder_layer: no memory for its activations")

    if weights.reduce is None:
        run(_LAYER_WHOLE)
        return h
    sum_over_ranks, o_bias, down_bias = weights.reduce
    start, n = weights.projection_out(bsz * t)
    out = scratch[start : start + n].view(bsz, t, d)  # the projection's partial output, [B, T, D]
    for part, bias in ((_LAYER_ATTENTION, o_bias), (_LAYER_MLP, down_bias)):
        run(part)
        sum_over_ranks(out)
        h += out if bias is None else out + bias
    return h


_LAYER_WHOLE, _LAYER_ATTENTION, _LAYER_MLP = abi.LAYER_WHOLE, abi.LAYER_ATTENTION, abi.LAYER_MLP  # the parts of a layer


@torch.library.custom_op("specdist::rms_norm", mutates_args=())
def _rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _rms_norm(x, weight, eps)


@_rms_norm_op.register_fake
def _(x, weight, eps):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("specdist::rope_attention", mutates_args=("k_cache", "v_cache"))
def _rope_attention_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    write_pos: torch.Tensor,
    query_pos: torch.Tensor,
    window: int,
    scale: float,
    softcap: float,
) -> torch.Tensor:
    return _rope_attention(q, k, v, cos, sin, k_cache, v_cache, slots, write_pos, query_pos, window, scale, softcap)


@_rope_attention_op.register_fake
def _(q, k, v, cos, sin, k_cache, v_cache, slots, write_pos, query_pos, window, scale, softcap):
    return q.new_empty(q.shape)


@torch.library.custom_op("specdist::block_mm", mutates_args=())
def _block_mm_op(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, n: int, kind: int) -> torch.Tensor:
    return _block_mm(x, codes, scales, n, kind)


@_block_mm_op.register_fake
def _(x, codes, scales, n, kind):
    return x.new_empty(x.shape[0], n, dtype=torch.float32)


@torch.library.custom_op("specdist::attention", mutates_args=())
def _attention_op(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    query_pos: torch.Tensor,
    window: int,
    scale: float,
    softcap: float,
) -> torch.Tensor:
    return _attention(q, k_cache, v_cache, slots, query_pos, window, scale, softcap).contiguous()


@_attention_op.register_fake
def _(q, k_cache, v_cache, slots, query_pos, window, scale, softcap):
    return q.new_empty(q.shape)
