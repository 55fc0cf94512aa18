"""The model families the runner serves, and the one check that refuses every other.

Each family is a Hugging Face ``model_type`` plus the few switches in which its forward
differs from Llama's that cannot be read off its modules (where a layer's sliding window
comes from, which soft-caps transformers applies). Everything else the runner reads off the
modules themselves: q/k norms, Gemma's pre/post norms, fused projections, MoE blocks.

:func:`check_supported` runs before any weight is read (the loader passes it the type from
``config.json`` or the GGUF header) and again when a runner is built.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass

from specdist.errors import ConfigError


@dataclass(frozen=True)
class Family:
    name: str  # as the README lists it
    # Where a layer's sliding window comes from, as transformers reads it: "none" (never),
    # "config" (config.sliding_window, every layer), "layer" (the attention module's own
    # ``sliding_window``: set on the layers config.layer_types marks "sliding_attention").
    window: str
    attn_softcap: bool = False  # tanh soft-cap of attention scores (config.attn_logit_softcapping)
    final_softcap: bool = False  # tanh soft-cap of the logits (config.final_logit_softcapping)
    # The shape of its decoder layers, where one kernel call runs a whole layer on the CPU: "prenorm-swiglu" (RMS
    # norm, attention with rotary, residual add, RMS norm, silu(gate) * up, down, residual add: what
    # cpu_kernels.decoder_layer computes), or None (the runner calls each operation: sandwich norms, GELU, MoE).
    layer_kernel: str | None = None


PRENORM_SWIGLU = "prenorm-swiglu"  # the layer cpu_kernels.decoder_layer runs


FAMILIES: dict[str, Family] = {
    "llama": Family("Llama 2 / 3.x (RoPE default, linear, llama3, yarn, dynamic)", "none", layer_kernel=PRENORM_SWIGLU),
    "mistral": Family("Mistral (sliding window)", "config", layer_kernel=PRENORM_SWIGLU),
    "qwen2": Family("Qwen2 / Qwen2.5 (qkv bias, sliding-window layers)", "layer", layer_kernel=PRENORM_SWIGLU),
    "qwen3": Family("Qwen3 (q/k norm)", "layer", layer_kernel=PRENORM_SWIGLU),
    "qwen3_moe": Family("Qwen3-MoE (mixture of experts)", "layer"),
    "gemma2": Family(
        "Gemma 2 (soft-caps, pre/post norms, local/global layers)", "layer", attn_softcap=True, final_softcap=True
    ),
    "gemma3_text": Family("Gemma 3 text (q/k norm, local RoPE base, local/global layers)", "layer", final_softcap=True),
    "phi3": Family("Phi-3 (fused qkv and gate/up)", "config", layer_kernel=PRENORM_SWIGLU),
}
SUPPORTED_MODEL_TYPES = tuple(FAMILIES)

# GGUF ``general.architecture`` names that differ from the transformers model_type they load as
_GGUF_ARCHITECTURES = {"qwen3moe": "qwen3_moe", "gemma3": "gemma3_text", "qwen2moe": "qwen2_moe"}


def check_supported(config_or_model_type, key: str = "target.model") -> Family:
    """The family of a config (or a ``model_type`` string); ConfigError naming ``key``, the
    architecture and the supported ones otherwise."""
    if isinstance(config_or_model_type, str) or config_or_model_type is None:
        model_type, arch = config_or_model_type, None
    else:
        model_type = getattr(config_or_model_type, "model_type", None)
        arch = (getattr(config_or_model_type, "architectures", None) or [None])[0]
    family = FAMILIES.get(model_type)
    if family is None:
        what = f"model type {model_type!r}" + (f" ({arch})" if arch else "")
        raise ConfigError(key, f"{what} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    return family


def source_model_type(directory: str, gguf_file: str | None = None) -> str | None:
    """The model_type a checkpoint declares, read without its weights: ``config.json``'s
    ``model_type``, or the GGUF header's ``general.architecture``."""
    if gguf_file:
        arch = _gguf_architecture(os.path.join(directory, gguf_file))
        return _GGUF_ARCHITECTURES.get(arch, arch)
    try:
        with open(os.path.join(directory, "config.json")) as f:
            return json.load(f).get("model_type")
    except (OSError, ValueError):
        return None


# GGUF metadata value types: fixed sizes in bytes; 8 is a string, 9 an array
_GGUF_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def _gguf_architecture(path: str) -> str | None:
    """``general.architecture`` from a GGUF file's key/value header (llama.cpp writes it first)."""

    def read(f, fmt):
        return struct.unpack("<" + fmt, f.read(struct.calcsize(fmt)))[0]

    def string(f):
        return f.read(read(f, "Q")).decode("utf-8", "replace")

    def skip(f, vtype):
        if vtype == 8:
            f.seek(read(f, "Q"), 1)
        elif vtype == 9:
            etype, n = read(f, "I"), read(f, "Q")
            if etype in _GGUF_SIZES:
                f.seek(_GGUF_SIZES[etype] * n, 1)
            else:
                for _ in range(n):
                    skip(f, etype)
        else:
            f.seek(_GGUF_SIZES[vtype], 1)

    try:
        with open(path, "rb") as f:
            if f.read(4) != b"GGUF":
                return None
            read(f, "I")  # version
            read(f, "Q")  # tensor count
            for _ in range(read(f, "Q")):
                name, vtype = string(f), read(f, "I")
                if name == "general.architecture" and vtype == 8:
                    return string(f)
                skip(f, vtype)
    except (OSError, struct.error, KeyError):
        return None
    return None
