"""Tensor-parallel rank processes for the tests, forked from one server process.

A fresh ``python`` per rank spends seconds of CPU importing torch and transformers before it
does anything. Here one ``forkserver`` process imports them once per test session and every
rank is a fork of it: a new process (its own memory, its own process group) that starts with
those modules already loaded. The server never runs a torch op, so no thread pool is forked.
"""

from __future__ import annotations

import multiprocessing
import os
import socket
import sys
import time
from collections.abc import Callable

import pytest
import torch

PRELOAD = [
    "torch",
    "torch.distributed",
    "transformers",
    "transformers.models.llama.modeling_llama",
    "specdist.models.sharding",
    "specdist.models.runner",
    "workers.tensor_parallel",
]
RANK_ENV = {"OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1", "HF_HUB_OFFLINE": "1"}


def _context():
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def event():
    """An event the test can set and its ranks wait on (e.g. "stop serving")."""
    return _context().Event()


def _rank_main(fn: Callable, args: tuple, log_path: str, env: dict) -> None:
    """In the rank: stdout and stderr to its log file, its environment, then ``fn(*args)``."""
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.update(env)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    fn(*args)


def start_ranks(
    fn: Callable, args_of: Callable[[int], tuple], world_size: int, log_paths: list[str], env_extra: dict | None = None
) -> list:
    """Start ``fn(*args_of(rank))`` in ``world_size`` forked rank processes (started, not joined)."""
    ctx = _context()
    env = {**RANK_ENV, **(env_extra or {})}
    procs = [
        ctx.Process(target=_rank_main, args=(fn, args_of(r), log_paths[r], env), daemon=True) for r in range(world_size)
    ]
    for p in procs:
        p.start()
    return procs


def join_ranks(procs: list, timeout_s: float) -> None:
    """Wait for every rank until the deadline; kill (and reap) the ones still running."""
    deadline = time.monotonic() + timeout_s
    for p in procs:
        p.join(max(0.1, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()


WORLD_SIZE = 2  # the tensor-parallel tests' ranks
TIMEOUT_S = 150  # seconds a group of ranks may take


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
            out.append(runner.forward(op[1], op[2], op[3]).cpu())
        else:
            runner.cache.rollback(op[1], op[2])
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_ranks(
    fn,
    args: list[str],
    tmp_path,
    timeout_s: float = TIMEOUT_S,
    load: bool = True,
    env_extra: dict | None = None,
    world_size: int = WORLD_SIZE,
) -> list:
    """Run ``fn(rank, world_size, port, out, args)`` in ``world_size`` rank processes (tests/support/rank_procs.py);
    their outputs (``torch.load``-ed, or the paths with ``load=False``)."""
    for attempt in range(2):  # a second try if another process grabbed the port meanwhile
        port = _free_port()
        outs = [str(tmp_path / f"rank{r}_{attempt}.pt") for r in range(world_size)]
        logs = [str(tmp_path / f"rank{r}_{attempt}.log") for r in range(world_size)]
        procs = start_ranks(fn, lambda r: (r, world_size, port, outs[r], list(args)), world_size, logs, env_extra)
        join_ranks(procs, timeout_s)
        texts = [open(f).read() for f in logs]
        if all(p.exitcode == 0 for p in procs):
            return [torch.load(o, weights_only=False) for o in outs] if load else outs
        if attempt == 0 and any("address already in use" in t.lower() for t in texts):
            continue
        report = "\n".join(
            f"--- rank {r} exit code {p.exitcode} ---\n{t[-3000:]}" for r, (p, t) in enumerate(zip(procs, texts))
        )
        pytest.fail(f"tensor-parallel ranks failed:\n{report}")
    raise AssertionError("unreachable")
