"""Which device a config's ``engine.device`` names."""

from __future__ import annotations

import torch


def device_for(name: str | None) -> torch.device:
    """``auto`` (or None): CUDA when available, else CPU; anything else as torch names it."""
    if name in ("auto", None):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)
