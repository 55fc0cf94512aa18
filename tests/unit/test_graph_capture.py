"""The CUDA graph capture path (:mod:`specdist.models.graphs`), checked on the CPU through its eager replay.

- Host reads (:mod:`specdist.models.host_reads`): the guard raises on each op that reads device memory on the
  host and passes device work; every bucket's pass of every family of the model zoo, float32 and bfloat16, runs
  under it (float32 MoE experts through the capture-safe implementation the runner picks for its graphs); a pass
  that still reads the host turns that runner's graphs off with one line on stderr, and it serves uncaptured.
- ``engine.device: cuda:N``: capture, replay and the eager paged forward run under the runner's device.
- Static outputs: a bucket keeps hidden states [B' * T', D], not logits, and the logits of the rows a step asks
  for equal the eager paged pass's.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from support.model_zoo import FAMILIES, build_tiny

from specdist.models import graphs as graphs_module
from specdist.models.graphs import device_guard
from specdist.models.host_reads import HostReadError, HostReadGuard
from specdist.models.kv.options import KVOptions
from specdist.models.runner import CausalLMRunner

_X = torch.arange(6.0).reshape(2, 3)
_MASK = _X > 2
_IDS = torch.tensor([1, 0, 2])
_OFFS = torch.tensor([2, 4], dtype=torch.int32)

HOST_READS = {  # each reads device memory on the host on a GPU
    "item": lambda: _X[0, 0].item(),
    "int": lambda: int(_X.max()),
    "bool": lambda: bool(_MASK[0, 0]),
    "if": lambda: 1 if _MASK.any() else 0,
    "nonzero": lambda: _MASK.nonzero(),
    "equal": lambda: torch.equal(_X, _X),
    "where(condition)": lambda: torch.where(_MASK),
    "mask index": lambda: _X[_MASK],
    "mask assignment": lambda: _X.clone().__setitem__(_MASK, 0.0),
    "unique": lambda: _IDS.unique(),
    "bincount": lambda: _IDS.bincount(),
    "repeat_interleave(tensor)": lambda: _X.repeat_interleave(torch.tensor([1, 2]), dim=0),
    "histc without a range": lambda: _X.histc(4),
    "grouped_mm float32": lambda: torch.nn.functional.grouped_mm(torch.randn(4, 8), torch.randn(2, 8, 8), offs=_OFFS),
}
DEVICE_WORK = {  # none does
    "arithmetic": lambda: (_X * 2 + 1).softmax(-1),
    "where(condition, x, y)": lambda: torch.where(_MASK, _X, 0.0),
    "index by positions": lambda: _X[_IDS[:2]],
    "repeat_interleave(int)": lambda: _X.repeat_interleave(2, dim=0),
    "repeat_interleave(tensor, output_size)": lambda: _X.repeat_interleave(torch.tensor([1, 2]), dim=0, output_size=3),
    "histc over a range": lambda: _X.histc(4, 0, 5),
    "grouped_mm bfloat16": lambda: torch.nn.functional.grouped_mm(
        torch.randn(4, 8).bfloat16(), torch.randn(2, 8, 8).bfloat16(), offs=_OFFS
    ),
    "a CPU pass's copy to the CPU": lambda: _X.to("cpu", copy=True),
}


@pytest.mark.parametrize("grad", [False, True], ids=["inference", "autograd"])
@pytest.mark.parametrize("name", sorted(HOST_READS))
def test_the_guard_raises_on_a_host_read(name, grad):
    """torch dispatches ``item`` and ``_local_scalar_dense``, ``where`` and ``nonzero`` by the grad mode: both
    are caught."""
    with torch.inference_mode(not grad), pytest.raises(HostReadError, match="test_graph_capture.py"):
        with HostReadGuard("cpu"):
            HOST_READS[name]()


@pytest.mark.parametrize("name", sorted(DEVICE_WORK))
def test_the_guard_passes_device_work(name):
    with torch.inference_mode(), HostReadGuard("cpu"):
        DEVICE_WORK[name]()


def test_the_guard_raises_on_copies_between_the_host_and_the_pass_s_device():
    """Device-to-host always; host-to-device from pageable memory ("meta" stands for a GPU here)."""
    for copy in (
        lambda: torch.empty(3, device="meta").cpu(),
        lambda: torch.zeros(3).copy_(torch.empty(3, device="meta")),
        lambda: torch.zeros(3).to("meta"),
    ):
        with pytest.raises(HostReadError, match="copy"), HostReadGuard("meta"):
            copy()
    with HostReadGuard("meta"):
        torch.empty(3, device="meta") + 1


def _paged_runner(model, slots: int = 4, max_len: int = 64) -> CausalLMRunner:
    return CausalLMRunner(model, slots, max_len, kv=KVOptions("paged", block_size=4))


def _steps(graphed: CausalLMRunner, eager: CausalLMRunner, bsz: int, vocab: int):
    """A prefill (eager in both) then three ragged steps of 1-4 tokens a request: (graphed, eager) logits."""
    sg = [graphed.cache.allocate(40) for _ in range(bsz)]
    se = [eager.cache.allocate(40) for _ in range(bsz)]
    prompts = [[(5 * b + i) % vocab for i in range(3 + b)] for b in range(bsz)]
    graphed.forward(sg, prompts, [0] * bsz)
    eager.forward(se, prompts, [0] * bsz)
    for step in range(3):
        tokens = [[(b + step) % vocab] * (1 + (b + step) % 4) for b in range(bsz)]
        n = [len(t) for t in tokens]
        yield graphed.forward(sg, tokens, n, packed=True), eager.forward(se, tokens, n, packed=True)
    for s in sg:
        graphed.cache.free(s)
    for s in se:
        eager.cache.free(s)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_every_bucket_of_every_family_passes_the_host_read_guard(family, dtype):
    """On a GPU every bucket's pass is captured: run on the CPU, each reads nothing on the host. float32 MoE
    experts (transformers' grouped_mm: torch's fallback reads its offsets on the host, the capture error an H100
    gave) run the capture-safe implementation in the graphs; the logits stay the eager paged pass's."""
    model = build_tiny(family).to(dtype)
    graphed, eager = _paged_runner(model), _paged_runner(model)
    lines = []
    graphed.capture_graphs(max_batch_size=2, max_tokens=4, log=lines.append, eager_replay=True)
    assert graphed.graphs is not None and len(graphed.graphs.graphs) == 2 * 3, lines
    moe_f32 = family == "qwen3_moe" and dtype == torch.float32
    assert graphed.graphs.experts == ("batched_mm" if moe_f32 else None)
    assert ("MoE experts batched_mm" in lines[-1]) == moe_f32
    for g in graphed.graphs.graphs.values():
        with torch.inference_mode(), HostReadGuard(graphed.device):
            g.replay()
    assert model.config._experts_implementation == "grouped_mm" or family != "qwen3_moe"  # the eager pass's own
    if dtype == torch.float32:
        for got, want in _steps(graphed, eager, 2, model.config.vocab_size):
            assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), (got - want).abs().max()


