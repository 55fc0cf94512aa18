"""Sharded loading (specdist.models.sharding.load_sharded): what each rank holds, and what it costs.

- Peak resident memory of 2 ranks loading a random 440 MB Llama checkpoint (fp32, two safetensors
  shards with an index), each in its own process: above the process's baseline (taken right before
  loading, after imports and the process group), at most half of the sharded weights plus the
  replicated ones, plus 10%.
- A rank's parameters are exactly its slices of the full tensors (tiny checkpoints, in this
  process: loading is collective-free, only forwards need the group).
"""

from __future__ import annotations

import json
import os
import re
import time

import pytest
import torch
from support.rank_procs import WORLD_SIZE, spawn_ranks

# about 440 MB in fp32: 4 layers of 11 M parameters, embedding and head of 32.8 M each
BIG = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=4)
BIG_VOCAB = 32000


def _status() -> dict[str, int]:
    """VmRSS and VmHWM (peak RSS) of this process, in bytes."""
    text = open("/proc/self/status").read()
    return {k: int(re.search(rf"{k}:\s+(\d+) kB", text).group(1)) * 1024 for k in ("VmRSS", "VmHWM")}


def _rss_worker(rank: int, world_size: int, port: int, out_path: str, ckpts: list[str]) -> None:
    [ckpt] = ckpts
    torch.set_num_threads(1)
    import resource

    import torch.distributed as dist
    import transformers.models.llama.modeling_llama  # noqa: F401  (an import, not part of loading)

    from specdist.models.loader import ModelSource
    from specdist.models.sharding import load_sharded
    from workers.tensor_parallel import init_process_group

    init_process_group(rank, world_size, "127.0.0.1", port, "cpu")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak (VmHWM) to the current RSS
    before = _status()
    model = load_sharded(ModelSource(ckpt, None), "float32", "cpu", rank, world_size)
    after = _status()
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    rep = model.load_report
    json.dump(
        {
            "baseline": before["VmRSS"],
            "peak": after["VmHWM"],
            "rss_after": after["VmRSS"],
            "ru_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "held": held,
            "bytes_read": rep.bytes_read,
            "bytes_total": rep.bytes_total,
            "seconds": rep.seconds,
            "sharded": rep.sharded,
        },
        open(out_path, "w"),
    )
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow
def test_two_ranks_peak_memory_is_their_share(tmp_path):
    from specdist.bench.checkpoints import llama_tensor_shapes, write_random_llama

    t0 = time.perf_counter()
    ckpt = str(tmp_path / "big")
    written = write_random_llama(ckpt, BIG_VOCAB, dtype=torch.float32, shard_bytes=256 << 20, **BIG)
    write_s = time.perf_counter() - t0
    assert written.num_bytes >= 400 << 20 and os.path.isfile(os.path.join(ckpt, "model.safetensors.index.json"))
    replicated = sharded = 0
    for name, shape in llama_tensor_shapes(dict(BIG, vocab_size=BIG_VOCAB)).items():
        nbytes = torch.Size(shape).numel() * 4
        if name.endswith(("norm.weight", "embed_tokens.weight")):
            replicated += nbytes
        else:
            sharded += nbytes
    share = sharded / WORLD_SIZE + replicated
    budget = 1.10 * share  # the bound: the rank's share plus 10%
    try:
        t1 = time.perf_counter()
        ranks = [json.load(open(p)) for p in spawn_ranks(_rss_worker, [ckpt], tmp_path, load=False)]
        load_wall = time.perf_counter() - t1
    finally:
        for name in os.listdir(ckpt):  # 440 MB: gone before the next test
            os.remove(os.path.join(ckpt, name))
    mb = 1 / 1e6
    print(
        f"\ncheckpoint {written.num_bytes * mb:.0f} MB (sharded {sharded * mb:.0f} MB, replicated "
        f"{replicated * mb:.0f} MB) written in {write_s:.1f} s; 2 ranks in {load_wall:.1f} s"
    )
    for r, res in enumerate(ranks):
        grew = res["peak"] - res["baseline"]
        print(
            f"rank {r}: baseline {res['baseline'] * mb:.0f} MB, peak {res['peak'] * mb:.0f} MB, "
            f"peak - baseline {grew * mb:.0f} MB, share {share * mb:.0f} MB, budget {budget * mb:.0f} MB; "
            f"holds {res['held'] * mb:.0f} MB; read {res['bytes_read'] * mb:.0f} MB in {res['seconds']:.1f} s; "
            f"(ru_maxrss {res['ru_maxrss'] * mb:.0f} MB: a lifetime peak that also counts the parent's RSS at fork)"
        )
        assert res["sharded"] and res["bytes_total"] == written.num_bytes
        assert res["bytes_read"] == share  # the even split of every sharded tensor, plus the replicated ones
        assert res["held"] == share
        assert grew <= budget, f"rank {r}: peak grew by {grew * mb:.0f} MB, budget {budget * mb:.0f} MB"


# ---------------------------------------------------------------- slices, in this process
def _full_and_ranks(ckpt: str) -> tuple[dict, list[dict]]:
    from specdist.models.loader import ModelSource, load_model
    from specdist.models.sharding import load_sharded

    full = {k: v.detach() for k, v in load_model(ModelSource(ckpt, None), "float32").state_dict().items()}
    ranks = []
    for r in range(WORLD_SIZE):
        model = load_sharded(ModelSource(ckpt, None), "float32", "cpu", r, WORLD_SIZE)
        ranks.append((model, {k: v.detach() for k, v in model.state_dict().items()}))
    return full, ranks


def _split(t: torch.Tensor, dim: int, r: int) -> torch.Tensor:
    return torch.tensor_split(t, WORLD_SIZE, dim)[r]


