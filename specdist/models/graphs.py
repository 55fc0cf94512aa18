"""CUDA graphs of the paged forward, one per (batch, tokens per request) bucket, captured at load.

A step of ``B`` requests and ``T`` tokens each runs the graph of the smallest bucket that holds
it (``B' >= B``, ``T' >= T``); the rest of the bucket is padding that writes the scratch block.
Every input of a graph is one static int32 buffer on the device, the layout of
:func:`specdist.models.attention.pack_step`; a step fills it with its one host-to-device copy from
a pinned buffer and replays the graph, which derives positions and cache rows on the device
(:func:`~specdist.models.attention.unpack_step`), runs the decoder stack over the paged kernels
(whose key lengths are read from device memory, so one graph serves every length) and the output
head over all ``B' * T'`` rows. The rows the step asked for are then selected from the graph's
static logits (one ``index_select``, which also frees them from the next replay).

This is gpt-fast's and vLLM's scheme (``torch.cuda.CUDAGraph`` over the eager pass, static buffers,
one memory pool shared by every graph, largest bucket first), and what replaces the per-bucket
Inductor compiles of ``engine.compile`` on GPUs: a capture takes one warm-up pass and one recorded
pass, milliseconds a bucket instead of a whole-model compile.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

import numpy as np
import torch

from specdist.models.attention import pack_step, step_size, unpack_step

GRAPH_TOKENS = (1, 2, 4, 8, 16, 32)  # tokens-per-request buckets (32: a verification of up to 31 drafts)
EXTRA_WORDS_PER_ROW = 32  # room a graph's input buffer keeps for runner.forward's ``extra`` words
ACTIVATION_MARGIN = 0.9  # share of the free device memory the paged cache may take when it sizes itself


@dataclass
class KVOptions:
    """How a runner keeps K/V (``engine.kv_cache*``): ``kind`` auto (paged on GPUs, where the paged kernels run;
    a slot per request on the CPU, which the CPU attention kernels read) | slots | paged; ``block_size`` tokens a
    block; ``max_tokens`` tokens the paged cache holds (None: ``num_slots * max_len``, or on a GPU as much of that
    as fits in ``memory_fraction`` of the free device memory)."""

    kind: str = "auto"
    block_size: int = 16
    max_tokens: int | None = None
    memory_fraction: float = ACTIVATION_MARGIN

    @classmethod
    def from_engine(cls, ec, device: torch.device | str) -> "KVOptions":
        """The options of an ``engine:`` config section (:class:`specdist.config.EngineConfig`) for a runner on
        ``device``."""
        kind = "paged" if ec.paged(torch.device(device).type) else "slots"
        return cls(kind, ec.kv_block_size, ec.kv_cache_tokens, ec.gpu_memory_utilization)

    def paged(self, device: torch.device) -> bool:
        return self.kind == "paged" or (self.kind == "auto" and device.type == "cuda")

    def tokens(self, device: torch.device, num_slots: int, max_len: int, bytes_per_token: int) -> int:
        """Tokens the paged cache holds: the configured number, else every slot's full length, capped on a GPU
        by the free memory (never below one sequence of ``max_len``)."""
        if self.max_tokens is not None:
            return max(self.max_tokens, max_len)
        want = num_slots * max_len
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            want = min(want, int(free * self.memory_fraction) // bytes_per_token)
        return max(want, max_len)


@dataclass
class _Graph:
    bsz: int
    tokens: int
    buf: torch.Tensor  # [step_size + tail] int32: the static input (pack_step's layout), then a caller's words
    graph: torch.cuda.CUDAGraph | None  # None: replayed eagerly (see CudaGraphs)
    logits: torch.Tensor  # [B' * T', V] float32, static output
    hidden: torch.Tensor | None  # [B', T', nD] static output (EAGLE-3 taps), or None
    rows: torch.Tensor  # view of buf: the logits rows a step asks for
    run: object  # the pass over buf (what the graph recorded)

    def replay(self) -> None:
        if self.graph is not None:
            self.graph.replay()
        else:
            self.logits, self.hidden = self.run()


class CudaGraphs:
    """The captured buckets of one runner (:meth:`specdist.models.runner.CausalLMRunner.capture_graphs`).

    ``eager_replay``: nothing is captured and a "replay" runs the pass again over the bucket's static buffers, on
    any device: the buckets, the buffers' layout and the caller's words in their tail, checked on a CPU."""

    def __init__(self, runner, eager_replay: bool = False):
        self.runner = runner
        self.eager_replay = eager_replay
        self.graphs: dict[tuple[int, int], _Graph] = {}
        self.batch_sizes: list[int] = []
        self.token_counts: list[int] = []
        self.capture_s: dict[tuple[int, int], float] = {}
        self.pool = None

    def capture(self, batch_sizes: list[int], token_counts: list[int], log=None) -> float:
        """Capture every (batch, tokens) bucket, the largest first (the smaller ones then reuse its memory);
        ``log``: a function given one progress line a bucket (default: stderr). Returns the seconds taken."""
        log = log or (lambda line: print(line, file=sys.stderr, flush=True))
        t0 = time.perf_counter()
        self.batch_sizes, self.token_counts = sorted(batch_sizes), sorted(token_counts)
        self.pool = None if self.eager_replay else torch.cuda.graph_pool_handle()
        buckets = sorted(((b, t) for b in batch_sizes for t in token_counts), key=lambda bt: -bt[0] * bt[1])
        for i, (bsz, tokens) in enumerate(buckets):
            t1 = time.perf_counter()
            self.graphs[(bsz, tokens)] = self._capture_one(bsz, tokens)
            self.capture_s[(bsz, tokens)] = time.perf_counter() - t1
            log(f"cuda graphs: captured batch {bsz} x {tokens} tokens ({i + 1}/{len(buckets)}) in "
                f"{self.capture_s[(bsz, tokens)]:.2f} s")
        return time.perf_counter() - t0

    @torch.inference_mode()
    def _capture_one(self, bsz: int, tokens: int) -> _Graph:
        runner = self.runner
        cache = runner.cache
        width = cache.max_blocks
        size = step_size(bsz, tokens, width)
        # the graph reads the head (all padding at capture); the tail carries a caller's words (runner.forward's
        # ``extra``: a verification's sampling inputs, at most about 24 words a row)
        buf = torch.zeros(size + EXTRA_WORDS_PER_ROW * bsz * tokens + 64, dtype=torch.int32, device=runner.device)

        def run():
            step = unpack_step(buf[:size], bsz, tokens, width, cache.block_size)
            h, hidden = runner.paged_layers(step)  # [B, T, D]
            return runner.head_rows(h.reshape(bsz * tokens, 1, -1))[:, 0], hidden  # [B * T, V]

        bt = bsz * tokens
        rows = buf[size - 2 * bt: size - bt]
        if self.eager_replay:
            return _Graph(bsz, tokens, buf, None, *run(), rows, run)
        stream = torch.cuda.Stream(runner.device)
        stream.wait_stream(torch.cuda.current_stream(runner.device))
        with torch.cuda.stream(stream):  # warm-up: Triton's compiles and cuBLAS's choices happen outside capture
            for _ in range(2):
                run()
        torch.cuda.current_stream(runner.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits, hidden = run()
        return _Graph(bsz, tokens, buf, graph, logits, hidden, rows, run)

    def bucket(self, bsz: int, tokens: int) -> _Graph | None:
        """The smallest captured bucket holding ``bsz`` requests of ``tokens`` tokens, or None."""
        b = next((x for x in self.batch_sizes if x >= bsz), None)
        t = next((x for x in self.token_counts if x >= tokens), None)
        return None if b is None or t is None else self.graphs.get((b, t))

    def run(self, slots: list[int], tokens: list[list[int]], starts: list[int], num_logits: list[int], extra=None):
        """Replay the bucket of this call: (packed logits [sum(num_logits), V], hidden [B, T, nD] or None,
        ``extra`` on the device or None), or None when no bucket holds it (the caller runs the eager pass).
        ``extra`` (the caller's int32 words, numpy) rides in the same copy, into the buffer's tail."""
        g = self.bucket(len(slots), max(len(t) for t in tokens))
        if g is None:
            return None
        runner = self.runner
        host = pack_step(runner.cache, slots, tokens, starts, num_logits, g.bsz, g.tokens, runner.cache.max_blocks)
        at = len(host) + len(host) % 2  # the caller's words start on an even word
        tail = None
        if extra is None:
            runner.attention.send(host, g.buf[: len(host)])
        elif at + len(extra) <= g.buf.numel():  # the caller's words ride in the buffer's tail
            runner.attention.send(np.concatenate([host, [0] * (at - len(host)), extra]), g.buf[: at + len(extra)])
            tail = g.buf[at: at + len(extra)]
        else:  # more than the tail holds: a copy of their own
            runner.attention.send(host, g.buf[: len(host)])
            tail = runner.attention.send(extra)
        g.replay()
        logits = g.logits.index_select(0, g.rows[: sum(num_logits)].long())  # [M, V], free of the next replay
        hidden = None
        if g.hidden is not None:
            hidden = g.hidden[: len(slots), : max(len(t) for t in tokens)].clone()
        return logits, hidden, tail
