"""A GGUF file's structure checked before anything else reads it.

gguf's reader, transformers' GGUF loading and :mod:`specdist.models.native` trust the header: a
count or length past the end of the file made a reader loop and allocate without bound, and a
file cut short failed deep inside numpy (``cannot reshape array of size ...``). :func:`check_gguf`
walks the whole header once (magic, version, every metadata value, every tensor's name, shape,
type and offset) with each count and length checked against the bytes left, and each tensor's
data against the file's end, and says in one line what is wrong, naming the file. It allocates
nothing per element beyond the walk itself; metadata arrays longer than ``MAX_ARRAY`` elements
are refused (a tokenizer's vocabulary and merges are a few hundred thousand: every element later
becomes Python objects in transformers' reader).

Bounds by the bytes left are not enough: gguf's reader spends memory and time on each metadata entry and
tensor, so a small file of many one-byte entries costs it seconds and hundreds of MB (docs/performance.md,
"Figures moved from docstrings"). Hence absolute caps, far above what
real files hold (a few dozen entries; about 10 tensors a layer, 30 with unmerged experts): ``MAX_METADATA``
entries, ``MAX_METADATA_BYTES`` of metadata and ``MAX_ARRAY`` array elements in all, ``MAX_TENSORS`` tensors and,
where the header says its architecture's ``block_count``, ``TENSORS_PER_BLOCK`` a block plus ``TENSORS_OUTSIDE``.
Tensors' data ranges must not overlap (a reader would hand out one range as two weights).

The format (https://github.com/ggml-org/ggml/blob/master/docs/gguf.md): ``GGUF``, version (2 or 3),
tensor count and metadata count (uint64), the metadata (key string, value type, value), the
tensor infos (name, dimension count, dimensions, type, offset), then the tensor data from the
next multiple of ``general.alignment`` (default 32). Strings are a uint64 length and the bytes.
"""

from __future__ import annotations

import os

MAX_ARRAY = 1 << 22  # metadata array elements read at most (4,194,304), in one array and in all
MAX_METADATA = 4096  # metadata entries (real files: 20 to 60)
MAX_METADATA_BYTES = 64 << 20  # the metadata's bytes (a 256k-token vocabulary with its merges: about 10 MB)
MAX_TENSORS = 16384  # tensors in a file (a 126-layer model: about 1,200)
TENSORS_PER_BLOCK, TENSORS_OUTSIDE = 64, 64  # tensors a layer (block) and outside the layers, by block_count
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_NESTING = 2  # arrays of arrays at most this deep
_SCALARS = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # value type -> bytes
_STRING, _ARRAY = 8, 9


class GGUFError(ValueError):
    """What is wrong with a GGUF file (the message names what, not the file: the caller adds it)."""


class _Walk:
    def __init__(self, data: memoryview):
        self.data = data
        self.at = 0
        self.elements = 0  # metadata array elements walked so far (MAX_ARRAY in all)

    def left(self) -> int:
        return len(self.data) - self.at

    def take(self, n: int, what: str) -> memoryview:
        if n > self.left():
            raise GGUFError(f"{what} needs {n} bytes at offset {self.at}; the file ends {self.left()} bytes later")
        out = self.data[self.at : self.at + n]
        self.at += n
        return out

    def u32(self, what: str) -> int:
        return int.from_bytes(self.take(4, what), "little")

    def u64(self, what: str) -> int:
        return int.from_bytes(self.take(8, what), "little")

    def string(self, what: str) -> bytes:
        n = self.u64(f"the length of {what}")
        if n > self.left():
            raise GGUFError(f"{what} claims {n} bytes; {self.left()} are left in the file")
        return bytes(self.take(n, what))

    def name(self, what: str) -> str:
        """A string that must be UTF-8 (a metadata key, a tensor's name)."""
        try:
            return self.string(what).decode()
        except UnicodeDecodeError:
            raise GGUFError(f"{what} is not UTF-8") from None

    def value(self, vtype: int, what: str, depth: int = 0) -> object:
        """Walk one value; returns it for scalars and strings (None for arrays: only walked)."""
        if vtype in _SCALARS:
            raw = self.take(_SCALARS[vtype], what)
            return int.from_bytes(raw, "little") if vtype not in (6, 12) else None
        if vtype == _STRING:
            return self.string(what)
        if vtype != _ARRAY:
            raise GGUFError(f"{what} has value type {vtype}, which GGUF does not define")
        itype = self.u32(f"the element type of {what}")
        count = self.u64(f"the length of {what}")
        self.elements += count
        if count > MAX_ARRAY or self.elements > MAX_ARRAY:
            raise GGUFError(
                f"{what} is an array of {count} elements, {self.elements} in all; at most {MAX_ARRAY} are read"
            )
        if itype in _SCALARS:
            self.take(count * _SCALARS[itype], f"the {count} elements of {what}")
            return None
        if itype == _STRING:
            if count * 8 > self.left():  # every string takes at least its 8-byte length
                raise GGUFError(f"{what} claims {count} strings; {self.left()} bytes are left in the file")
            for i in range(count):
                n = self.u64(f"the length of {what}[{i}]")
                self.take(n, f"{what}[{i}]")
            return None
        if itype == _ARRAY and depth < MAX_NESTING:
            if count * 12 > self.left():  # every array takes at least its type and length
                raise GGUFError(f"{what} claims {count} arrays; {self.left()} bytes are left in the file")
            for i in range(count):
                self.value(_ARRAY, f"{what}[{i}]", depth + 1)
            return None
        raise GGUFError(f"{what} holds elements of type {itype}, which this reader does not take")


