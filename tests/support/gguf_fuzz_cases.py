"""Damaged GGUF files, loaded the ways specdist loads one, in a process of its own (run as a script by
tests/unit/test_gguf_files.py, under a memory limit). Prints one JSON line a case: how loading ended.

The cases start from a valid tiny GGUF Llama (tests/unit/test_native_weights.py's writer) and break it: the
file cut at several points, a metadata array or string whose length runs past the end, tensor and
metadata counts past the end, a tensor's offset past the end, huge dimensions, a type whose block size
disagrees with the data, a block scale that is NaN or infinite (its blocks do not reproduce), and seeded
random byte flips in the header. Every case must end either in
specdist's ConfigError naming the file (or, for a flip that leaves the file valid, in a loaded model).
"""

from __future__ import annotations

import json
import os
import random
import resource
import struct
import sys
import time


def _fields(path: str) -> dict:
    """Offsets of the parts the cases aim at, read from the valid file with gguf's own reader."""
    import gguf

    r = gguf.GGUFReader(path)
    out = {"tensor_count": 8, "kv_count": 16}
    tokens = r.fields["tokenizer.ggml.tokens"]
    out["tokens_count"] = tokens.offset + 8 + len("tokenizer.ggml.tokens") + 4 + 4  # key len, key, type, item type
    out["first_string_len"] = out["tokens_count"] + 8
    scores = r.fields["tokenizer.ggml.scores"]
    out["scores_count"] = scores.offset + 8 + len("tokenizer.ggml.scores") + 4 + 4
    t = r.tensors[2]
    out["tensor_name"] = t.name
    # the tensor infos: find this tensor's info by its name bytes after the metadata
    with open(path, "rb") as f:
        data = f.read()
    name = t.name.encode()
    at = data.index(struct.pack("<Q", len(name)) + name, r.fields["tokenizer.ggml.eos_token_id"].offset)
    n_dims = struct.unpack_from("<I", data, at + 8 + len(name))[0]
    out["dims"] = at + 8 + len(name) + 4
    out["type"] = out["dims"] + 8 * n_dims
    out["offset"] = out["type"] + 4
    out["data_start"] = r.data_offset
    q = next(t for t in r.tensors if t.tensor_type.name.startswith("Q"))  # a block type: a scale first
    out["first_scale"] = int(q.data_offset)
    return out


def _put(data: bytearray, at: int, fmt: str, value) -> bytearray:
    struct.pack_into(fmt, data, at, value)
    return data


def cases(valid: bytes, f: dict) -> list[tuple[str, bytes]]:
    n = len(valid)
    out = [(f"cut at {frac:.1%}", valid[: int(n * frac)]) for frac in (0.01, 0.3, 0.6, 0.9, 0.999)]
    out.append(("header only", valid[:24]))
    big = 1 << 40
    out.append(("metadata array of 2^40 strings", bytes(_put(bytearray(valid), f["tokens_count"], "<Q", big))))
    out.append(("metadata array of 2^40 floats", bytes(_put(bytearray(valid), f["scores_count"], "<Q", big))))
    out.append(("a string of 2^40 bytes", bytes(_put(bytearray(valid), f["first_string_len"], "<Q", big))))
    out.append(("2^40 tensors", bytes(_put(bytearray(valid), f["tensor_count"], "<Q", big))))
    out.append(("2^40 metadata entries", bytes(_put(bytearray(valid), f["kv_count"], "<Q", big))))
    out.append(("a tensor offset past the end", bytes(_put(bytearray(valid), f["offset"], "<Q", 1 << 33))))
    out.append(("a huge dimension", bytes(_put(bytearray(valid), f["dims"], "<Q", 1 << 50))))
    out.append(("a zero dimension", bytes(_put(bytearray(valid), f["dims"], "<Q", 0))))
    out.append(("another quantization type", bytes(_put(bytearray(valid), f["type"], "<I", 12))))  # Q4_K: 256-blocks
    out.append(("an unknown type", bytes(_put(bytearray(valid), f["type"], "<I", 250))))
    out.append(("tensor data cut by one byte", valid[:-1]))
    # the header is sound, the data is not: a block's scale NaN, or infinite; dequantized by transformers and by
    # specdist's blocks, the two must disagree in a way the blocks check sees
    out.append(
        (
            "a block scale NaN: its blocks do not reproduce",
            bytes(_put(bytearray(valid), f["first_scale"], "<H", 0x7E00)),
        )
    )
    out.append(
        (
            "a block scale infinite: its blocks do not reproduce",
            bytes(_put(bytearray(valid), f["first_scale"], "<H", 0x7C00)),
        )
    )
    rng = random.Random(1234)
    for i in range(40):  # seeded byte flips in the header and the tensor infos
        b = bytearray(valid)
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(f["data_start"])] = rng.randrange(256)
        out.append((f"random flips {i}", bytes(b)))
    return out


def load(path: str) -> str:
    """How loading ``path`` ended: "ok", "ConfigError: ..." or another exception's name and message."""
    from specdist.errors import ConfigError
    from specdist.models.loader import gguf_parsed_once, load_model, load_tokenizer, resolve_model

    try:
        src = resolve_model(path, "target.model")
        with gguf_parsed_once():
            load_tokenizer(src)
            load_model(src, "float32", weights="native")
        return "ok"
    except ConfigError as e:
        return f"ConfigError: {e}"
    except BaseException as e:  # noqa: BLE001 - reported: the test fails on anything else
        return f"{type(e).__name__}: {str(e)[:300]}"


def main() -> int:
    limit = int(sys.argv[2]) << 20
    resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))  # a runaway allocation fails here, not the machine
    work = sys.argv[1]
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, tests)  # (the support package)
    from support.gguf_writer import write_tiny_gguf

    valid_path = write_tiny_gguf(os.path.join(work, "valid.gguf"))
    valid = open(valid_path, "rb").read()
    f = _fields(valid_path)
    print(json.dumps({"case": "valid", "result": load(valid_path), "seconds": 0}), flush=True)
    # specdist's own header reader (the fast reader transformers is given), without the file check in front
    import gguf

    from specdist.models.loader import _fast_gguf_reader

    reader = _fast_gguf_reader(gguf.gguf_reader.GGUFReader)
    for i, (name, data) in enumerate(cases(valid, f)[6:9]):  # the counts and lengths past the end
        path = os.path.join(work, f"reader{i}.gguf")
        with open(path, "wb") as out:
            out.write(data)
        t0 = time.perf_counter()
        try:
            reader(path)
            result = "ok"
        except BaseException as e:  # noqa: BLE001 - reported
            result = f"{type(e).__name__}: {str(e)[:200]}"
        print(
            json.dumps(
                {
                    "case": f"reader: {name}",
                    "path": path,
                    "result": result,
                    "seconds": round(time.perf_counter() - t0, 2),
                }
            ),
            flush=True,
        )
    for i, (name, data) in enumerate(cases(valid, f)):
        path = os.path.join(work, f"case{i}.gguf")
        with open(path, "wb") as out:
            out.write(data)
        t0 = time.perf_counter()
        result = load(path)
        print(
            json.dumps({"case": name, "path": path, "result": result, "seconds": round(time.perf_counter() - t0, 2)}),
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
