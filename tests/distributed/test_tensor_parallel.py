"""Tensor-parallel target (specdist.models.sharding over gloo): 2 ranks reproduce the unsharded logits.

Each rank is a process forked from a server that imported torch once (tests/support/rank_procs.py); the
parent picks a free localhost port, waits with a timeout and kills stragglers. No Ray. One pair of rank
processes serves the whole module: it loads every checkpoint in turn (sharded), runs the same
ragged ops on each and saves what it saw; the tests compare that with the unsharded runner.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
from support.helpers import devices
from support.rank_procs import OPS, WORLD_SIZE, run_ops, spawn_ranks


def _shapes(model, runner) -> dict:
    layer = model.model.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    out = {"o": attn.o_proj.weight.shape, "lm_head": model.lm_head.weight.shape, "cache": runner.cache.k[0].shape}
    for name in ("q_proj", "k_proj", "v_proj", "qkv_proj"):
        if hasattr(attn, name):
            out[name[:-5]] = getattr(attn, name).weight.shape
    for name in ("gate_proj", "gate_up_proj", "down_proj"):
        if hasattr(mlp, name):
            out[name[:-5]] = getattr(mlp, name).weight.shape
    return {k: tuple(v) for k, v in out.items()}


def _worker(rank: int, world_size: int, port: int, out_path: str, ckpts: list[str]) -> None:
    torch.set_num_threads(1)
    import torch.distributed as dist

    from specdist.models.loader import ModelSource
    from specdist.models.runner import CausalLMRunner
    from specdist.models.sharding import load_sharded
    from workers.tensor_parallel import broadcast_object, control_group, init_process_group

    # SPECDIST_TEST_DEVICE=cuda: one GPU per rank, NCCL collectives (the same code, chosen by device)
    device = f"cuda:{rank}" if os.environ.get("SPECDIST_TEST_DEVICE") == "cuda" else "cpu"
    init_process_group(rank, world_size, "127.0.0.1", port, device)
    init_process_group(rank, world_size, "127.0.0.1", port, device)  # idempotent
    results = []
    for ckpt in ckpts:
        model = load_sharded(ModelSource(ckpt, None), "float32", device, rank, world_size)
        runner = CausalLMRunner(model, num_slots=2, max_len=32)
        logits = run_ops(runner, OPS if rank == 0 else [None] * len(OPS), broadcast=broadcast_object)
        tied = (
            model.lm_head.weight.untyped_storage().data_ptr()
            == model.model.embed_tokens.weight.untyped_storage().data_ptr()
        )
        results.append(
            {
                "logits": logits,
                "shapes": _shapes(model, runner),
                "report": model.load_report,
                "head_shares_embedding": tied,
                "control": (dist.get_backend(control_group()), control_group() is dist.group.WORLD),
            }
        )
    torch.save(results, out_path)
    dist.barrier()
    dist.destroy_process_group()


def _family_cases() -> list[str]:
    """The model-zoo families the runner serves whose head counts split over WORLD_SIZE ranks."""
    from support.model_zoo import FAMILIES, _family_config

    from specdist.models.runner import SUPPORTED_MODEL_TYPES
    from specdist.models.sharding import check_shardable

    out = []
    for family in FAMILIES:
        config_cls, _, kwargs = _family_config(family, 16, {})
        config = config_cls(**kwargs)
        try:
            check_shardable(config, WORLD_SIZE)
        except ValueError:
            continue
        if config.model_type in SUPPORTED_MODEL_TYPES:
            out.append(family)
    return out


FAMILY_CASES = _family_cases()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """{case: (unsharded logits, [rank results], checkpoint)} for every case, from one pair of rank processes."""
    from support.helpers import save_tiny_llama
    from support.model_zoo import save_tiny

    from specdist.models.loader import ModelSource, load_model
    from specdist.models.runner import CausalLMRunner

    root = tmp_path_factory.mktemp("tp")
    ckpts = {
        "llama": save_tiny_llama(str(root / "llama"), seed=11, vocab_size=16),
        # uneven vocabulary (8 + 7 rows) and MLP (23 + 22), lm_head tied to the embedding
        "llama-tied-uneven": save_tiny(
            str(root / "tied"), "llama", seed=12, vocab_size=15, intermediate_size=45, tie_word_embeddings=True
        ),
    }
    for family in FAMILY_CASES:
        ckpts[f"zoo-{family}"] = save_tiny(str(root / family), family, seed=13)
    t0 = time.perf_counter()
    results = spawn_ranks(_worker, list(ckpts.values()), root)
    print(f"\n2 ranks over {len(ckpts)} checkpoints: {time.perf_counter() - t0:.1f} s")
    out = {}
    for i, (case, ckpt) in enumerate(ckpts.items()):
        ref = run_ops(CausalLMRunner(load_model(ModelSource(ckpt, None), "float32"), num_slots=2, max_len=32), OPS)
        out[case] = (ref, [r[i] for r in results], ckpt)
    return out


def _check_logits(case: str, ref: list[torch.Tensor], ranks: list[dict]) -> None:
    """Rank 0 holds the full logits, within fp32 rounding of the unsharded ones; rank r's local
    logits are exactly rank 0's columns for its vocabulary chunk (they were gathered from it)."""
    from specdist.models.sharding import chunk_range

    worst = 0.0
    for step, want in enumerate(ref):
        got0 = ranks[0]["logits"][step]
        assert got0.shape == want.shape
        vocab = want.shape[-1]
        for r, res in enumerate(ranks[1:], start=1):
            a, b = chunk_range(vocab, WORLD_SIZE, r)
            assert torch.equal(res["logits"][step], got0[..., a:b]), f"{case}: rank {r} disagrees with rank 0"
        worst = max(worst, (got0 - want).abs().max().item())
    scale = max(w.abs().max().item() for w in ref)
    print(f"\n{case}: TP=2 max |logits diff| = {worst:.3g} (max |logit| {scale:.3g})")
    # fp32: the row-parallel sums add two partial products instead of one long dot product; the
    # rounding difference is ~1e-7 relative per reduction, far below 1e-5 of the logit scale.
    assert worst <= 1e-5 * max(1.0, scale), case


