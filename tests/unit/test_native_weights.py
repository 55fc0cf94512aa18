"""Int4 group linears, GGUF blocks run natively (``target.weights``), and the ``self-w4`` draft.

Tiny models throughout: a tiny Llama GGUF file written here with ``gguf.GGUFWriter`` (mixed
Q4_0 / Q4_1 / Q8_0 / F16 linears, llama.cpp's q/k row order, a tied Q8_0 head, a word-level
BPE tokenizer transformers rebuilds), and the session's tiny safetensors checkpoints (conftest).

Tolerances, per backend of :class:`Int4GroupLinear` (both run here: the block kernels where the CPU
has AVX2, torch's int4 kernel with ``cpu_kernels.available`` patched off). With
``M = |(codes - 8) * scale| + |zero|`` (the weight's magnitude before cancellation):

- torch's int4 kernel rounds the (scale, zero) pairs to bf16 (8 significant bits, relative error
  <= 2**-9 each), may round the de-quantized weight to bf16 inside the kernel (<= 2**-9) and returns
  bf16 (<= 2**-9 of the output). So, with ``x`` bf16-representable, the output is within
  ``3 * 2**-9 < 2**-7`` of ``(|x| @ M.T)`` of ``x @ W.T``; measured: at most 0.2% of it.
- the block kernels keep the file's scales and round ``x`` per block of 32 to bytes of step
  ``d = max |x| / 127``: each element moves by at most ``d / 2``, so the output is within
  ``(d / 2) @ M.T`` of ``x @ W.T`` (plus float32 summation, ``2**-20`` of ``|x| @ M.T``).
"""

from __future__ import annotations

import collections
import copy
import itertools
import time

import numpy as np
import pytest
import torch
from scipy import stats
from support.gguf_writer import (
    GRID,
    GRID16,
    HEAD_TYPE,
    HF_NAMES,
    LAYERS,
    LINEAR_TYPES,
    Q,
    _quantized,
    grid16_bytes,
    grid_bytes,
    iq4_nl_bytes,
    iq4_xs_bytes,
    q2_k_bytes,
    q3_k_bytes,
    q4_k_bytes,
    q5_k_bytes,
    q6_k_bytes,
    write_tiny_gguf,
)
from support.gtest import (
    ALPHA,
    VOCAB,
    Case,
    _prob_table,
    g_statistic,
    joint,
    merge_cells,
    power,
    seq_index,
    speculative_law,
    transform,
)
from support.helpers import devices, sample_engine, tiny_config
from support.model_zoo import build_tiny
from test_dtypes import PROMPTS, TIE, _check_greedy, _compare_with_plain, _reference_logits
from torch import nn

from specdist.config import load_config
from specdist.cores.proposers import check_draft, draft_dtype, draft_traits
from specdist.engine.local import Engine
from specdist.errors import ConfigError
from specdist.models import native
from specdist.models.fusion import _fuse, fuse_projections, quantized_copy, unfused_copy
from specdist.models.kernels import cpu_kernels
from specdist.models.loader import gguf_parsed_once, load_model, load_tokenizer, resolve_model
from specdist.models.native import decode_blocks, dequantize, self_draft, use_native_blocks
from specdist.models.quant import GROUP, Int4GroupLinear, Int8WeightOnlyLinear
from specdist.sampling_params import SamplingParams

gguf = pytest.importorskip("gguf")
NATIVE = ("Q4_0", "Q4_1", "Q8_0")
ALL_NATIVE = NATIVE + ("Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS") + GRID + GRID16
# int4 segments a weight (else 1)
REPEAT = {
    "Q8_0": 2,
    "Q5_0": 2,
    "Q5_1": 2,
    "Q5_K": 2,
    "Q2_K": 4,
    "Q3_K": 4,
    "Q6_K": 4,
    "IQ4_NL": 2,
    "IQ4_XS": 2,
    **{t: 2 for t in GRID},
    **{t: 4 for t in GRID16},
}
LEGACY = ("Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q5_1", "IQ4_NL")  # types whose block scales are float16 in the file
# types whose scales are a float16 factor per 256 times integers (super-blocks of 256)
SUPER_TYPES = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS") + GRID + GRID16
# the CPU kernel each runs on ("q4" for the others)
BLOCKS = {
    "Q8_0": "q8",
    "Q5_0": "q5",
    "Q5_1": "q5",
    "Q5_K": "q5",
    "Q2_K": "q2m_16",
    "Q3_K": "q4_16",
    "Q6_K": "q6_16",
    "IQ4_NL": "iq4",
    "IQ4_XS": "iq4",
    "IQ3_S": "q5",
    "IQ1_S": "q5",
    "IQ3_XXS": "q8",
    "IQ2_XXS": "q8",
    "IQ2_XS": "q7_16",
    "IQ2_S": "q7_16",
    "IQ1_M": "q6_16",
}


