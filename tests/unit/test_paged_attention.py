"""The paged KV cache and its attention backend.

- :class:`~specdist.models.kv.paged.PagedKVCache`: blocks taken as sequences grow and returned on
  rollback, prefix sharing with copy on write, reservations, memory per token held;
- the Triton kernels of :mod:`specdist.models.kernels.triton_attention` against the torch reference of
  :mod:`specdist.models.backends.paged`: on the CPU under Triton's interpreter (float32 / float16), on a GPU
  compiled (bfloat16 and float32);
- the runner and the engine over the paged cache: the same logits and greedy tokens as the slot cache,
  on the CPU and (cuda) with CUDA graphs, and 64 requests of 100 tokens in the memory that 8 slots of
  2048 tokens take.
"""

from __future__ import annotations

import pytest
import torch
from support.helpers import devices, tiny_config
from support.kernel_checks import run_interpreted
from support.paged_kernels_check import (
    ATTENTION_CASES,
    SPLIT_CASES,
    check_attention,
    check_rope,
    check_split_attention,
    check_tanh,
)

from specdist import SamplingParams
from specdist.engine.local import Engine
from specdist.models.kv.options import KVOptions
from specdist.models.kv.paged import KVCacheFull, PagedKVCache
from specdist.models.kv.slots import SlotKVCache
from specdist.models.runner import CausalLMRunner


