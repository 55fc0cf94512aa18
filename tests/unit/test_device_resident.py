"""No vocabulary-sized tensor leaves the model's device on the verification and in-process draft paths.

A spy patches the Python-level ways a tensor gets to the host or to another device
(``Tensor.cpu``, ``.to`` with a device, ``.tolist``, ``.numpy``, ``.item``, ``__array__``) and
records every call made on a tensor with a dimension of the vocabulary's size. The tiny models
have a vocabulary of 97, a size no other dimension of theirs has (hidden 32, MLP 64, context 64,
batch 4, k 3), so any hit is a row of logits, p or q. On CPU no call really moves anything, so
the spy counts calls, not bytes: a ``.to(device)`` counts even where the devices agree (a dtype-only
``.to`` does not). A control under the same spy shows that it catches each kind of call, and that
the engine with the runner's old ``logits.cpu()`` put back fails it.
"""

from __future__ import annotations

import pytest
import torch
from support.helpers import devices, save_tiny_llama

from specdist.engine.local import Engine
from specdist.models.runner import CausalLMRunner
from specdist.sampling_params import SamplingParams

VOCAB = 97
BATCH = 4
PROMPTS = [[1, 2, 3], [4, 5], [6, 7, 8, 9, 10], [11, 12]]
_WATCHED = ("cpu", "to", "tolist", "numpy", "item", "__array__")


def _names_a_device(args, kwargs) -> bool:
    """Whether a ``Tensor.to`` call moves to a device (or to another tensor's), not only casts."""
    if "device" in kwargs:
        return True
    return bool(args) and isinstance(args[0], (str, int, torch.device, torch.Tensor))


class TransferSpy:
    """Records (method, shape) of every watched call; ``hits`` are those on vocabulary-sized tensors."""

    def __init__(self, monkeypatch, vocab: int):
        self.vocab = vocab
        self.calls: list[tuple[str, tuple[int, ...]]] = []
        for name in _WATCHED:
            monkeypatch.setattr(torch.Tensor, name, self._wrap(name, getattr(torch.Tensor, name)))

    def _wrap(self, name, inner):
        def spy(t, *args, **kwargs):
            if name != "to" or _names_a_device(args, kwargs):
                self.calls.append((name, tuple(t.shape)))
            return inner(t, *args, **kwargs)

        return spy

    @property
    def hits(self) -> list[tuple[str, tuple[int, ...]]]:
        return [(n, s) for n, s in self.calls if self.vocab in s]


@pytest.fixture(scope="module")
def vocab97(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("vocab97")
    return {
        "target": save_tiny_llama(str(root / "target"), seed=1, vocab_size=VOCAB),
        "draft": save_tiny_llama(str(root / "draft"), seed=2, vocab_size=VOCAB, layers=1),
    }


def _engine(models, method: str, threshold: float = 0.0, device: str = "cpu") -> Engine:
    draft = {"method": method, "num_speculative_tokens": 3, "length_policy": "fixed", "confidence_threshold": threshold}
    if method == "model":
        draft["model"] = models["draft"]
    return Engine.from_config(
        {
            "target": {"model": models["target"]},
            "draft": draft,
            "engine": {"max_model_len": 64, "max_batch_size": BATCH, "device": device},
        }
    )


def _params(temperature: float) -> list[SamplingParams]:
    return [
        SamplingParams(temperature=temperature, top_p=0.9, max_tokens=20, ignore_eos=True, seed=10 + i)
        for i in range(BATCH)
    ]


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize(
    "method,temperature,threshold",
    [
        ("model", 0.8, 0.0),  # sampled model drafts: q rows made and verified on the device
        ("model", 0.0, 0.0),  # greedy: one-hot q
        ("model", 0.8, 0.2),  # the confidence rule reads the draft's distribution on the device
        ("self-w8", 0.8, 0.0),  # on CUDA self-w4 (self-w8 is refused there: quant.INT8_ON_CUDA)
    ],
)
def test_steps_keep_vocabulary_sized_tensors_on_the_device(
    vocab97, monkeypatch, method, temperature, threshold, device
):
    eng = _engine(vocab97, "self-w4" if (method, device) == ("self-w8", "cuda") else method, threshold, device)
    assert eng.target_core.runner.device.type == device
    spy = TransferSpy(monkeypatch, VOCAB)
    reqs = [eng.add_request(p, sp) for p, sp in zip(PROMPTS, _params(temperature))]
    steps = 0
    while eng.has_unfinished():
        eng.step()
        steps += 1
    monkeypatch.undo()
    assert all(len(r.output.token_ids) == 20 for r in reqs)
    assert steps >= 4 and eng.stats.drafted > 0  # several speculative steps ran under the spy
    assert spy.hits == []
    # what does leave, one copy per step (specdist.cores.verify_batch): sampled, the verifier's 3 values a request
    # (accepted count, final token, unusable flag); greedy, each verified row's argmax and NaN flag (N rows: every
    # request's drafts + 1). (Under the default Gumbel coupling drafts carry no q rows, so no q check follows.)
    if temperature > 0:
        assert ("tolist", (BATCH * 3,)) in spy.calls
    else:
        assert ("tolist", (2 * BATCH * 4,)) in spy.calls


def test_spy_catches_each_transfer_and_the_old_host_logits(vocab97, monkeypatch):
    spy = TransferSpy(monkeypatch, VOCAB)
    row = torch.zeros(1, VOCAB)
    row.cpu(), row.to("cpu"), row.to(device=torch.device("cpu")), row.tolist(), row.numpy()
    row[0, :1].item(), row.to(torch.float16)  # a one-entry tensor; a dtype cast is not a move
    assert spy.hits == [
        ("cpu", (1, VOCAB)),
        ("to", (1, VOCAB)),
        ("to", (1, VOCAB)),
        ("tolist", (1, VOCAB)),
        ("numpy", (1, VOCAB)),
    ]
    assert spy.calls[len(spy.hits) :] == [("item", (1,))]
    monkeypatch.undo()

    # The runner as it was before the logits stayed on the device: the same engine run fails the check.
    eng = _engine(vocab97, "model")
    inner = CausalLMRunner.forward
    monkeypatch.setattr(CausalLMRunner, "forward", lambda self, *a, **k: inner(self, *a, **k).cpu())
    spy = TransferSpy(monkeypatch, VOCAB)
    eng.generate(PROMPTS, SamplingParams(temperature=0.8, max_tokens=8, ignore_eos=True, seed=1))
    assert ("cpu", (BATCH * 4, VOCAB)) in spy.hits  # the verification forward (packed): last token + 3 drafts