class _ReadsTheHost(torch.nn.Module):
    """An embedding that asks the host whether any id is out of range (a check some modules make)."""

    def __init__(self, embed):
        super().__init__()
        self.embed = embed

    def forward(self, ids):
        if (ids >= self.embed.num_embeddings).any():
            raise IndexError("token id out of range")
        return self.embed(ids)


def test_a_pass_that_reads_the_host_runs_uncaptured_after_one_line(capsys):
    model = build_tiny("llama")
    eager = _paged_runner(model)
    graphed = _paged_runner(model)
    model.model.embed_tokens = _ReadsTheHost(model.model.embed_tokens)
    lines = []
    assert graphed.capture_graphs(max_tokens=2, log=lines.append, eager_replay=True) == 0.0
    err = capsys.readouterr().err.strip().splitlines()
    assert graphed.graphs is None and lines == [] and len(err) == 1, err
    assert (
        "cuda graphs: off for this llama runner" in err[0]
        and "is_nonzero" in err[0]
        and "test_graph_capture.py" in err[0]
    )
    for got, want in _steps(graphed, eager, 2, model.config.vocab_size):  # served by the eager paged pass
        assert torch.equal(got, want)


def test_float32_moe_experts_without_a_capture_safe_choice_turn_the_graphs_off(monkeypatch, capsys):
    """What the H100 showed, found on the CPU: transformers' grouped experts in float32 read the host in torch's
    grouped GEMM; with no other implementation to take, the runner says so and serves uncaptured."""
    monkeypatch.setattr(graphs_module, "choosable_experts", lambda model: False)
    runner = _paged_runner(build_tiny("qwen3_moe"))
    runner.capture_graphs(max_tokens=2, log=lambda line: None, eager_replay=True)
    err = capsys.readouterr().err.strip().splitlines()
    assert runner.graphs is None and len(err) == 1
    assert "aten._grouped_mm" in err[0] and "transformers/integrations/moe.py" in err[0], err[0]


# --------------------------------------------------------------------------- engine.device: cuda:N
class _DeviceRecorder:
    """Stands for torch.cuda.device (no GPU here): records the devices entered and how deep the caller is."""

    def __init__(self):
        self.entered: list[torch.device] = []
        self.depth = 0

    def __call__(self, device):
        @contextlib.contextmanager
        def entered():
            self.entered.append(torch.device(device))
            self.depth += 1
            try:
                yield
            finally:
                self.depth -= 1

        return entered()


