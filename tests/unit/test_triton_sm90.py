"""The paged attention's Triton kernels as the GPU would compile and launch them, checked on a CPU.

- Every kernel of specdist/models/kernels/triton_attention.py compiles for sm_90 (H100 / H200) at the head sizes,
  grouped-query ratios, soft-caps and dtypes of the supported families, with no register spills in ptxas's
  report and the key loop software-pipelined (the interpreter accepts code that the real compiler refuses;
  this finds it before a device does).
- The compile keys Triton's JIT would derive for ``configs/gpu.yaml``'s CUDA-graph buckets and a mix of
  prefills: at most two per kernel (decode / verification rows and prefill rows), so no bucket compiles at
  capture and no unseen prompt length stalls a server for a compile.
- The step buffer's segments start on 16 bytes; split-KV's rule depends on static shapes only.
- A decoder layer's kernels (specdist/models/kernels/triton_layer.py: add + RMS norm, SiLU * up) compile for
  sm_90 without spills at the families' widths, once per model whatever the bucket.

Launches are recorded, not run (tests/support/triton_launches.py binds them with Triton's own JIT binder
for an sm_90 target).
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
import yaml
from support.triton_launches import FAMILY_SHAPES, Recorder, compile_sm90, launch_step

from specdist.models.backends.paged import pack_step, step_layout, step_size, unpack_step
from specdist.models.graphs import GRAPH_TOKENS
from specdist.models.kernels.triton_attention import MAX_SPLITS, SPLIT_MIN_KEYS, paged_attention, split_count
from specdist.models.kernels.triton_layer import add_rms_norm, silu_mul
from specdist.models.kv.options import KVOptions
from specdist.models.kv.paged import PagedKVCache

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _gpu_yaml_steps():
    """(batch, tokens, table width) of every CUDA-graph bucket configs/gpu.yaml captures (as
    CausalLMRunner.capture_graphs picks them: batches 1, 2, 4 ... up to max_batch_size; token buckets up to
    the one holding k + 1), then a mix of eager prefills (the call's own shapes, tables as wide as the
    longest sequence)."""
    with open(os.path.join(ROOT, "configs", "gpu.yaml")) as f:
        cfg = yaml.safe_load(f)
    engine, k = cfg["engine"], cfg["draft"]["num_speculative_tokens"]
    bs = engine.get("kv_block_size", KVOptions.block_size)
    top = engine["max_batch_size"]
    batches = sorted({min(1 << i, top) for i in range(top.bit_length() + 1)})
    tokens = [t for t in GRAPH_TOKENS if t == 1 or t // 2 < k + 1]
    width = PagedKVCache.blocks_for(engine["max_model_len"], bs)
    buckets = [(b, t, width) for b in batches for t in tokens]
    prefills = [(1, n, PagedKVCache.blocks_for(n, bs)) for n in (3, 9, 17, 37, 100, 255, 513, 1000, 2000)]
    prefills += [(3, 40, 5), (2, 300, 40), (5, 7, 12), (7, 129, 9), (16, 64, 100)]
    return buckets, prefills, bs


def test_the_gpu_configs_buckets_and_prefills_compile_each_kernel_at_most_twice():
    """configs/gpu.yaml's 30 buckets (its built-in model's 9 query / 3 KV heads of 64, bfloat16) and 14 prefill
    shapes, every layer kind (full and windowed): each kernel gets at most two compile keys (Triton's
    specialisation of every argument and the launch options), where per-bucket step-buffer offsets, ``T`` and
    table widths gave one per bucket."""
    buckets, prefills, bs = _gpu_yaml_steps()
    assert len(buckets) == 30
    shape = dataclasses.replace(FAMILY_SHAPES[0], window=1024)  # the built-in model, windowed layers as well
    with Recorder() as rec:
        for bsz, tokens, width in buckets + prefills:
            for windowed in (False, True):
                launch_step(shape, torch.bfloat16, bsz, tokens, width, bs, windowed)
    counts = {name: len(k) for name, k in rec.keys().items()}
    assert set(counts) == {
        "_rope_write_kernel",
        "_paged_attention_kernel",
        "_paged_attention_split_kernel",
        "_split_reduce_kernel",
    }, counts
    assert all(n <= 2 for n in counts.values()), counts


def test_the_step_buffer_s_segments_start_on_16_bytes_and_round_trip():
    """Every segment of every bucket's and prefill's step buffer starts on a multiple of 4 int32 words; what
    pack_step writes is what unpack_step reads back."""
    buckets, prefills, bs = _gpu_yaml_steps()
    for bsz, tokens, width in buckets + prefills:
        layout = step_layout(bsz, tokens, width)
        assert all(s.start % 4 == 0 for s in layout.values()), (bsz, tokens, width)
        assert max(s.stop for s in layout.values()) <= step_size(bsz, tokens, width)
    cache = PagedKVCache(1, 4, 1, 2, 64, 40, 4)
    slots = [cache.allocate(24) for _ in range(3)]
    for s, n in zip(slots, (9, 1, 22)):
        cache.ensure(s, n)
    tokens = [[5, 6, 7], [8], [1, 2]]
    host = pack_step(cache, slots, tokens, [6, 0, 20], [2, 1, 1], 5, 3, 6)  # 2 padding requests
    assert len(host) == step_size(5, 3, 6)
    step = unpack_step(torch.tensor(host, dtype=torch.int32), 5, 3, 6, 4)
    assert step.ids.tolist() == [[5, 6, 7], [8, 0, 0], [1, 2, 0], [0, 0, 0], [0, 0, 0]]
    assert step.starts.tolist() == [6, 0, 20, 0, 0] and step.n_new.tolist() == [3, 1, 2, 0, 0]
    assert step.table[:3].tolist() == [row + [0] * (6 - len(row)) for row in (cache.tables[s] for s in slots)]
    assert step.table[3:].abs().sum() == 0
    assert step.logits_rows[:4].tolist() == [1, 2, 3, 7] and step.logits_dst[:4].tolist() == [0, 1, 2, 4]


def test_split_kv_is_chosen_from_static_shapes_for_small_batches_over_long_tables():
    """The rule: no split once batch x KV heads x row blocks fill the 132 SMs or the table holds under 512 keys;
    else about one program an SM, ranges of at least 256 keys of a full table, at most 64. A captured bucket's
    launches are the same whatever its requests' lengths (they are read from device memory)."""
    assert split_count(8, 2048) == 8  # batch 1 of an 8-KV-head model, 2048-token tables: 17 wanted, 2048 / 256
    assert split_count(8, 32768) == 17  # long tables: one program an SM
    assert split_count(1, 1 << 20) == MAX_SPLITS
    assert split_count(132, 1 << 20) == 1 and split_count(8, 2 * SPLIT_MIN_KEYS - 1) == 1
    shape = FAMILY_SHAPES[4]  # 8 KV heads of 128
    q = torch.zeros(2, shape.hq, shape.hd, dtype=torch.bfloat16)  # a decode bucket of 2 requests
    cache = torch.zeros(4, 16, shape.hkv, shape.hd, dtype=torch.bfloat16)
    table = torch.zeros(2, 128, dtype=torch.int32)  # 2048-token tables
    launches = []
    for starts, n_new in (([5, 0], [1, 0]), ([1900, 37], [1, 1])):
        with Recorder() as rec:
            paged_attention(
                q,
                cache,
                cache,
                table,
                torch.tensor(starts, dtype=torch.int32),
                torch.tensor(n_new, dtype=torch.int32),
                1,
                0.1,
            )
        launches.append([(launch.kernel, launch.grid, launch.key) for launch in rec.launches])
    assert launches[0] == launches[1]  # the same kernels, grids and compile keys whatever the lengths
    assert [(name, grid) for name, grid, _ in launches[0]] == [
        ("_paged_attention_split_kernel", (2, 8, 8)),  # 2 requests x 8 KV heads x (1 row block x 8 ranges)
        ("_split_reduce_kernel", (2, 8, 1)),
    ]
    with Recorder() as rec:
        paged_attention(
            q.repeat(16, 1, 1),
            cache,
            cache,
            table.repeat(16, 1),
            torch.zeros(32, dtype=torch.int32),
            torch.ones(32, dtype=torch.int32),
            1,
            0.1,
        )  # 32 requests: 256 programs, no split
    assert [launch.kernel for launch in rec.launches] == ["_paged_attention_kernel"]


