"""Random-weight Llama checkpoints of a given size, written straight to safetensors.

For benchmarks and load tests that need a model of a real size without a download: the
tensors are drawn shard by shard (never the whole model in memory at once), under the
key names transformers expects, with a ``config.json`` and, when a tokenizer is given, its
files. Random weights give near-uniform next-token distributions, so acceptance rates
measured on them say nothing; throughput and memory do.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch

# about 1.0 B parameters with the 49,152-token vocabulary of the built-in tokenizer
LLAMA_1B = dict(
    hidden_size=2048, intermediate_size=5632, num_hidden_layers=18, num_attention_heads=32, num_key_value_heads=8
)
# a small draft for it: 4 layers of width 512 (about 0.07 B parameters, mostly embeddings)
LLAMA_DRAFT = dict(
    hidden_size=512, intermediate_size=1408, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4
)


@dataclass(frozen=True)
class Written:
    path: str
    num_params: int
    num_bytes: int


def llama_tensor_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor of a LlamaForCausalLM checkpoint (untied head): name -> shape."""
    d, inter, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd = d // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * hd
    shapes = {"model.embed_tokens.weight": (v, d)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "self_attn.q_proj.weight": (d, d),
                p + "self_attn.k_proj.weight": (kv, d),
                p + "self_attn.v_proj.weight": (kv, d),
                p + "self_attn.o_proj.weight": (d, d),
                p + "mlp.gate_proj.weight": (inter, d),
                p + "mlp.up_proj.weight": (inter, d),
                p + "mlp.down_proj.weight": (d, inter),
                p + "input_layernorm.weight": (d,),
                p + "post_attention_layernorm.weight": (d,),
            }
        )
    shapes["model.norm.weight"] = (d,)
    shapes["lm_head.weight"] = (v, d)
    return shapes


def write_random_llama(
    path: str,
    vocab_size: int,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    std: float = 0.02,
    tokenizer=None,
    shard_bytes: int = 2 << 30,
    **arch,
) -> Written:
    """Write a random Llama checkpoint to ``path`` (``arch``: hidden_size, intermediate_size,
    num_hidden_layers, num_attention_heads, num_key_value_heads; see LLAMA_1B). At most one
    file's worth (``shard_bytes``) of tensors is in memory at a time."""
    from safetensors.torch import save_file

    cfg = dict(arch, vocab_size=vocab_size)
    os.makedirs(path, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    shapes = llama_tensor_shapes(cfg)
    groups: list[list[str]] = []  # tensor names per file, in order
    pending: dict[str, torch.Tensor] = {}
    pending_bytes = total = 0

    def flush():
        save_file(pending, os.path.join(path, f"part-{len(groups) + 1}.safetensors"), metadata={"format": "pt"})
        groups.append(list(pending))
        pending.clear()

    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            t = torch.ones(shape, dtype=dtype)
        else:
            t = (torch.randn(shape, generator=gen) * std).to(dtype)
        if pending and pending_bytes + t.nbytes > shard_bytes:
            flush()
            pending_bytes = 0
        pending[name] = t
        pending_bytes += t.nbytes
        total += t.nbytes
    flush()
    if len(groups) == 1:
        os.replace(os.path.join(path, "part-1.safetensors"), os.path.join(path, "model.safetensors"))
    else:  # the "i-of-N" names need N: rename, then write the index
        weight_map = {}
        for i, names in enumerate(groups, 1):
            fname = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
            os.replace(os.path.join(path, f"part-{i}.safetensors"), os.path.join(path, fname))
            weight_map.update(dict.fromkeys(names, fname))
        with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "bos_token_id": 1,
        "eos_token_id": 2,
        **cfg,
    }
    if tokenizer is not None:
        config["bos_token_id"], config["eos_token_id"] = tokenizer.bos_token_id, tokenizer.eos_token_id
        tokenizer.save_pretrained(path)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    num_params = sum(torch.Size(s).numel() for s in shapes.values())
    return Written(path, num_params, total)