def _tiny_llama(seed: int = 0, **over):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = dict(
        vocab_size=50,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    cfg.update(over)
    return LlamaForCausalLM(LlamaConfig(**cfg)).eval()


# --------------------------------------------------------------------------- the cache
def _paged(num_blocks=20, block_size=4, slots=4, max_len=32):
    return PagedKVCache(1, slots, 1, 2, max_len, num_blocks, block_size)


def test_blocks_are_taken_as_a_sequence_grows_and_returned_on_rollback():
    c = _paged()
    s = c.allocate(20)
    c.ensure(s, 9)  # positions 0..8: blocks for 3 x 4
    c.lengths[s] = 9
    assert len(c.tables[s]) == 3 and c.blocks_in_use == 3
    c.rollback(s, 5)  # 2 blocks hold 5 tokens: the third goes back
    assert len(c.tables[s]) == 2 and c.blocks_in_use == 2
    c.rollback(s, 4)
    assert len(c.tables[s]) == 1
    c.free(s)
    assert c.blocks_in_use == 0 and c.num_free == 4
    assert 0 not in c._free_blocks  # the scratch block is never handed out


def test_a_shared_prefix_shares_full_blocks_and_copies_on_write():
    c = _paged()
    a = c.allocate(20)
    c.ensure(a, 10)
    for p in range(10):  # K of position p = p
        c.k[0][c.tables[a][p // 4], p % 4] = p
    c.lengths[a] = 10
    b = c.allocate(20)
    c.copy_prefix(c, a, b, 10)  # 2 full blocks shared, the partial third copied
    assert c.tables[b][:2] == c.tables[a][:2] and c.tables[b][2] != c.tables[a][2] and c.copies == 1
    assert [c.refs[x] for x in c.tables[a]] == [2, 2, 1]
    c.rollback(b, 6)  # b now writes position 6, inside the shared second block: copied first
    c.ensure(b, 8)
    assert c.tables[b][1] != c.tables[a][1] and c.copies == 2
    c.k[0][c.tables[b][1], 2] = -1
    assert c.k[0][c.tables[a][1], 2, 0, 0] == 6  # the reader's block is unchanged
    assert c.k[0][c.tables[b][1], 1, 0, 0] == 5  # the copy kept what b still holds
    c.free(a)
    c.free(b)
    assert c.blocks_in_use == 0


def test_reservations_bound_what_the_live_sequences_may_take():
    c = _paged(num_blocks=9, block_size=4, max_len=32)  # 8 usable blocks
    a = c.allocate(20)  # 5 blocks reserved
    assert c.can_allocate(12) and not c.can_allocate(13)
    c.allocate(12)
    with pytest.raises(KVCacheFull):
        c.allocate(1)
    c.reserve(a, 0)  # a finished request's slot kept for reuse holds only its blocks
    assert c.can_allocate(20)


def test_64_requests_of_100_tokens_fit_where_8_slots_of_2048_do_today(tiny_models):
    """The bytes of 8 slots of 2048 tokens (the slot cache's ``8 * 2049`` positions a layer) hold 64 running
    requests of 100 tokens (20 prompt, 80 output) in the paged cache: all 64 are admitted in one step and run
    together, and every block comes back."""
    cfg = tiny_config(
        tiny_models,
        method="none",
        max_batch_size=64,
        max_model_len=2048,
        kv_cache="paged",
        kv_cache_tokens=8 * 2048 - 16,
        prefix_caching=False,
    )  # 1023 blocks of 16 and the scratch block
    eng = Engine.from_config(cfg)
    cache = eng.target_core.cache
    layers, heads, dim = len(cache.k), cache.k[0].shape[2], cache.k[0].shape[3]
    slots = SlotKVCache(layers, 8, heads, dim, 2048, cache.k[0].dtype)

    def nbytes(c):
        return sum(t.numel() * t.element_size() for t in c.k + c.v)

    assert nbytes(cache) <= nbytes(slots)
    prompts = [[1 + (i % 5), 2, 3, 4, 5, 6, 7, 1, 2, 3] * 2 for i in range(64)]  # 20 tokens each
    for p in prompts:
        eng.add_request(p, SamplingParams(max_tokens=80, temperature=0.0, ignore_eos=True))
    eng.step()
    assert len(eng.running) == 64 and not eng.waiting
    peak = 0
    while eng.running:
        eng.step()
        peak = max(peak, cache.blocks_in_use)
    assert peak <= 64 * 7  # 100 tokens: 7 blocks of 16 a request
    assert cache.blocks_in_use == 0 and eng.kv_slots_in_use() == {"target": 0}


# --------------------------------------------------------------------------- the kernels
@pytest.mark.slow
def test_the_kernels_under_triton_s_interpreter_equal_the_reference():
    """float32 and float16, sliding windows and soft-caps, grouped-query heads, ragged requests, padded rows;
    split-KV over long contexts (ranges past the short rows' keys, a prefill of two row blocks); the soft-cap's
    tanh within 2.5 float32 epsilons of float64's; full and partial rotary. In a process of its own
    (tests/support/paged_kernels_check.py: the interpreter must be on before Triton is imported)."""
    out = run_interpreted("paged_kernels_check.py", timeout=300)
    assert out.count(": ok") == 1 + 2 * (len(ATTENTION_CASES) + len(SPLIT_CASES) + 1 + 2), out


CUDA = devices()[1].marks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window,softcap", ATTENTION_CASES)
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_compiled_attention_kernel_equals_the_reference(dtype, window, softcap):
    assert check_attention("cuda", dtype, window, softcap) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window,softcap,splits", SPLIT_CASES)
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_compiled_split_kv_kernels_equal_the_reference(dtype, window, softcap, splits):
    assert check_split_attention("cuda", dtype, window, softcap, splits) is None
    assert check_split_attention("cuda", dtype, 64, softcap, splits or 3, t_pad=20) is None  # a prefill


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_compiled_soft_cap_tanh_is_as_exact_as_torch_s():
    """The GPU's exp and division are approximate: the soft-cap's tanh still within 2.5 float32 epsilons."""
    assert check_tanh("cuda") is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rotary", [32, 16])
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_compiled_rope_kernel_equals_the_reference(dtype, rotary):
    assert check_rope("cuda", dtype, rotary) is None


# --------------------------------------------------------------------------- runner and engine
@pytest.mark.parametrize("device", devices())
def test_the_paged_runner_gives_the_slot_runners_logits(device):
    """Prefill, ragged verification, rollback and a shared prefix: the paged runner's logits are the slot
    runner's (float32; on a GPU the paged kernels, with and without CUDA graphs)."""
    model = _tiny_llama().to(device)
    a = CausalLMRunner(model, 4, 64, kv=KVOptions("slots"))
    b = CausalLMRunner(model, 4, 64, kv=KVOptions("paged", block_size=4))
    if device == "cuda":
        b.capture_graphs(max_tokens=4, log=lambda line: None)
    sa, sb = [a.cache.allocate() for _ in range(3)], [b.cache.allocate(40) for _ in range(3)]
    prompts = [[1, 2, 3, 4, 5, 6, 7], [8, 9, 10], list(range(11, 22))]
    for tokens, n_logits in ((prompts, [2, 1, 3]), ([[5, 6], [7], [1, 2, 3, 4]], [2, 1, 4]), ([[9]] * 3, [1] * 3)):
        want = a.forward(sa, tokens, n_logits, packed=True)
        got = b.forward(sb, tokens, n_logits, packed=True)
        assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), (got - want).abs().max()
        for cache, slots in ((a.cache, sa), (b.cache, sb)):
            cache.rollback(slots[2], cache.lengths[slots[2]] - 1)


def test_the_paged_engine_gives_the_slot_engines_tokens(tiny_models):
    """Greedy and seeded sampled outputs, model drafts and suffix drafts: the same tokens through either cache."""
    for method in ("model", "suffix", "none"):
        outs = {}
        for kv in ("slots", "paged"):
            eng = Engine.from_config(
                tiny_config(tiny_models, method=method, k=3, max_batch_size=4, kv_cache=kv, kv_block_size=4)
            )
            prompts = [[1, 2, 3, 4, 5], [6, 7, 1], [2] * 12, [3, 4, 5, 6, 1, 2, 3, 4, 5, 6, 1, 2, 3]]
            params = [
                SamplingParams(max_tokens=16, temperature=0.0 if i % 2 else 0.9, seed=i, ignore_eos=True)
                for i in range(4)
            ]
            outs[kv] = [o.token_ids for o in eng.generate(prompts, params)]
            assert eng.kv_slots_in_use()["target"] == 0
        assert outs["slots"] == outs["paged"], method


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_graph_replay_equals_the_eager_paged_pass_on_cuda():
    """The logits a captured graph gives are the eager paged pass's (float32: the graph's padded shapes run other
    GEMM tilings, so equal up to rounding), ragged batches of every bucket."""
    model = _tiny_llama(hidden_size=128, num_attention_heads=8, num_key_value_heads=2).to("cuda")
    eager = CausalLMRunner(model, 8, 128, kv=KVOptions("paged", block_size=16))
    graphed = CausalLMRunner(model, 8, 128, kv=KVOptions("paged", block_size=16))
    seconds = graphed.capture_graphs(max_tokens=5, log=lambda line: None)
    assert seconds < 60 and len(graphed.graphs.graphs) == 4 * 4  # batches 1, 2, 4, 8 x tokens 1, 2, 4, 8
    for bsz in (1, 3, 8):
        se = [eager.cache.allocate(100) for _ in range(bsz)]
        sg = [graphed.cache.allocate(100) for _ in range(bsz)]
        prompts = [[(7 * b + i) % 50 for i in range(5 + b)] for b in range(bsz)]
        eager.forward(se, prompts, [0] * bsz)
        graphed.forward(sg, prompts, [0] * bsz)  # a prefill: no logits, eager in both
        for step in range(3):
            tokens = [[(b + step) % 50] * (1 + (b + step) % 4) for b in range(bsz)]  # ragged: 1-4 tokens
            n = [len(t) for t in tokens]
            want = eager.forward(se, tokens, n, packed=True)
            got = graphed.forward(sg, tokens, n, packed=True)
            assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), (bsz, step, (got - want).abs().max())
        for s in se:
            eager.cache.free(s)
        for s in sg:
            graphed.cache.free(s)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_cuda_engine_with_graphs_gives_plain_decodings_tokens(tiny_models):
    """float32 on the GPU (no TF32): suffix drafts through the paged kernels and CUDA graphs give the tokens plain
    decoding gives, and a step synchronises with the host once."""
    cfg = tiny_config(tiny_models, method="suffix", k=4, max_batch_size=8, device="cuda")
    spec = Engine.from_config(cfg)
    plain = Engine.from_config(tiny_config(tiny_models, method="none", max_batch_size=8, device="cuda"))
    assert spec.target_core.runner.graphs is not None and spec.target_core.cache.paged
    prompts = [[1, 2, 3, 1, 2, 3, 1, 2], [4, 5, 6, 4, 5, 6], [2, 2, 2, 2, 2]]
    sp = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    assert [o.token_ids for o in spec.generate(prompts, sp)] == [o.token_ids for o in plain.generate(prompts, sp)]


def test_the_graph_buckets_give_the_eager_pass_s_logits_and_carry_the_callers_words(tiny_models):
    """The graphs' static-buffer path (replayed eagerly: no CUDA here): padded buckets, ragged requests, the
    logits rows picked from the bucket's output, and a verification's sampling inputs in the buffer's tail: the
    same tokens as the eager paged pass, greedy and sampled, model and suffix drafts."""
    for method in ("model", "suffix"):
        outs = []
        for graphs in (False, True):
            eng = Engine.from_config(
                tiny_config(tiny_models, method=method, k=3, max_batch_size=4, kv_cache="paged", kv_block_size=4)
            )
            if graphs:
                lines = []
                eng.target_core.runner.capture_graphs(max_tokens=4, log=lines.append, eager_replay=True)
                assert len(lines) == 3 * 3 + 1  # batches 1, 2, 4 x tokens 1, 2, 4, then the whole
                if eng.draft_core.runner is not None:
                    eng.draft_core.runner.capture_graphs(max_tokens=2, log=lines.append, eager_replay=True)
            prompts = [[1, 2, 3, 4, 5], [6, 7, 1], [2] * 12]
            params = [
                SamplingParams(
                    max_tokens=14,
                    temperature=0.0 if i == 1 else 0.9,
                    top_p=0.9,
                    seed=i,
                    ignore_eos=True,
                    logprobs=1 if i == 2 else None,
                )
                for i in range(3)
            ]
            outs.append(eng.generate(prompts, params))
        eager, graphed = outs
        assert [o.token_ids for o in eager] == [o.token_ids for o in graphed], method
        # the bucket's padded shapes run other GEMM tilings: the log-probabilities agree up to rounding
        for a, b in zip(eager[2].logprobs, graphed[2].logprobs):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-5) and [t for t, _ in a.top] == [t for t, _ in b.top]