def _expected_reads(ckpt: str) -> tuple[int, int, bool]:
    """(bytes of the tensors every rank reads whole, bytes of the tensors the ranks split between them,
    whether the on-disk keys are the parameters' names: per-expert MoE keys are converted by transformers)."""
    from safetensors import safe_open

    replicated = sharded = 0
    with safe_open(os.path.join(ckpt, "model.safetensors"), "pt") as f:
        keys = list(f.keys())
        for key in keys:
            t = f.get_tensor(key)
            whole = key.endswith(("norm.weight", "embed_tokens.weight", "mlp.gate.weight"))  # gate: a MoE router
            if whole:
                replicated += t.numel() * t.element_size()
            else:
                sharded += t.numel() * t.element_size()
    return replicated, sharded, not any(".experts.0." in k for k in keys)


@pytest.mark.slow
def test_two_rank_llama_matches_unsharded(two_ranks):
    ref, ranks, ckpt = two_ranks["llama"]
    _check_logits("llama", ref, ranks)
    # 4 heads / 2 kv heads, head_dim 8, hidden 32, intermediate 64, vocab 16: half of each per rank.
    want_shapes = {
        "q": (16, 32),
        "k": (8, 32),
        "v": (8, 32),
        "o": (32, 16),
        "gate": (32, 32),
        "down": (32, 32),
        "lm_head": (8, 32),
        "cache": (2, 1, 33, 8),
    }
    replicated, sharded, _ = _expected_reads(ckpt)
    for res in ranks:
        assert res["control"] == ("gloo", False)  # broadcast_object travels on its own gloo group
        assert res["shapes"] == want_shapes
        assert not res["head_shares_embedding"]
        rep = res["report"]
        assert rep.sharded and rep.bytes_total == replicated + sharded
        assert rep.bytes_read == replicated + sharded // 2  # every split here is even


def test_two_rank_tied_uneven_split(two_ranks):
    ref, ranks, ckpt = two_ranks["llama-tied-uneven"]
    _check_logits("llama-tied-uneven", ref, ranks)
    replicated, sharded, _ = _expected_reads(ckpt)  # no lm_head on disk: it is the embedding
    for r, (res, vocab_rows, inter) in enumerate(zip(ranks, (8, 7), (23, 22))):
        assert res["shapes"]["lm_head"] == (vocab_rows, 32) and res["head_shares_embedding"]
        assert res["shapes"]["gate"] == (inter, 32) and res["shapes"]["down"] == (32, inter)
    assert sum(res["report"].bytes_read for res in ranks) == WORLD_SIZE * replicated + sharded


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILY_CASES)
def test_two_rank_family_matches_unsharded(two_ranks, family):
    ref, ranks, ckpt = two_ranks[f"zoo-{family}"]
    _check_logits(family, ref, ranks)
    replicated, sharded, one_to_one = _expected_reads(ckpt)
    for res in ranks:
        assert res["report"].sharded == one_to_one
        if not one_to_one:  # loaded whole by transformers, then sliced: every rank read the whole file
            assert (
                res["report"].bytes_read
                == res["report"].bytes_total
                == os.path.getsize(os.path.join(ckpt, "model.safetensors"))
            )
    if one_to_one:
        assert sum(res["report"].bytes_read for res in ranks) == WORLD_SIZE * replicated + sharded