def test_the_device_guard_sets_the_current_cuda_device(monkeypatch):
    rec = _DeviceRecorder()
    monkeypatch.setattr(torch.cuda, "device", rec)
    with device_guard(torch.device("cuda", 1)):
        assert rec.depth == 1
    with device_guard(torch.device("cpu")):
        assert rec.depth == 0
    assert rec.entered == [torch.device("cuda", 1)]


def test_capture_replay_and_the_eager_paged_forward_run_under_the_runner_s_device(monkeypatch):
    """Triton launches, ``torch.cuda.graph`` and a graph's replay take the current CUDA device: every layer's
    attention (the paged kernels' launches) and the output head run inside the device guard of the runner's
    device, at capture, at replay and in the eager paged forward."""
    rec = _DeviceRecorder()
    monkeypatch.setattr(graphs_module, "device_guard", rec)
    runner = _paged_runner(build_tiny("llama"))
    depths: dict[str, list[int]] = {"attention": [], "head": []}
    attend, head = runner.attention.forward, runner._head
    monkeypatch.setattr(runner.attention, "forward", lambda *a: (depths["attention"].append(rec.depth), attend(*a))[1])
    monkeypatch.setattr(runner, "_head", lambda hs: (depths["head"].append(rec.depth), head(hs))[1])
    phases = {}

    def phase(name, call):
        for seen in depths.values():
            seen.clear()
        call()
        phases[name] = {k: list(v) for k, v in depths.items()}

    phase("capture", lambda: runner.capture_graphs(max_tokens=2, log=lambda line: None, eager_replay=True))
    slots = [runner.cache.allocate(40) for _ in range(2)]
    phase("eager prefill", lambda: runner.forward(slots, [[1, 2, 3, 4, 5, 6, 7, 8, 9]] * 2, [1, 1]))  # past the buckets
    phase("replay", lambda: runner.forward(slots, [[3], [4, 5]], [1, 2]))
    assert set(rec.entered) == {runner.device}
    for name, seen in phases.items():
        assert seen["attention"] and min(seen["attention"]) >= 1, (name, seen)
    for name in ("eager prefill", "replay"):
        assert phases[name]["head"] and min(phases[name]["head"]) >= 1, (name, phases[name])


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_graphs_on_a_second_gpu_give_the_eager_logits():
    """``engine.device: cuda:1``: capture, replay and the Triton kernels on the runner's device, not device 0."""
    model = build_tiny("llama").to("cuda:1")
    graphed, eager = _paged_runner(model), _paged_runner(model)
    graphed.capture_graphs(max_tokens=4, log=lambda line: None)
    assert graphed.graphs is not None and torch.cuda.current_device() == 0
    for got, want in _steps(graphed, eager, 3, model.config.vocab_size):
        assert got.device == torch.device("cuda", 1)
        assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), (got - want).abs().max()


# --------------------------------------------------------------------------- static outputs
def test_a_bucket_keeps_hidden_states_and_gives_the_eager_pass_s_logits():
    """The rows a step asks for go through the head after the graph: each bucket's static tensors have no
    vocabulary dimension (the logits of every padded row, 1.9 GiB at 8 B / 64 slots, are gone), its static bytes
    grow with the hidden size and not with the vocabulary, and the logits are the eager paged pass's."""

    def captured(**over):
        model = build_tiny("llama", **over)
        runner = _paged_runner(model)
        runner.capture_graphs(max_tokens=4, log=lambda line: None, eager_replay=True)
        return model, runner

    model, graphed = captured(vocab_size=1000)
    eager = _paged_runner(model)
    vocab, dim = 1000, model.config.hidden_size
    for (bsz, tokens), g in graphed.graphs.graphs.items():
        for name, value in vars(g).items():
            assert not isinstance(value, torch.Tensor) or vocab not in value.shape, (bsz, tokens, name)
        assert g.out.shape == (bsz * tokens, dim)
        assert graphed.graphs.static_bytes()[(bsz, tokens)] == g.buf.numel() * 4 + bsz * tokens * dim * 4
    small = captured(vocab_size=16)[1].graphs.static_bytes()
    wide = captured(hidden_size=64, intermediate_size=64)[1].graphs.static_bytes()
    for bt, n in graphed.graphs.static_bytes().items():
        assert small[bt] == n and wide[bt] - n == bt[0] * bt[1] * 32 * 4  # out: [B' * T', D] float32
    for bsz in (1, 3, 4):  # buckets 1, 4 and 4 (3 padded), ragged token counts in buckets 1, 2 and 4
        for got, want in _steps(graphed, eager, bsz, vocab):  # the layers ran at the bucket's padded shapes
            assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (got - want).abs().max()
