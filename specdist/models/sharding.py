"""Tensor-parallel partition rules and the sharded loader.

Rank ``r`` of ``W`` holds, per decoder layer (gpt-fast / Megatron style):

- ``q_proj`` / ``k_proj`` / ``v_proj`` (column-parallel: a plain ``nn.Linear`` with the rank's
  output rows, bias sliced alike): heads ``[r*H/W, (r+1)*H/W)`` and kv heads likewise. Whole heads
  only (:func:`check_shardable`), so attention and the KV cache (``Hkv/W`` heads per slot) are
  rank-local. Phi-3's fused ``qkv_proj``: the rank's q rows, k rows and v rows, concatenated.
- ``gate_proj`` / ``up_proj`` (column-parallel): the rank's chunk of the intermediate dim
  (``torch.tensor_split`` chunks: may be uneven). Phi-3's fused ``gate_up_proj``: its gate rows,
  then its up rows.
- ``o_proj`` / ``down_proj`` (row-parallel, :class:`RowParallelLinear`): the matching input
  columns; the partial products are summed over the group (:func:`sum_over_ranks`, once each), the bias
  added once after the sum.
- Mixture-of-experts ``experts`` (3D ``gate_up_proj [E, 2I, D]`` / ``down_proj [E, D, I]``): every
  expert's intermediate dim is split like a dense MLP's; the experts' output is summed over the group once
  (a forward hook). The router is replicated, so every rank routes every token alike.
- ``lm_head`` (vocab-parallel, :class:`VocabParallelLMHead`): the rank's vocabulary rows; the local
  logits are gathered to rank 0 of the group only (rank 0 returns ``[..., V]``, the others their
  own ``[..., V_r]``, which they discard). Tied to ``embed_tokens``: the embedding is replicated
  and the head is a view of the rank's rows of it (no second copy).

Replicated: embeddings, norms (incl. q/k norms), routers, rotary tables.

Sharded loading (:func:`load_sharded`): the model is built from its config with every parameter
on the meta device (buffers such as rotary ``inv_freq`` are computed by the model's own
constructor), the sharded modules are replaced by their local-shape versions (still meta), then
each parameter is materialised on the target device holding only its slice. A safetensors
checkpoint is read with positional reads of exactly the rank's byte ranges (a column slice of a
row-major matrix read through ``mmap`` would fault in every page of it). Checkpoints whose keys do
not map 1:1 onto the parameters (GGUF, converted MoE experts) are loaded whole by transformers on
the host and sliced in memory by the same rules.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from specdist.models.dtypes import TORCH_DTYPES, resolve_dtype
from specdist.models.families import check_supported
from specdist.models.kernels.cpu_kernels import GROUP
from specdist.models.loader import (
    ModelSource,
    declared_model_type,
    format_bytes,
    gguf_parsed_once,
    load_model,
    progress_reporter,
    quiet_transformers,
)

COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # nn.Linear: the rank's output rows
ROW = ("o_proj", "down_proj")  # nn.Linear: the rank's input columns, all-reduced output


def check_shardable(config, world_size: int) -> None:
    """Raise ValueError unless the attention and KV head counts split evenly over ``world_size`` ranks."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    n_heads = int(config.num_attention_heads)
    n_kv = int(getattr(config, "num_key_value_heads", None) or n_heads)
    for field, value in (("num_attention_heads", n_heads), ("num_key_value_heads", n_kv)):
        if value % world_size:
            raise ValueError(
                f"cannot shard over {world_size} ranks: config.{field} = {value} is not divisible by {world_size}"
            )


def chunk_range(n: int, world_size: int, rank: int) -> tuple[int, int]:
    """[start, stop) of chunk ``rank`` when ``n`` items are cut as ``torch.tensor_split(n, world_size)``."""
    q, extra = divmod(n, world_size)
    start = rank * q + min(rank, extra)
    return start, start + q + (rank < extra)


