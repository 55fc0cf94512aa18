"""Tiny GGUF files for the tests: random blocks of every quant type gguf-py cannot quantize to (K-quants, IQ
types), and a tiny Llama written as a GGUF file (``write_tiny_gguf``) whose linears are of chosen types."""

from __future__ import annotations

import gguf
import numpy as np

from specdist.models import native

# the tiny Llama: width, heads, KV heads, feed-forward width, layers, vocabulary
H, HEADS, KV_HEADS, FF, LAYERS, GGUF_VOCAB = 64, 4, 2, 128, 2, 16

Q = gguf.GGMLQuantizationType

# every type native runs (SUPER_TYPES: 256-wide rows)
GRID = ("IQ3_S", "IQ3_XXS", "IQ2_XXS", "IQ1_S")  # grid types: a scale per block times grid values with their signs

GRID16 = ("IQ2_XS", "IQ2_S", "IQ1_M")  # grid types with a scale per 16


def _quantized(rows: int, cols: int, kind: str, seed: int, std: float = 0.5) -> np.ndarray:
    """A tensor's blocks: gguf-py's quantization of a random float weight, or random K-quant or IQ4 blocks
    (gguf-py quantizes to none of those)."""
    if kind == "IQ4_NL":
        return iq4_nl_bytes(rows, cols, seed, scale=std / 60)
    if kind == "IQ4_XS":
        return iq4_xs_bytes(rows, cols, seed, scale=std / 60 / 16)
    if kind in GRID:  # grid values up to 62 (IQ3_XXS), 43 (IQ2_XXS), 15 (IQ3_S), 1 (IQ1_S), times multipliers of 2-31
        scale = std / {"IQ3_XXS": 60, "IQ2_XXS": 40, "IQ3_S": 80, "IQ1_S": 6}[kind]
        return grid_bytes(kind, rows, cols, seed, scale=scale)
    if kind in GRID16:  # values up to 43 (IQ2_XS, IQ2_S) or 9 (IQ1_M, 8 times its), times multipliers up to 31 / 15
        return grid16_bytes(kind, rows, cols, seed, scale=std / {"IQ2_XS": 300, "IQ2_S": 300, "IQ1_M": 12}[kind])
    if kind == "Q4_K":
        return q4_k_bytes(rows, cols, seed, scale=std / 125)
    if kind == "Q6_K":
        return q6_k_bytes(rows, cols, seed, scale=std / 256)
    if kind == "Q5_K":
        return q5_k_bytes(rows, cols, seed, scale=std / 250)
    if kind == "Q3_K":
        return q3_k_bytes(rows, cols, seed, scale=std / 80)
    if kind == "Q2_K":
        return q2_k_bytes(rows, cols, seed, scale=std / 20)
    rng = np.random.default_rng(seed)
    a = (rng.standard_normal((rows, cols)) * std + rng.standard_normal((rows, 1)) * std).astype(np.float32)
    return gguf.quants.quantize(a, Q[kind])


def q4_k_bytes(rows: int, cols: int, seed: int, scale: float = 1e-2) -> np.ndarray:
    """Random Q4_K super-blocks ``[rows, cols / 256 * 144]`` uint8, packed as llama.cpp packs them (gguf-py has
    no Q4_K quantizer): fp16 d and dmin, 6-bit scales and mins (scales 0-3 / mins 0-3 in the low 6 bits of bytes
    0-3 / 4-7, the high 2 bits of scales and mins 4-7 above them, their low 4 bits in bytes 8-11), and 128 code
    bytes (sub-block 2i in the low nibbles of bytes 32i..32i+31, 2i + 1 in the high ones)."""
    rng = np.random.default_rng(seed)
    nb = cols // 256
    d = rng.uniform(0.1 * scale, 2 * scale, (rows, nb)).astype(np.float16)  # weights up to about 15 * 63 * d
    dmin = rng.uniform(0.1 * scale, 2 * scale, (rows, nb)).astype(np.float16)
    sc, mn = rng.integers(0, 64, (2, rows, nb, 8)).astype(np.uint8)
    q = rng.integers(0, 16, (rows, nb, 4, 2, 32)).astype(np.uint8)
    scales = np.concatenate(
        [
            (sc[..., :4] & 63) | ((sc[..., 4:] >> 4) << 6),
            (mn[..., :4] & 63) | ((mn[..., 4:] >> 4) << 6),
            (sc[..., 4:] & 15) | ((mn[..., 4:] & 15) << 4),
        ],
        -1,
    )  # [rows, nb, 12]
    codes = (q[..., 0, :] | (q[..., 1, :] << 4)).reshape(rows, nb, 128)
    blocks = np.concatenate([d[..., None].view(np.uint8), dmin[..., None].view(np.uint8), scales, codes], -1)
    return np.ascontiguousarray(blocks.reshape(rows, nb * 144))