def _magnitude(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, repeat: int) -> torch.Tensor:
    """``|(c - 8) * scale| + |zero|`` per weight, halves added (Q8_0): the scale of the rounding errors."""
    rows, n = codes.shape
    g = codes.reshape(rows, n // GROUP, GROUP).float()
    m = ((g - 8).abs() * scales[..., None].abs() + zeros[..., None].abs()).reshape(rows, n)
    return m.reshape(rows, repeat, n // repeat).sum(1)


def _assert_int4_matmul(lin: nn.Module, w: torch.Tensor, mag: torch.Tensor, x: torch.Tensor, blocks: bool) -> float:
    """``lin(x)`` is ``x @ w.T`` within the backend's bound (module doc); returns the worst ratio to it."""
    y = lin(x)
    assert y.dtype == x.dtype and y.shape == (*x.shape[:-1], w.shape[0])
    ref = x.double() @ w.double().T
    scale = x.double().abs() @ mag.double().T
    if blocks:  # half a quantization step of x per element, against the weight's magnitude
        xb = x.double().reshape(*x.shape[:-1], -1, GROUP)
        step = (xb.abs().amax(-1, keepdim=True) / 127 / 2).expand_as(xb).reshape(x.shape)
        bound = step @ mag.double().T + 2**-20 * scale
    else:
        bound = 2**-7 * scale
    ratio = float(((y.double() - ref).abs() / bound).max())
    assert ratio <= 1.0, ratio
    return ratio


@pytest.fixture(
    params=[
        pytest.param(
            "blocks",
            marks=pytest.mark.skipif(
                not cpu_kernels.available(), reason="block kernels need an x86 CPU with AVX2 and a C compiler"
            ),
        ),
        "int4pack",
    ]
)
def int4_backend(request, monkeypatch):
    """Each Int4GroupLinear built under this fixture uses the named backend."""
    if request.param == "int4pack":
        monkeypatch.setattr(cpu_kernels, "available", lambda: False)
    return request.param


# ----------------------------------------------------------------------------- 1. Int4GroupLinear
@pytest.mark.parametrize("kind", ALL_NATIVE)
def test_int4_linear_computes_its_dequantized_weight(kind, int4_backend):
    cols = 256 if kind in SUPER_TYPES else 96
    raw = _quantized(48, cols, kind, seed=ALL_NATIVE.index(kind))
    codes, scales, zeros, repeat = decode_blocks(raw, kind, cols)
    assert repeat == REPEAT.get(kind, 1) and codes.shape == (48, repeat * cols)
    assert int(codes.min()) >= 0 and int(codes.max()) <= 15
    lin = Int4GroupLinear(codes, scales, zeros, repeat_input=repeat)
    assert (lin.in_features, lin.out_features, lin.repeat_input) == (cols, 48, repeat)
    assert lin.blocks == (BLOCKS.get(kind, "q4") if int4_backend == "blocks" else None)
    w = dequantize(codes, scales, zeros, repeat)  # the file's weight, exactly (test 2)
    mag = _magnitude(codes, scales, zeros, repeat)
    x = torch.randn(5, 3, cols, generator=torch.Generator().manual_seed(1)).bfloat16().float()
    _assert_int4_matmul(lin, w, mag, x, lin.blocks is not None)
    bias = torch.randn(48)
    lin_b = Int4GroupLinear(codes, scales, zeros, bias, repeat)
    assert torch.equal(lin_b(x), lin(x) + bias)
    # bf16 activations: the same numbers in bf16 give the same bits, returned in bf16
    assert lin(x.bfloat16()).dtype == torch.bfloat16 and torch.equal(lin(x.bfloat16()), lin(x).bfloat16())


@pytest.mark.skipif(not cpu_kernels.available(), reason="block kernels need an x86 CPU with AVX2 and a C compiler")
@pytest.mark.parametrize("kind", SUPER_TYPES)
def test_k_quant_scales_stay_in_their_file_form(kind):
    """On the CPU kernels a K-quant (or IQ4_XS) keeps its scales as the file holds them (native.super_scales: a float16
    factor per 256 elements times an int8 per block or per 16), whose products are decode_blocks' scales: Q6_K, Q3_K,
    Q2_K, IQ4_XS and the grid types give the bits of the float32 scales; Q4_K and Q5_K, whose offsets the float32
    path recomputes (zero - 8 d), stay within the quantized product's bound of the file's weight. The scales take under
    half the bytes. Products that are not the groups' scales (a tampered integer) keep the float32 scales; rows stand
    alone as in the batch; a column cut
    through a super-block keeps float32 scales for that part."""
    from specdist.models.sharding import Cut, take_blocks, take_super_scales

    cols = 512
    raw = _quantized(48, cols, kind, seed=SUPER_TYPES.index(kind) + 40)
    codes, scales, zeros, repeat = decode_blocks(raw, kind, cols)
    factors, ints = native.super_scales(raw, kind, cols)
    per_block = {"Q2_K": 4, "IQ4_XS": 1, **{t: 1 for t in GRID}}.get(kind, 2)  # ints a block
    assert factors.shape[:2] == (48, cols // 256) and ints.shape == (48, cols // GROUP, per_block)
    flt = Int4GroupLinear(codes, scales, zeros, repeat_input=repeat)
    lin = Int4GroupLinear(codes, scales, zeros, repeat_input=repeat, super_scales=(factors, ints))
    assert lin.blocks == flt.blocks == BLOCKS.get(kind, "q4")
    assert lin.scales_and_zeros.dtype == torch.uint8 and flt.scales_and_zeros.dtype == torch.float32
    assert lin.scales_and_zeros.nbytes * 2 < flt.scales_and_zeros.nbytes
    # 9 rows: several tiles of every kind (super-block scales multiplied out once per group), one row each alone
    x = torch.randn(9, cols, generator=torch.Generator().manual_seed(2))
    y = lin(x)
    if kind not in ("Q4_K", "Q5_K"):
        assert torch.equal(y, flt(x))
    _assert_int4_matmul(
        lin, dequantize(codes, scales, zeros, repeat), _magnitude(codes, scales, zeros, repeat), x, True
    )
    assert torch.equal(torch.cat([lin(x[i : i + 1]) for i in range(9)]), y)
    tampered = ints.clone()
    tampered[3, 5, 0] += 1
    assert (
        Int4GroupLinear(
            codes, scales, zeros, repeat_input=repeat, super_scales=(factors, tampered)
        ).scales_and_zeros.dtype
        == torch.float32
    )
    # a row-parallel cut: whole super-blocks on 2 ranks; 4 ranks split them (128 columns each)
    for world, whole in ((2, True), (4, False)):
        cut = Cut(1, (cols,))
        part = take_super_scales(cut, factors, ints, 1, world)
        assert (part is not None) == whole
        if whole:
            blocks = take_blocks(cut, codes, scales, zeros, repeat, 1, world)
            ranked = Int4GroupLinear(*blocks, repeat_input=repeat, super_scales=part)
            assert ranked.scales_and_zeros.dtype == torch.uint8
            xs = x[:, cols // 2 :]
            assert torch.equal(
                ranked(xs),
                Int4GroupLinear(
                    *blocks, repeat_input=repeat, super_scales=(factors[:, 1:], ints[:, cols // 2 // GROUP :])
                )(xs),
            )
            _assert_int4_matmul(ranked, dequantize(*blocks, repeat), _magnitude(*blocks, repeat), xs, True)


def test_int4_linear_from_linear_is_q4_1_rounding(int4_backend):
    torch.manual_seed(0)
    linear = nn.Linear(64, 32, bias=True)
    with torch.no_grad():
        linear.weight.normal_(0.0, 0.35)
    lin = Int4GroupLinear.from_linear(linear)
    w = linear.weight.detach()
    g = w.reshape(32, 2, GROUP)
    lo, hi = g.amin(-1).half().float(), g.amax(-1)  # the minimum and the step as float16 values, as GGUF stores them
    step = ((hi - lo) / 15).half().float()  # [out, G]: the asymmetric min/max rule
    codes = torch.round((g - lo[..., None]) / step[..., None]).clamp(0, 15).reshape(32, 64)
    wq = dequantize(codes, step, lo + 8 * step, 1)
    # half a step, plus the float16 roundings of the minimum (half its ulp) and of the step (15 of its ulps at most)
    bound = (0.5 + 15 * 2**-11) * step + 2**-11 * lo.abs()
    assert float(((wq - w).abs() / bound.repeat_interleave(GROUP, 1)).max()) <= 1.0
    if lin.blocks:
        assert lin.scales_and_zeros.dtype == torch.float16  # read at half the bytes
    mag = _magnitude(codes, step, lo + 8 * step, 1)
    x = torch.randn(7, 64).bfloat16().float()
    _assert_int4_matmul(lambda t: lin(t) - linear.bias.detach(), wq, mag, x, lin.blocks is not None)  # bias: float32
    with pytest.raises(ValueError, match="divisible by 32"):
        Int4GroupLinear.from_linear(nn.Linear(48, 32))
    with pytest.raises(ValueError, match="out_features divisible by 16"):
        Int4GroupLinear.from_linear(nn.Linear(32, 8))


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0", "Q6_K", "Q5_K", "Q3_K", "Q2_K", "IQ4_XS", "IQ2_XS", "IQ1_M"])
def test_int4_linear_rows_do_not_depend_on_the_batch(kind, int4_backend):
    cols = 256 if kind in SUPER_TYPES else 128
    codes, scales, zeros, repeat = decode_blocks(_quantized(64, cols, kind, seed=7), kind, cols)
    lin = Int4GroupLinear(codes, scales, zeros, repeat_input=repeat)
    x = torch.randn(40, cols, generator=torch.Generator().manual_seed(2))
    full = lin(x)
    for m in (1, 2, 3, 7, 16, 17, 33):
        assert torch.equal(lin(x[:m]), full[:m]), m
        assert torch.equal(lin(x[40 - m :]), full[40 - m :]), m
    for i in (0, 5, 39):
        assert torch.equal(lin(x[i : i + 1])[0], full[i])
    assert torch.equal(lin(x.reshape(4, 10, cols)).reshape(40, 64), full)


def _int4_model(family: str, **overrides) -> nn.Module:
    return quantized_copy(build_tiny(family, **overrides), Int4GroupLinear)


def test_fused_int4_projections_equal_their_parts(int4_backend):
    x = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(3))
    # hidden 64: q 64, k/v 32, gate/up 64 rows (qwen2: q/k/v biases) -> every projection fuses
    for family in ("llama", "qwen2"):
        model = _int4_model(family, hidden_size=64)
        assert fuse_projections(model) == 2
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            assert type(attn.fused_qkv.inner) is Int4GroupLinear
            parts = (attn.q_proj, attn.k_proj, attn.v_proj)
            assert all(type(p) is Int4GroupLinear for p in parts)
            assert (attn.q_proj.bias is not None) == (family == "qwen2")
            fused_packed = attn.fused_qkv.inner.packed.untyped_storage().data_ptr()
            for got, p in zip(attn.fused_qkv(x), parts):
                assert torch.equal(got, p(x))
                # the block kernels' packed rows are views of the fused ones (the weights held once); torch's int4
                # layouts are packed again from the codes, the parts keeping their own
                shared = p.packed.untyped_storage().data_ptr() == fused_packed
                assert shared == (int4_backend == "blocks")
            for got, p in zip(mlp.fused_gate_up(x), (mlp.gate_proj, mlp.up_proj)):
                assert torch.equal(got, p(x))
    # hidden 32: k/v have 16 rows, q 32 (a 16-row part between others): everything fuses on either backend
    model = _int4_model("llama")
    assert type(model.model.layers[0].self_attn.k_proj) is Int4GroupLinear
    assert model.model.layers[0].self_attn.k_proj.out_features == 16
    assert fuse_projections(model) == 2
    x32 = x[..., :32]
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for got, p in zip(attn.fused_qkv(x32), (attn.q_proj, attn.k_proj, attn.v_proj)):
            assert torch.equal(got, p(x32))
        for got, p in zip(mlp.fused_gate_up(x32), (mlp.gate_proj, mlp.up_proj)):
            assert torch.equal(got, p(x32))
    # Q8_0 halves (repeat_input 2) and Q4 parts do not concatenate; nor do int4 and int8 parts
    q4 = Int4GroupLinear(*decode_blocks(_quantized(32, 64, "Q4_0", 1), "Q4_0", 64)[:3])
    c, s, z, r = decode_blocks(_quantized(32, 64, "Q8_0", 2), "Q8_0", 64)
    assert _fuse([q4, Int4GroupLinear(c, s, z, repeat_input=r)]) is None
    assert _fuse([q4, Int8WeightOnlyLinear.from_linear(nn.Linear(64, 32))]) is None


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
def test_fused_int4_parts_off_the_tiles_equal_their_parts(kind, int4_backend):
    """Parts of 16, 48 and 16 rows start at rows 16 and 64, off any 32- or 64-row tile of torch's int4 layouts (which
    differ between AVX2, AVX-512 and CUDA): a fusion that slices or concatenates packed rows gives other weights
    there. The fused module gives each part's own output bit for bit, and the dequantized weight's matmul; the parts
    keep their own weights (remove_fusion leaves them working), and on torch's layouts their codes read back exactly."""
    cols, sizes = 64, (16, 48, 16)
    parts, ws, mags, biases = [], [], [], []
    for i, rows in enumerate(sizes):
        codes, scales, zeros, repeat = decode_blocks(_quantized(rows, cols, kind, seed=20 + i), kind, cols)
        bias = torch.randn(rows, generator=torch.Generator().manual_seed(i))  # [rows]
        parts.append(Int4GroupLinear(codes, scales, zeros, bias, repeat))
        if int4_backend == "int4pack":
            assert torch.equal(parts[-1].codes(), codes.to(torch.uint8))
        ws.append(dequantize(codes, scales, zeros, repeat))  # [rows, cols]
        mags.append(_magnitude(codes, scales, zeros, repeat))
        biases.append(bias)
    x = torch.randn(2, 7, cols, generator=torch.Generator().manual_seed(5)).bfloat16().float()
    before = [p(x) for p in parts]  # [2, 7, rows] each
    fused = _fuse(parts)
    assert fused is not None and fused.split_sizes == list(sizes)
    for got, p, y in zip(fused(x), parts, before):
        assert torch.equal(got, p(x)) and torch.equal(p(x), y)
    bias = torch.cat(biases)  # [80]
    _assert_int4_matmul(
        lambda t: torch.cat(fused(t), -1) - bias, torch.cat(ws), torch.cat(mags), x, int4_backend == "blocks"
    )
    if int4_backend == "int4pack":
        storages = {t.untyped_storage().data_ptr() for t in (fused.inner.packed, *(p.packed for p in parts))}
        assert len(storages) == 4


def test_int4_copy_keeps_linears_the_kernel_cannot_take():
    """in_features % 32 (groups) and out_features % 16 (the kernel's row tiles) decide; others stay float."""
    model = build_tiny("llama", vocab_size=8)  # lm_head: 8 rows
    copy = quantized_copy(model, Int4GroupLinear)
    assert type(copy.lm_head) is nn.Linear and torch.equal(copy.lm_head.weight, model.lm_head.weight)
    kinds = collections.Counter(type(m).__name__ for m in copy.modules() if isinstance(m, (nn.Linear, Int4GroupLinear)))
    assert kinds == {"Int4GroupLinear": 14, "Linear": 1}
    assert all(type(m) is nn.Linear for m in model.modules() if isinstance(m, (nn.Linear, Int4GroupLinear)))


# ----------------------------------------------------------------------------- 2. GGUF blocks


@pytest.mark.parametrize("kind", ALL_NATIVE)
def test_decode_blocks_matches_gguf_dequantization(kind, tmp_path):
    rng = np.random.default_rng(11)
    rows, cols = 24, 512 if kind in SUPER_TYPES else 160
    a = (
        rng.standard_normal((rows, cols)) * rng.choice([0.01, 0.3, 5.0], (rows, 1)) + rng.standard_normal((rows, 1))
    ).astype(np.float32)
    a[0] = 0.0  # zero blocks: d = 0
    a[1, :GROUP] = 2.5  # a constant block
    a[2] = 3.0 + rng.standard_normal(cols).astype(np.float32) * 1e-4  # d tiny next to m (Q4_1's extra rounding)
    packers = {
        "Q2_K": q2_k_bytes,
        "Q3_K": q3_k_bytes,
        "Q4_K": q4_k_bytes,
        "Q5_K": q5_k_bytes,
        "Q6_K": q6_k_bytes,
        "IQ4_NL": iq4_nl_bytes,
        "IQ4_XS": iq4_xs_bytes,
    }
    raw = (
        packers[kind](rows, cols, 11)
        if kind in packers
        else grid_bytes(kind, rows, cols, 11)
        if kind in GRID
        else grid16_bytes(kind, rows, cols, 11)
        if kind in GRID16
        else gguf.quants.quantize(a, Q[kind])
    )
    assert raw.dtype == np.uint8 and raw.shape[0] == rows
    want = torch.from_numpy(gguf.quants.dequantize(raw, Q[kind]).copy())
    codes, scales, zeros, repeat = decode_blocks(raw, kind, cols)
    got = dequantize(codes, scales, zeros, repeat)
    assert got.dtype == torch.float32 and got.shape == (rows, cols)
    if kind in ("Q4_1", "Q4_K", "Q5_1", "Q5_K"):  # gguf: d * c + m; here: d * (c - 8) + (m + 8 d), one rounding more
        eps = torch.finfo(torch.float32).eps
        tol = eps * (want.abs() + zeros[:, -cols // GROUP :].repeat_interleave(GROUP, 1).abs())
        assert bool(((got - want).abs() <= tol).all())
    else:
        assert torch.equal(got, want)
    # through a file: the bytes gguf's reader maps (ReaderTensor.data, [rows, bytes per row]) give the same
    writer = gguf.GGUFWriter(str(tmp_path / "t.gguf"), "llama")
    writer.add_tensor("t.weight", raw, raw_dtype=Q[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    (tensor,) = gguf.GGUFReader(str(tmp_path / "t.gguf")).tensors
    assert tensor.tensor_type.name == kind and tensor.data.shape == raw.shape
    assert torch.equal(dequantize(*decode_blocks(tensor.data, kind, cols)), got)


# ----------------------------------------------------------------------------- a tiny GGUF Llama


def expected_native_modules() -> dict[str, str]:
    """Module name -> GGUF type of every linear that runs on blocks."""
    out = {
        f"model.layers.{i}.{HF_NAMES[s]}": t for i in range(LAYERS) for s, t in LINEAR_TYPES[i].items() if t in NATIVE
    }
    out["lm_head"] = HEAD_TYPE
    return out


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> str:
    return write_tiny_gguf(str(tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf"))


def test_the_fast_gguf_reader_parses_what_gguf_parses(tmp_path, tiny_gguf):
    """specdist's reader (array fields as memoryview slices, specdist.models.loader) against gguf's own,
    on the tiny model's file and on one with an array of every scalar type, strings (empty and
    multi-byte), an empty array and a nested array: the same fields, parts (bytes), indices and
    types, and the same values as transformers parses them."""
    from transformers.integrations.ggml import _gguf_parse_value

    from specdist.models.loader import _fast_gguf_reader

    path = str(tmp_path / "arrays.gguf")
    w = gguf.GGUFWriter(path, "llama")
    types = gguf.GGUFValueType
    for t, vals in (
        (types.UINT8, [0, 255]),
        (types.INT8, [-128, 5]),
        (types.UINT16, [1, 65535]),
        (types.INT16, [-3, 3]),
        (types.UINT32, [7, 2**32 - 1]),
        (types.INT32, [-9, 9]),
        (types.FLOAT32, [0.5, -1.25]),
        (types.BOOL, [True, False]),
        (types.UINT64, [2**64 - 1, 1]),
        (types.INT64, [-(2**63), 2]),
        (types.FLOAT64, [1e300, -2.5]),
    ):
        w.add_key_value(f"test.{t.name.lower()}", vals, types.ARRAY, sub_type=t)
    w.add_array("test.strings", ["", "é", "ab c", "x" * 300])
    w.add_array("test.empty", [])
    w.add_array("test.nested", [[1, 2], [3]])
    w.add_uint32("test.scalar", 42)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    for file in (path, tiny_gguf):
        stock_cls = gguf.gguf_reader.GGUFReader  # (gguf.GGUFReader may be specdist's caching wrapper by now)
        fast, stock = _fast_gguf_reader(stock_cls)(file), stock_cls(file)
        assert list(fast.fields) == list(stock.fields)
        for name, a in fast.fields.items():
            b = stock.fields[name]
            assert (a.offset, a.data, a.types) == (b.offset, b.data, b.types), name
            assert [bytes(p) for p in a.parts] == [bytes(p) for p in b.parts], name
            if len(a.types) <= 2:  # (transformers parses no nested arrays)
                assert [_gguf_parse_value(a.parts[i], a.types) for i in a.data] == [
                    _gguf_parse_value(b.parts[i], b.types) for i in b.data
                ], name
        assert [(t.name, t.data_offset) for t in fast.tensors] == [(t.name, t.data_offset) for t in stock.tensors]
    assert fast.fields["tokenizer.ggml.tokens"].contents()[:3] == ["a", "b", "c"]


@pytest.fixture(scope="module")
def gguf_models(tiny_gguf):
    """(tokenizer, float model, native model), float32, from one parse of the file."""
    src = resolve_model(tiny_gguf)
    with gguf_parsed_once():
        return load_tokenizer(src), load_model(src, "float32"), load_model(src, "float32", weights="native")


def test_one_parse_gives_what_separate_parses_give(tiny_gguf, monkeypatch):
    """Inside gguf_parsed_once the header metadata is parsed once (the tokenizer's config and the
    model's config share it), and every caller gets an equal, separate copy of it."""
    import transformers.modeling_gguf_pytorch_utils as gguf_utils

    from specdist.models.loader import _reader_class

    fresh = gguf_utils.load_gguf_checkpoint(tiny_gguf)  # outside: a parse of its own
    parses = []
    reader_cls = _reader_class()  # what gguf.GGUFReader makes inside gguf_parsed_once
    init = reader_cls.__init__
    monkeypatch.setattr(reader_cls, "__init__", lambda self, *a, **k: parses.append(1) or init(self, *a, **k))
    with gguf_parsed_once():
        first = gguf_utils.load_gguf_checkpoint(tiny_gguf)
        first["config"]["model_type"] = "changed by a caller"
        second = gguf_utils.load_gguf_checkpoint(tiny_gguf, return_tensors=False)
    assert second == fresh and len(parses) == 1


def _linears(model: nn.Module) -> dict[str, nn.Module]:
    """The model's own linears (a runner's fused copies, ``fused_*.inner``, left out)."""
    return {n: m for n, m in model.named_modules() if isinstance(m, (nn.Linear, Int4GroupLinear)) and "fused_" not in n}


# ----------------------------------------------------------------------------- 3. use_native_blocks
def test_native_load_replaces_every_block_linear(tiny_gguf, gguf_models):
    _, flt, nat = gguf_models
    want = expected_native_modules()
    lin = _linears(nat)
    assert set(lin) == set(_linears(flt))
    for name, m in lin.items():
        if name in want:
            assert type(m) is Int4GroupLinear, name
            assert m.repeat_input == (2 if want[name] == "Q8_0" else 1), name
        else:
            assert type(m) is nn.Linear, name  # the F16 ffn_down
    assert sorted(n for n, m in lin.items() if type(m) is nn.Linear) == ["model.layers.1.mlp.down_proj"]
    counts = collections.Counter(want.values())
    assert counts == {"Q4_0": 4, "Q4_1": 6, "Q8_0": 4}
    # the function reports the same, by GGUF type
    assert use_native_blocks(unfused_copy(flt), tiny_gguf) == dict(counts)
    # weights: float leaves every linear float, the head tied to the embedding
    assert all(type(m) is nn.Linear for m in _linears(flt).values())
    assert flt.lm_head.weight is flt.get_input_embeddings().weight
    # native: the embedding keeps its float table, the head runs on its own copy of the Q8_0 blocks
    assert torch.equal(nat.get_input_embeddings().weight, flt.get_input_embeddings().weight)
    assert not nat.config.tie_word_embeddings
    nat.tie_weights()  # transformers' re-tie must not undo the untie
    assert type(nat.lm_head) is Int4GroupLinear


def test_native_weights_are_the_files_in_transformers_row_order(tiny_gguf, gguf_models):
    """Probe each native linear with the identity: its weight is the float model's (bf16 scales), q and k
    included, whose GGUF rows are in llama.cpp's order (reading them unpermuted would be far off)."""
    _, flt, nat = gguf_models
    reader = gguf.GGUFReader(tiny_gguf)
    raw = {t.name: t for t in reader.tensors}
    fl = _linears(flt)
    for name, m in _linears(nat).items():
        if type(m) is not Int4GroupLinear:
            continue
        w = fl[name].weight.detach()
        probe = m(torch.eye(m.in_features)).T  # [out, in]
        # bf16 scale / zero and the kernel's bf16 output: 2**-7 of the largest weight of the tensor
        tol = 2**-7 * float(w.abs().max())
        assert float((probe - w).abs().max()) <= tol, name
        if name.endswith(("q_proj", "k_proj")):
            layer = int(name.split(".")[2])
            t = raw[f"blk.{layer}.attn_{name[-6]}.weight"]
            unpermuted = dequantize(*decode_blocks(t.data, t.tensor_type.name, m.in_features))
            assert float((unpermuted - w).abs().max()) > 20 * tol, name  # the permutation matters


def test_q4_k_linears_run_on_their_own_blocks(tmp_path):
    """A file whose linears are Q4_K (what most GGUF files on the Hub hold): every linear runs on Int4GroupLinear
    blocks made from the file's codes, each sub-block a Q4_1 block with scale d * sc and zero 8 d sc - dmin m,
    matching the float weight transformers de-quantized (identity probe, as above); the logits stay close to the
    float model's."""
    path = write_tiny_gguf(
        str(tmp_path / "q4k.gguf"), seed=5, hidden=256, ff=512, linear_types=[dict.fromkeys(HF_NAMES, "Q4_K")] * 2
    )
    src = resolve_model(path)
    with gguf_parsed_once():
        flt, nat = load_model(src, "float32"), load_model(src, "float32", weights="native")
    fl = _linears(flt)
    blocks = {n: m for n, m in _linears(nat).items() if type(m) is Int4GroupLinear and n != "lm_head"}
    assert len(blocks) == 2 * 7 and all(m.repeat_input == 1 for m in blocks.values())
    assert use_native_blocks(unfused_copy(flt), path) == {"Q4_K": 14, "Q8_0": 1}
    for name, m in blocks.items():
        w = fl[name].weight.detach()
        probe = m(torch.eye(m.in_features)).T  # [out, in]
        assert float((probe - w).abs().max()) <= 2**-7 * float(w.abs().max()), name
    ids = torch.tensor([[0, 5, 3, 9, 14, 2, 2, 15, 8, 1, 4, 6]])
    with torch.no_grad():
        a, b = flt(ids).logits, nat(ids).logits
    assert float((a - b).abs().max() / a.abs().max()) <= 0.04


# what llama.cpp's Q2_K, Q3_K_M, Q4_K_M, Q5_K_M, IQ4_XS and IQ3_XXS (grid types) write: Q2_K / Q3_K / Q4_K / Q5_K,
# larger types for value / down projections in some layers and a Q6_K head, and Q5_0 (Q5_1) where a row is not whole
# super-blocks (K-quants need 256 | width); layer 0 of each mixes kinds in q/k/v (no fusion)
K_MIXES = {
    "Q2_K": [
        dict(
            attn_q="Q2_K",
            attn_k="Q2_K",
            attn_v="Q3_K",
            attn_output="Q3_K",
            ffn_gate="Q2_K",
            ffn_up="Q2_K",
            ffn_down="Q4_K",
        ),
        dict(
            attn_q="Q2_K",
            attn_k="Q2_K",
            attn_v="Q4_K",
            attn_output="Q3_K",
            ffn_gate="Q2_K",
            ffn_up="Q2_K",
            ffn_down="Q3_K",
        ),
    ],
    "Q4_K_M": [
        dict(
            attn_q="Q4_K",
            attn_k="Q4_K",
            attn_v="Q6_K",
            attn_output="Q5_0",
            ffn_gate="Q4_K",
            ffn_up="Q4_K",
            ffn_down="Q6_K",
        ),
        dict(
            attn_q="Q5_0",
            attn_k="Q5_0",
            attn_v="Q8_0",
            attn_output="Q4_K",
            ffn_gate="Q5_0",
            ffn_up="Q5_0",
            ffn_down="Q4_K",
        ),
    ],
    "Q3_K_M": [
        dict(
            attn_q="Q3_K",
            attn_k="Q3_K",
            attn_v="Q5_K",
            attn_output="Q4_K",
            ffn_gate="Q3_K",
            ffn_up="Q3_K",
            ffn_down="Q5_K",
        ),
        dict(
            attn_q="Q3_K",
            attn_k="Q3_K",
            attn_v="Q3_K",
            attn_output="Q4_K",
            ffn_gate="Q3_K",
            ffn_up="Q3_K",
            ffn_down="Q4_K",
        ),
    ],
    # llama.cpp's IQ4_XS: IQ4_NL where a row is not whole super-blocks; some projections in a K-quant
    "IQ4_XS": [
        dict(
            attn_q="IQ4_XS",
            attn_k="IQ4_XS",
            attn_v="IQ4_NL",
            attn_output="IQ4_XS",
            ffn_gate="IQ4_XS",
            ffn_up="IQ4_XS",
            ffn_down="Q5_K",
        ),
        dict(
            attn_q="IQ4_XS",
            attn_k="IQ4_XS",
            attn_v="IQ4_XS",
            attn_output="IQ4_NL",
            ffn_gate="IQ4_XS",
            ffn_up="IQ4_XS",
            ffn_down="IQ4_NL",
        ),
    ],
    # the grid types, as llama.cpp's IQ3_XXS / IQ2_XXS / IQ1_S presets mix them with larger types for value projections
    "IQ3_XXS": [
        dict(
            attn_q="IQ3_XXS",
            attn_k="IQ3_XXS",
            attn_v="IQ3_S",
            attn_output="IQ3_S",
            ffn_gate="IQ2_XXS",
            ffn_up="IQ2_XXS",
            ffn_down="IQ1_S",
        ),
        dict(
            attn_q="IQ2_XXS",
            attn_k="IQ2_XXS",
            attn_v="IQ4_XS",
            attn_output="IQ3_XXS",
            ffn_gate="IQ1_S",
            ffn_up="IQ1_S",
            ffn_down="IQ3_S",
        ),
    ],
    # the grid types with a scale per 16, as llama.cpp's IQ2_XS / IQ1_M presets keep value projections wider
    "IQ2_XS": [
        dict(
            attn_q="IQ2_XS",
            attn_k="IQ2_XS",
            attn_v="Q4_K",
            attn_output="IQ2_XS",
            ffn_gate="IQ2_XS",
            ffn_up="IQ2_XS",
            ffn_down="IQ2_S",
        ),
        dict(
            attn_q="IQ1_M",
            attn_k="IQ1_M",
            attn_v="IQ2_S",
            attn_output="IQ2_XS",
            ffn_gate="IQ1_M",
            ffn_up="IQ1_M",
            ffn_down="IQ2_XS",
        ),
    ],
    "Q5_K_M": [
        dict(
            attn_q="Q5_K",
            attn_k="Q5_K",
            attn_v="Q8_0",
            attn_output="Q5_1",
            ffn_gate="Q5_K",
            ffn_up="Q5_K",
            ffn_down="Q6_K",
        ),
        dict(
            attn_q="Q5_1",
            attn_k="Q5_1",
            attn_v="Q5_K",
            attn_output="Q5_K",
            ffn_gate="Q5_1",
            ffn_up="Q5_1",
            ffn_down="Q5_K",
        ),
    ],
}


@pytest.mark.slow
@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("mix", sorted(K_MIXES))
def test_a_k_quant_mix_runs_on_its_own_blocks_layers_as_one_call(tmp_path, mix, device):
    """Q5_0, Q5_1, Q5_K and Q6_K linears run on their blocks too (Q5_0 as Q8_0's signed bytes, Q5_1 and Q5_K as
    bytes with a scale and an offset per block, Q6_K as bytes with a scale per 16; on CUDA, or a CPU without the
    block kernels, Q6_K stays float: four int4 passes would read more than bf16), each the float weight
    transformers de-quantized (identity probe); the logits stay close to the float model's. A layer whose q, k
    and v differ in kind or in their scales' form (no fusion) still runs as one decoder_layer call, with three
    matmuls for q/k/v: its logits are the op-by-op path's up to the call's own silu."""
    from specdist.models.quant import BLOCK_KINDS
    from specdist.models.runner import CausalLMRunner

    types = K_MIXES[mix]
    path = write_tiny_gguf(
        str(tmp_path / f"{mix}.gguf"), seed=6, hidden=256, ff=512, linear_types=types, head_type="Q6_K"
    )
    src = resolve_model(path)
    with gguf_parsed_once():
        flt, nat = load_model(src, "float32", device), load_model(src, "float32", device, weights="native")
    cpu_blocks = device == "cpu" and cpu_kernels.available()
    kind_of = {f"model.layers.{i}.{HF_NAMES[short]}": t for i, layer in enumerate(types) for short, t in layer.items()}
    kind_of["lm_head"] = "Q6_K"  # the tied head
    native_kinds = {n: t for n, t in kind_of.items() if cpu_blocks or t not in native.CPU_BLOCKS_ONLY}
    assert use_native_blocks(unfused_copy(flt), path) == dict(collections.Counter(native_kinds.values()))
    fl = _linears(flt)
    blocks = {n: m for n, m in _linears(nat).items() if type(m) is Int4GroupLinear}
    assert set(blocks) == set(native_kinds)
    assert all(m.blocks == (BLOCKS.get(kind_of[n], "q4") if cpu_blocks else None) for n, m in blocks.items())
    for name, m in blocks.items():
        w = fl[name].weight.detach() if name != "lm_head" else flt.get_input_embeddings().weight.detach()
        probe = m(torch.eye(m.in_features, device=device)).T  # [out, in]
        # torch's int4 kernel (CUDA, or a CPU without the block kernels) takes its (scale, zero) pairs in bfloat16
        # and rounds its output to bfloat16: 2^-9 of |zero| + 8 |scale| + |w|, about 2^-7.4 of max |w|, on top of
        # the re-quantization's own error (seen on an H100: IQ3_XXS 0.0089 of max |w|)
        tol = 2**-7 if m.blocks else 2**-6
        assert float((probe - w).abs().max()) <= tol * float(w.abs().max()), name
    ids = torch.tensor([[0, 5, 3, 9, 14, 2, 2, 15, 8, 1, 4, 6]], device=device)
    with torch.no_grad():
        a, b = flt(ids).logits, nat(ids).logits
    # the inputs' byte rounding, amplified by random weights (seed 6; other seeds move the mixes' ratios between 0.015
    # and 0.77): zero-mean IQ weights leave more of it (0.095 and 0.062 here) than the K-quants' offset ones
    assert float((a - b).abs().max() / a.abs().max()) <= (0.1 if mix.startswith("IQ") else 0.04)
    if not cpu_blocks:
        return
    runner = CausalLMRunner(nat, 1, 40)
    kernels = runner.layer_kernels
    assert all(k is not None for k in kernels)
    half, flags = cpu_kernels.LIN_HALF_SCALES, cpu_kernels.LIN_HALF_SCALES | cpu_kernels.LIN_SUPER_SCALES
    for layer, kernel in zip(types, kernels):  # q/k/v one fused matmul where they share a kernel, else three
        qkv = [BLOCKS.get(layer[s], "q4") for s in ("attn_q", "attn_k", "attn_v")]
        # fused where the kinds and their scales' forms agree (super-block scales only with super-block scales)
        forms = {(b, layer[s] in SUPER_TYPES) for b, s in zip(qkv, ("attn_q", "attn_k", "attn_v"))}
        want = [BLOCK_KINDS[b] for b in (qkv[:1] if len(forms) == 1 else qkv)]
        assert [int(lin.kind) & ~flags for lin in kernel.linears[:3] if lin.n] == want
        assert int(kernel.linears[5].kind) & ~flags == BLOCK_KINDS[BLOCKS.get(layer["ffn_down"], "q4")]
        # the legacy types' scales are float16 values in the file: the kernels read them at that width; the
        # K-quants' in their file's form (a factor per super-block, an integer per block)
        assert (layer["ffn_down"] in LEGACY) <= bool(int(kernel.linears[5].kind) & half)
        assert (layer["ffn_down"] in SUPER_TYPES) <= bool(int(kernel.linears[5].kind) & cpu_kernels.LIN_SUPER_SCALES)
    assert any(
        len({(BLOCKS.get(layer[s], "q4"), layer[s] in SUPER_TYPES) for s in ("attn_q", "attn_k", "attn_v")}) > 1
        for layer in types
    )  # some layer's q/k/v differ in kind or in their scales' form
    slot = runner.cache.allocate()
    one_call = runner.forward([slot], [ids[0].tolist()], [12])
    runner.cache.rollback(slot, 0)
    runner.layer_kernels = [None] * len(kernels)
    op_by_op = runner.forward([slot], [ids[0].tolist()], [12])
    assert float((one_call - op_by_op).abs().max()) <= 1e-3 * float(op_by_op.abs().max())


def _native_rank(rank: int, world_size: int, port: int, out_path: str, args: list[str]) -> None:
    """A tensor-parallel rank: its shard of the GGUF file (``args``: path, weights), the module's ops (rank 0
    keeps the logits), and per projection ``(module type, runs on blocks, CPU kernel or None)``."""
    torch.set_num_threads(1)
    import os

    import torch.distributed as dist
    from support.rank_procs import OPS, run_ops

    from specdist.models.runner import CausalLMRunner
    from specdist.models.sharding import load_sharded
    from workers.tensor_parallel import broadcast_object, init_process_group

    device = f"cuda:{rank}" if os.environ.get("SPECDIST_TEST_DEVICE") == "cuda" else "cpu"
    init_process_group(rank, world_size, "127.0.0.1", port, device)
    model = load_sharded(resolve_model(args[0]), "float32", device, rank, world_size, weights=args[1])
    runner = CausalLMRunner(model, num_slots=2, max_len=32)
    logits = run_ops(runner, OPS if rank == 0 else [None] * len(OPS), broadcast=broadcast_object)
    # the same ops with every layer op by op (a fresh cache), against the layer calls (two a layer, the partial
    # outputs summed between them)
    layer_calls = sum(k is not None and k.reduce is not None for k in runner.layer_kernels)
    op_runner = CausalLMRunner(model, num_slots=2, max_len=32)
    op_runner.layer_kernels = [None] * len(op_runner.layer_kernels)
    op_by_op = run_ops(op_runner, OPS if rank == 0 else [None] * len(OPS), broadcast=broadcast_object)
    kinds, scales = {}, {}  # scales: the packed scales' dtype of each projection on the CPU block kernels
    for name, m in model.named_modules():
        if name.endswith(("_proj", "lm_head")):
            blocks = m if type(m) is Int4GroupLinear else getattr(m, "blocks", None)
            kinds[name] = (type(m).__name__, blocks is not None, getattr(blocks, "blocks", None))
            if getattr(blocks, "blocks", None):
                scales[name] = str(blocks.scales_and_zeros.dtype)
    torch.save(
        {"logits": logits, "kinds": kinds, "layer_calls": layer_calls, "op_by_op": op_by_op, "scales": scales}, out_path
    )
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("device", devices(min_gpus=2))
def test_tensor_parallel_ranks_run_their_part_of_the_blocks(tmp_path, device):
    """Two ranks (gloo; NCCL on two GPUs) load a Q4_K_M-style file natively: each column-parallel projection and
    the vocabulary-parallel head keep their rows' blocks, each row-parallel one (o, down) its input columns'
    blocks (whole blocks of 32, in every input copy of a Q8_0 / Q6_K layout), checked against the rank's float
    slice at load; Q6_K stays float off the CPU kernels. A K-quant part keeps its super-block scales where its
    columns hold whole super-blocks of 256, else float32 ones. On the CPU kernels each rank's layer runs as two
    decoder_layer calls with the all-reduces between them, as its op-by-op path computes it (up to the call's silu). The
    logits of the ragged ops equal one process's native model's up to the order of the row-parallel partial sums
    (all-reduced), which moves an activation's rounding
    now and then; ``weights: float`` keeps floats and computes other numbers."""
    from support.rank_procs import OPS, run_ops, spawn_ranks

    from specdist.models.runner import CausalLMRunner

    cpu_blocks = device == "cpu" and cpu_kernels.available()
    env = {"SPECDIST_TEST_DEVICE": "cuda"} if device == "cuda" else None
    path = write_tiny_gguf(
        str(tmp_path / "tp.gguf"),
        seed=8,
        hidden=256,
        ff=512,
        linear_types=K_MIXES["Q4_K_M"],
        head_type="Q6_K",
        vocab=64,
    )
    with gguf_parsed_once():
        one = CausalLMRunner(
            load_model(resolve_model(path), "float32", "cuda:0" if device == "cuda" else "cpu", weights="native"),
            num_slots=2,
            max_len=32,
        )
    want = run_ops(one, OPS)
    ranks = spawn_ranks(_native_rank, [path, "native"], tmp_path, env_extra=env)
    types = {
        f"model.layers.{i}.{HF_NAMES[short]}": kind
        for i, layer in enumerate(K_MIXES["Q4_K_M"])
        for short, kind in layer.items()
    }
    types["lm_head"] = "Q6_K"
    for r, res in enumerate(ranks):
        for name, kind in types.items():
            on_blocks = cpu_blocks or kind not in native.CPU_BLOCKS_ONLY
            sharded = (
                "VocabParallelLMHead"
                if name == "lm_head"
                else "RowParallelLinear"
                if name.endswith(("o_proj", "down_proj"))
                else "Int4GroupLinear"
                if on_blocks
                else "Linear"
            )
            kernel = BLOCKS.get(kind, "q4") if cpu_blocks and on_blocks else None
            assert res["kinds"][name] == (sharded, on_blocks, kernel), (r, name)
            if kernel:  # K-quant scales in their file's form unless the rank's input columns split a super-block
                split = name.endswith("o_proj")  # 256 inputs: 128 a rank (down_proj: 512, 256 a rank)
                want_dtype = "torch.float16" if kind in LEGACY else "torch.float32" if split else "torch.uint8"
                assert res["scales"][name] == want_dtype, (r, name)
    got = ranks[0]["logits"]
    assert len(got) == len(want)
    # the ranks' layers run as decoder_layer calls where the CPU kernels run (their own silu: within 1e-3)
    assert all(res["layer_calls"] == (len(K_MIXES["Q4_K_M"]) if cpu_blocks else 0) for res in ranks)
    for a, b in zip(got, ranks[0]["op_by_op"]):
        assert float((a - b).abs().max()) <= 1e-3 * float(b.abs().max())
    # measured on the CPU kernels: equal (the byte rounding of the next input absorbed every difference)
    tol = 1e-2 if cpu_blocks else 5e-2  # torch's int4 kernels: bf16 partial sums, all-reduced
    for a, b in zip(got, want):
        assert a.shape == b.shape
        assert float((a - b).abs().max()) <= tol * float(b.abs().max())
        assert float((a.argmax(-1) == b.argmax(-1)).float().mean()) >= 0.9
    floats = spawn_ranks(_native_rank, [path, "float"], tmp_path, env_extra=env)
    assert not any(kind[1] for kind in floats[0]["kinds"].values())
    # the float shards compute other numbers (activations not rounded to bytes): the blocks above were used
    assert max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(floats[0]["logits"], want)) > 1e-4


def test_native_logits_close_to_the_float_models(gguf_models):
    """Same weights (up to bf16 scales), bf16 activations into the linears. Measured max |native - float| /
    max |float logits| = 1.9% on these sequences (on random ones the model run wholly in bf16 is about
    twice as far off); asserted <= 4% (TIE['bfloat16'] is 5%). Larger weights make this random model
    chaotic: at std 0.35 the same measure reaches 13% (18% for the model in bf16), hence std 0.25."""
    _, flt, nat = gguf_models
    ids = torch.tensor([[0, 5, 3, 9, 14, 2, 2, 15, 8, 1, 4, 6], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]])
    with torch.no_grad():
        a, b = flt(ids).logits, nat(ids).logits
    rel = float((a - b).abs().max() / a.abs().max())
    print(f"native vs float logits: max relative error {rel:.4f}")
    assert 0 < rel <= 0.04
    assert float((a.argmax(-1) == b.argmax(-1)).float().mean()) >= 0.9


def test_a_gguf_file_without_blocks_loads_floats_under_auto(tmp_path):
    """A GGUF file whose linears are all F16 (no block type): ``weights: auto`` (the default) keeps transformers'
    floats, ``native`` refuses it naming target.weights, and a self-w4 draft quantizes the floats to int4 groups."""
    path = write_tiny_gguf(
        str(tmp_path / "f16.gguf"), linear_types=[dict.fromkeys(HF_NAMES, "F16")] * 2, head_type="F16"
    )
    src = resolve_model(path)
    with gguf_parsed_once():
        model = load_model(src, "float32", weights="auto")
        assert all(type(m) is nn.Linear for m in _linears(model).values())
        with pytest.raises(ConfigError, match=r"config target\.weights: .* holds no .* to run natively"):
            load_model(src, "float32", weights="native")
        draft = self_draft(model, "self-w4", path)
    assert draft is not model
    # every linear, the head included (untied from the embedding)
    assert collections.Counter(type(m).__name__ for m in _linears(draft).values()) == {"Int4GroupLinear": 15}


def test_native_load_in_bfloat16_passes_the_check(tiny_gguf):
    """A bf16 load rounds transformers' floats once more: the blocks still reproduce them (rtol 2 eps of bf16)."""
    with gguf_parsed_once():
        model = load_model(resolve_model(tiny_gguf), "bfloat16", weights="native")
    assert collections.Counter(type(m).__name__ for m in _linears(model).values()) == {
        "Int4GroupLinear": 14,
        "Linear": 1,
    }
    with torch.no_grad():
        assert model(torch.tensor([[1, 2, 3]])).logits.dtype == torch.bfloat16


def test_wrong_rows_or_tensors_are_refused_naming_the_tensor(tiny_gguf, gguf_models, monkeypatch):
    _, flt, _ = gguf_models
    order = native._row_order

    def identity_for_k1(processor, gguf_name, rows):  # forget the llama.cpp permutation of one k tensor
        return torch.arange(rows) if gguf_name == "blk.1.attn_k.weight" else order(processor, gguf_name, rows)

    with monkeypatch.context() as m:
        m.setattr(native, "_row_order", identity_for_k1)
        with pytest.raises(
            ConfigError,
            match=r"target\.weights.*blk\.1\.attn_k\.weight \(Q4_0\).*model\.layers\.1\."
            r"self_attn\.k_proj.*weights: float",
        ):
            use_native_blocks(unfused_copy(flt), tiny_gguf)
        # a GGUF self-w4 draft of a float target reads the same blocks: the error names draft.method
        with pytest.raises(ConfigError, match=r"draft\.method.*blk\.1\.attn_k\.weight"):
            self_draft(flt, "self-w4", tiny_gguf)

    import transformers.modeling_gguf_pytorch_utils as tf_gguf

    real_map = tf_gguf.get_gguf_hf_weights_map

    def swapped(a: str, b: str):
        def mapping(*args, **kwargs):
            names = real_map(*args, **kwargs)
            if not kwargs.get("qual_name"):  # the whole model's map (it recurses into submodules)
                names[a], names[b] = names[b], names[a]
            return names

        return mapping

    # two tensors of the same shape and type, swapped: the first of them in the file is named
    monkeypatch.setattr(tf_gguf, "get_gguf_hf_weights_map", swapped("blk.0.ffn_gate.weight", "blk.0.ffn_up.weight"))
    with pytest.raises(ConfigError, match=r"target\.weights.*blk\.0\.ffn_gate\.weight \(Q4_0\).*mlp\.up_proj"):
        use_native_blocks(unfused_copy(flt), tiny_gguf)
    # of different shapes: the row count is named
    monkeypatch.setattr(tf_gguf, "get_gguf_hf_weights_map", swapped("blk.0.attn_q.weight", "blk.0.attn_k.weight"))
    with pytest.raises(ConfigError, match=r"target\.weights.*blk\.0\.attn_q\.weight: 64 rows in the file, 32"):
        use_native_blocks(unfused_copy(flt), tiny_gguf)
    monkeypatch.undo()
    # the float model was never touched
    assert all(type(m) is nn.Linear for m in _linears(flt).values())


def test_non_gguf_model_with_native_weights_loads_as_stored(tiny_models):
    src = resolve_model(tiny_models["target"])
    nat, flt = load_model(src, "float32", weights="native"), load_model(src, "float32", weights="float")
    assert all(type(m) is nn.Linear for m in _linears(nat).values())
    a, b = nat.state_dict(), flt.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ----------------------------------------------------------------------------- 4. config
def test_config_target_weights_and_self_w4():
    assert load_config({}).target.weights == "auto"
    for value in ("auto", "native", "float"):
        assert load_config({"target": {"weights": value}}).target.weights == value
    for bad in ("int4", "", None, 4):
        with pytest.raises(ConfigError, match=r"config target\.weights"):
            load_config({"target": {"weights": bad}})
    cluster = {"enabled": True, "tensor_parallel_size": 2, "num_draft_workers": 1}
    for ok in ("auto", "native", "float"):  # every choice on several ranks too (each rank its part of the blocks)
        assert load_config({"target": {"weights": ok}, "cluster": cluster}).target.weights == ok
    cfg = load_config({"target": {"dtype": "bfloat16"}, "draft": {"method": "self-w4", "dtype": "float16"}})
    assert cfg.draft.method == "self-w4" and draft_dtype(cfg) == "bfloat16"  # the target's own copy
    assert draft_traits(load_config({"draft": {"method": "self-w4", "pipeline": True}}).draft).pipelined
    with pytest.raises(ConfigError, match=r"config draft\.method: no draft method 'self-w2'"):
        check_draft(load_config({"draft": {"method": "self-w2"}}).draft)


# ----------------------------------------------------------------------------- 5. engine, self-w4 (tiny, float target)
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def test_self_w4_greedy_equals_plain_greedy(tiny_models):
    """fp32 target: speculative greedy = plain greedy, token for token; the draft is the target's int4 copy."""
    eng = Engine.from_config(tiny_config(tiny_models, method="self-w4", k=3))
    draft = eng.draft_core.runner.model
    kinds = collections.Counter(type(m).__name__ for m in _linears(draft).values())
    assert kinds == {"Int4GroupLinear": 14, "Linear": 1}  # lm_head: 8 rows, the kernel's tiles are 16
    assert all(type(m) is nn.Linear for m in _linears(eng.target_core.runner.model).values())
    plain = Engine.from_config(tiny_config(tiny_models, method="none"))
    spec_out = [o.token_ids for o in eng.generate(PROMPTS, GREEDY)]
    assert spec_out == [o.token_ids for o in plain.generate(PROMPTS, GREEDY)]
    assert eng.stats.drafted > 0 and 0 < eng.stats.accepted < eng.stats.drafted
    assert eng.kv_slots_in_use() == {"target": 0, "draft": 0}


# G-test of the self-w4 engine at temperature 0.8 (tests/support/gtest.py's machinery, as test_exactness_frequency):
# the law of the first 3 tokens after the prompt [1, 2, 3, 1, 2, 3], k = 3 fixed. N = 3000, alpha = 1e-4
# (the false-failure rate of a correct sampler; seeds are fixed, so a run is deterministic); on the
# session's tiny target: df 52, threshold 98.7, G 49.8; acceptance 0.64 (printed). Power: a sampler
# returning the int4 draft's samples has non-centrality ~4800, one resampling from p after a rejection
# ~720 (both detected with power ~1; asserted > 0.999 and > 0.9).
W4_CASE = Case("self-w4", 3, 3, temperature=0.8)
W4_N = 3000


def _draft_table(draft: nn.Module, case: Case) -> dict[tuple, np.ndarray]:
    """The int4 draft's q after every prefix shorter than the window (its own forward, float32 -> float64)."""
    seqs = list(itertools.product(range(VOCAB), repeat=case.window))
    ids = torch.tensor([list(case.prompt) + list(s) for s in seqs])
    with torch.no_grad():
        logits = draft(input_ids=ids).logits.double().numpy()
    table = {}
    for si, s in enumerate(seqs):
        for i in range(case.window):
            table.setdefault(s[:i], transform(logits[si, len(case.prompt) - 1 + i], case.temperature, 0, 1.0)[0])
    return table


def test_self_w4_engine_samples_target_distribution(tiny_models):
    case, n = W4_CASE, W4_N
    ptab, _ = _prob_table(tiny_models["target"], case)
    p = joint(ptab, case.window)
    t0 = time.perf_counter()
    outs = sample_engine(tiny_models, case, n, seed0=44_000_000)
    print(f"\n{case.id}: N={n} in {time.perf_counter() - t0:.2f}s")
    assert len(outs) == n and all(len(o.token_ids) == case.max_tokens for o in outs)
    drafted = np.array([o.metrics.drafted for o in outs])
    accepted = np.array([o.metrics.accepted for o in outs])
    rate = accepted.sum() / drafted.sum()
    everything = int(((drafted > 0) & (accepted == drafted)).sum())
    nothing = int(((drafted > 0) & (accepted == 0)).sum())
    print(f"  acceptance {rate:.3f}; requests with every draft accepted {everything}, with none {nothing}")
    assert 0.2 <= rate <= 0.95 and everything >= n // 50 and nothing >= n // 50  # both paths exercised

    counts = np.bincount([seq_index(o.token_ids[: case.window]) for o in outs], minlength=VOCAB**case.window)
    assert not ((counts > 0) & (p == 0)).any()
    cells = merge_cells(p, n)
    df = len(cells) - 1
    threshold = stats.chi2.isf(ALPHA, df)
    g = g_statistic(counts, p, cells)
    print(f"  G = {g:.1f}, df = {df}, threshold (alpha {ALPHA:g}) = {threshold:.1f}")
    # power, from the int4 draft's own q: the algorithm's law is the target's, draft samples and
    # resampling from p after a rejection would be caught
    qtab = _draft_table(quantized_copy(_hf(tiny_models["target"]), Int4GroupLinear), case)
    assert np.abs(speculative_law(ptab, qtab, case, "exact") - p).max() < 1e-9
    lam, pw_draft = power(joint(qtab, case.window), p, cells, n)
    lam_w, pw_wrong = power(speculative_law(ptab, qtab, case, "resample_from_p"), p, cells, n)
    print(f"  power: draft-only sampler {pw_draft:.6f} (nc {lam:.0f}), resample-from-p {pw_wrong:.4f} (nc {lam_w:.0f})")
    assert pw_draft > 0.999 and pw_wrong > 0.9
    assert g <= threshold, f"G = {g:.1f} > {threshold:.1f} (df {df}, N {n}): not the target distribution"


def _hf(path: str) -> nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


# ----------------------------------------------------------------------------- 6. native target + self draft
def _gguf_config(path: str, method: str) -> dict:
    return {
        "target": {"model": path, "weights": "native"},
        "draft": {"method": method, "num_speculative_tokens": 3, "length_policy": "fixed"},
        "engine": {"max_model_len": 64, "max_batch_size": 8, "device": "cpu"},
    }


def test_native_target_with_self_drafts_matches_plain_decoding(tiny_gguf, gguf_models):
    """Native linears take bf16 activations, so (as in test_dtypes) a position's logits depend in the
    last bits on the forward's shape: every token is the argmax of the plain native target's logits on
    the emitted prefix, or within TIE['bfloat16'] of the float logit scale at a near tie; speculative
    and plain outputs agree up to the first near tie."""
    tok, flt, nat = gguf_models
    # the engine's runner fuses projections and stores half-width weights in the model it is given: a copy,
    # so that the module's other tests see the model as loaded
    plain = Engine(load_config(_gguf_config(tiny_gguf, "none")), copy.deepcopy(nat), tok)
    base = [o.token_ids for o in plain.generate(PROMPTS, GREEDY)]
    runner = plain.target_core.runner
    with torch.no_grad():
        scale = max(float(flt(torch.tensor([p + o])).logits.abs().max()) for p, o in zip(PROMPTS, base))
    tie = TIE["bfloat16"] * scale
    refs = [_reference_logits(runner, p, o) for p, o in zip(PROMPTS, base)]
    clear = sum(_check_greedy(r, o, tie) for r, o in zip(refs, base))
    total = sum(len(o) for o in base)
    whole = 0
    for method in ("self-w4", "self-w8"):
        with gguf_parsed_once():
            eng = Engine.from_config(_gguf_config(tiny_gguf, method))  # loads the file with weights: native
        target, draft = eng.target_core.runner.model, eng.draft_core.runner.model
        assert type(target.lm_head) is Int4GroupLinear
        if method == "self-w4":
            assert draft is target  # already int4 groups: the draft is the target itself
        else:
            assert draft is not target
            assert type(draft.model.layers[1].mlp.down_proj) is Int8WeightOnlyLinear  # the F16 linear
        spec = [o.token_ids for o in eng.generate(PROMPTS, GREEDY)]
        print(f"{method}: acceptance {eng.stats.accepted / eng.stats.drafted:.3f}")
        assert eng.stats.drafted > 0 and eng.stats.accepted > (0.9 if method == "self-w4" else 0.5) * eng.stats.drafted
        c, t, w = _compare_with_plain(runner, PROMPTS, spec, base, refs, tie, method)
        clear, total, whole = clear + c, total + t, whole + w
        assert eng.kv_slots_in_use() == {"target": 0, "draft": 0}
    print(
        f"native target: {clear} of {total} positions clear of near ties (tie {tie:.3f}); "
        f"{whole} of {2 * len(PROMPTS)} speculative outputs identical to plain decoding"
    )
    assert clear >= 0.6 * total  # most positions are clear: the argmax is checked exactly there


def test_self_w4_of_a_float_gguf_target_runs_the_files_blocks(tiny_gguf, gguf_models):
    """weights: float keeps the target float; its self-w4 draft is built from the file's blocks, so it
    computes what the native model computes."""
    _, flt, nat = gguf_models
    draft = self_draft(flt, "self-w4", tiny_gguf)
    assert all(type(m) is nn.Linear for m in _linears(flt).values())  # the target is untouched
    assert {n: type(m) for n, m in _linears(draft).items()} == {n: type(m) for n, m in _linears(nat).items()}
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    with torch.no_grad():
        assert torch.equal(draft(ids).logits, nat(ids).logits)
