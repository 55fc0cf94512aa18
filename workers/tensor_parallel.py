"""Tensor-parallel sharding of the target model with DeepSpeed AutoTP.

Every rank of a tensor-parallel group loads the *same* full HF checkpoint, then
:func:`shard_model` cuts it in place (``deepspeed.init_inference`` with
``tensor_parallel={"tp_size": world_size}`` and ``replace_with_kernel_inject=False``,
i.e. AutoTP: plain HF modules with their ``nn.Linear`` layers swapped for sharded
ones; the InferenceEngine wrapper is dropped and the HF model returned).

What is sharded, and what rank ``r`` of ``W`` holds, per decoder layer:

- ``q_proj`` / ``k_proj`` / ``v_proj`` (column-parallel, ``LinearLayer``): the output
  rows of heads ``[r*H/W, (r+1)*H/W)`` and kv heads ``[r*Hkv/W, (r+1)*Hkv/W)``. Whole
  heads only, so attention (and the KV cache: ``Hkv/W`` heads per slot) is rank-local.
- ``o_proj`` (row-parallel, ``LinearAllreduce``): the matching ``H/W * head_dim`` input
  columns; its partial output is summed across ranks.
- ``gate_proj`` / ``up_proj`` (column-parallel): ``intermediate_size/W`` output rows
  (cut in grains of ``mlp_grain_size(...)``, at most DeepSpeed's default 64, chosen so the
  split is even: the fixed grain of 64 would give all of a 64-wide MLP to one rank).
- ``down_proj`` (row-parallel, all-reduce): the matching input columns.
- ``lm_head`` (``LmHeadLinearAllreduce``): ``hidden_size/W`` input columns (same grain);
  every rank ends up with the full ``[.., vocab]`` logits.

Replicated on every rank: embeddings, RMSNorms, rotary tables.

Collectives per forward: 2 all-reduces of ``[B, T, hidden]`` per decoder layer (after
``o_proj`` and after ``down_proj``), plus one of ``[B, n_logits, vocab]`` in ``lm_head``.
They are issued in module order, so every rank must run the same forwards on the same
(batch, token) shapes: rank 0 decides a step and sends its inputs to the others with
:func:`broadcast_object`, then all ranks call the runner. Every rank gets the same
all-reduced sums, so the logits are bitwise identical on all ranks (checked by the test).

CPU uses gloo, CUDA uses NCCL; the code is the same. DeepSpeed's CPU shared-memory
all-reduce kernel is disabled (it segfaults on our CPUs and costs a C++ build), so
every collective goes through the torch.distributed process group.
"""

from __future__ import annotations

import datetime
import os
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

_TIMEOUT = datetime.timedelta(minutes=10)


def _disable_shm_allreduce() -> None:
    """Make DeepSpeed's TorchBackend skip its shared-memory all-reduce op (``shm_comm_op``).

    ``TorchBackend.__init__`` calls ``deepspeed.comm.torch.build_shm_op()``; returning None
    leaves ``shm_vector_kernel_level`` unset, so ``inference_all_reduce`` falls back to
    ``torch.distributed.all_reduce``. ``deepspeed.comm.torch`` as an attribute is the real
    ``torch`` (re-exported by ``from .comm import *``), so the module is taken from sys.modules.
    """
    import deepspeed.comm.torch  # noqa: F401  (registers the submodule)

    mod = sys.modules["deepspeed.comm.torch"]
    if not hasattr(mod, "build_shm_op"):  # a DeepSpeed without the op: nothing to disable
        return
    if getattr(mod.build_shm_op, "_specdist_disabled", False):
        return

    def build_shm_op():
        return None

    build_shm_op._specdist_disabled = True
    mod.build_shm_op = build_shm_op


