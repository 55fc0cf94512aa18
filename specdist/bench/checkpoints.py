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
LLAMA_1B = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=18,
                num_attention_heads=32, num_key_value_heads=8)
# a small draft for it: 4 layers of width 512 (about 0.07 B parameters, mostly embeddings)
LLAMA_DRAFT = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
                   num_attention_heads=8, num_key_value_heads=4)


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
        shapes.update({
            p + "self_attn.q_proj.weight": (d, d), p + "self_attn.k_proj.weight": (kv, d),
            p + "self_attn.v_proj.weight": (kv, d), p + "self_attn.o_proj.weight": (d, d),
            p + "mlp.gate_proj.weight": (inter, d), p + "mlp.up_proj.weight": (inter, d),
            p + "mlp.down_proj.weight": (d, inter),
            p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,),
        })
    shapes["model.norm.weight"] = (d,)
    shapes["lm_head.weight"] = (v, d)
    return shapes


def write_random_llama(path: str, vocab_size: int, dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                       std: float = 0.02, tokenizer=None, shard_bytes: int = 2 << 30, **arch) -> Written:
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
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "tie_word_embeddings": False, "torch_dtype": str(dtype).removeprefix("torch."),
        "bos_token_id": 1, "eos_token_id": 2, **cfg,
    }
    if tokenizer is not None:
        config["bos_token_id"], config["eos_token_id"] = tokenizer.bos_token_id, tokenizer.eos_token_id
        tokenizer.save_pretrained(path)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    num_params = sum(torch.Size(s).numel() for s in shapes.values())
    return Written(path, num_params, total)
