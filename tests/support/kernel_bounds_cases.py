"""Bad indices and shapes handed to the CPU kernels' wrappers, one case a line (run as a script by
tests/unit/test_cpu_kernel_bounds.py: a kernel that trusted them would read or write outside the cache, which can
crash the process, so the cases run in one of their own). Prints "CASE | how it ended" per case."""

from __future__ import annotations

import sys

import torch

from specdist.models.kernels import cpu_kernels as ck

S, H, L1, D = 2, 2, 9, 8  # cache slots, kv heads, positions (the last a scratch column), head size
B, T, HQ = 2, 3, 4


def good():
    g = torch.Generator().manual_seed(0)
    cache = dict(k_cache=torch.zeros(S, H, L1, D), v_cache=torch.zeros(S, H, L1, D))
    slots = torch.tensor([0, 1])
    pos = torch.tensor([[0, 1, 2], [3, 4, 5]])
    return g, cache, slots, pos


def attention_case(**bad):
    g, cache, slots, pos = good()
    args = dict(q=torch.randn(B, HQ, T, D, generator=g), **cache, slots=slots, query_pos=pos)
    args.update(bad)
    return lambda: ck.attention(args["q"], args["k_cache"], args["v_cache"], args["slots"], args["query_pos"], None, 0.3)


def rope_case(**bad):
    g, cache, slots, pos = good()
    args = dict(q=torch.randn(B, T, HQ, D, generator=g), k=torch.randn(B, T, H, D, generator=g),
                v=torch.randn(B, T, H, D, generator=g), cos=torch.ones(B, T, D), sin=torch.zeros(B, T, D), **cache,
                slots=slots, write_pos=pos, query_pos=pos)
    args.update(bad)
    return lambda: ck.rope_attention(args["q"], args["k"], args["v"], args["cos"], args["sin"], args["k_cache"],
                                     args["v_cache"], args["slots"], args["write_pos"], args["query_pos"], None, 0.3)


CASES = {
    "attention: valid": attention_case(),
    "attention: slot past the cache": attention_case(slots=torch.tensor([0, 2])),
    "attention: negative slot": attention_case(slots=torch.tensor([-1, 0])),
    "attention: query past the cache": attention_case(query_pos=torch.tensor([[0, 1, 2], [3, 4, 9]])),
    "attention: negative query position": attention_case(query_pos=torch.tensor([[0, -5, 2], [3, 4, 5]])),
    "attention: too few slots": attention_case(slots=torch.tensor([0])),
    "attention: positions of another shape": attention_case(query_pos=torch.tensor([[0, 1], [3, 4]])),
    "attention: float64 queries": attention_case(q=torch.randn(B, HQ, T, D, dtype=torch.float64)),
    "attention: cache of another head size": attention_case(k_cache=torch.zeros(S, H, L1, 4),
                                                            v_cache=torch.zeros(S, H, L1, 4)),
    "attention: k and v caches differ": attention_case(v_cache=torch.zeros(S, H, L1 - 2, D)),
    "attention: heads not a multiple": attention_case(q=torch.randn(B, 3, T, D)),
    "rope: valid": rope_case(),
    "rope: write past the cache": rope_case(write_pos=torch.tensor([[0, 1, 2], [3, 4, 50]])),
    "rope: negative write": rope_case(write_pos=torch.tensor([[0, 1, 2], [-3, 4, 5]])),
    "rope: slot past the cache": rope_case(slots=torch.tensor([7, 0])),
    "rope: cache heads differ from k": rope_case(k=torch.randn(B, T, 1, D), v=torch.randn(B, T, 1, D)),
    "rope: cos of another shape": rope_case(cos=torch.ones(B, T, D // 2)),
    "rope: float16 queries": rope_case(q=torch.randn(B, T, HQ, D).half()),
}


def main() -> int:
    for name, call in CASES.items():
        try:
            call()
            print(f"{name} | ok", flush=True)
        except Exception as e:  # noqa: BLE001 - reported
            print(f"{name} | {type(e).__name__}: {e}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
