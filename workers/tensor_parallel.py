"""The tensor-parallel process group of the target ranks.

The partition rules and the sharded loader are :mod:`specdist.models.sharding`: every rank
loads only its slices (:func:`~specdist.models.sharding.load_sharded`), then builds a
``CausalLMRunner`` on its shard.

Collectives per forward, on the group (gloo on CPU, NCCL on CUDA): 2 all-reduces of
``[B, T, hidden]`` per decoder layer (after ``o_proj`` and after ``down_proj``, or the
experts of a mixture-of-experts layer), and one gather of the local logits to rank 0 in
``lm_head``. They are issued in module order, so every rank must run the same forwards on
the same (batch, token) shapes: rank 0 decides a step and sends its inputs to the others
with :func:`broadcast_object`, then all ranks call the runner. That control message goes
over a separate gloo group, so it stays a host-side message when the collectives use NCCL.

Timeouts: both groups start with ``_TIMEOUT``; :func:`set_collective_timeout` then bounds how long
a collective waits for a rank that died or hangs. Rank 0 bounds both groups; the other ranks
only the collectives of a forward, since they wait on the control group, idle, for rank 0's
next message.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _set_pg_timeout

from specdist.models.sharding import check_shardable  # noqa: F401  (the bring-up check, re-exported)

_TIMEOUT = datetime.timedelta(minutes=10)
_control: tuple | None = None  # (the default group it belongs to, the gloo group carrying broadcast_object)


def backend_for(device: torch.device | str) -> str:
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def init_process_group(rank: int, world_size: int, master_addr: str, master_port: int, device) -> None:
    """Join the tensor-parallel group (gloo on CPU, nccl on CUDA) and its gloo control group.

    Idempotent: a second call with the same rank and world size is a no-op; a call that
    disagrees with the already initialised group raises RuntimeError.
    """
    global _control
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.set_device(device.index if device.index is not None else torch.cuda.current_device())
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
    if _control is None or _control[0] is not dist.group.WORLD:  # none yet for this group
        # new_group is collective: every rank gets here, in the same order.
        _control = (dist.group.WORLD, dist.new_group(backend="gloo", timeout=_TIMEOUT))


def control_group():
    """The gloo group for host-side control messages (after :func:`init_process_group`)."""
    if _control is None or not dist.is_initialized() or _control[0] is not dist.group.WORLD:
        raise RuntimeError("the tensor-parallel control group needs init_process_group() first")
    return _control[1]


def broadcast_object(obj: Any = None, src: int = 0) -> Any:
    """Send a picklable object from rank ``src`` to all ranks over the gloo control group; every rank returns it."""
    group = control_group()
    box = [obj if dist.get_rank() == src else None]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def set_collective_timeout(seconds: float) -> None:
    """This rank's collective timeout: the forward's group, and on rank 0 also the control group."""
    timeout = datetime.timedelta(seconds=float(seconds))
    _set_pg_timeout(timeout, dist.group.WORLD)
    if dist.get_rank() == 0:
        _set_pg_timeout(timeout, control_group())
