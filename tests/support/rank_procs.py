"""Tensor-parallel rank processes for the tests, forked from one server process.

A fresh ``python`` per rank spends seconds of CPU importing torch and transformers before it
does anything. Here one ``forkserver`` process imports them once per test session and every
rank is a fork of it: a new process (its own memory, its own process group) that starts with
those modules already loaded. The server never runs a torch op, so no thread pool is forked.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import time
from collections.abc import Callable

PRELOAD = ["torch", "torch.distributed", "transformers", "transformers.models.llama.modeling_llama",
           "specdist.models.sharding", "specdist.models.runner", "workers.tensor_parallel"]
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


def start_ranks(fn: Callable, args_of: Callable[[int], tuple], world_size: int, log_paths: list[str],
                env_extra: dict | None = None) -> list:
    """Start ``fn(*args_of(rank))`` in ``world_size`` forked rank processes (started, not joined)."""
    ctx = _context()
    env = {**RANK_ENV, **(env_extra or {})}
    procs = [ctx.Process(target=_rank_main, args=(fn, args_of(r), log_paths[r], env), daemon=True)
             for r in range(world_size)]
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
