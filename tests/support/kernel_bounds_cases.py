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
    return lambda: ck.attention(
        args["q"], args["k_cache"], args["v_cache"], args["slots"], args["query_pos"], None, 0.3
    )


def rope_case(**bad):
    g, cache, slots, pos = good()
    args = dict(
        q=torch.randn(B, T, HQ, D, generator=g),
        k=torch.randn(B, T, H, D, generator=g),
        v=torch.randn(B, T, H, D, generator=g),
        cos=torch.ones(B, T, D),
        sin=torch.zeros(B, T, D),
        **cache,
        slots=slots,
        write_pos=pos,
        query_pos=pos,
    )
    args.update(bad)
    return lambda: ck.rope_attention(
        args["q"],
        args["k"],
        args["v"],
        args["cos"],
        args["sin"],
        args["k_cache"],
        args["v_cache"],
        args["slots"],
        args["write_pos"],
        args["query_pos"],
        None,
        0.3,
    )


DM, I = 16, 8  # a decoder layer's width and MLP width (its heads: HQ and H of D)


def layer_weights(**bad):
    """Dense float32 weights of a decoder layer over the cache above (``bad`` replaces a norm or a matmul's weight)."""
    g = torch.Generator().manual_seed(1)
    w = dict(
        norm1=torch.ones(DM),
        norm2=torch.ones(DM),
        qkv=torch.randn((HQ + 2 * H) * D, DM, generator=g) * 0.1,
        o=torch.randn(DM, HQ * D, generator=g) * 0.1,
        gate_up=torch.randn(2 * I, DM, generator=g) * 0.1,
        down=torch.randn(DM, I, generator=g) * 0.1,
    )
    w.update(bad)
    dense = [(w[name], None, w[name].shape[0], ck.LIN_F32, None) for name in ("qkv", "o", "gate_up", "down")]
    return ck.LayerWeights(w["norm1"], w["norm2"], 1e-6, dense)


def layer_case(**bad):
    def call():
        g, cache, slots, pos = good()
        weights = layer_weights(**bad)
        h = torch.randn(B, T, DM, generator=g)
        ck.decoder_layer(
            h,
            weights,
            torch.ones(B, T, D),
            torch.zeros(B, T, D),
            cache["k_cache"],
            cache["v_cache"],
            slots,
            pos,
            pos,
            None,
            0.3,
        )

    return call


def edited_in_place(kernel: str):
    """Index tensors made under inference mode (no version counter), checked by a first call, then one position
    moved far outside the cache in place: the second call must be refused, not read or write there."""

    def call():
        with torch.inference_mode():
            g, cache, slots, pos = good()
            write = pos.clone()
            q, k, v = (torch.randn(B, T, n, D, generator=g) for n in (HQ, H, H))
            cos, sin = torch.ones(B, T, D), torch.zeros(B, T, D)
            weights = layer_weights()

            def run():
                if kernel == "attention":
                    ck.attention(q.transpose(1, 2), cache["k_cache"], cache["v_cache"], slots, pos, None, 0.3)
                elif kernel == "rope":
                    ck.rope_attention(
                        q, k, v, cos, sin, cache["k_cache"], cache["v_cache"], slots, write, pos, None, 0.3
                    )
                else:
                    ck.decoder_layer(
                        torch.randn(B, T, DM, generator=g),
                        weights,
                        cos,
                        sin,
                        cache["k_cache"],
                        cache["v_cache"],
                        slots,
                        write,
                        pos,
                        None,
                        0.3,
                    )

            run()
            (pos if kernel == "attention" else write)[1, 2] = 1 << 40
            run()

    return call


CASES = {
    "attention: valid": attention_case(),
    "attention: slot past the cache": attention_case(slots=torch.tensor([0, 2])),
    "attention: negative slot": attention_case(slots=torch.tensor([-1, 0])),
    "attention: query past the cache": attention_case(query_pos=torch.tensor([[0, 1, 2], [3, 4, 9]])),
    "attention: negative query position": attention_case(query_pos=torch.tensor([[0, -5, 2], [3, 4, 5]])),
    "attention: too few slots": attention_case(slots=torch.tensor([0])),
    "attention: positions of another shape": attention_case(query_pos=torch.tensor([[0, 1], [3, 4]])),
    "attention: float64 queries": attention_case(q=torch.randn(B, HQ, T, D, dtype=torch.float64)),
    "attention: cache of another head size": attention_case(
        k_cache=torch.zeros(S, H, L1, 4), v_cache=torch.zeros(S, H, L1, 4)
    ),
    "attention: k and v caches differ": attention_case(v_cache=torch.zeros(S, H, L1 - 2, D)),
    "attention: heads not a multiple": attention_case(q=torch.randn(B, 3, T, D)),
    "rope: valid": rope_case(),
    "rope: write past the cache": rope_case(write_pos=torch.tensor([[0, 1, 2], [3, 4, 50]])),
    "rope: negative write": rope_case(write_pos=torch.tensor([[0, 1, 2], [-3, 4, 5]])),
    "rope: slot past the cache": rope_case(slots=torch.tensor([7, 0])),
    "rope: cache heads differ from k": rope_case(k=torch.randn(B, T, 1, D), v=torch.randn(B, T, 1, D)),
    "rope: cos of another shape": rope_case(cos=torch.ones(B, T, D // 2)),
    "rope: float16 queries": rope_case(q=torch.randn(B, T, HQ, D).half()),
    "rms_norm: valid": lambda: ck.rms_norm(torch.randn(3, 40), torch.ones(40), 1e-6),
    "rms_norm: weight shorter than the rows": lambda: ck.rms_norm(torch.randn(3, 40), torch.ones(8), 1e-6),
    "rms_norm: weight of two dimensions": lambda: ck.rms_norm(torch.randn(3, 40), torch.ones(2, 40), 1e-6),
    "layer: valid": layer_case(),
    "layer: W_o of too few rows": layer_case(o=torch.zeros(DM // 2, HQ * D)),
    "layer: W_down of too few rows": layer_case(down=torch.zeros(DM - 1, I)),
    "layer: W_gate_up of odd rows": layer_case(gate_up=torch.zeros(2 * I + 1, DM)),
    "layer: norm2 shorter": layer_case(norm2=torch.ones(DM // 2)),
    "attention: query position edited in place under inference mode": edited_in_place("attention"),
    "rope: write position edited in place under inference mode": edited_in_place("rope"),
    "layer: write position edited in place under inference mode": edited_in_place("layer"),
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