@dataclass(frozen=True)
class Cut:
    """How one parameter is split: along ``dim``, each of the consecutive blocks of sizes ``parts``
    (they sum to the full extent) is cut into ``world_size`` chunks; a rank holds its chunk of every
    block, concatenated in order (a fused q/k/v weight: its q rows, then its k rows, then its v rows)."""

    dim: int
    parts: tuple[int, ...]

    def ranges(self, rank: int, world_size: int) -> list[tuple[int, int]]:
        """The rank's [start, stop) along ``dim`` in the full tensor, one per block."""
        out, base = [], 0
        for n in self.parts:
            a, b = chunk_range(n, world_size, rank)
            out.append((base + a, base + b))
            base += n
        return out

    def local_size(self, rank: int, world_size: int) -> int:
        return sum(b - a for a, b in self.ranges(rank, world_size))

    def take(self, full: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
        """The rank's part of a full tensor (a new contiguous tensor, not a view)."""
        if full.shape[self.dim] != sum(self.parts):
            raise ValueError(f"size {full.shape[self.dim]} along dim {self.dim} is not {sum(self.parts)}")
        return torch.cat([full.narrow(self.dim, a, b - a) for a, b in self.ranges(rank, world_size)], self.dim)


# ---------------------------------------------------------------- sharded modules
def sum_over_ranks(t: torch.Tensor, group=None) -> torch.Tensor:
    """``t`` summed over the group's ranks, in place, the ranks' parts added in rank order
    (``((t_0 + t_1) + t_2) + ...``) on every rank: each element's sum depends only on that element's parts. An
    all-reduce's ring cuts the buffer into chunks by its size and reduces each chunk from a different rank, so with
    three ranks or more an element's additions would be ordered by where it falls in the buffer, and a row's output
    would depend on the rows batched with it (two ranks do not: their sum commutes)."""
    world = dist.get_world_size(group)
    if world == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(parts, t.contiguous(), group=group)  # parts[r]: rank r's, in group rank order
    total = parts[0]
    for p in parts[1:]:
        total += p
    return t.copy_(total)


class RowParallelLinear(nn.Module):
    """``y = sum over ranks (x_r @ W_r.T) + b``: the rank's input columns, then :func:`sum_over_ranks`. ``blocks``: the
    rank's columns as GGUF blocks (:func:`shard_native_blocks`; ``weight`` is then None), or None."""

    def __init__(self, in_local: int, out_features: int, bias: bool, group=None, device=None, dtype=None):
        super().__init__()
        self.in_features, self.out_features, self.group = in_local, out_features, group
        self.weight = nn.Parameter(torch.empty(out_features, in_local, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype)) if bias else None
        self.blocks: nn.Module | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in_local] -> [..., out]
        y = F.linear(x, self.weight) if self.blocks is None else self.blocks(x)
        sum_over_ranks(y, self.group)
        return y if self.bias is None else y + self.bias


