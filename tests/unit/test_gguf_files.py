"""Damaged and hostile GGUF files end in specdist's own error, naming the file, in bounded time and memory.

tests/support/gguf_fuzz_cases.py breaks a valid tiny GGUF Llama in every way a header can lie (cut short, counts,
lengths, offsets and dimensions past the end, types whose block sizes disagree with the data, random byte
flips) and a way its data can (a block scale NaN or infinite: its blocks do not reproduce), and loads each
the way specdist does (tokenizer, float model, native blocks), in a process of its own under a 3 GiB data
limit (``RLIMIT_DATA``) and a time limit: a runaway allocation fails there instead of taking the machine.
Also specdist's own header reader, given counts and lengths past the end, refuses them at once (it appended
empty views until memory ran out)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from support import SUPPORT

LIMIT_MB = 3072


@pytest.mark.slow
def test_damaged_gguf_files_end_in_a_config_error_naming_the_file(tmp_path):
    script = os.path.join(SUPPORT, "gguf_fuzz_cases.py")
    run = subprocess.run(
        [sys.executable, script, str(tmp_path), str(LIMIT_MB)],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    lines = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert run.returncode == 0 and len(lines) >= 60, run.stdout[-2000:] + run.stderr[-2000:]
    assert lines[0] == {"case": "valid", "result": "ok", "seconds": 0}
    readers = [r for r in lines if r["case"].startswith("reader:")]
    assert len(readers) == 3
    for r in readers:  # the reader alone: a ValueError saying what runs past the end, at once
        assert r["result"].startswith("ValueError:") and ("left" in r["result"] or "past the end" in r["result"]), r
        assert r["seconds"] < 5, r
    damaged = [r for r in lines[1:] if not r["case"].startswith(("reader:", "random flips"))]
    assert len(damaged) == 19
    for r in lines[1:]:
        if r in readers:
            continue
        assert r["seconds"] < 20, r
        if r["case"].startswith("random flips") and r["result"] == "ok":
            continue  # a flip that left the file valid (a value byte)
        key = "target.weights" if "do not reproduce" in r["case"] else "target.model"
        assert r["result"].startswith(f"ConfigError: config {key}: " + r["path"] + ": "), r
        assert "\n" not in r["result"]
    assert all(r["result"] != "ok" for r in damaged)
