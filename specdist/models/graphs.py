"""CUDA graphs of the paged forward, one per (batch, tokens per request) bucket, captured at load.

A step of ``B`` requests and ``T`` tokens each runs the graph of the smallest bucket that holds
it (``B' >= B``, ``T' >= T``); the rest of the bucket is padding that writes the scratch block.
Every input of a graph is one static int32 buffer on the device, the layout of
:func:`specdist.models.backends.paged.pack_step`; a step fills it with its one host-to-device copy from
a pinned buffer and replays the graph, which derives positions and cache rows on the device
(:func:`~specdist.models.backends.paged.unpack_step`), runs the decoder stack over the paged kernels
(whose key lengths are read from device memory, so one graph serves every length); its static output is
the last layer's hidden states ``[B' * T', D]``. The rows the step asked for are then selected from them (one
``index_select``, which also frees them from the next replay) and the final norm and output head run on those
rows alone, outside the graph: a bucket keeps no ``[B' * T', V]`` logits (float32 at a 128k vocabulary, 64
slots and 16 tokens: 0.5 GiB a bucket).

Every pass is checked for host reads before it is captured (:mod:`specdist.models.host_reads`): the largest
bucket's runs once uncaptured first, then each bucket's first warm-up pass. Where a model's MoE experts read the
host (transformers' grouped experts outside bf16), the passes take ``CAPTURE_SAFE_EXPERTS``; any other host read
turns the runner's graphs off (:meth:`specdist.models.runner.CausalLMRunner.capture_graphs`).

This is gpt-fast's and vLLM's scheme (``torch.cuda.CUDAGraph`` over the eager pass, static buffers,
one memory pool shared by every graph, largest bucket first), and what replaces the per-bucket
Inductor compiles of ``engine.compile`` on GPUs: a capture takes one warm-up pass and one recorded
pass, milliseconds a bucket instead of a whole-model compile.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch

from specdist.models.backends.paged import pack_step, step_layout, step_size, unpack_step
from specdist.models.host_reads import HostReadError, HostReadGuard

# transformers' MoE experts implementation the graphs' passes take where the model's own reads the host (grouped
# experts outside bf16): a gathered bmm per (token, pick), no host read; its memory grows with the bucket's rows
CAPTURE_SAFE_EXPERTS = "batched_mm"
GRAPH_TOKENS = (1, 2, 4, 8, 16, 32)  # tokens-per-request buckets (32: a verification of up to 31 drafts)
EXTRA_WORDS_PER_ROW = 32  # room a graph's input buffer keeps for runner.forward's ``extra`` words


@dataclass
class _Graph:
    bsz: int
    tokens: int
    buf: torch.Tensor  # [step_size + tail] int32: the static input (pack_step's layout), then a caller's words
    graph: torch.cuda.CUDAGraph | None  # None: replayed eagerly (see CudaGraphs)
    out: torch.Tensor  # [B' * T', D] static output: the last layer's hidden states (the head runs outside)
    hidden: torch.Tensor | None  # [B', T', nD] static output (EAGLE-3 taps), or None
    rows: torch.Tensor  # view of buf: the rows of ``out`` whose logits a step asks for
    run: object  # the pass over buf (what the graph recorded)

    def replay(self) -> None:
        """Run the pass over ``buf`` into ``out`` and ``hidden`` (on CUDA: under :func:`device_guard` of the
        runner's device, as :meth:`CudaGraphs.run` calls it)."""
        if self.graph is not None:
            self.graph.replay()
        else:
            self.out, self.hidden = self.run()

    def static_bytes(self) -> int:
        """Bytes of the bucket's own static tensors (input buffer and outputs; the memory pool that holds the
        pass's intermediates is shared by every bucket)."""
        return sum(t.numel() * t.element_size() for t in (self.buf, self.out, self.hidden) if t is not None)


def device_guard(device: torch.device):
    """The current CUDA device set to ``device`` for what runs inside: Triton launches, ``torch.cuda.graph``'s
    capture and a graph's replay take the current device, not their tensors' (``engine.device: cuda:N``,
    N > 0). A no-op on other devices."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def on_runner_device(method):
    """A runner's ``method`` run under :func:`device_guard` of the runner's device."""

    @functools.wraps(method)
    def guarded(runner, *args, **kwargs):
        with device_guard(runner.device):
            return method(runner, *args, **kwargs)

    return guarded


def choosable_experts(model) -> bool:
    """The model has MoE experts whose implementation transformers lets the config choose, and
    ``CAPTURE_SAFE_EXPERTS`` is one of them (transformers' ``use_experts_implementation``)."""
    if not any(hasattr(m, "_apply_gate") and hasattr(m, "is_concatenated") for m in model.modules()):
        return False
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    return CAPTURE_SAFE_EXPERTS in ALL_EXPERTS_FUNCTIONS


@contextlib.contextmanager
def experts_implementation(model, implementation: str | None):
    """The model's MoE experts run ``implementation`` inside (None: the config's own)."""
    if implementation is None:
        yield
        return
    config = model.config
    before = config._experts_implementation  # noqa: SLF001 - transformers reads the choice from this field
    config._experts_implementation = implementation  # noqa: SLF001
    try:
        yield
    finally:
        config._experts_implementation = before  # noqa: SLF001


class CudaGraphs:
    """The captured buckets of one runner (:meth:`specdist.models.runner.CausalLMRunner.capture_graphs`).

    ``eager_replay``: nothing is captured and a "replay" runs the pass again over the bucket's static buffers, on
    any device: the buckets, the buffers' layout, the caller's words in their tail and the host-read check of
    every bucket's pass, on a CPU."""

    def __init__(self, runner, eager_replay: bool = False):
        self.runner = runner
        self.eager_replay = eager_replay
        self.graphs: dict[tuple[int, int], _Graph] = {}
        self.batch_sizes: list[int] = []
        self.token_counts: list[int] = []
        self.capture_s: dict[tuple[int, int], float] = {}
        self.pool = None
        self.stream = None  # the capture stream, on the runner's device
        self.experts: str | None = None  # the MoE experts implementation the passes run (None: the model's own)

    def capture(self, batch_sizes: list[int], token_counts: list[int], log=None) -> float:
        """Capture every (batch, tokens) bucket, the largest first (the smaller ones then reuse its memory);
        ``log``: a function given one progress line a bucket and one for the whole (default: stderr). Returns
        the seconds taken. Raises :class:`~specdist.models.host_reads.HostReadError` where a pass reads the
        device on the host (nothing is captured then: the largest bucket's pass runs first, uncaptured)."""
        log = log or (lambda line: print(line, file=sys.stderr, flush=True))
        t0 = time.perf_counter()
        self.batch_sizes, self.token_counts = sorted(batch_sizes), sorted(token_counts)
        buckets = sorted(((b, t) for b in batch_sizes for t in token_counts), key=lambda bt: -bt[0] * bt[1])
        device = self.runner.device
        with device_guard(device):
            self._choose_experts(*buckets[0])
            if not self.eager_replay:
                self.pool, self.stream = torch.cuda.graph_pool_handle(), torch.cuda.Stream(device)
            for i, (bsz, tokens) in enumerate(buckets):
                t1 = time.perf_counter()
                self.graphs[(bsz, tokens)] = self._capture_one(bsz, tokens)
                self.capture_s[(bsz, tokens)] = time.perf_counter() - t1
                log(
                    f"cuda graphs: captured batch {bsz} x {tokens} tokens ({i + 1}/{len(buckets)}) in "
                    f"{self.capture_s[(bsz, tokens)]:.2f} s"
                )
        seconds = time.perf_counter() - t0
        sizes = self.static_bytes()
        b, t = buckets[0]
        log(
            f"cuda graphs: {len(buckets)} buckets in {seconds:.2f} s, static buffers {_size(sum(sizes.values()))} "
            f"(batch {b} x {t} tokens: {_size(sizes[(b, t)])})"
            + (f", MoE experts {self.experts}" if self.experts else "")
        )
        return seconds

    def static_bytes(self) -> dict[tuple[int, int], int]:
        """Each bucket's static bytes (:meth:`_Graph.static_bytes`): its input buffer, the hidden states
        [B' * T', D] and EAGLE-3 taps it outputs."""
        return {bt: g.static_bytes() for bt, g in self.graphs.items()}

    def _pass(self, bsz: int, tokens: int):
        """A bucket's static input buffer, the length of its head, and the pass over it (what a graph records):
        ``run() -> (out [B * T, D], hidden [B, T, nD] or None)``."""
        runner = self.runner
        cache = runner.cache
        width = cache.max_blocks
        size = step_size(bsz, tokens, width)
        # the graph reads the head (all padding at capture); the tail carries a caller's words (runner.forward's
        # ``extra``: a verification's sampling inputs, at most about 24 words a row)
        buf = torch.zeros(size + EXTRA_WORDS_PER_ROW * bsz * tokens + 64, dtype=torch.int32, device=runner.device)

        def run():
            with experts_implementation(runner.model, self.experts):
                step = unpack_step(buf[:size], bsz, tokens, width, cache.block_size)
                h, hidden = runner.paged_layers(step)  # [B, T, D]
            return h.reshape(bsz * tokens, -1), hidden  # [B * T, D]

        return buf, size, run

    @torch.inference_mode()
    def _choose_experts(self, bsz: int, tokens: int) -> None:
        """One pass of the bucket (the largest) under :class:`HostReadGuard` before any capture. Where it reads
        the host and the model's MoE experts can run another implementation (:func:`choosable_experts`: in
        float32, transformers' grouped experts run torch's grouped GEMM fallback, which reads its offsets on the
        host), the passes take ``CAPTURE_SAFE_EXPERTS`` and the check runs again; a host read left raises
        :class:`HostReadError`."""
        run = self._pass(bsz, tokens)[2]
        try:
            with HostReadGuard(self.runner.device):
                run()
        except HostReadError:
            if not choosable_experts(self.runner.model):
                raise
            self.experts = CAPTURE_SAFE_EXPERTS
            with HostReadGuard(self.runner.device):
                run()

    @torch.inference_mode()
    def _capture_one(self, bsz: int, tokens: int) -> _Graph:
        buf, size, run = self._pass(bsz, tokens)
        rows = buf[step_layout(bsz, tokens, self.runner.cache.max_blocks)["logits_rows"]]
        if self.eager_replay:
            with HostReadGuard(self.runner.device):
                out, hidden = run()
            return _Graph(bsz, tokens, buf, None, out, hidden, rows, run)
        current = torch.cuda.current_stream(self.runner.device)
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):  # warm-up: Triton's compiles and cuBLAS's choices happen outside capture
            with HostReadGuard(self.runner.device):  # each bucket's pass checked (the capture would fail less clearly)
                run()
            run()
        current.wait_stream(self.stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
            out, hidden = run()
        return _Graph(bsz, tokens, buf, graph, out, hidden, rows, run)

    def bucket(self, bsz: int, tokens: int) -> _Graph | None:
        """The smallest captured bucket holding ``bsz`` requests of ``tokens`` tokens, or None."""
        b = next((x for x in self.batch_sizes if x >= bsz), None)
        t = next((x for x in self.token_counts if x >= tokens), None)
        return None if b is None or t is None else self.graphs.get((b, t))

    def run(self, slots: list[int], tokens: list[list[int]], starts: list[int], num_logits: list[int], extra=None):
        """Replay the bucket of this call: (packed logits [sum(num_logits), V], hidden [B, T, nD] or None,
        ``extra`` on the device or None), or None when no bucket holds it (the caller runs the eager pass).
        ``extra`` (the caller's int32 words, numpy) rides in the same copy, into the buffer's tail. The graph
        outputs hidden states; the final norm and head run after it on the rows asked for alone."""
        g = self.bucket(len(slots), max(len(t) for t in tokens))
        if g is None:
            return None
        runner = self.runner
        host = pack_step(runner.cache, slots, tokens, starts, num_logits, g.bsz, g.tokens, runner.cache.max_blocks)
        at = len(host) + len(host) % 2  # the caller's words start on an even word
        tail = None
        with device_guard(runner.device):
            if extra is None:
                runner.attention.send(host, g.buf[: len(host)])
            elif at + len(extra) <= g.buf.numel():  # the caller's words ride in the buffer's tail
                runner.attention.send(np.concatenate([host, [0] * (at - len(host)), extra]), g.buf[: at + len(extra)])
                tail = g.buf[at : at + len(extra)]
            else:  # more than the tail holds: a copy of their own
                runner.attention.send(host, g.buf[: len(host)])
                tail = runner.attention.send(extra)
            g.replay()
            picked = g.out.index_select(0, g.rows[: sum(num_logits)].long())  # [M, D], free of the next replay
            logits = runner.head_rows(picked[:, None])[:, 0]  # [M, V] float32
            hidden = None
            if g.hidden is not None:
                hidden = g.hidden[: len(slots), : max(len(t) for t in tokens)].clone()
        return logits, hidden, tail


def _size(n: int) -> str:
    """``n`` bytes in the largest binary unit that leaves at least 1."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.1f} {unit}"
    return f"{n} B"
