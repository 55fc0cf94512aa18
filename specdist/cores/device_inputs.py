"""A step's host-made inputs as one int32 word array, and read back as views on the device.

A verification (or a draft pass) needs a handful of small arrays on the device besides the
forward's own metadata: uniforms, draft tokens, per-row sampling settings, row indices. Sent one
by one they are a copy each; :class:`HostInputs` packs them into int32 words that ride in the
forward's one host-to-device copy (``CausalLMRunner.forward(extra=...)``), and
:meth:`HostInputs.unpack` gives each back as a view of the device buffer: no copy, no sync.
8-byte arrays (float64 uniforms, int64 indices and noise keys) come first and the runner starts the
words on an even word, so each view is aligned. Integers travel as int64: the device then reads them
as index tensors as they are, with no conversion kernel each.
"""

from __future__ import annotations

import numpy as np
import torch

_DTYPES = {
    np.dtype(np.float64): torch.float64,
    np.dtype(np.int64): torch.int64,
    np.dtype(np.float32): torch.float32,
    np.dtype(np.int32): torch.int32,
}


class HostInputs:
    """Named arrays, added on the host, packed into int32 words (:meth:`words`)."""

    def __init__(self):
        self.arrays: dict[str, np.ndarray] = {}

    def add(self, name: str, values, dtype) -> None:
        self.arrays[name] = np.ascontiguousarray(np.asarray(values, dtype=dtype).reshape(-1))

    def _order(self) -> list[str]:  # 8-byte arrays first: every array starts aligned to its size
        return sorted(self.arrays, key=lambda n: -self.arrays[n].dtype.itemsize)

    def words(self) -> np.ndarray:  # [W] int32
        parts = [self.arrays[n].view(np.int32) for n in self._order()]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)

    def unpack(self, buf: torch.Tensor) -> dict[str, torch.Tensor]:
        """Views of ``buf`` ([W] int32 on the device, :meth:`words` copied there), one per array, each in its dtype."""
        out, at = {}, 0
        for name in self._order():
            a = self.arrays[name]
            n = a.size * a.dtype.itemsize // 4
            out[name] = buf[at : at + n].view(_DTYPES[a.dtype])
            at += n
        return out