# every kernel and row block: decode rows without and with split-KV, prefill rows without and with it
_COMPILE_STEPS = [(64, 1, 128, 1), (1, 1, 128, 4), (8, 128, 32, 1), (1, 128, 32, 4)]


def _compile_cases():
    """bfloat16 (the GPU serving dtype) at every family's shape; float16 and float32 at one shape per head size."""
    cases, seen = [], set()
    for shape in FAMILY_SHAPES:
        cases.append((shape, torch.bfloat16))
        if shape.hd not in seen:
            seen.add(shape.hd)
            cases += [(shape, torch.float16), (shape, torch.float32)]
    return cases


@pytest.mark.slow
def test_every_kernel_compiles_for_sm90_without_register_spills(tmp_path, monkeypatch):
    """Each distinct compile (about 150, ~40 s) of the rotary, attention, split-KV attention and reduce kernels at
    the families' shapes: ptxas (Triton's own, ``-v``) reports 0 bytes of spill stores and loads and at most 255
    registers; the attention kernels' PTX at head sizes 64 and up has ``cp.async`` (the key loop is
    software-pipelined). Triton's cache goes to a temporary folder."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    launches = {}
    for shape, dtype in _compile_cases():
        with Recorder() as rec:
            for bsz, tokens, width, splits in _COMPILE_STEPS:
                launch_step(shape, dtype, bsz, tokens, width, windowed=shape.window is not None, splits=splits)
        for launch in rec.launches:
            launches.setdefault((launch.source.hash(), str(launch.options)), (shape, dtype, launch))
    kinds = {launch.kernel for _, _, launch in launches.values()}
    assert kinds == {
        "_rope_write_kernel",
        "_paged_attention_kernel",
        "_paged_attention_split_kernel",
        "_split_reduce_kernel",
    }
    problems = []
    for shape, dtype, launch in launches.values():
        kernel, report = compile_sm90(launch)
        what = f"{launch.kernel} {shape.name} {dtype} {launch.source.constants} warps {launch.options['num_warps']}"
        if not report or report["spill_stores"] or report["spill_loads"] or report["registers"] > 255:
            problems.append(f"{what}: {report}")
        if "attention" in launch.kernel and shape.hd >= 64 and "cp.async" not in kernel.asm["ptx"]:
            problems.append(f"{what}: the key loop is not pipelined")
    assert not problems, "\n".join(problems)


# (hidden size, intermediate size) of the supported families' checkpoints whose layers take the fused kernels
LAYER_WIDTHS = {
    "smollm2-135m": (576, 1536),
    "qwen2.5-0.5b": (896, 4864),
    "qwen3-0.6b": (1024, 3072),
    "llama-3.2-1b / random-1b": (2048, 5632),
    "phi-3-mini": (3072, 8192),
    "qwen2.5-7b": (3584, 18944),
    "llama-3.1-8b / mistral-7b": (4096, 14336),
}


GEMMA_WIDTHS = {"gemma2-2b": 2304, "gemma3-1b": 1152}  # hidden sizes (their MLPs are GELU: no SiLU * up)


def _launch_layer(dim: int, inter: int | None, dtype: torch.dtype, rows: int) -> None:
    """A layer's fused launches over ``rows`` token rows (meant to run under a Recorder): add + norm with and
    without a residual, SiLU * up; ``inter`` None: Gemma's (1 + w norms, the residual normed first)."""
    h = torch.empty(rows, dim, dtype=dtype)
    w = torch.empty(dim, dtype=dtype)
    if inter is None:
        add_rms_norm(h, None, w, 1e-6, offset=1.0)
        add_rms_norm(h, torch.empty_like(h), w, 1e-6, (w, 1e-6), 1.0)
        return
    add_rms_norm(h, None, w, 1e-6)
    add_rms_norm(h, torch.empty_like(h), w, 1e-6)
    silu_mul(torch.empty(rows, 2 * inter, dtype=dtype))