@pytest.mark.parametrize("device", devices(min_gpus=2)[1:])  # the CPU twin: test_two_rank_llama_matches_unsharded
def test_two_rank_nccl_matches_unsharded(tmp_path, device):
    """Two GPUs, NCCL collectives, control messages on gloo: rank 0's logits equal the unsharded runner's."""
    from support.helpers import save_tiny_llama

    from specdist.models.loader import ModelSource, load_model
    from specdist.models.runner import CausalLMRunner

    ckpt = save_tiny_llama(str(tmp_path / "llama"), seed=11, vocab_size=16)
    ref = run_ops(CausalLMRunner(load_model(ModelSource(ckpt, None), "float32"), num_slots=2, max_len=32), OPS)
    ranks = [r[0] for r in spawn_ranks(_worker, [ckpt], tmp_path, env_extra={"SPECDIST_TEST_DEVICE": "cuda"})]
    assert all(res["control"] == ("gloo", False) for res in ranks)
    _check_logits("llama on NCCL", ref, ranks)


def _batch_worker(rank: int, world_size: int, port: int, out_path: str, args: list[str]) -> None:
    """A rank of the built-in model on its GGUF blocks: request A's logits (a prefill, then a verification of 3
    tokens) computed alone and beside 1, 3 and 6 other requests of other lengths."""
    torch.set_num_threads(1)
    import torch.distributed as dist

    from specdist.models.loader import gguf_parsed_once, resolve_model
    from specdist.models.runner import CausalLMRunner
    from specdist.models.sharding import load_sharded
    from workers.tensor_parallel import init_process_group

    init_process_group(rank, world_size, "127.0.0.1", port, "cpu")
    with gguf_parsed_once():
        model = load_sharded(
            resolve_model("smollm2-135m-instruct"), "float32", "cpu", rank, world_size, weights="native"
        )
    runner = CausalLMRunner(model, num_slots=8, max_len=128)
    prompt, verify = [(7 * i + 3) % 49000 for i in range(30)], [11, 22, 33]
    results = []
    for others in (0, 1, 3, 6):
        slots = [runner.cache.allocate() for _ in range(others + 1)]
        rest = [[(11 * i + 5 * j + 1) % 49000 for i in range(9 + 4 * j)] for j in range(others)]
        prefill = runner.forward(slots, [prompt] + rest, [1] * len(slots))[0]  # [1, V]
        steps = runner.forward(slots, [verify] + [[5 + j, 6] for j in range(others)], [3] + [2] * others)[0]  # [3, V]
        results.append((prefill.clone(), steps[:3].clone()))
        for s in slots:
            runner.cache.free(s)
    torch.save(results, out_path)  # rank 0: the full vocabulary; the others their rows
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow
def test_three_ranks_rows_do_not_depend_on_the_batch(tmp_path):
    """Three ranks (the default deployment's split of the built-in model, on its GGUF blocks): a request's logits are
    the same bits alone and beside other requests, in a prefill and a verification step. The row-parallel partial
    sums are added in rank order (sharding.sum_over_ranks): an all-reduce's ring, whose chunks follow the buffer's
    size, moved them by up to 0.4 with the batch (two ranks' sums commute, so only three or more show it)."""
    from specdist.models.kernels import cpu_kernels

    if not cpu_kernels.available():
        pytest.skip("the batch-invariant forward needs the CPU block kernels (x86 with AVX2)")
    results = spawn_ranks(_batch_worker, [], tmp_path, world_size=3)[0]
    alone_prefill, alone_steps = results[0]
    for others, (prefill, steps) in zip((1, 3, 6), results[1:]):
        assert torch.equal(prefill, alone_prefill), others
        assert torch.equal(steps, alone_steps), others


def test_indivisible_heads_raise():
    from transformers import LlamaConfig

    from specdist.models.sharding import check_shardable

    cfg = LlamaConfig(
        vocab_size=8,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    with pytest.raises(ValueError, match="num_key_value_heads"):
        check_shardable(cfg, 4)
    with pytest.raises(ValueError, match="num_attention_heads"):
        check_shardable(cfg, 3)
    check_shardable(cfg, 2)
