"""Forward time by KV cache dtype: the built-in model on its GGUF blocks, a float32 cache (``model``) against a
float16 one (``auto``), the two runners alternating, medians (docs/performance.md, "KV cache dtype").

    python benchmarks/kv_cache_dtype.py              # 8 shapes, median of 12 after 2 warm-ups
    python benchmarks/kv_cache_dtype.py --quick      # 2 small shapes, 4 calls each
"""

from __future__ import annotations

import argparse
import statistics
import time

from specdist.models.loader import gguf_parsed_once, load_model, resolve_model
from specdist.models.native import use_native_blocks
from specdist.models.runner import CausalLMRunner

# (requests, cached tokens, new tokens each)
SHAPES = [(1, 200, 1), (1, 200, 9), (1, 1000, 1), (1, 1000, 9), (1, 1000, 17), (16, 500, 1), (16, 500, 3), (16, 500, 5)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="two small shapes, 4 timed calls each")
    args = ap.parse_args()
    shapes, reps = (SHAPES[:2], 4) if args.quick else (SHAPES, 12)
    src = resolve_model("smollm2-135m-instruct")
    with gguf_parsed_once():
        model = load_model(src, "float32")
        use_native_blocks(model, src.gguf_path)
    runners = {c: CausalLMRunner(model, 16, 1100, kv_cache_dtype=c) for c in ("model", "auto")}
    print("| requests | cached tokens | new tokens each | float32 cache ms | float16 cache ms | float32 / float16 |")
    print("|---|---|---|---|---|---|")
    for bsz, ctx, t in shapes:
        state = {}
        for c, r in runners.items():
            slots = [r.cache.allocate() for _ in range(bsz)]
            for i, s in enumerate(slots):
                r.forward([s], [[(7 * j + 3 + i) % r.vocab_size for j in range(ctx)]], [0])
            state[c] = slots
        new = [[(5 * j + 11 + i) % 49152 for j in range(t)] for i in range(bsz)]
        times: dict[str, list[float]] = {c: [] for c in runners}
        for rep in range(reps + 2):
            for c, r in runners.items():
                t0 = time.perf_counter()
                r.forward(state[c], new, [t] * bsz)
                dt = time.perf_counter() - t0
                for s in state[c]:
                    r.cache.rollback(s, ctx)
                if rep >= 2:
                    times[c].append(dt)
        m = {c: statistics.median(v) * 1e3 for c, v in times.items()}
        print(
            f"| {bsz} | {ctx} | {t} | {m['model']:.1f} | {m['auto']:.1f} | {m['model'] / m['auto']:.2f} |", flush=True
        )
        for c, r in runners.items():
            for s in state[c]:
                r.cache.free(s)


if __name__ == "__main__":
    main()