def q6_k_bytes(rows: int, cols: int, seed: int, scale: float = 1e-2) -> np.ndarray:
    """Random Q6_K super-blocks ``[rows, cols / 256 * 210]`` uint8 as llama.cpp lays them out: 128 bytes of low
    4 bits, 64 of high 2 bits, 16 int8 scales (one per 16 weights, signed), an fp16 d. Random bytes are valid
    codes; the scales stay in -64..63 and d in [0.1, 2] x ``scale`` (weights up to about 32 * 64 * d)."""
    rng = np.random.default_rng(seed)
    nb = cols // 256
    codes = rng.integers(0, 256, (rows, nb, 192), dtype=np.uint8)
    sc = rng.integers(-64, 64, (rows, nb, 16)).astype(np.int8).view(np.uint8)
    d = rng.uniform(0.1 * scale, 2 * scale, (rows, nb, 1)).astype(np.float16).view(np.uint8)
    return np.ascontiguousarray(np.concatenate([codes, sc, d], -1).reshape(rows, nb * 210))


def q5_k_bytes(rows: int, cols: int, seed: int, scale: float = 1e-2) -> np.ndarray:
    """Random Q5_K super-blocks ``[rows, cols / 256 * 176]`` uint8: Q4_K's first 16 bytes (fp16 d and dmin, 6-bit
    scales and mins; random bytes are valid), 32 bytes of high bits (bit j: sub-block j), 128 of low 4 bits."""
    rng = np.random.default_rng(seed)
    nb = cols // 256
    d = rng.uniform(0.1 * scale, 2 * scale, (rows, nb, 2)).astype(np.float16).view(np.uint8)  # d, dmin
    rest = rng.integers(0, 256, (rows, nb, 172), dtype=np.uint8)
    return np.ascontiguousarray(np.concatenate([d, rest], -1).reshape(rows, nb * 176))


def q2_k_bytes(rows: int, cols: int, seed: int, scale: float = 1e-2) -> np.ndarray:
    """Random Q2_K super-blocks ``[rows, cols / 256 * 84]`` uint8: 16 bytes of 4-bit scales and mins, 64 of 2-bit codes
    (random bytes are valid), then fp16 d and dmin in [0.1, 2] x ``scale`` (weights up to about 3 * 15 * d)."""
    rng = np.random.default_rng(seed)
    nb = cols // 256
    rest = rng.integers(0, 256, (rows, nb, 80), dtype=np.uint8)
    d = rng.uniform(0.1 * scale, 2 * scale, (rows, nb, 2)).astype(np.float16).view(np.uint8)
    return np.ascontiguousarray(np.concatenate([rest, d], -1).reshape(rows, nb * 84))


def q3_k_bytes(rows: int, cols: int, seed: int, scale: float = 1e-2) -> np.ndarray:
    """Random Q3_K super-blocks ``[rows, cols / 256 * 110]`` uint8: 32 bytes of mask bits, 64 of 2-bit codes, 12 of
    6-bit scales (random bytes are valid), and an fp16 d in [0.1, 2] x ``scale`` (weights up to about 4 * 32 * d)."""
    rng = np.random.default_rng(seed)
    nb = cols // 256
    rest = rng.integers(0, 256, (rows, nb, 108), dtype=np.uint8)
    d = rng.uniform(0.1 * scale, 2 * scale, (rows, nb, 1)).astype(np.float16).view(np.uint8)
    return np.ascontiguousarray(np.concatenate([rest, d], -1).reshape(rows, nb * 110))


