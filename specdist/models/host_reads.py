"""Host reads inside a pass meant for a CUDA graph, found before the capture and on any device.

A captured pass may only enqueue device work. An op whose result the host reads (``item``, ``nonzero``, the
truth of a tensor, a copy to the CPU) synchronises the stream, and inside ``torch.cuda.graph`` it fails ("Cannot
copy between CPU and CUDA tensors during CUDA graph capture", "operation not permitted when stream is
capturing") or, where it does not, bakes the value it read at capture into every replay. :class:`HostReadGuard`
is a ``TorchDispatchMode`` that raises :class:`HostReadError` at such an op, naming it and the line of Python
that called it.

It judges an op by what it would do on the device the pass is for, so a CPU (the tests' eager replay of the
graph buckets, :class:`specdist.models.graphs.CudaGraphs`) catches the same ops as a GPU: ops whose result is a
host value, ops whose output size depends on the data (their kernels read a count back), torch's grouped GEMM
outside its bf16 kernel (its fallback loops over the groups with their offsets read on the host: transformers'
MoE experts in float32), and copies between the host and the pass's device.
"""

from __future__ import annotations

import os
import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# ops (schema names) whose result the host reads, or whose output size it reads, whatever their arguments
_ALWAYS = {
    "aten::_local_scalar_dense": "a tensor's value read on the host (item)",
    "aten::item": "a tensor's value read on the host (item)",
    "aten::is_nonzero": "a tensor's truth read on the host (bool, if)",
    "aten::equal": "torch.equal's answer is read on the host",
    "aten::allclose": "torch.allclose's answer is read on the host",
    "aten::nonzero": "nonzero's output size is read on the host",
    "aten::argwhere": "argwhere's output size is read on the host",
    "aten::masked_select": "masked_select's output size is read on the host",
    "aten::bincount": "bincount's output size is read on the host",
    "aten::_unique": "unique's output size is read on the host",
    "aten::_unique2": "unique's output size is read on the host",
    "aten::unique_dim": "unique's output size is read on the host",
    "aten::unique_consecutive": "unique's output size is read on the host",
    "transformers::grouped_mm_fallback": "transformers' grouped GEMM fallback reads its offsets on the host",
}
_COPIES = {"aten::_to_copy", "aten::to", "aten::copy_", "aten::copy", "aten::_copy_from", "aten::_copy_from_and_resize"}
_INDEXING = {"aten::index", "aten::index_put", "aten::index_put_", "aten::_index_put_impl_"}
_THIS = os.path.abspath(__file__)
_TORCH = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep


class HostReadError(RuntimeError):
    """An op of a pass meant for a CUDA graph reads device memory on the host (see the module doc)."""


class HostReadGuard(TorchDispatchMode):
    """Raise :class:`HostReadError` at the first host read of what runs inside (``with HostReadGuard(device):``).
    ``device``: the device the pass runs on when captured (CPU tensors are the host's only when it is not the
    CPU)."""

    def __init__(self, device: torch.device | str):
        super().__init__()
        self.device = torch.device(device)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        why = host_read(func, args, kwargs, self.device)
        if why is not None:
            raise HostReadError(f"{func} at {_caller()}: {why}")
        return func(*args, **kwargs)


def host_read(func, args, kwargs, device: torch.device) -> str | None:
    """Why the call ``func(*args, **kwargs)`` reads device memory on the host when it runs on ``device`` (None:
    it does not)."""
    schema = func._schema  # noqa: SLF001 - an OpOverload's schema: its name and argument names
    name = schema.name
    if name in _ALWAYS:
        return _ALWAYS[name]
    named = {a.name: v for a, v in zip(schema.arguments, args)}  # the arguments by the schema's names
    named.update(kwargs)
    if name == "aten::where" and len(named) == 1:  # where(condition): nonzero
        return "where(condition)'s output size is read on the host"
    if name in _INDEXING and any(
        isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in named.get("indices") or ()
    ):
        return "a boolean mask index: its count is read on the host"
    if (
        name == "aten::repeat_interleave"
        and isinstance(named.get("repeats"), torch.Tensor)
        and named.get("output_size") is None
    ):
        return "repeat_interleave by a tensor without output_size reads its total on the host"
    if name == "aten::histc" and named.get("min", 0) == named.get("max", 0):
        return "histc without a range reads the data's min and max on the host"
    if name == "aten::_grouped_mm" and not _grouped_mm_on_device(named, device):
        return (
            f"{named['self'].dtype} x {named['mat2'].dtype}: torch's grouped GEMM has a kernel of its own only "
            "for bfloat16 (on sm90 / sm100); otherwise it loops over the groups with their offsets read on the "
            "host"
        )
    if name in _COPIES:
        return _transfer(named, device)
    return None


def _grouped_mm_on_device(named: dict, device: torch.device) -> bool:
    """torch's ``_grouped_mm`` runs its CUTLASS kernel, which reads the offsets on the device: bf16 operands and
    output on an sm90 or sm100 GPU (for another device, judged by the dtypes alone, as for such a GPU)."""
    bf16 = torch.bfloat16
    if not (named["self"].dtype == named["mat2"].dtype == bf16 and named.get("out_dtype") in (None, bf16)):
        return False
    return device.type != "cuda" or torch.cuda.get_device_capability(device)[0] in (9, 10)


def _transfer(named: dict, device: torch.device) -> str | None:
    """A copy between the host and ``device``: to the host, always a read; to the device, from pageable host
    memory (a pinned source can be captured)."""
    if device.type == "cpu":
        return None
    src = named.get("src", named.get("self"))  # copy_(self=dst, src); the others copy self
    if "src" in named:
        dst = named["self"].device
    elif isinstance(named.get("dst"), torch.Tensor):  # _copy_from(self, dst)
        dst = named["dst"].device
    elif isinstance(named.get("other"), torch.Tensor):  # to(other)
        dst = named["other"].device
    else:
        dst = named.get("device")
    if not isinstance(src, torch.Tensor) or dst is None:
        return None
    dst = torch.device(dst)
    if src.device.type == device.type and dst.type == "cpu":
        return f"a copy from {src.device} to the host"
    if src.device.type == "cpu" and dst.type == device.type and not src.is_pinned():
        return f"a copy from pageable host memory to {dst}"
    return None


def _caller() -> str:
    """file:line of the innermost frame outside torch and this module: the Python that made the call."""
    for frame in reversed(traceback.extract_stack()):
        path = os.path.abspath(frame.filename)
        if not path.startswith(_TORCH) and path != _THIS:
            parts = path.split(os.sep)
            root = next((p for p in ("site-packages", "dist-packages") if p in parts), None)
            short = parts[parts.index(root) + 1 :] if root else parts[-3:]
            return f"{'/'.join(short)}:{frame.lineno}"
    return "?"