def backend_for(device: torch.device | str) -> str:
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def init_process_group(rank: int, world_size: int, master_addr: str, master_port: int, device) -> None:
    """Join the tensor-parallel group: torch.distributed (gloo on CPU, nccl on CUDA) + deepspeed.comm.

    Idempotent: a second call with the same rank and world size is a no-op; a call that
    disagrees with the already initialised group raises RuntimeError.
    """
    device = torch.device(device)
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        torch.cuda.set_device(index)
        os.environ["LOCAL_RANK"] = str(index)  # InferenceEngine calls set_device(LOCAL_RANK)
    else:
        os.environ.setdefault("LOCAL_RANK", "0")
    # deepspeed.comm reads these (logging, init_distributed's env checks).
    os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank), str(world_size)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = master_addr, str(master_port)

    if dist.is_initialized():
        if dist.get_rank() != rank or dist.get_world_size() != world_size:
            raise RuntimeError(
                f"torch.distributed is already initialised as rank {dist.get_rank()} of "
                f"{dist.get_world_size()}, not rank {rank} of {world_size}"
            )
    else:
        dist.init_process_group(
            backend_for(device),
            init_method=f"tcp://{master_addr}:{master_port}",
            rank=rank,
            world_size=world_size,
            timeout=_TIMEOUT,
        )

    _disable_shm_allreduce()
    import deepspeed.comm as ds_comm

    if not ds_comm.is_initialized():
        # torch.distributed is up, so this only wraps it in a TorchBackend (no new group).
        ds_comm.init_distributed(dist_backend=dist.get_backend(), dist_init_required=False, verbose=False)
    cdb = ds_backend()  # the live backend (``deepspeed.comm.cdb`` is a stale import-time copy)
    if getattr(cdb, "shm_comm_op", None) is not None:  # built by someone before we could patch it
        cdb.shm_vector_kernel_level = 0  # forces inference_all_reduce onto the process group


def ds_backend():
    """DeepSpeed's communication backend object (``TorchBackend``), or None before init."""
    import deepspeed.comm.comm  # noqa: F401

    return sys.modules["deepspeed.comm.comm"].cdb


def check_shardable(config, world_size: int) -> None:
    """Raise ValueError unless the head counts split evenly over ``world_size`` ranks."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    n_heads = int(config.num_attention_heads)
    n_kv = int(getattr(config, "num_key_value_heads", None) or n_heads)
    for field, value in (("num_attention_heads", n_heads), ("num_key_value_heads", n_kv)):
        if value % world_size:
            raise ValueError(
                f"cannot shard over {world_size} ranks: config.{field} = {value} is not divisible by {world_size}"
            )


def mlp_grain_size(intermediate_size: int, hidden_size: int, world_size: int) -> int:
    """Largest power of two <= 64 (DeepSpeed's default grain) that splits the MLP and lm_head evenly, else 1."""
    for grain in (64, 32, 16, 8, 4, 2):
        if intermediate_size % (grain * world_size) == 0 and hidden_size % (grain * world_size) == 0:
            return grain
    return 1  # near-even split (exact all the same: row-parallel partial sums just differ in size)


def shard_model(model: nn.Module, world_size: int) -> nn.Module:
    """AutoTP-shard a loaded HF causal LM over the current process group; returns the HF model.

    Call on every rank, after :func:`init_process_group`, with the same full weights on each
    (the group must be exactly the ``world_size`` ranks ``0..world_size-1``). Run it before
    building a ``CausalLMRunner`` (fused q/k/v and gate/up projections are removed first:
    they would not be sharded). ``world_size == 1`` returns the model unchanged.
    """
    check_shardable(model.config, world_size)
    if world_size == 1:
        return model
    if not dist.is_initialized():
        raise RuntimeError("shard_model needs init_process_group() first")
    if dist.get_world_size() != world_size:
        raise ValueError(f"world_size {world_size} != torch.distributed world size {dist.get_world_size()}")
    from specdist.models.fusion import remove_fusion

    remove_fusion(model)
    _disable_shm_allreduce()
    import deepspeed

    dtype = next(model.parameters()).dtype
    grain = mlp_grain_size(int(model.config.intermediate_size), int(model.config.hidden_size), world_size)
    engine = deepspeed.init_inference(
        model,
        tensor_parallel={"tp_size": world_size, "tp_grain_size": grain},
        dtype=dtype,
        replace_with_kernel_inject=False,
    )
    sharded = engine.module
    sharded.eval()
    return sharded


def broadcast_object(obj: Any = None, src: int = 0) -> Any:
    """Send a picklable object from rank ``src`` to all ranks; every rank returns it."""
    box = [obj if dist.get_rank() == src else None]
    dist.broadcast_object_list(box, src=src)
    return box[0]