def _want(name: str, full: torch.Tensor, r: int, cfg) -> torch.Tensor:
    """Rank r's part of a full tensor, by the rules written out independently of sharding.py."""
    hd = cfg.hidden_size // cfg.num_attention_heads if getattr(cfg, "head_dim", None) is None else cfg.head_dim
    # the fused names first: "qkv_proj" ends like "v_proj", "gate_up_proj" like "up_proj"
    if name.endswith("qkv_proj.weight"):  # Phi-3: [q; k; v] rows
        q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
        return torch.cat([_split(p, 0, r) for p in full.split([q, kv, kv])])
    if name.endswith("mlp.gate_up_proj.weight"):  # Phi-3: [gate; up] rows
        return torch.cat([_split(p, 0, r) for p in full.chunk(2)])
    if name.endswith(
        (
            "q_proj.weight",
            "k_proj.weight",
            "v_proj.weight",
            "gate_proj.weight",
            "up_proj.weight",
            "q_proj.bias",
            "k_proj.bias",
            "v_proj.bias",
            "lm_head.weight",
        )
    ):
        return _split(full, 0, r)
    if name.endswith(("o_proj.weight", "down_proj.weight")) and full.dim() == 2:
        return _split(full, 1, r)
    if name.endswith("experts.gate_up_proj"):  # [E, 2I, D]: per expert, its gate rows and its up rows
        return torch.cat([_split(p, 1, r) for p in full.chunk(2, dim=1)], dim=1)
    if name.endswith("experts.down_proj"):  # [E, D, I]
        return _split(full, 2, r)
    return full  # replicated


@pytest.mark.parametrize("case", ["llama-tied-uneven", "qwen2", "phi3", "qwen3_moe"])
def test_rank_holds_its_slices(tmp_path, case):
    from support.model_zoo import save_tiny

    if case == "llama-tied-uneven":  # vocabulary 15 (8 + 7 rows), MLP 45 (23 + 22)
        ckpt = save_tiny(
            str(tmp_path / case), "llama", seed=5, vocab_size=15, intermediate_size=45, tie_word_embeddings=True
        )
    else:
        ckpt = save_tiny(str(tmp_path / case), case, seed=5)
    full, ranks = _full_and_ranks(ckpt)
    for r, (model, state) in enumerate(ranks):
        # qwen3_moe's checkpoint stores one tensor per expert: it takes the load-whole-then-slice path
        assert model.load_report.sharded == (case != "qwen3_moe")
        assert set(state) == set(full)
        for name, want in full.items():
            got = state[name]
            assert torch.equal(got, _want(name, want, r, model.config)), f"rank {r}: {name}"
        for name, b in model.named_buffers():  # rotary tables and the like: computed, on the device
            assert b.device.type == "cpu" and torch.isfinite(b.float()).all(), name
    if case == "llama-tied-uneven":
        for r, (model, _) in enumerate(ranks):
            head, embed = model.lm_head.weight, model.model.embed_tokens.weight
            assert head.untyped_storage().data_ptr() == embed.untyped_storage().data_ptr()  # a view, not a copy
            assert head.shape[0] == (8, 7)[r]


def test_rank_slices_in_bfloat16(tmp_path):
    """An fp32 checkpoint loaded as bfloat16: each slice is read, then converted (round to nearest)."""
    from support.model_zoo import save_tiny

    from specdist.models.loader import ModelSource
    from specdist.models.sharding import load_sharded

    ckpt = save_tiny(str(tmp_path / "qwen2"), "qwen2", seed=7)
    full, _ = _full_and_ranks(ckpt)
    model = load_sharded(ModelSource(ckpt, None), "bfloat16", "cpu", 1, WORLD_SIZE)
    state = model.state_dict()
    for name, want in full.items():
        assert state[name].dtype == torch.bfloat16, name
        assert torch.equal(state[name], _want(name, want, 1, model.config).to(torch.bfloat16)), name


def test_load_reports_progress(tmp_path):
    from support.model_zoo import save_tiny

    from specdist.models.loader import ModelSource
    from specdist.models.sharding import load_sharded

    ckpt = save_tiny(str(tmp_path / "llama"), "llama", seed=6)
    lines = []
    model = load_sharded(
        ModelSource(ckpt, None, key="target.model"), "float32", "cpu", 1, WORLD_SIZE, progress=lines.append
    )
    rep = model.load_report
    assert len(lines) == 2 and lines[0].startswith("loading target llama (")
    assert re.fullmatch(r"rank 1 of 2 read [\d.]+ kB of [\d.]+ kB \(sharded\) in [\d.]+ s", lines[1]), lines[1]
    assert 0 < rep.bytes_read < rep.bytes_total


def test_unsupported_checkpoints_are_refused_before_reading(tmp_path):
    from support.model_zoo import save_tiny

    from specdist.errors import ConfigError
    from specdist.models.loader import ModelSource
    from specdist.models.sharding import load_sharded

    ckpt = save_tiny(str(tmp_path / "llama"), "llama", seed=6)
    os.remove(os.path.join(ckpt, "model.safetensors"))  # nothing to read: the check must come first
    with pytest.raises(ValueError, match="num_attention_heads = 4 is not divisible by 3"):
        load_sharded(ModelSource(ckpt, None), "float32", "cpu", 0, 3)
    with open(os.path.join(ckpt, "config.json"), "w") as f:  # an architecture the runner does not serve
        json.dump({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}, f)
    with pytest.raises(ConfigError, match=r"target\.model: model type 'gpt2' is not supported"):
        load_sharded(ModelSource(ckpt, None), "float32", "cpu", 0, 2)