def check_gguf(path: str) -> None:
    """Raise :class:`GGUFError` saying what is wrong with the GGUF file at ``path``, or return."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    size = os.path.getsize(path)
    with open(path, "rb") as f:
        if size < 24:
            raise GGUFError(f"{size} bytes: shorter than a GGUF header (24)")
        import mmap

        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            data = memoryview(mapped)
            try:
                _check(_Walk(data), size, GGML_QUANT_SIZES, GGMLQuantizationType)
            finally:
                data.release()


def _check(w: _Walk, size: int, quant_sizes: dict, quant_type) -> None:
    if bytes(w.take(4, "the magic")) != b"GGUF":
        raise GGUFError("no GGUF magic at its start")
    version = w.u32("the version")
    if version not in (2, 3):
        raise GGUFError(f"GGUF version {version}; versions 2 and 3 are read")
    n_tensors = w.u64("the tensor count")
    n_kv = w.u64("the metadata count")
    if n_kv > MAX_METADATA:
        raise GGUFError(f"{n_kv} metadata entries claimed; at most {MAX_METADATA} are read")
    if n_kv * 13 > w.left():  # key length (8), type (4), at least one byte of value
        raise GGUFError(f"{n_kv} metadata entries claimed; {w.left()} bytes are left in the file")
    if n_tensors > MAX_TENSORS:  # (checked against the blocks after the metadata)
        raise GGUFError(f"{n_tensors} tensors claimed; at most {MAX_TENSORS} are read")
    alignment = 32
    ints: dict[str, int] = {}  # integer metadata, for the block count
    architecture = None
    for i in range(n_kv):
        name = w.name(f"metadata key {i}")
        vtype = w.u32(f"the type of {name!r}")
        value = w.value(vtype, repr(name))
        if w.at > MAX_METADATA_BYTES:
            raise GGUFError(f"the metadata runs past {MAX_METADATA_BYTES} bytes (at {name!r}); no more is read")
        if name == "general.alignment":
            if not isinstance(value, int) or value <= 0 or value & (value - 1):
                raise GGUFError(f"general.alignment is {value!r}, not a power of two")
            alignment = value
        elif name == "general.architecture" and isinstance(value, bytes):
            architecture = value.decode(errors="replace")
        elif isinstance(value, int):
            ints[name] = value
    blocks = ints.get(f"{architecture}.block_count")
    if blocks is not None and n_tensors > TENSORS_PER_BLOCK * blocks + TENSORS_OUTSIDE:
        raise GGUFError(
            f"{n_tensors} tensors claimed for {blocks} blocks; at most {TENSORS_PER_BLOCK} a block and "
            f"{TENSORS_OUTSIDE} outside them are read"
        )
    if n_tensors * 28 > w.left():  # name length (8), dims count (4), type (4), offset (8), a dimension (4+)
        raise GGUFError(f"{n_tensors} tensors claimed; {w.left()} bytes are left in the file")
    infos = []
    names: set[str] = set()
    for i in range(n_tensors):
        name = w.name(f"the name of tensor {i}")
        if name in names:
            raise GGUFError(f"tensor {name!r} appears twice")
        names.add(name)
        n_dims = w.u32(f"the dimension count of {name!r}")
        if not 1 <= n_dims <= MAX_DIMS:
            raise GGUFError(f"tensor {name!r} has {n_dims} dimensions; GGUF tensors have 1 to {MAX_DIMS}")
        dims = [w.u64(f"dimension {d} of {name!r}") for d in range(n_dims)]
        if 0 in dims:
            raise GGUFError(f"tensor {name!r} has a dimension of 0 ({dims})")
        ttype = w.u32(f"the type of {name!r}")
        offset = w.u64(f"the offset of {name!r}")
        try:
            block, type_bytes = quant_sizes[quant_type(ttype)]
        except (ValueError, KeyError):
            raise GGUFError(f"tensor {name!r} has type {ttype}, which gguf does not know") from None
        elements = 1
        for d in dims:
            elements *= d
        if dims[0] % block:
            raise GGUFError(
                f"tensor {name!r} ({quant_type(ttype).name}): its rows of {dims[0]} values are not whole "
                f"blocks of {block}"
            )
        infos.append((name, offset, elements // block * type_bytes))
    start = -(-w.at // alignment) * alignment
    for name, offset, nbytes in infos:
        if offset % alignment:
            raise GGUFError(f"tensor {name!r} starts at offset {offset}, not a multiple of the alignment {alignment}")
        if start + offset + nbytes > size:
            raise GGUFError(
                f"tensor {name!r} needs bytes {start + offset}..{start + offset + nbytes}; the file "
                f"ends at {size} (cut short?)"
            )
    end, last = 0, None  # the data ranges in file order: each must start at or after the previous one's end
    for name, offset, nbytes in sorted(infos, key=lambda info: info[1]):
        if offset < end:
            raise GGUFError(
                f"tensor {name!r} (data bytes {offset}..{offset + nbytes}) overlaps tensor {last!r} (up to {end})"
            )
        end, last = offset + nbytes, name
