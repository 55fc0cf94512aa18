"""One copy each way a step: the paged path's host-device traffic, counted on the CPU.

On a GPU every host-to-device copy is a transfer of its own and every device-to-host read a
synchronisation that waits for the whole queue. The paged path sends everything a forward needs
in one packed copy (the runner's metadata and, in its tail, the verification's sampling inputs:
:class:`specdist.cores.verify_batch.VerifyBatch`) and brings a step's results back in one copy.

There is no device here, so the test counts what would cross on one: every tensor made from host
data (``torch.tensor``, ``torch.as_tensor``, ``torch.from_numpy``) and every read of a tensor's
values on the host (``tolist``, ``item``, ``numpy``, ``cpu``, and ``bool`` / ``int`` / ``float`` /
``index`` of a tensor). The code under test makes none of those for bookkeeping alone, so each one
is a copy on a GPU. ``gpu_check`` counts the same steps' synchronisations on the GPU itself
(``torch.cuda.set_sync_debug_mode``).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from support.helpers import tiny_config

from specdist import SamplingParams
from specdist.engine.local import Engine

pytestmark = pytest.mark.usefixtures("one_thread")

TO_DEVICE = ("tensor", "as_tensor", "from_numpy")
TO_HOST = ("tolist", "item", "numpy", "cpu", "__bool__", "__int__", "__float__", "__index__")


class Copies:
    """Counts the calls above while active; ``marks`` splits the counts at each runner forward."""

    def __init__(self):
        self.to_device = 0
        self.to_host = 0
        self.where: list[str] = []

    @contextlib.contextmanager
    def counting(self, monkeypatch):
        for name in TO_DEVICE:
            real = getattr(torch, name)
            monkeypatch.setattr(torch, name, self._wrap(real, "to_device", name))
        for name in TO_HOST:
            real = getattr(torch.Tensor, name)
            monkeypatch.setattr(torch.Tensor, name, self._wrap(real, "to_host", name))
        try:
            yield self
        finally:
            monkeypatch.undo()

    def _wrap(self, real, kind: str, name: str):
        counter = self

        def counted(*args, **kwargs):
            setattr(counter, kind, getattr(counter, kind) + 1)
            counter.where.append(name)
            return real(*args, **kwargs)

        return counted

    def reset(self) -> tuple[int, int, list[str]]:
        out = (self.to_device, self.to_host, self.where)
        self.to_device = self.to_host = 0
        self.where = []
        return out


CASES = [  # (draft method, temperature, coupling)
    ("none", 0.0, "rejection"),
    ("none", 0.8, "rejection"),
    ("suffix", 0.0, "rejection"),
    ("suffix", 0.8, "rejection"),
    ("suffix", 0.8, "gumbel"),
    ("ngram", 0.7, "rejection"),
]


@pytest.mark.parametrize("method,temperature,coupling", CASES)
def test_a_step_copies_once_each_way(tiny_models, monkeypatch, method, temperature, coupling):
    """Steady steps (every request admitted, none admitted in the step) over a paged cache: at most one
    host-to-device copy and one device-to-host read a step, with 3 requests of mixed settings (top-k,
    top-p, log-probabilities) drafting ragged proposals."""
    cfg = tiny_config(tiny_models, method=method, k=3, max_batch_size=4, kv_cache="paged", kv_block_size=4)
    cfg["sampling"] = {"coupling": coupling}
    eng = Engine.from_config(cfg)
    params = [
        SamplingParams(max_tokens=12, temperature=temperature, seed=1, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=temperature, top_k=3, seed=2, ignore_eos=True),
        SamplingParams(
            max_tokens=12,
            temperature=temperature,
            top_p=0.8,
            seed=3,
            ignore_eos=True,
            logprobs=2 if temperature > 0 else None,
        ),
    ]
    prompts = [[1, 2, 3, 1, 2, 3, 1, 2], [4, 5, 6, 4, 5], [2, 3, 1, 2, 3, 1]]
    for p, sp in zip(prompts, params):
        eng.add_request(p, sp)
    eng.step()  # admission: the prompts' prefill is a forward (and a copy) of its own
    copies = Copies()
    seen = []
    with copies.counting(monkeypatch):
        while eng.running:
            eng.step()
            to_device, to_host, where = copies.reset()
            seen.append((to_device, to_host))
            assert to_device <= 1 and to_host <= 1, f"step {len(seen)}: {to_device} copies in, {to_host} out: {where}"
    assert len(seen) >= 3 and seen[0] == (1, 1)  # the counter saw the step's traffic
    assert eng.kv_slots_in_use()["target"] == 0


def test_the_counter_sees_a_copy_each_way(tiny_models, monkeypatch):
    """Negative control: the counter counts a tensor made from a list and a read back."""
    copies = Copies()
    with copies.counting(monkeypatch):
        x = torch.tensor([1, 2, 3])
        x.tolist()
        bool(x[0] > 0)
    assert copies.reset()[:2] == (1, 2)


@pytest.mark.parametrize(
    "method,temperature,coupling",
    [("model", 0.0, "rejection"), ("model", 0.8, "rejection"), ("model", 0.8, "gumbel"), ("self-w8", 0.9, "rejection")],
)
def test_each_forward_pass_copies_once_each_way(tiny_models, monkeypatch, method, temperature, coupling):
    """Model drafts run k draft passes a step: each pass (and the verification) makes at most one copy each
    way, counted between the starts of consecutive forwards (the draft's and the target's)."""
    cfg = tiny_config(tiny_models, method=method, k=3, max_batch_size=4, kv_cache="paged", kv_block_size=4)
    cfg["sampling"] = {"coupling": coupling}
    eng = Engine.from_config(cfg)
    for i, p in enumerate([[1, 2, 3, 4], [5, 6, 7], [2, 4, 6, 1, 3]]):
        eng.add_request(
            p, SamplingParams(max_tokens=10, temperature=temperature, top_p=0.9 if i else 1.0, seed=i, ignore_eos=True)
        )
    eng.step()
    copies = Copies()
    windows = []

    def marked(real):
        def forward(*args, **kwargs):
            windows.append(copies.reset())
            return real(*args, **kwargs)

        return forward

    for runner in (eng.target_core.runner, eng.draft_core.runner):
        monkeypatch.setattr(runner, "forward", marked(runner.forward))
    with copies.counting(monkeypatch):
        while eng.running:
            eng.step()
        windows.append(copies.reset())
    windows = windows[1:]  # the first window began before counting
    assert len(windows) >= 6 and max(w[0] for w in windows) == 1
    for i, (to_device, to_host, where) in enumerate(windows):
        assert to_device <= 1 and to_host <= 1, f"pass {i}: {to_device} copies in, {to_host} out: {where}"
