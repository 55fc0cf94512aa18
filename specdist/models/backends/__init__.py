"""Attention backends, registered by name (as the draft methods are): what a runner asks once a step
(:meth:`AttentionBackend.plan`: the step's metadata, on the device) and once a layer
(:meth:`AttentionBackend.forward`: rotary, the new keys and values written into the cache, the layer's
attention output), and the KV cache layout each one reads (:meth:`AttentionBackend.make_cache`).

| name | cache | where it runs |
|---|---|---|
| ``paged`` | paged blocks | CUDA with Triton (the kernels of :mod:`specdist.models.kernels.triton_attention`) |
| ``paged-torch`` | paged blocks | anywhere: torch's reference of the same kernels |
| ``sdpa`` | a slot a request | anywhere: torch's scaled-dot-product attention |
| ``cpu`` | a slot a request | an x86 CPU with specdist's C kernels, float32 |

A new backend (FlashInfer's or FlashAttention's paged API, say) is one module here that subclasses
:class:`AttentionBackend` under ``@register``, and one entry in ``tests/unit/test_attention_backends.py``,
which runs every registered backend against one float64 reference.
"""

from specdist.models.backends import paged as _paged  # noqa: F401 (registers paged, paged-torch)
from specdist.models.backends import slots as _slots  # noqa: F401 (registers sdpa, cpu)
from specdist.models.backends.base import (
    AttentionBackend,
    SlotStep,
    backend_class,
    backend_names,
    choose_backend,
    register,
)

__all__ = ["AttentionBackend", "SlotStep", "backend_class", "backend_names", "choose_backend", "register"]
