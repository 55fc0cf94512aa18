"""Half-width storage of float32 weights (specdist.models.dtypes.HalfStoredLinear): a bf16 or fp16 checkpoint
loaded in float32 keeps its dense layers' and its head's weights in that dtype on the CPU, and every forward
gives the bits the float32 weights give (the kernels convert each element exactly as they load it; torch's
GEMM past the kernels' rows multiplies the converted weights)."""

import copy

import pytest
import torch

from specdist.models.dtypes import HalfStoredEmbedding, HalfStoredLinear, half_width
from specdist.models.kernels import cpu_kernels
from specdist.models.runner import CausalLMRunner

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="the CPU kernels need x86 with AVX2")


def _rounded(model: torch.nn.Module, first_layer: torch.dtype = torch.bfloat16) -> torch.nn.Module:
    """``model`` with every matrix rounded to bfloat16 values (layer 0's to ``first_layer``'s), as a checkpoint
    in that dtype loads in float32."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                dt = first_layer if ".layers.0." in name else torch.bfloat16
                p.copy_(p.to(dt).float())
    return model


def _tiny(tied: bool, seed: int = 3) -> torch.nn.Module:
    from support.model_zoo import build_tiny

    return build_tiny(
        "llama", seed=seed, vocab_size=40, hidden_size=64, num_hidden_layers=3, tie_word_embeddings=tied
    ).requires_grad_(False)


def _calls(runner: CausalLMRunner) -> list[torch.Tensor]:
    """Logits of a prefill, decode steps of 1 and 3 tokens for two requests, a 7-token verification, and a call
    of more rows than the kernels take (torch's GEMM), in that order on the same two slots."""
    slots = [runner.cache.allocate() for _ in range(2)]
    g = torch.Generator().manual_seed(5)
    rnd = lambda n: torch.randint(0, 40, (n,), generator=g).tolist()  # noqa: E731
    out = [runner.forward(slots, [rnd(9), rnd(5)], [1, 1])]
    out.append(runner.forward(slots, [rnd(1), rnd(1)], [1, 1]))
    out.append(runner.forward(slots, [rnd(3), rnd(3)], [3, 3], packed=True))
    out.append(runner.forward(slots[:1], [rnd(7)], [7]))
    n = cpu_kernels.F32_MAX_ROWS // 2 + 3  # two requests: more rows than F32_MAX_ROWS
    out.append(runner.forward(slots, [rnd(n), rnd(n)], [n, n]))
    for s in slots:
        runner.cache.free(s)
    return out


@pytest.mark.parametrize("tied", [False, True])
def test_half_stored_weights_give_the_float32_bits(tied):
    """Layers 1-2 exact in bf16 hold bf16, layer 0 exact only in fp16 holds fp16, the head holds bf16 (a tied
    embedding looks up its rows in the head's table, an untied one keeps float32); prefill, decode, verification
    and a call past the kernels' rows give the float32 runner's logits bit for bit, and the layers' weights take
    half the bytes."""
    model = _rounded(_tiny(tied), first_layer=torch.float16)
    full = CausalLMRunner(copy.deepcopy(model), 2, 128, half_storage=False)
    half = CausalLMRunner(model, 2, 128)
    layer = half.layers
    dtypes = [
        (type(m), m.weight.dtype)
        for m in (
            layer[0].mlp.down_proj,
            layer[1].mlp.down_proj,
            layer[2].self_attn.fused_qkv.inner,
            half.model.lm_head,
        )
    ]
    assert dtypes == [(HalfStoredLinear, torch.float16)] + [(HalfStoredLinear, torch.bfloat16)] * 3
    embed = half.model.model.embed_tokens
    if tied:  # one bf16 table for the head and the lookups, as the tie kept one float32 table
        assert type(embed) is HalfStoredEmbedding and embed.weight is half.model.lm_head.weight
    else:
        assert type(embed) is torch.nn.Embedding and embed.weight.dtype == torch.float32
    assert all(k is not None and k.dense for k in half.layer_kernels)
    kinds = {int(lin.kind) for k in half.layer_kernels for lin in k.linears if lin.n}
    assert kinds == {cpu_kernels.LIN_BF16, cpu_kernels.LIN_F16}

    def layer_weight_bytes(r):  # the storage the layers' matmul weights keep alive (fused parts are views)
        storages = {
            m.weight.untyped_storage().data_ptr(): m.weight.untyped_storage().nbytes()
            for layer in r.layers
            for m in layer.modules()
            if type(m) in (torch.nn.Linear, HalfStoredLinear)
        }
        return sum(storages.values())

    assert 2 * layer_weight_bytes(half) == layer_weight_bytes(full)
    for got, want in zip(_calls(half), _calls(full)):
        assert torch.equal(got, want)
    ids = torch.tensor([[1, 7, 3, 9, 2]])  # transformers' own forward runs on the half-width modules too
    assert torch.equal(half.model(ids).logits, full.model(ids).logits)


def test_weights_no_half_dtype_holds_stay_float32():
    """Random float32 weights are exact in neither half dtype: nothing changes."""
    runner = CausalLMRunner(_tiny(False), 2, 64)
    assert not any(type(m) is HalfStoredLinear for m in runner.model.modules())
    assert half_width(torch.tensor([[1.0, 1 + 2**-12]])) is None
    assert half_width(torch.tensor([[1.0, float("nan")]])) is None
    assert half_width(torch.tensor([[1.0, 1 + 2**-9]])).dtype == torch.float16
    assert half_width(torch.tensor([[1.0, 2.0**100]])).dtype == torch.bfloat16


def test_a_low_bit_copy_of_a_half_stored_model_quantizes_every_linear():
    """A self draft made from a target a runner already holds in half width (engines over one model) quantizes
    the half-width linears as it would the float32 ones: the same int8 codes."""
    from specdist.models.fusion import quantized_copy
    from specdist.models.quant import Int8WeightOnlyLinear

    model = _rounded(_tiny(True))
    want = quantized_copy(copy.deepcopy(model))
    CausalLMRunner(model, 1, 64)
    got = quantized_copy(model)
    assert not any(type(m) in (torch.nn.Linear, HalfStoredLinear) for m in got.modules())
    pairs = [(a, b) for a, b in zip(got.modules(), want.modules()) if type(a) is Int8WeightOnlyLinear]
    assert len(pairs) == 3 * 7 + 1  # every layer's seven projections and the head
    assert all(torch.equal(a.codes(), b.codes()) and torch.equal(a.scales, b.scales) for a, b in pairs)
