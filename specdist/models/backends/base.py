"""The attention backend interface and its registry (see the package doc)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from specdist.errors import ConfigError

_REGISTRY: dict[str, type["AttentionBackend"]] = {}


def register(cls: type["AttentionBackend"]) -> type["AttentionBackend"]:
    """Class decorator: the backend under its ``name``."""
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise ValueError(f"attention backend {cls.name!r} registered twice")
    _REGISTRY[cls.name] = cls
    return cls


def backend_names() -> list[str]:
    return sorted(_REGISTRY)


def backend_class(name: str) -> type["AttentionBackend"]:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ConfigError(
            "engine.attention_backend", f"no attention backend {name!r}; there are {', '.join(backend_names())}"
        ) from None


def choose_backend(kv_kind: str, device: torch.device, dtype: torch.dtype) -> type["AttentionBackend"]:
    """The backend a runner on ``device`` in ``dtype`` takes for ``engine.kv_cache`` ``kv_kind`` (auto | slots |
    paged): paged blocks on CUDA (Triton's kernels where Triton runs), a slot a request elsewhere (the C kernels
    where they run, else SDPA); ``paged`` off CUDA is torch's reference of the paged kernels."""
    paged = kv_kind == "paged" or (kv_kind == "auto" and device.type == "cuda")
    order = ("paged", "paged-torch") if paged else ("cpu", "sdpa")
    for name in order:
        if _REGISTRY[name].unavailable(device, dtype) is None:
            return _REGISTRY[name]
    raise AssertionError(f"no backend of {order} runs on {device}")  # the last of each runs everywhere


class AttentionBackend(ABC):
    """One attention implementation over one KV cache. ``windows``: each layer's sliding window (None: full);
    ``softcap``: the attention scores' tanh cap (Gemma 2) or None; ``rope``: each layer's (cos, sin) tables
    [max_len + 1, rd] (rd <= head_dim: partial rotary passes the rest), shared between layers of one type."""

    name: ClassVar[str]
    kv_layout: ClassVar[str]  # "slots": SlotKVCache; "paged": PagedKVCache

    def __init__(
        self,
        cache,
        scaling: float,
        windows: list[int | None],
        softcap: float | None,
        rope: list[tuple[torch.Tensor, torch.Tensor]],
    ):
        self.cache, self.scaling, self.windows, self.softcap, self.rope = cache, scaling, windows, softcap, rope
        # each layer's table as the index of the first layer with the same one (steps compute each table once)
        first = {}
        self.rope_index = [first.setdefault(id(cos), i) for i, (cos, _) in enumerate(rope)]
        self.mask_windows = list(dict.fromkeys(windows))  # a padded (static) pass builds one mask per window
        self.mask_of_layer = [self.mask_windows.index(w) for w in windows]

    def rope_at(self, step, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [B, T, rd] of layer i at the step's write positions (slot steps)."""
        return step.rope(self.rope_index[i], self.rope[i])

    @classmethod
    def unavailable(cls, device: torch.device, dtype: torch.dtype) -> str | None:
        """None when the backend runs on ``device`` for a model in ``dtype``, else why not (one line)."""
        return None

    @classmethod
    @abstractmethod
    def make_cache(
        cls,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        head_dim: int,
        max_len: int,
        dtype: torch.dtype,
        device: torch.device,
        num_blocks: int | None = None,
        block_size: int = 16,
    ):
        """The KV cache this backend reads (``num_blocks`` and ``block_size``: the paged layout's)."""

    @abstractmethod
    def plan(
        self,
        slots: list[int],
        tokens: list[list[int]],
        starts: list[int],
        num_logits: list[int],
        bsz: int,
        t_pad: int,
        extra=None,
    ):
        """Once a step: the metadata of ``B = bsz`` requests (those past ``len(slots)`` are padding) of ``T = t_pad``
        token rows each, on the device; at least ``.ids`` [B, T], ``.bsz``, ``.tokens`` and ``.extra`` (the
        caller's int32 words ``extra`` [W] on the device, or None)."""

    @abstractmethod
    def forward(self, i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step) -> torch.Tensor:
        """Layer ``i``: q [N, Hq, hd], k, v [N, Hkv, hd] (N = B * T rows, before the rotary; views of the fused
        projection are fine) -> the attention output [N, Hq, hd]; the rotated k and v go into the cache."""


@dataclass
class SlotStep:
    """One step's metadata for the slot cache's backends: request b's token t is row ``b * T + t``."""

    bsz: int  # B
    tokens: int  # T
    ids: torch.Tensor  # [B, T] int64 token ids (padded: 0), on the device
    slots: torch.Tensor  # [B] int64: each request's slot
    write_pos: torch.Tensor  # [B, T] int64: each token's position (padded: the scratch column)
    query_pos: torch.Tensor  # [B, T] int64: each query's position (padded: its request's last)
    slot_ids: list[int] | None = None  # the same slots on the host (None in a padded pass: keys by masks)
    starts: list[int] | None = None  # tokens each request held before the step (host)
    n_new: list[int] | None = None  # its new tokens (host)
    extra: torch.Tensor | None = None  # [W] int32: the caller's words on the device
    masks: tuple | None = None  # a padded pass's [B, 1, T, S] boolean masks, one per distinct window
    ropes: dict = field(default_factory=dict)  # table index -> (cos, sin) [B, T, rd] at write_pos
    plans: dict = field(default_factory=dict)  # window -> (first key, mask, is_causal) of the SDPA forms

    def rope(self, key: int, table: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [B, T, rd] of this step's write positions, from one table (``key`` names it), once a step."""
        got = self.ropes.get(key)
        if got is None:
            cos, sin = table
            got = self.ropes[key] = (cos[self.write_pos], sin[self.write_pos])
        return got

    @property
    def contiguous(self) -> bool:
        """The requests' slots are consecutive (their keys are a view of the cache)."""
        s = self.slot_ids
        return s == list(range(s[0], s[0] + len(s)))
