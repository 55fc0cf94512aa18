"""Tensor-parallel (DeepSpeed AutoTP, gloo) target: 2 ranks reproduce the unsharded logits.

Each rank is a fresh ``python`` subprocess running this file as a script; the parent
picks a free localhost port, waits with a timeout and kills stragglers. No Ray.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest
import torch

WORLD_SIZE = 2
TIMEOUT_S = 90

# Rank 0 broadcasts each op; all ranks apply it. Ragged prefill, a 3-token verify step,
# rollback of the rejected tokens, then a step with the slots in non-contiguous order.
OPS = [
    ("forward", [0, 1], [[1, 2, 3, 4, 5], [6, 2]], [5, 2]),
    ("forward", [0, 1], [[3, 1, 4], [5, 0, 6]], [3, 3]),
    ("rollback", 0, 6),  # slot 0 accepted 1 of 3
    ("rollback", 1, 4),  # slot 1 accepted 2 of 3
    ("forward", [1, 0], [[2, 2, 7], [4]], [3, 1]),
    ("forward", [0], [[5]], [1]),  # single query, no mask
]


def run_ops(runner, ops, broadcast=None) -> list[torch.Tensor]:
    out = []
    for i in range(len(ops)):
        op = ops[i] if broadcast is None else broadcast(ops[i] if ops is not None else None)
        if op[0] == "forward":
            out.append(runner.forward(op[1], op[2], op[3]))
        else:
            runner.cache.rollback(op[1], op[2])
    return out


def _worker(rank: int, world_size: int, port: int, ckpt: str, out_path: str) -> None:
    torch.set_num_threads(1)
    from specdist.models.loader import ModelSource, load_model
    from specdist.models.runner import CausalLMRunner
    from workers.tensor_parallel import broadcast_object, ds_backend, init_process_group, shard_model

    model = load_model(ModelSource(ckpt, None), "float32")
    init_process_group(rank, world_size, "127.0.0.1", port, "cpu")
    init_process_group(rank, world_size, "127.0.0.1", port, "cpu")  # idempotent
    assert ds_backend().shm_comm_op is None, "DeepSpeed's shm all-reduce must stay off (segfaults here)"
    model = shard_model(model, world_size)
    attn = model.model.layers[0].self_attn
    runner = CausalLMRunner(model, num_slots=2, max_len=32)
    shapes = {
        "q": tuple(attn.q_proj.weight.shape),
        "k": tuple(attn.k_proj.weight.shape),
        "o": tuple(attn.o_proj.weight.shape),
        "gate": tuple(model.model.layers[0].mlp.gate_proj.weight.shape),
        "down": tuple(model.model.layers[0].mlp.down_proj.weight.shape),
        "lm_head": tuple(model.lm_head.weight.shape),
        "cache": tuple(runner.cache.k[0].shape),
    }
    t0 = time.perf_counter()
    logits = run_ops(runner, OPS if rank == 0 else [None] * len(OPS), broadcast=broadcast_object)
    fwd_s = time.perf_counter() - t0
    torch.save({"logits": logits, "shapes": shapes, "forward_s": fwd_s}, out_path)
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn_ranks(ckpt: str, tmp_path) -> tuple[list[dict], float]:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    env.update(OMP_NUM_THREADS="1", TQDM_DISABLE="1", HF_HUB_OFFLINE="1")
    for attempt in range(2):  # a second try if another process grabbed the port meanwhile
        port = _free_port()
        outs = [str(tmp_path / f"rank{r}_{attempt}.pt") for r in range(WORLD_SIZE)]
        logs = [open(tmp_path / f"rank{r}_{attempt}.log", "w+") for r in range(WORLD_SIZE)]
        t0 = time.perf_counter()
        procs = [
            subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), str(r), str(WORLD_SIZE), str(port), ckpt, outs[r]],
                cwd=root, env=env, stdout=logs[r], stderr=subprocess.STDOUT,
            )
            for r in range(WORLD_SIZE)
        ]
        try:
            deadline = time.monotonic() + TIMEOUT_S
            for p in procs:
                p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        elapsed = time.perf_counter() - t0
        texts = []
        for f in logs:
            f.seek(0)
            texts.append(f.read())
            f.close()
        if all(p.returncode == 0 for p in procs):
            return [torch.load(o) for o in outs], elapsed
        if attempt == 0 and any("address already in use" in t.lower() for t in texts):
            continue
        report = "\n".join(
            f"--- rank {r} rc={p.returncode} ---\n{t[-3000:]}" for r, (p, t) in enumerate(zip(procs, texts))
        )
        pytest.fail(f"tensor-parallel ranks failed:\n{report}")
    raise AssertionError("unreachable")


def test_two_rank_autotp_matches_unsharded(tmp_path):
    from conftest import save_tiny_llama
    from specdist.models.loader import ModelSource, load_model
    from specdist.models.runner import CausalLMRunner

    ckpt = save_tiny_llama(str(tmp_path / "target"), seed=11, vocab_size=16)
    ref_runner = CausalLMRunner(load_model(ModelSource(ckpt, None), "float32"), num_slots=2, max_len=32)
    ref = run_ops(ref_runner, OPS)

    results, elapsed = _spawn_ranks(ckpt, tmp_path)
    # 4 heads / 2 kv heads, head_dim 8, hidden 32, intermediate 64, vocab 16: half of each per rank.
    want_shapes = {"q": (16, 32), "k": (8, 32), "o": (32, 16), "gate": (32, 32), "down": (32, 32),
                   "lm_head": (16, 16), "cache": (2, 1, 33, 8)}
    for res in results:
        assert res["shapes"] == want_shapes
    worst = 0.0
    for got0, got1, want in zip(results[0]["logits"], results[1]["logits"], ref):
        assert got0.shape == want.shape
        assert torch.equal(got0, got1), "ranks disagree"
        worst = max(worst, (got0 - want).abs().max().item())
    scale = max(w.abs().max().item() for w in ref)
    print(f"\nTP=2 max |logits diff| = {worst:.3g} (max |logit| {scale:.3g}); 2-rank wall {elapsed:.1f}s, "
          f"forwards {results[0]['forward_s'] * 1e3:.0f} ms")
    assert worst < 1e-4


def test_indivisible_heads_raise():
    from transformers import LlamaConfig, LlamaForCausalLM

    from workers.tensor_parallel import shard_model

    cfg = LlamaConfig(vocab_size=8, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2)
    model = LlamaForCausalLM(cfg)
    with pytest.raises(ValueError, match="num_key_value_heads"):
        shard_model(model, 4)
    with pytest.raises(ValueError, match="num_attention_heads"):
        shard_model(model, 3)


if __name__ == "__main__":  # one rank: <rank> <world_size> <port> <checkpoint> <out.pt>
    _worker(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5])
