"""The output projection's CPU row padding (specdist/models/runner.py:_lm_head) changes no result."""

from __future__ import annotations

import pytest
import torch

from specdist.models.runner import _lm_head


@pytest.mark.parametrize("bsz,n", [(1, 1), (1, 2), (1, 3), (2, 1), (3, 1), (2, 3), (1, 7), (4, 2)])
def test_padded_lm_head_equals_plain(bsz: int, n: int) -> None:
    torch.manual_seed(0)
    head = torch.nn.Linear(48, 100, bias=False)
    hs = torch.randn(bsz, n, 48)
    got = _lm_head(head, hs)  # [B, n, V]
    assert got.shape == (bsz, n, 100)
    torch.testing.assert_close(got, head(hs), rtol=1e-5, atol=1e-6)


def test_other_heads_are_called_as_is() -> None:
    calls = []

    class Head(torch.nn.Module):
        def forward(self, x):
            calls.append(tuple(x.shape))
            return x

    _lm_head(Head(), torch.zeros(1, 3, 4))
    assert calls == [(1, 3, 4)]  # not an nn.Linear (int8, tensor-parallel heads): no padding
