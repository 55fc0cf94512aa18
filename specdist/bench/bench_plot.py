"""Plots of a ``specdist bench cluster`` result (its ``--json`` object, schema in
:mod:`specdist.bench.cluster_bench`).

- PREFIX-throughput.png: output tokens/s against the load level, one panel per load mode
  (closed-loop concurrency, Poisson request rate), one line per variant (spec, no-spec, ...).
- PREFIX-latency.png: empirical CDFs of the time to first token and of the inter-token
  latency, one line per variant and level (colour: level, line style: variant).

    python -m specdist.bench.bench_plot results.json PREFIX   # redraw from a --json file

matplotlib is imported lazily with the Agg backend.
"""

from __future__ import annotations

import json
import sys

from specdist.api.preflight import MissingDependency

_MODES = {"concurrency": "concurrency (closed-loop clients)", "request_rate": "request rate, req/s (Poisson arrivals)"}
_STYLES = ("-", "--", ":", "-.")


def check_matplotlib() -> None:
    """MissingDependency (one line on the command line) unless matplotlib imports."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise MissingDependency("--plot needs matplotlib: pip install 'specdist[bench]'") from None


def _pyplot():
    check_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _level_key(r: dict) -> float:
    v = r["concurrency"] if r["mode"] == "concurrency" else r["request_rate"]
    return float("inf") if v == "inf" else float(v)


def _variants(levels: list[dict]) -> list[str]:
    return list(dict.fromkeys(r["variant"] for r in levels))  # first-seen order


def plot_throughput(doc: dict, path: str) -> str:
    """Output tokens/s against each load level, one line per variant; returns ``path``."""
    plt = _pyplot()
    levels = doc["levels"]
    modes = [m for m in _MODES if any(r["mode"] == m for r in levels)]
    fig, axes = plt.subplots(1, max(1, len(modes)), figsize=(6.4 * max(1, len(modes)), 4.4), squeeze=False)
    try:
        for ax, mode in zip(axes[0], modes):
            rows = [r for r in levels if r["mode"] == mode]
            xs = sorted({_level_key(r) for r in rows})  # categorical positions: inf is a level too
            for variant in _variants(rows):
                mine = sorted((r for r in rows if r["variant"] == variant), key=_level_key)
                ax.plot(
                    [xs.index(_level_key(r)) for r in mine],
                    [r["output_tokens_per_s"] for r in mine],
                    marker="o",
                    label=variant,
                )
            hf = doc.get("hf_plain")
            if hf:
                ax.axhline(
                    hf["output_tokens_per_s"],
                    color="grey",
                    linestyle="--",
                    linewidth=1,
                    label="transformers generate, 1 request at a time",
                )
            ax.set_xticks(range(len(xs)), [f"{x:g}" for x in xs])
            ax.set_xlabel(_MODES[mode])
            ax.set_ylabel("output tokens/s")
            ax.set_ylim(bottom=0)
            ax.grid(alpha=0.3)
            ax.legend()
        s = doc["settings"]
        fig.suptitle(f"specdist bench cluster: {s['max_tokens']} tokens per request, temperature {s['temperature']:g}")
        fig.tight_layout()
        fig.savefig(path, format="png")
    finally:
        plt.close(fig)
    return path


def plot_latency(doc: dict, path: str) -> str:
    """CDFs of TTFT and ITL per variant and level; returns ``path``."""
    plt = _pyplot()
    levels = doc["levels"]
    variants = _variants(levels)
    labels = list(dict.fromkeys(r["label"] for r in sorted(levels, key=lambda r: (r["mode"], _level_key(r)))))
    cmap = plt.get_cmap("viridis")
    fig, axes = plt.subplots(1, 2, figsize=(12.8, 5.2))
    try:
        for ax, name, key in ((axes[0], "time to first token", "ttft_s"), (axes[1], "inter-token latency", "itl_s")):
            positive = True
            for r in levels:
                xs = [x * 1e3 for p in r["per_request"] for x in (p[key] if key == "itl_s" else [p[key]])]
                if not xs:
                    continue
                xs.sort()
                positive &= xs[0] > 0
                colour = cmap(labels.index(r["label"]) / max(1, len(labels) - 1))
                style = _STYLES[variants.index(r["variant"]) % len(_STYLES)]
                ax.step(
                    xs,
                    [(i + 1) / len(xs) for i in range(len(xs))],
                    where="post",
                    color=colour,
                    linestyle=style,
                    label=f"{r['variant']} {r['label']}",
                )
            if positive:
                ax.set_xscale("log")
            ax.set_xlabel(f"{name}, ms")
            ax.set_ylabel("fraction of " + ("requests" if key == "ttft_s" else "tokens"))
            ax.set_ylim(0, 1.02)
            ax.grid(alpha=0.3)
            ax.set_title(f"{name} (CDF)")
        handles, names = axes[0].get_legend_handles_labels()
        fig.legend(handles, names, loc="lower center", ncol=min(6, max(1, len(names))), fontsize="small")
        fig.tight_layout(rect=(0, 0.06 * (1 + (len(names) - 1) // 6), 1, 1))
        fig.savefig(path, format="png")
    finally:
        plt.close(fig)
    return path


def plot_results(doc: dict, prefix: str) -> list[str]:
    """Both figures: [PREFIX-throughput.png, PREFIX-latency.png]."""
    return [plot_throughput(doc, f"{prefix}-throughput.png"), plot_latency(doc, f"{prefix}-latency.png")]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python -m specdist.bench.bench_plot RESULTS.json PREFIX", file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        doc = json.load(f)
    for path in plot_results(doc, argv[1]):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
