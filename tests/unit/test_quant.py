from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from specdist.models.fusion import quantized_copy
from specdist.models.kernels import cpu_kernels
from specdist.models.quant import Int8WeightOnlyLinear, quantize_model_int8


@pytest.fixture
def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(config).eval()


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


# "blocks": the CPU kernels' Q8 path where they run (x86 with AVX2; whole blocks of 32 inputs);
# "torch": torch's int8 kernel, and its dequantizing fallback for 40 inputs (not a multiple of 16)
CASES = [
    pytest.param("blocks", 64, marks=pytest.mark.skipif(not cpu_kernels.available(), reason="no CPU kernels")),
    ("torch", 64),
    ("torch", 40),
]


@pytest.mark.parametrize("backend,in_features", CASES)
@pytest.mark.parametrize("bias", [False, True])
def test_linear_close_to_float(in_features: int, bias: bool, backend: str, monkeypatch) -> None:
    if backend == "torch":
        monkeypatch.setattr(cpu_kernels, "available", lambda: False)
    torch.manual_seed(0)
    linear = nn.Linear(in_features, 48, bias=bias)
    q = Int8WeightOnlyLinear.from_linear(linear)
    assert (q.block_codes is not None) == (backend == "blocks") == (q.weight_int8 is None)
    assert q.codes().dtype == torch.int8 and q.codes().shape == (48, in_features)
    assert q.scales.dtype == torch.bfloat16 and q.scales.shape == (48,)
    assert (q.in_features, q.out_features) == (in_features, 48)
    x = torch.randn(2, 5, in_features)  # [batch, seq, in]
    with torch.no_grad():
        y, ref = q(x), linear(x)  # [2, 5, 48]
    assert y.shape == ref.shape and y.dtype == torch.float32
    assert _rel_err(y, ref) < 0.02


def test_zero_row() -> None:
    linear = nn.Linear(32, 8, bias=False)
    with torch.no_grad():
        linear.weight[3].zero_()
    q = Int8WeightOnlyLinear.from_linear(linear)
    assert q.scales[3].item() == 1.0 and torch.all(q.codes()[3] == 0)
    assert torch.isfinite(q.scales.float()).all()
    with torch.no_grad():
        y = q(torch.randn(4, 32))  # [4, 8]
    assert torch.all(y[:, 3] == 0) and torch.isfinite(y).all()


@pytest.mark.parametrize(
    "backend",
    [pytest.param("blocks", marks=pytest.mark.skipif(not cpu_kernels.available(), reason="no CPU kernels")), "torch"],
)
def test_fused_int8_parts_are_views_of_one_copy(backend, monkeypatch) -> None:
    """q/k/v-like parts fuse into one Int8 linear whose output splits into the parts' outputs; each part's
    codes are a view of the fused ones. On the block kernel, parts of a row count that is not a multiple of
    its groups of 8 rows (13 here) stay apart, and their codes still come back row by row."""
    if backend == "torch":
        monkeypatch.setattr(cpu_kernels, "available", lambda: False)
    from specdist.models.fusion import _fuse

    torch.manual_seed(1)
    linears = [nn.Linear(64, n) for n in (32, 16, 16)]
    parts = [Int8WeightOnlyLinear.from_linear(lin) for lin in linears]
    x = torch.randn(3, 64)
    with torch.no_grad():
        alone = [p(x) for p in parts]
        fused = _fuse(parts)
        assert fused is not None
        for got, want, p in zip(fused(x), alone, parts):
            assert torch.equal(got, want) and torch.equal(p(x), want)
            held = p.block_codes if backend == "blocks" else p.weight_int8
            whole = fused.inner.block_codes if backend == "blocks" else fused.inner.weight_int8
            assert held.untyped_storage().data_ptr() == whole.untyped_storage().data_ptr()
        odd = [Int8WeightOnlyLinear.from_linear(nn.Linear(64, n)) for n in (13, 16)]
        assert (_fuse(odd) is None) == (backend == "blocks")
        w = torch.randint(-127, 128, (13, 64), dtype=torch.int8)
        q = Int8WeightOnlyLinear(w, torch.full((13,), 0.5))
        assert torch.equal(q.codes(), w)
        assert _rel_err(q(x), x @ (w.float() * 0.5).T) < 0.02


def test_quantized_copy_leaves_original(tiny_llama: LlamaForCausalLM) -> None:
    before = {k: v.clone() for k, v in tiny_llama.state_dict().items()}
    draft = quantized_copy(tiny_llama)
    for k, v in tiny_llama.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert tiny_llama.lm_head.weight is tiny_llama.model.embed_tokens.weight
    assert tiny_llama.config.tie_word_embeddings
    assert not any(isinstance(m, Int8WeightOnlyLinear) for m in tiny_llama.modules())

    assert not any(isinstance(m, nn.Linear) for m in draft.modules())
    n_linear = sum(isinstance(m, nn.Linear) for m in tiny_llama.modules())
    assert sum(isinstance(m, Int8WeightOnlyLinear) for m in draft.modules()) == n_linear
    assert isinstance(draft.lm_head, Int8WeightOnlyLinear)
    embed = draft.model.embed_tokens.weight
    assert embed.dtype == torch.float32 and torch.equal(embed, tiny_llama.model.embed_tokens.weight)
    assert embed.data_ptr() != tiny_llama.model.embed_tokens.weight.data_ptr()
    draft.tie_weights()  # must not re-tie the int8 lm_head to the float embedding
    assert not hasattr(draft.lm_head, "weight")