def test_the_layer_kernels_compile_once_per_model_whatever_the_bucket():
    """configs/gpu.yaml's 30 buckets and 14 prefill shapes (their B * T rows) at the built-in model's widths, in
    bfloat16: add + norm compiles twice (with and without the residual), SiLU * up once; the row count is a grid
    size only."""
    buckets, prefills, _ = _gpu_yaml_steps()
    dim, inter = LAYER_WIDTHS["smollm2-135m"]
    with Recorder() as rec:
        for bsz, tokens, _ in buckets + prefills:
            _launch_layer(dim, inter, torch.bfloat16, bsz * tokens)
    assert {name: len(k) for name, k in rec.keys().items()} == {"_add_rms_norm_kernel": 2, "_silu_mul_kernel": 1}


def test_the_layer_kernels_compile_for_sm90_without_register_spills(tmp_path, monkeypatch):
    """Each distinct compile of add + norm and SiLU * up (bfloat16 at every width, float16 and float32 at the
    smallest and largest; Gemma's norms at its widths; 29, about 4 s): ptxas reports no spills and at most 255
    registers."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    cases = [(w, torch.bfloat16) for w in LAYER_WIDTHS.values()]
    cases += [
        (w, dtype)
        for dtype in (torch.float16, torch.float32)
        for w in (min(LAYER_WIDTHS.values()), max(LAYER_WIDTHS.values()))
    ]
    cases += [((dim, None), torch.bfloat16) for dim in GEMMA_WIDTHS.values()]
    launches = {}
    for (dim, inter), dtype in cases:
        with Recorder() as rec:
            _launch_layer(dim, inter, dtype, 3)
        for launch in rec.launches:
            launches.setdefault((launch.source.hash(), str(launch.options)), (dim, dtype, launch))
    assert {launch.kernel for _, _, launch in launches.values()} == {"_add_rms_norm_kernel", "_silu_mul_kernel"}
    problems = []
    for dim, dtype, launch in launches.values():
        _, report = compile_sm90(launch)
        if not report or report["spill_stores"] or report["spill_loads"] or report["registers"] > 255:
            problems.append(f"{launch.kernel} width {dim} {dtype} warps {launch.options['num_warps']}: {report}")
    assert not problems, "\n".join(problems)
