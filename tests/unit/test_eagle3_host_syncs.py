"""EAGLE-3 drafting waits for the device at most once a draft pass (issue 50, finding 10).

On a GPU every read of a device value on the host (``item``, ``tolist``, the truth of a tensor, ``nonzero``,
``torch.equal``, a copy to the CPU) and every blocking copy from the host (``Tensor.to`` without
``non_blocking``, ``torch.tensor(..., device=...)``) waits for everything queued on the device. A draft pass must
read its drafted tokens back, once; nothing else may wait.

There is no GPU here: the head sits on the meta device (shapes only, no data), so every crossing between the
host and "the device" is an operation :class:`HostTraffic` sees, as on a GPU. A read back returns zeros (the
meta device has no values), so the drafts are token 0: this counts, it does not check tokens (the CPU tests of
tests/engine/test_eagle3.py do).
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import LlamaConfig

from specdist.bench.checkpoints import write_random_eagle3_head
from specdist.cores.draft import DrafterCore
from specdist.cores.proposers.eagle3 import Eagle3Proposer
from specdist.models.eagle3 import load_eagle3_head
from specdist.sampling_params import SamplingParams
from specdist.transport.protocol import ProposeItem, StartItem

pytestmark = pytest.mark.usefixtures("one_thread")

aten = torch.ops.aten
_READS = {aten._local_scalar_dense, aten.item, aten.nonzero, aten.equal, aten.is_nonzero}  # noqa: SLF001


def _device(x) -> torch.device:
    return torch.device(x) if x is not None else torch.device("cpu")


class HostTraffic(TorchDispatchMode):
    """While active: ``syncs``, what would wait for the device (a host read, a copy to the host, a blocking copy
    from it), and ``copies_in``, every copy from the host to the device, each named with its shape."""

    def __init__(self, monkeypatch):
        super().__init__()
        self.syncs: list[str] = []
        self.copies_in: list[str] = []
        for name in ("tensor", "as_tensor"):  # made straight on a device: no operation to see, a blocking copy
            real = getattr(torch, name)

            def made(*args, _real=real, _name=name, **kwargs):
                if _device(kwargs.get("device")).type != "cpu":
                    self.syncs.append(f"torch.{_name}(device=...)")
                    self.copies_in.append(f"torch.{_name}")
                return _real(*args, **kwargs)

            monkeypatch.setattr(torch, name, made)

    def mark(self) -> tuple[int, int]:
        return len(self.syncs), len(self.copies_in)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        op = func.overloadpacket
        if op in _READS:
            self.syncs.append(str(op))
            if op in (aten._local_scalar_dense, aten.item):  # noqa: SLF001
                return 0
        if op is aten._to_copy:  # noqa: SLF001
            src, dst = args[0], _device(kwargs.get("device", args[0].device))
            if src.device.type != "cpu" and dst.type == "cpu":  # a read back: zeros for the meta device's values
                self.syncs.append(f"to host {tuple(src.shape)}")
                return torch.zeros(src.shape, dtype=kwargs.get("dtype") or src.dtype)
            if src.device.type == "cpu" and dst.type != "cpu":
                self.copies_in.append(f"to device {tuple(src.shape)}")
                if not kwargs.get("non_blocking", False):
                    self.syncs.append(f"blocking to device {tuple(src.shape)}")
        if op is aten.copy_ and args[0].device.type != args[1].device.type:
            non_blocking = (args[2] if len(args) > 2 else False) or kwargs.get("non_blocking", False)
            if args[0].device.type == "cpu":
                self.syncs.append(f"copy_ to host {tuple(args[1].shape)}")
                return args[0]
            self.copies_in.append(f"copy_ to device {tuple(args[1].shape)}")
            if not non_blocking:
                self.syncs.append(f"blocking copy_ to device {tuple(args[1].shape)}")
        return func(*args, **kwargs)


@pytest.fixture(scope="module")
def head_dir(tmp_path_factory):
    """A random head for a target of vocabulary 16, hidden size 32, 2 layers (the head's draft vocabulary 10)."""
    config = LlamaConfig(
        vocab_size=16,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    path = str(tmp_path_factory.mktemp("eagle3") / "head")
    write_random_eagle3_head(path, config, draft_vocab_size=10, seed=1, std=0.3)
    return path, config


REQUESTS = [  # (prompt, sampling, coupling): greedy, sampled under both couplings with top-k / top-p, a long prompt
    ([5, 6, 1, 2, 3, 4], SamplingParams(temperature=0.0, max_tokens=16), "rejection"),
    ([3, 1, 4], SamplingParams(temperature=0.8, top_p=0.9, max_tokens=16), "gumbel"),
    ([2, 7, 1, 8, 2, 8, 1, 8, 2, 8], SamplingParams(temperature=1.0, top_k=5, max_tokens=16), "rejection"),
]


@pytest.mark.parametrize("which", ["all", "greedy", "sampled"])
def test_a_draft_pass_waits_for_the_device_once(head_dir, monkeypatch, which: str) -> None:
    """A prompt's first draft (the prompt's states fed, a long one caught up in a forward of its own) and the
    step after (one accepted draft, the target's token, their states): each pass makes at most one host read
    (its tokens) and one copy to the device a forward of the head (ids, positions, slots and the sampling inputs
    together; a prompt's first pass may run two forwards, the catch-up of a long prompt first)."""
    path, config = head_dir
    head = load_eagle3_head(path, config, torch.nn.Embedding(16, 32, device="meta"), torch.float32, "meta")
    core = DrafterCore(Eagle3Proposer(head, 4, 32), 32)
    reqs = [r for r in REQUESTS if which == "all" or (which == "greedy") == (r[1].temperature == 0)]
    width = len(head.spec.aux_layers) * head.spec.target_hidden_size
    core.start(
        [
            StartItem(str(i), p, sp, 7 + i, coupling, hidden_layers=tuple(head.spec.aux_layers))
            for i, (p, sp, coupling) in enumerate(reqs)
        ]
    )
    traffic = HostTraffic(monkeypatch)
    passes: list[tuple[list[str], list[str], int]] = []  # per pass: its waits, its copies in, the head's forwards
    forwards = []
    draft_pass, forward = core.proposer.draft_pass, head.forward

    def counted(*args, **kwargs):
        s, c, f = *traffic.mark(), len(forwards)
        draft_pass(*args, **kwargs)
        passes.append((traffic.syncs[s:], traffic.copies_in[c:], len(forwards) - f))

    def counted_forward(*args, **kwargs):
        forwards.append(1)
        return forward(*args, **kwargs)

    monkeypatch.setattr(core.proposer, "draft_pass", counted)
    monkeypatch.setattr(head, "forward", counted_forward)
    k = 3
    with traffic:
        props, _ = core.propose(
            [
                ProposeItem(str(i), 0, [], k, len(p), hidden=torch.empty(len(p) - 1, width, device="meta"))
                for i, (p, _, _) in enumerate(reqs)
            ]
        )
        assert all(len(pr.token_ids) == k for pr in props)  # the meta device's reads give token 0
        core.propose(
            [
                ProposeItem(str(i), 1, [0], k, len(p) + 2, hidden=torch.empty(2, width, device="meta"))
                for i, (p, _, _) in enumerate(reqs)
            ]
        )
    assert len(passes) == 2 * k
    for n, (syncs, copies_in, fw) in enumerate(passes):
        assert len(syncs) <= 1 and len(copies_in) <= fw, f"pass {n}: waits {syncs}, copies in {copies_in}"
    assert sum(len(s) for s, _, _ in passes) == 2 * k  # each pass reads its tokens (the counter sees reads)
    assert passes[0][2] == 2  # the prompts' first pass caught up first (each feeds more than CATCH_UP_IN_PASS)


def test_the_counter_sees_each_kind_of_wait(monkeypatch) -> None:
    """Negative control: a value read, a truth, a list read back, a blocking copy in and a tensor made on the
    device are waits; a non-blocking copy in is a copy, not a wait."""
    traffic = HostTraffic(monkeypatch)
    with traffic:
        x = torch.ones(3, device="meta")
        x.sum().item()
        bool(x[0])
        x.tolist()
        torch.zeros(2).to("meta")
        torch.zeros(2).to("meta", non_blocking=True)
        torch.tensor([1, 2], device="meta")
    assert len(traffic.syncs) == 5, traffic.syncs
    assert len(traffic.copies_in) == 3, traffic.copies_in