class VocabParallelLMHead(nn.Module):
    """The rank's vocabulary rows. Rank 0 of the group returns the full ``[..., V]`` logits
    (gathered from every rank); the others return their local ``[..., V_r]``. ``blocks``: the rank's rows as
    GGUF blocks, bias included (:func:`shard_native_blocks`; ``weight`` is then None), or None."""

    def __init__(
        self, hidden_size: int, vocab_sizes: list[int], rank: int, bias: bool, group=None, device=None, dtype=None
    ):
        super().__init__()
        self.vocab_sizes, self.rank, self.group = list(vocab_sizes), rank, group
        self.in_features, self.out_features = hidden_size, vocab_sizes[rank]
        self.weight = nn.Parameter(torch.empty(vocab_sizes[rank], hidden_size, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(vocab_sizes[rank], device=device, dtype=dtype)) if bias else None
        self.blocks: nn.Module | None = None

    def forward(self, h: torch.Tensor) -> torch.Tensor:  # [..., D] -> [..., V] on rank 0, [..., V_r] elsewhere
        local = F.linear(h, self.weight, self.bias) if self.blocks is None else self.blocks(h)  # [..., V_r]
        width = max(self.vocab_sizes)
        padded = F.pad(local, (0, width - local.shape[-1])).contiguous()  # gather needs equal shapes
        dst = 0 if self.group is None else dist.get_global_rank(self.group, 0)
        if self.rank != 0:
            dist.gather(padded, None, dst=dst, group=self.group)
            return local
        parts = [torch.empty_like(padded) for _ in self.vocab_sizes]
        dist.gather(padded, parts, dst=dst, group=self.group)
        return torch.cat([p[..., :n] for p, n in zip(parts, self.vocab_sizes)], -1)  # [..., V]


def _sum_output_over_ranks(group):
    def hook(module, args, output):  # the experts' partial sums over the rank's intermediate chunk
        return sum_over_ranks(output, group)

    return hook


# ---------------------------------------------------------------- the partition
@contextmanager
def meta_parameters() -> Iterator[None]:
    """Modules built inside get their parameters on the meta device; buffers stay real (the model's
    constructor computes them: rotary ``inv_freq``, Gemma's ``embed_scale``). The switch is
    process-wide while it lasts: build one skeleton at a time."""
    register = nn.Module.register_parameter

    def register_meta(module, name, param):
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = register_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def build_skeleton(config, dtype: torch.dtype) -> nn.Module:
    """The causal LM for ``config`` with meta parameters (no weight memory) and real buffers."""
    quiet_transformers()
    from transformers import AutoModelForCausalLM

    with meta_parameters():
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


def _meta_linear(old: nn.Linear, out_features: int) -> nn.Linear:
    return nn.Linear(old.in_features, out_features, bias=old.bias is not None, device="meta", dtype=old.weight.dtype)


def _head_counts(model: nn.Module, attn: nn.Module) -> tuple[int, int, int]:
    cfg = model.config.get_text_config()
    n_heads = int(cfg.num_attention_heads)
    return n_heads, int(getattr(cfg, "num_key_value_heads", None) or n_heads), int(attn.head_dim)


def partition(model: nn.Module, rank: int, world_size: int, group=None) -> dict[str, Cut]:
    """Replace the sharded modules of a meta-parameter model by their rank-local versions (still
    meta); returns the :class:`Cut` of every sharded parameter by name (the others are replicated).

    Only the decoder layers and the output head are touched.
    """
    check_shardable(model.config, world_size)
    names = {id(m): n for n, m in model.named_modules()}
    cuts: dict[str, Cut] = {}

    def cut_linear(parent, child: str, cut: Cut, new: nn.Module) -> None:
        prefix = f"{names[id(parent)]}.{child}"
        cuts[f"{prefix}.weight"] = cut
        if getattr(parent, child).bias is not None and cut.dim == 0:  # row-parallel: whole, added after the sum
            cuts[f"{prefix}.bias"] = Cut(0, cut.parts)
        setattr(parent, child, new)

    for layer in model.get_decoder().layers:
        for parent in list(layer.modules()):
            for child, mod in list(parent.named_children()):
                if type(mod) is nn.Linear and child in COLUMN:
                    cut = Cut(0, (mod.out_features,))
                    cut_linear(parent, child, cut, _meta_linear(mod, cut.local_size(rank, world_size)))
                elif type(mod) is nn.Linear and child == "qkv_proj":  # Phi-3: [q; k; v] rows
                    n_heads, n_kv, hd = _head_counts(model, parent)
                    cut = Cut(0, (n_heads * hd, n_kv * hd, n_kv * hd))
                    if sum(cut.parts) != mod.out_features:
                        raise ValueError(f"{names[id(mod)]}: {mod.out_features} rows, not q + k + v = {sum(cut.parts)}")
                    cut_linear(parent, child, cut, _meta_linear(mod, cut.local_size(rank, world_size)))
                elif type(mod) is nn.Linear and child == "gate_up_proj":  # Phi-3: [gate; up] rows
                    cut = Cut(0, (mod.out_features // 2, mod.out_features // 2))
                    cut_linear(parent, child, cut, _meta_linear(mod, cut.local_size(rank, world_size)))
                elif type(mod) is nn.Linear and child in ROW:
                    cut = Cut(1, (mod.in_features,))
                    new = RowParallelLinear(
                        cut.local_size(rank, world_size),
                        mod.out_features,
                        mod.bias is not None,
                        group,
                        device="meta",
                        dtype=mod.weight.dtype,
                    )
                    cut_linear(parent, child, cut, new)
                elif child == "experts" and isinstance(getattr(mod, "gate_up_proj", None), nn.Parameter):
                    _partition_experts(mod, names[id(mod)], rank, world_size, group, cuts)

    head = model.get_output_embeddings()
    embed = model.get_input_embeddings()
    vocab = int(head.weight.shape[0])
    sizes = [b - a for a, b in (chunk_range(vocab, world_size, r) for r in range(world_size))]
    head_name = names[id(head)]
    new_head = VocabParallelLMHead(
        head.in_features, sizes, rank, head.bias is not None, group, device="meta", dtype=head.weight.dtype
    )
    new_head.tied_to = names[id(embed)] + ".weight" if head.weight is embed.weight else None
    model.set_output_embeddings(new_head)
    cuts[f"{head_name}.weight"] = Cut(0, (vocab,))
    if head.bias is not None:
        cuts[f"{head_name}.bias"] = Cut(0, (vocab,))
    return cuts


def _partition_experts(experts: nn.Module, name: str, rank: int, world_size: int, group, cuts: dict) -> None:
    """3D expert weights ``gate_up_proj [E, 2I, D]`` (gate rows, then up rows) and ``down_proj [E, D, I]``."""
    if (
        getattr(experts, "is_transposed", False)
        or not getattr(experts, "is_concatenated", True)
        or getattr(experts, "has_bias", False)
    ):
        raise ValueError(f"{name}: only concatenated, untransposed, bias-free expert weights can be sharded")
    gate_up, down = experts.gate_up_proj, experts.down_proj
    inter = gate_up.shape[1] // 2
    if gate_up.dim() != 3 or down.dim() != 3 or down.shape[2] != inter or gate_up.shape[1] != 2 * inter:
        raise ValueError(
            f"{name}: expert shapes {tuple(gate_up.shape)} / {tuple(down.shape)} are not [E, 2I, D] / [E, D, I]"
        )
    gu_cut, down_cut = Cut(1, (inter, inter)), Cut(2, (inter,))
    local = chunk_range(inter, world_size, rank)
    n_local = local[1] - local[0]
    e, d = gate_up.shape[0], gate_up.shape[2]
    experts.gate_up_proj = nn.Parameter(torch.empty(e, 2 * n_local, d, device="meta", dtype=gate_up.dtype))
    experts.down_proj = nn.Parameter(torch.empty(e, d, n_local, device="meta", dtype=down.dtype))
    if hasattr(experts, "intermediate_dim"):
        experts.intermediate_dim = n_local
    experts.register_forward_hook(_sum_output_over_ranks(group))
    cuts[f"{name}.gate_up_proj"], cuts[f"{name}.down_proj"] = gu_cut, down_cut


# ---------------------------------------------------------------- tensor sources
_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
_SAFETENSORS_INDEX = "model.safetensors.index.json"
_SAFETENSORS_FILE = "model.safetensors"


@dataclass(frozen=True)
class _Entry:
    path: str
    dtype: torch.dtype | None  # None: a dtype this reader does not know
    shape: tuple[int, ...]
    offset: int  # file offset of the tensor's first byte
    nbytes: int


def _read_header(path: str) -> dict[str, _Entry]:
    """A safetensors file's tensors: 8-byte little-endian header length, JSON header, raw data."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    base = 8 + n
    return {
        name: _Entry(
            path,
            _SAFETENSORS_DTYPES.get(v["dtype"]),
            tuple(v["shape"]),
            base + v["data_offsets"][0],
            v["data_offsets"][1] - v["data_offsets"][0],
        )
        for name, v in header.items()
        if name != "__metadata__"
    }


def _byte_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, writable in place."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


class SafetensorsFiles:
    """A safetensors checkpoint (``model.safetensors``, or the shards named by its index), read with
    positional reads of exactly the requested byte ranges: only those bytes enter the process."""

    def __init__(self, directory: str):
        index = os.path.join(directory, _SAFETENSORS_INDEX)
        if os.path.isfile(index):
            with open(index) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        else:
            files = [_SAFETENSORS_FILE]
        self.entries: dict[str, _Entry] = {}
        for name in files:
            self.entries.update(_read_header(os.path.join(directory, name)))
        self.bytes_total = sum(e.nbytes for e in self.entries.values())
        self.bytes_read = 0
        self._fds: dict[str, int] = {}

    @staticmethod
    def find(directory: str) -> SafetensorsFiles | None:
        """The checkpoint in ``directory``, or None when it has no safetensors weights."""
        if any(os.path.isfile(os.path.join(directory, f)) for f in (_SAFETENSORS_INDEX, _SAFETENSORS_FILE)):
            return SafetensorsFiles(directory)
        return None

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def mismatches(self, model: nn.Module) -> list[str]:
        """The parameters of ``model`` (a meta skeleton) that have no tensor of their shape on disk."""
        out = []
        for name, p in model.named_parameters():  # a tied head shares the embedding's entry
            e = self.entries.get(name)
            if e is None or e.dtype is None or e.shape != tuple(p.shape):
                out.append(name)
        return out

    def read(self, name: str, cut: Cut | None, rank: int, world_size: int) -> torch.Tensor:
        """The rank's part of tensor ``name`` (all of it when ``cut`` is None), on the CPU in the file's dtype."""
        e = self.entries[name]
        fd = self._fds.get(e.path)
        if fd is None:
            fd = self._fds[e.path] = os.open(e.path, os.O_RDONLY)
        if cut is None:
            out = torch.empty(e.shape, dtype=e.dtype)
            self._pread(fd, _byte_view(out), e.offset)
            return out
        shape, dim = e.shape, cut.dim
        if shape[dim] != sum(cut.parts):
            raise ValueError(
                f"{name}: size {shape[dim]} along dim {dim} on disk, the partition expects {sum(cut.parts)}"
            )
        ranges = cut.ranges(rank, world_size)
        local = sum(b - a for a, b in ranges)
        out = torch.empty(shape[:dim] + (local,) + shape[dim + 1 :], dtype=e.dtype)
        buf = _byte_view(out)
        outer, extent = math.prod(shape[:dim]), shape[dim]
        row = math.prod(shape[dim + 1 :]) * out.element_size()  # bytes of one index along dim
        pos = 0
        for o in range(outer):  # the tensor as [outer, extent, inner]: one read per (outer index, block)
            for a, b in ranges:
                n = (b - a) * row
                self._pread(fd, buf[pos : pos + n], e.offset + (o * extent + a) * row)
                pos += n
        return out

    def _pread(self, fd: int, view: memoryview, offset: int) -> None:
        while len(view):
            n = os.preadv(fd, [view], offset)
            if n == 0:
                raise EOFError(f"safetensors file ends before byte {offset}")
            view, offset = view[n:], offset + n
            self.bytes_read += n

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


class InMemoryTensors:
    """Full tensors already in memory (a model loaded whole), sliced by the same cuts."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def read(self, name: str, cut: Cut | None, rank: int, world_size: int) -> torch.Tensor:
        full = self.tensors[name]
        return full.clone() if cut is None else cut.take(full, rank, world_size)


def materialise(
    model: nn.Module, cuts: dict[str, Cut], source, rank: int, world_size: int, device: torch.device | str
) -> None:
    """Give every meta parameter of a partitioned model the rank's part of its tensor from ``source``
    (read on the CPU, then moved to ``device`` in the parameter's dtype); move the buffers to ``device``.
    Persistent buffers found in ``source`` are read from it (replicated)."""
    head = model.get_output_embeddings()
    tied = getattr(head, "tied_to", None)
    done: dict[int, nn.Parameter] = {}  # a parameter registered in two modules is read once
    # torch.nn.Module has no public way to swap a registered tensor in place (None entries and buffer
    # persistence kept): the module's own _parameters / _buffers dicts are used directly
    for mod_name, module in model.named_modules():
        prefix = f"{mod_name}." if mod_name else ""
        for pname, p in list(module._parameters.items()):  # noqa: SLF001 - torch's nn.Module internals
            if p is None or (module is head and pname == "weight" and tied):
                continue
            if id(p) not in done:
                name = prefix + pname
                t = source.read(name, cuts.get(name), rank, world_size)
                if tuple(t.shape) != tuple(p.shape):
                    raise ValueError(f"{name}: the checkpoint gives {tuple(t.shape)}, the model wants {tuple(p.shape)}")
                done[id(p)] = nn.Parameter(t.to(device=device, dtype=p.dtype), requires_grad=False)
            module._parameters[pname] = done[id(p)]  # noqa: SLF001 - torch's nn.Module internals
        for bname, b in list(module._buffers.items()):  # noqa: SLF001 - torch's nn.Module internals
            if b is None:
                continue
            if bname not in module._non_persistent_buffers_set and prefix + bname in source:  # noqa: SLF001 - as above
                b = source.read(prefix + bname, None, rank, world_size).to(b.dtype)
            module._buffers[bname] = b.to(device)  # noqa: SLF001 - torch's nn.Module internals
    if tied:
        embed = model.get_input_embeddings().weight  # [V, D], replicated
        a, b = chunk_range(embed.shape[0], world_size, rank)
        head.weight = nn.Parameter(embed.detach()[a:b], requires_grad=False)  # a view of the rank's rows


# ---------------------------------------------------------------- GGUF blocks, sharded
def take_blocks(
    cut: Cut, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, repeat: int, rank: int, world_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The rank's part of a linear's int4 groups (:func:`specdist.models.native.decode_blocks`: ``codes [N, r K]``,
    ``scales`` and ``zeros [N, r K / 32]``) by the weight's cut: its rows, or its input columns in each of the
    ``r`` input copies. None where a column cut splits a block of 32 (the float weight then stays)."""
    if cut.dim == 0:
        return cut.take(codes, rank, world_size), cut.take(scales, rank, world_size), cut.take(zeros, rank, world_size)
    k = codes.shape[1] // repeat
    ranges = cut.ranges(rank, world_size)
    if sum(cut.parts) != k or any(a % GROUP or b % GROUP for a, b in ranges):
        return None
    cols = torch.cat([torch.arange(s * k + a, s * k + b) for s in range(repeat) for a, b in ranges])
    groups = cols[::GROUP] // GROUP  # each block's first column: its (scale, zero) index
    return codes[:, cols], scales[:, groups], zeros[:, groups]


def take_super_scales(
    cut: Cut, factors: torch.Tensor, ints: torch.Tensor, rank: int, world_size: int
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The rank's part of a K-quant's super-block scales (:func:`specdist.models.native.super_scales`: ``factors
    [N, K / 256, F]``, ``ints [N, K / 32, P]``) by the weight's cut, as :func:`take_blocks` takes its blocks. None where
    a
    column cut splits a super-block of 256 (the float32 block scales then serve)."""
    if cut.dim == 0:
        return cut.take(factors, rank, world_size), cut.take(ints, rank, world_size)
    ranges = cut.ranges(rank, world_size)
    if any(a % 256 or b % 256 for a, b in ranges):
        return None
    supers = torch.cat([torch.arange(a // 256, b // 256) for a, b in ranges])
    blocks = torch.cat([torch.arange(a // GROUP, b // GROUP) for a, b in ranges])
    return factors[:, supers], ints[:, blocks]


@torch.no_grad()
def shard_native_blocks(
    model: nn.Module, gguf_path: str, cuts: dict[str, Cut], rank: int, world_size: int, key: str = "target.weights"
) -> dict[str, int]:
    """Run a partitioned GGUF model's block-quantized linears on the rank's part of the file's own blocks (in
    place): column-parallel projections and the vocabulary-parallel head keep their rows' blocks, row-parallel
    ones their input columns' (whole blocks of 32; the partial sums are all-reduced as before). Each part is checked
    against the float slice the rank loaded. Returns how many linears run natively per GGUF type; a linear whose
    part the int4 kernels cannot take (rows not a multiple of 16, a block split) keeps its float slice."""
    from specdist.errors import ConfigError
    from specdist.models.native import install, native_tensors, reproduces
    from specdist.models.quant import INT4_ROWS, Int4GroupLinear

    device = next(model.parameters()).device
    sharded = (nn.Linear, RowParallelLinear, VocabParallelLMHead)
    replaced: dict[str, int] = {}
    for t in native_tensors(model, gguf_path, device, lambda name, m: type(m) in sharded and f"{name}.weight" in cuts):
        target = t.module
        part = take_blocks(cuts[f"{t.owner}.weight"], t.codes, t.scales, t.zeros, t.repeat, rank, world_size)
        if part is None or part[0].shape[0] % INT4_ROWS:
            continue
        if not reproduces(*part, t.repeat, target.weight.detach().cpu()):
            raise ConfigError(
                key,
                f"{gguf_path}: {t.name} ({t.kind}): rank {rank}'s blocks do not reproduce its slice of the "
                f"weight for {t.owner}; load it with weights: float",
            )
        bias = None if type(target) is RowParallelLinear else target.bias  # row-parallel: added after the sum
        sup = None if t.super is None else take_super_scales(cuts[f"{t.owner}.weight"], *t.super, rank, world_size)
        blocks = Int4GroupLinear(*(x.to(device) for x in part), bias, t.repeat, sup)
        if type(target) is nn.Linear:
            install(model, t.owner, blocks)
        else:
            target.blocks, target.weight = blocks, None
        replaced[t.kind] = replaced.get(t.kind, 0) + 1
    return replaced


# ---------------------------------------------------------------- the loader
@dataclass(frozen=True)
class LoadReport:
    rank: int
    world_size: int
    bytes_read: int  # weight bytes that entered this process
    bytes_total: int  # weight bytes of the whole checkpoint
    seconds: float
    sharded: bool  # False: the full checkpoint was loaded, then sliced in memory


def load_sharded(
    source: ModelSource,
    dtype: str,
    device: torch.device | str,
    rank: int,
    world_size: int,
    group=None,
    progress: Callable[[str], None] | None = None,
    weights: str = "float",
) -> nn.Module:
    """Rank ``rank``'s shard of the model in ``dtype`` (``auto`` resolved for ``device``), in eval mode, on
    ``device``; ``world_size == 1``: :func:`load_model`. ``weights`` (``target.weights``): native or auto run a
    GGUF file's block-quantized linears on the rank's part of their blocks (:func:`shard_native_blocks`).

    Safetensors checkpoints whose keys are the model's parameter names are read slice by slice
    (replicated tensors whole, once); anything else (GGUF, keys transformers converts on load) is
    loaded whole on the host by transformers, then sliced. The architecture and the head counts
    (against ``world_size``) are checked before any weight is read (a GGUF's head counts right
    after: its config is parsed with its weights). The model carries a :class:`LoadReport` as
    ``load_report``; ``progress`` (default: the ``specdist.load`` logger) gets a line before and after.
    """
    with gguf_parsed_once():  # a GGUF file's config, weights and native blocks: one parse of its header
        return _load_sharded(source, dtype, device, rank, world_size, group, progress, weights)


def _load_sharded(
    source: ModelSource,
    dtype: str,
    device: torch.device | str,
    rank: int,
    world_size: int,
    group,
    progress: Callable[[str], None] | None,
    weights: str,
) -> nn.Module:
    if world_size == 1:
        return load_model(source, dtype, device, progress, weights)
    # an architecture the runner cannot serve is refused before any weight is read, as by load_model
    check_supported(declared_model_type(source), source.key or "target.model")
    dtype = resolve_dtype(dtype, device)
    report = progress_reporter(progress)
    quiet_transformers()
    from transformers import AutoConfig, GenerationConfig

    size, fmt = source.checkpoint_bytes()
    who = f"rank {rank} of {world_size}"
    t0 = time.perf_counter()
    files = model = None
    if not source.gguf_file:  # a GGUF's config comes with its weights (its header alone parses as slowly)
        config = AutoConfig.from_pretrained(source.directory, local_files_only=True)
        check_shardable(config, world_size)
        model = build_skeleton(config, TORCH_DTYPES[dtype])
        files = SafetensorsFiles.find(source.directory)
    if files is not None and not files.mismatches(model):
        report(
            f"loading {source.role} {source.short_name} ({format_bytes(size)} {fmt}, {dtype}): "
            f"{who} reads its shards ..."
        )
        cuts = partition(model, rank, world_size, group)
        try:
            materialise(model, cuts, files, rank, world_size, device)
        finally:
            files.close()
        read, total, how = files.bytes_read, files.bytes_total, "sharded"
        if os.path.isfile(os.path.join(source.directory, "generation_config.json")):
            model.generation_config = GenerationConfig.from_pretrained(source.directory, local_files_only=True)
    else:
        report(
            f"{source.role} {source.short_name}: the {fmt} weights do not map 1:1 onto the model's parameters; "
            f"{who} loads the full checkpoint on the host, then keeps its slices "
            "(this path holds the full checkpoint once)"
        )
        full = load_model(source, dtype, "cpu", progress)
        check_shardable(full.config, world_size)
        model = build_skeleton(full.config, TORCH_DTYPES[dtype])
        cuts = partition(model, rank, world_size, group)
        materialise(model, cuts, InMemoryTensors(full.state_dict()), rank, world_size, device)
        model.generation_config = full.generation_config
        del full
        if source.gguf_file and weights in ("native", "auto"):
            with gguf_parsed_once():
                native = shard_native_blocks(model, source.gguf_path, cuts, rank, world_size)
            if not native and weights == "native":
                from specdist.errors import ConfigError

                raise ConfigError(
                    "target.weights",
                    f"{source.gguf_path}: no linear runs natively on rank {rank} of "
                    f"{world_size}; load it with weights: auto or float",
                )
            report(
                f"{who}: native GGUF blocks: "
                + (", ".join(f"{n} {k}" for k, n in sorted(native.items())) or "none (every part keeps its floats)")
            )
        read = total = size
        how = "full checkpoint, sliced in memory"
    model.eval()
    seconds = time.perf_counter() - t0
    model.load_report = LoadReport(rank, world_size, read, total, seconds, how == "sharded")
    report(f"{who} read {format_bytes(read)} of {format_bytes(total)} ({how}) in {seconds:.1f} s")
    return model


def load_input_embedding(directory: str, dtype: torch.dtype, device) -> nn.Embedding | None:
    """A safetensors checkpoint's input embedding alone (the one tensor named ``*embed_tokens.weight``;
    only its bytes are read), as an ``nn.Embedding`` in ``dtype`` on ``device``; None when the
    directory has no safetensors weights or no such tensor (the caller loads the model instead).
    What an EAGLE-3 head without its own embedding needs of its target on a draft worker."""
    files = SafetensorsFiles.find(directory)
    if files is None:
        return None
    try:
        names = [n for n in files.entries if n.endswith("embed_tokens.weight") and files.entries[n].dtype is not None]
        if len(names) != 1:
            return None
        weight = files.read(names[0], None, 0, 1)  # [V, D]
    finally:
        files.close()
    return nn.Embedding.from_pretrained(weight.to(device=device, dtype=dtype), freeze=True)