def test_skip(tiny_llama: LlamaForCausalLM) -> None:
    quantize_model_int8(tiny_llama, skip=lambda name: name == "lm_head")
    assert type(tiny_llama.lm_head) is nn.Linear
    assert isinstance(tiny_llama.model.layers[0].self_attn.q_proj, Int8WeightOnlyLinear)


def test_hf_forward_and_generate(tiny_llama: LlamaForCausalLM) -> None:
    draft = quantized_copy(tiny_llama)
    ids = torch.randint(0, 64, (2, 12))  # [batch, seq]
    with torch.inference_mode():
        ref = tiny_llama(ids).logits  # [2, 12, vocab]
        got = draft(ids).logits  # [2, 12, vocab]
        assert got.shape == ref.shape
        cos = torch.nn.functional.cosine_similarity(got.flatten(0, 1), ref.flatten(0, 1), dim=-1)  # [24]
        assert cos.min().item() > 0.99
        agree = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
        assert agree >= 0.8
        out = draft.generate(ids[:1], max_new_tokens=5, do_sample=False)  # [1, 17]
    assert out.shape[0] == 1 and 12 < out.shape[1] <= 17  # may stop early at eos


def test_self_w8_is_refused_on_cuda_in_one_line() -> None:
    """torch's CUDA int8 weight-only matmul is a naive kernel, slower than the target a self-w8 copy drafts for:
    quantizing CUDA weights to int8 is refused naming draft.method, before any linear is replaced. The weights are
    fake CUDA tensors (shapes and a device, no GPU needed)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from specdist.errors import ConfigError

    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 16, bias=False))
    with FakeTensorMode():
        for lin in model:
            lin.weight = nn.Parameter(torch.empty(lin.weight.shape, device="cuda"))
        assert model[0].weight.device.type == "cuda"
        with pytest.raises(ConfigError) as e:
            quantize_model_int8(model)
    assert e.value.key == "draft.method" and "\n" not in str(e.value), str(e.value)
    assert "'self-w8' does not run on CUDA" in e.value.message and "'self-w4'" in e.value.message
    assert all(type(m) is nn.Linear for m in model)  # nothing replaced


def _tinygemm_checks(x: torch.Tensor, packed: torch.Tensor, group: int, sz: torch.Tensor) -> None:
    """The argument checks of torch's CUDA int4 kernels (aten/src/ATen/native/cuda/int4mm.cu,
    ``_weight_int4pack_mm_cuda`` and ``_convert_weight_to_int4pack_cuda``), which the meta kernels leave out."""
    inner = packed.shape[3] * 2  # k tiles of 16 columns packed together
    k, n = x.shape[1], packed.shape[0] * 8
    assert inner in (2, 4, 8) and k % (inner * 16) == 0  # the conversion's checks
    assert x.dtype == torch.bfloat16 and x.is_contiguous() and x.dim() == 2
    assert packed.dtype == torch.int32 and packed.is_contiguous() and packed.dim() == 4
    assert packed.shape[1] == k // (inner * 16) and packed.shape[2] == 32
    assert group in (32, 64, 128, 256) and k >= group and k % group == 0
    assert sz.dim() == 3 and sz.shape[1] == n and sz.shape[2] == 2 and sz.shape[0] == k // group
    assert sz.dtype == torch.bfloat16 and sz.is_contiguous()


# (out, in, repeat_input): the built-in model's projections (hidden 576, ff 1536), a 1 B target's (2048, 5632),
# Qwen2.5-0.5B's (896, 4864), tiny test models' (96 inputs: 2 inner k tiles) and GGUF's Q8_0 / Q6_K segment layouts
CUDA_SHAPES = [
    (576, 576, 1),
    (1536, 576, 1),
    (576, 1536, 1),
    (5632, 2048, 1),
    (2048, 5632, 1),
    (4864, 896, 1),
    (896, 4864, 1),
    (64, 96, 1),
    (576, 576, 2),
    (896, 4864, 4),
]


@pytest.mark.parametrize("out_features,in_features,repeat", CUDA_SHAPES)
def test_the_cuda_int4_layout_fits_torch_s_kernel(out_features: int, in_features: int, repeat: int) -> None:
    """self-w4 on CUDA runs torch's int4 kernel (tinygemm): the codes packed for CUDA, the (scale, zero) pairs and
    the bf16 activations as Int4GroupLinear makes them pass that kernel's checks, at the shapes of the supported
    families. Fake meta tensors: torch's meta kernels give the CUDA layouts' shapes, no GPU needed."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from specdist.models.quant import GROUP, int4_mm, int4_scales_and_zeros, pack_int4

    k = in_features * repeat
    with FakeTensorMode():
        packed = pack_int4(torch.empty(out_features, k, dtype=torch.uint8, device="meta"), "cuda")
        groups = torch.empty(out_features, k // GROUP, device="meta")  # [out, G] scales (and zeros)
        sz = int4_scales_and_zeros(groups, groups)
        x = torch.empty(3, in_features, device="meta").to(torch.bfloat16).repeat(1, repeat).contiguous()
        _tinygemm_checks(x, packed, GROUP, sz)
        y = int4_mm("cuda")(x, packed, GROUP, sz)
    assert tuple(y.shape) == (3, out_features) and y.dtype == torch.bfloat16
