"""Plot of the idealised speculative-decoding speedup (see :mod:`specdist.engine.cost_model`)."""

from __future__ import annotations

import os
from collections.abc import Sequence

from specdist.engine.cost_model import speedup


def plot_speedup(
    path: str | os.PathLike[str],
    draft_cost: float = 0.1,
    ks: Sequence[int] = (1, 2, 4, 8),
    points: int = 201,
) -> str | os.PathLike[str]:
    """Plot toy speedup against alpha in [0, 1) for each draft length in ``ks``.

    Draws a dashed break-even line at 1.0 and saves a PNG to ``path``, which
    is returned. matplotlib (the ``bench`` extra) is imported here, with the Agg backend; without it a
    ``MissingDependency`` says what to install.
    """
    if points < 2:
        raise ValueError(f"points must be >= 2, got {points!r}")
    from specdist.bench.bench_plot import check_matplotlib

    check_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    alphas = [i / points for i in range(points)]  # [0, 1), excludes 1
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    try:
        for k in ks:
            ax.plot(alphas, [speedup(a, k, draft_cost) for a in alphas], label=f"k = {k}")
        ax.axhline(1.0, color="grey", linestyle="--", linewidth=1, label="break-even")
        ax.set_xlabel("acceptance rate alpha")
        ax.set_ylabel("toy speedup E[L] / (1 + k c)")
        ax.set_title(f"Idealised speculative speedup, draft cost c = {draft_cost:g}")
        ax.set_xlim(0.0, 1.0)
        ax.legend()
        fig.tight_layout()
        fig.savefig(path, format="png")
    finally:
        plt.close(fig)
    return path
