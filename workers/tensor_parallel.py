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

Addresses: every socket of the group is on the node's own address (the one Ray uses), never on
every interface: rank 0's rendezvous store listens on a socket :func:`rendezvous_socket` bound
there (by default torch's store listens on ``::``), and gloo / NCCL bind to the interface holding
that address (``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME``, unless the environment sets them).
On a loopback deployment nothing of the group is reachable from another machine.

Timeouts: both groups start with ``_TIMEOUT``; :func:`set_collective_timeout` then bounds how long
a collective waits for a rank that died or hangs. Rank 0 bounds both groups; the other ranks
only the collectives of a forward, since they wait on the control group, idle, for rank 0's
next message.
"""

from __future__ import annotations

import datetime
import os
import socket
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _set_pg_timeout

from specdist.models.sharding import check_shardable  # noqa: F401  (the bring-up check, re-exported)

_TIMEOUT = datetime.timedelta(minutes=10)
_control: tuple | None = None  # (the default group it belongs to, the gloo group carrying broadcast_object)


def backend_for(device: torch.device | str) -> str:
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def rendezvous_socket(host: str, port: int = 0) -> socket.socket:
    """Rank 0: a socket listening on ``host:port`` (0: a free port) for the group's rendezvous store.
    Held from the moment its port is handed out, so no other process can take the port meanwhile."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    return sock


def interface_of(address: str) -> str | None:
    """The name of the network interface that holds ``address`` (None: no interface does, e.g. behind NAT)."""
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address.split("%")[0] == address for a in addrs):
            return name
    return None


def _bind_collectives_to(address: str, backend: str) -> None:
    """Make gloo (and NCCL's sockets) listen on the interface holding ``address``; an interface
    the environment already names wins."""
    interface = interface_of(address)
    if interface is None:
        return
    os.environ.setdefault("GLOO_SOCKET_IFNAME", interface)
    if backend == "nccl":
        os.environ.setdefault("NCCL_SOCKET_IFNAME", interface)


def init_process_group(
    rank: int,
    world_size: int,
    master_addr: str,
    master_port: int,
    device,
    listen: socket.socket | None = None,
    node_addr: str | None = None,
) -> None:
    """Join the tensor-parallel group (gloo on CPU, nccl on CUDA) and its gloo control group.

    Rank 0 serves the rendezvous store on ``listen`` (:func:`rendezvous_socket`, at
    ``master_addr:master_port``; None: it binds that address itself); the store takes the socket over. ``node_addr``:
    this rank's own node address, which its collectives listen on (default ``master_addr``: the ranks share a node).
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
        if rank == 0 and listen is None:
            listen = rendezvous_socket(master_addr, master_port)
        backend = backend_for(device)
        _bind_collectives_to(node_addr or master_addr, backend)
        # rank 0's store takes the listening socket's descriptor over (and closes it with the store)
        server = dict(is_master=True, master_listen_fd=listen.detach()) if rank == 0 else {}
        store = dist.TCPStore(master_addr, master_port, world_size, timeout=_TIMEOUT, **server)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=_TIMEOUT)
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