def iq4_nl_bytes(rows: int, cols: int, seed: int, scale: float = 1e-2) -> np.ndarray:
    """Random IQ4_NL blocks ``[rows, cols / 32 * 18]`` uint8: an fp16 d in [0.1, 2] x ``scale``, then 16 bytes of 4-bit
    indices (random bytes are valid; weights up to 127 d)."""
    rng = np.random.default_rng(seed)
    d = rng.uniform(0.1 * scale, 2 * scale, (rows, cols // 32, 1)).astype(np.float16).view(np.uint8)
    qs = rng.integers(0, 256, (rows, cols // 32, 16), dtype=np.uint8)
    return np.ascontiguousarray(np.concatenate([d, qs], -1).reshape(rows, cols // 32 * 18))


def grid_bytes(kind: str, rows: int, cols: int, seed: int, scale: float = 1e-2) -> np.ndarray:
    """Random super-blocks of a grid type (``native.GRID_TYPES``): an fp16 d in [0.1, 2] x ``scale``, then random bytes
    (every grid index, sign pattern and block scale they spell is valid)."""
    rng = np.random.default_rng(seed)
    size = native.GRID_TYPES[kind][0]
    d = rng.uniform(0.1 * scale, 2 * scale, (rows, cols // 256, 1)).astype(np.float16).view(np.uint8)
    rest = rng.integers(0, 256, (rows, cols // 256, size - 2), dtype=np.uint8)
    return np.ascontiguousarray(np.concatenate([d, rest], -1).reshape(rows, cols // 256 * size))


def grid16_bytes(kind: str, rows: int, cols: int, seed: int, scale: float = 1e-2) -> np.ndarray:
    """Random super-blocks of a grid type with a scale per 16 (``native.GRID16_TYPES``): random bytes (every grid
    index, sign and scale they spell is valid), then an fp16 d in [0.1, 2] x ``scale`` where the type keeps it
    (IQ2_XS, IQ2_S: the first 2 bytes; IQ1_M: the top nibbles of its last four uint16, lowest first)."""
    rng = np.random.default_rng(seed)
    size, nb = native.GRID16_TYPES[kind][0], cols // 256
    blocks = rng.integers(0, 256, (rows, nb, size), dtype=np.uint8)
    d = rng.uniform(0.1 * scale, 2 * scale, (rows, nb)).astype(np.float16).view(np.uint16)  # [rows, nb]
    if kind == "IQ1_M":
        words = blocks[..., 48:56].view(np.uint16)  # [rows, nb, 4]
        words[...] = (words & 0x0FFF) | (((d[..., None] >> np.array([0, 4, 8, 12], np.uint16)) & 15) << 12)
    else:
        blocks[..., 0:2] = d[..., None].view(np.uint8)
    return np.ascontiguousarray(blocks.reshape(rows, nb * size))


def iq4_xs_bytes(rows: int, cols: int, seed: int, scale: float = 1e-2) -> np.ndarray:
    """Random IQ4_XS super-blocks ``[rows, cols / 256 * 136]`` uint8: an fp16 d in [0.1, 2] x ``scale``, 2 + 4 bytes of
    6-bit block scales ``ls`` (the block's scale is ``d (ls - 32)``), 128 of 4-bit indices (random bytes are valid;
    weights up to 32 * 127 d)."""
    rng = np.random.default_rng(seed)
    d = rng.uniform(0.1 * scale, 2 * scale, (rows, cols // 256, 1)).astype(np.float16).view(np.uint8)
    rest = rng.integers(0, 256, (rows, cols // 256, 134), dtype=np.uint8)
    return np.ascontiguousarray(np.concatenate([d, rest], -1).reshape(rows, cols // 256 * 136))


# each linear's GGUF type; F16 stays a float nn.Linear. Layer 0 mixes repeats in q/k/v (no qkv fusion)
LINEAR_TYPES = [
    dict(
        attn_q="Q4_0", attn_k="Q4_1", attn_v="Q8_0", attn_output="Q4_1", ffn_gate="Q4_0", ffn_up="Q4_0", ffn_down="Q8_0"
    ),
    dict(
        attn_q="Q4_1", attn_k="Q4_0", attn_v="Q4_1", attn_output="Q8_0", ffn_gate="Q4_1", ffn_up="Q4_1", ffn_down="F16"
    ),
]

HEAD_TYPE = "Q8_0"  # token_embd.weight; no output.weight: the head is tied to it

HF_NAMES = dict(
    attn_q="self_attn.q_proj",
    attn_k="self_attn.k_proj",
    attn_v="self_attn.v_proj",
    attn_output="self_attn.o_proj",
    ffn_gate="mlp.gate_proj",
    ffn_up="mlp.up_proj",
    ffn_down="mlp.down_proj",
)


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf row order for q / k (transformers reverses it on load)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(
    path: str,
    seed: int = 0,
    std: float = 0.25,
    hidden: int = H,
    ff: int = FF,
    linear_types: list[dict] | None = None,
    head_type: str = HEAD_TYPE,
    vocab: int = GGUF_VOCAB,
) -> str:
    """A tiny GGUF Llama: ``len(linear_types)`` layers (default LINEAR_TYPES), each linear in its GGUF type."""
    linear_types = LINEAR_TYPES if linear_types is None else linear_types
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(path, "llama")
    w.add_name("tiny")
    w.add_context_length(128)
    w.add_embedding_length(hidden)
    w.add_block_count(len(linear_types))
    w.add_feed_forward_length(ff)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_dimension_count(hidden // HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    words = ["a", "b", "c", "d", "e", "f", "g", "<eos>"] + [f"w{i}" for i in range(8, vocab)]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(words)
    w.add_token_types([1] * vocab)
    w.add_token_scores([0.0] * vocab)
    w.add_token_merges([])
    w.add_bos_token_id(0)
    w.add_eos_token_id(7)

    def tensor(name: str, shape: tuple, kind: str, n_head: int = 0) -> None:
        a = (rng.standard_normal(shape) * std).astype(np.float32)
        if kind == "F32":
            w.add_tensor(name, 1.0 + 0.3 * a)  # norm weights near 1
        elif kind == "F16":
            w.add_tensor(name, a.astype(np.float16))
        elif kind.endswith("_K") or kind.startswith("IQ"):  # random blocks (gguf-py cannot quantize to these)
            w.add_tensor(name, _quantized(shape[0], shape[1], kind, int(rng.integers(1 << 30)), std), raw_dtype=Q[kind])
        else:
            if n_head:
                a = _llama_cpp_permute(a, n_head)
            w.add_tensor(name, gguf.quants.quantize(a, Q[kind]), raw_dtype=Q[kind])

    hd = hidden // HEADS
    shapes = dict(
        attn_q=(hidden, hidden),
        attn_k=(KV_HEADS * hd, hidden),
        attn_v=(KV_HEADS * hd, hidden),
        attn_output=(hidden, hidden),
        ffn_gate=(ff, hidden),
        ffn_up=(ff, hidden),
        ffn_down=(hidden, ff),
    )
    tensor("token_embd.weight", (vocab, hidden), head_type)
    tensor("output_norm.weight", (hidden,), "F32")
    for i, types in enumerate(linear_types):
        tensor(f"blk.{i}.attn_norm.weight", (hidden,), "F32")
        tensor(f"blk.{i}.ffn_norm.weight", (hidden,), "F32")
        for short, shape in shapes.items():
            n_head = HEADS if short == "attn_q" else KV_HEADS if short == "attn_k" else 0
            tensor(f"blk.{i}.{short}.weight", shape, types[short], n_head)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