def write_random_eagle3_head(
    path: str,
    target_config,
    draft_vocab_size: int | None = None,
    seed: int = 0,
    std: float = 0.02,
    hidden_size: int | None = None,
    intermediate_size: int | None = None,
    num_heads: int | None = None,
    num_kv_heads: int | None = None,
    aux_layers=None,
    with_embed: bool = False,
    dtype: torch.dtype = torch.float32,
) -> Written:
    """Write a random EAGLE-3 draft head for the target whose config is ``target_config`` (a
    transformers config or a dict) to ``path``: ``config.json`` and ``model.safetensors`` in the
    published layout (see :mod:`specdist.models.eagle3`).

    Sizes default to the target's (hidden size, intermediate size, heads, kv heads); the head's
    ``vocab_size`` is the target's, ``target_hidden_size`` the target's hidden size, and RoPE
    the target's (``rope_theta``, and ``rope_scaling`` when not the default type).
    ``draft_vocab_size`` (default: the target's vocabulary) below it draws a random injective
    draft-to-target map, stored as ``d2t`` offsets (draft ids in increasing target-id order)
    with its ``t2d`` membership mask. ``aux_layers``, when given, is written as
    ``eagle_aux_hidden_state_layer_ids`` as is; else the field is left out (the reader's default).
    ``with_embed``: write ``embed_tokens.weight`` (else the head uses the target's embedding).
    Matrices are N(0, std^2), norm weights 1 + N(0, std^2).
    """
    from safetensors.torch import save_file

    def get(key, default=None):
        if isinstance(target_config, dict):
            return target_config.get(key, default)
        return getattr(target_config, key, default)

    vocab = int(get("vocab_size"))
    t_hidden = int(get("hidden_size"))
    h = int(hidden_size or t_hidden)
    heads = int(num_heads or get("num_attention_heads"))
    kv_heads = int(num_kv_heads or get("num_key_value_heads") or heads)
    inter = int(intermediate_size or get("intermediate_size"))
    head_dim = h // heads if hidden_size or num_heads else int(get("head_dim") or h // heads)
    draft_vocab = int(draft_vocab_size or vocab)
    if draft_vocab > vocab:
        raise ValueError(f"draft_vocab_size {draft_vocab} exceeds the target's vocabulary {vocab}")

    rope = dict(get("rope_parameters") or {})
    rope_theta = float(rope.pop("rope_theta", get("rope_theta", 10000.0)))
    rope_scaling = rope if rope.get("rope_type", "default") != "default" else get("rope_scaling")

    gen = torch.Generator().manual_seed(seed)

    def matrix(*shape):
        return (torch.randn(shape, generator=gen) * std).to(dtype)

    def norm_weight():
        return (1.0 + torch.randn(h, generator=gen) * std).to(dtype)

    tensors = {
        "fc.weight": matrix(h, 3 * t_hidden),
        "midlayer.self_attn.q_proj.weight": matrix(heads * head_dim, 2 * h),
        "midlayer.self_attn.k_proj.weight": matrix(kv_heads * head_dim, 2 * h),
        "midlayer.self_attn.v_proj.weight": matrix(kv_heads * head_dim, 2 * h),
        "midlayer.self_attn.o_proj.weight": matrix(h, heads * head_dim),
        "midlayer.mlp.gate_proj.weight": matrix(inter, h),
        "midlayer.mlp.up_proj.weight": matrix(inter, h),
        "midlayer.mlp.down_proj.weight": matrix(h, inter),
        "midlayer.input_layernorm.weight": norm_weight(),
        "midlayer.hidden_norm.weight": norm_weight(),
        "midlayer.post_attention_layernorm.weight": norm_weight(),
        "norm.weight": norm_weight(),
        "lm_head.weight": matrix(draft_vocab, h),
    }
    if with_embed:
        tensors["embed_tokens.weight"] = matrix(vocab, h)
    if draft_vocab < vocab:
        targets = torch.randperm(vocab, generator=gen)[:draft_vocab].sort().values  # [Vd] distinct target ids
        tensors["d2t"] = targets - torch.arange(draft_vocab)  # target id of draft id i: i + d2t[i]
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[targets] = True
        tensors["t2d"] = t2d

    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": h,
        "intermediate_size": inter,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "num_hidden_layers": 1,
        "rms_norm_eps": float(get("rms_norm_eps", 1e-6)),
        "rope_theta": rope_theta,
        "rope_scaling": rope_scaling,
        "max_position_embeddings": int(get("max_position_embeddings", 2048)),
        "vocab_size": vocab,
        "draft_vocab_size": draft_vocab,
        "target_hidden_size": t_hidden,
        "norm_before_residual": False,
        "tie_word_embeddings": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    if aux_layers is not None:
        config["eagle_aux_hidden_state_layer_ids"] = [int(i) for i in aux_layers]
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    num_params = sum(t.numel() for name, t in tensors.items() if t.is_floating_point())
    return Written(path, num_params, sum(t.nbytes for t in tensors.values()))
