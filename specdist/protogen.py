"""Regenerate the protobuf / gRPC Python code in ``specdist/v1/`` from ``proto/specdist/v1/``.

    python -m specdist.protogen          # rewrite the generated files that changed
    python -m specdist.protogen --check  # write nothing; exit 1 listing stale files

Works from any directory (the repository root is found from this file's path) but
needs a source checkout, where ``proto/`` exists, and grpcio-tools. The command is
the documented one, run from the root:
``python -m grpc_tools.protoc -Iproto --python_out=. --pyi_out=. --grpc_python_out=. proto/specdist/v1/*.proto``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto" / "specdist" / "v1"
OUT_DIR = ROOT / "specdist" / "v1"
GENERATED = ("*_pb2.py", "*_pb2.pyi", "*_pb2_grpc.py")  # everything else in OUT_DIR is hand-written


def generate(dest: Path) -> dict[str, bytes]:
    """Run protoc with output root ``dest``; return {file name: contents} of what it wrote."""
    protos = sorted(p.relative_to(ROOT).as_posix() for p in PROTO_DIR.glob("*.proto"))
    if not protos:
        raise SystemExit(f"protogen: no .proto files in {PROTO_DIR} (this needs a source checkout)")
    outs = [f"--{kind}_out={dest}" for kind in ("python", "pyi", "grpc_python")]
    cmd = [sys.executable, "-m", "grpc_tools.protoc", "-Iproto", *outs, *protos]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"protogen: protoc failed:\n{done.stderr.strip()}")
    return _generated_files(dest / "specdist" / "v1")


def _generated_files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for pattern in GENERATED for p in folder.glob(pattern)}


def _fresh() -> dict[str, bytes]:
    with tempfile.TemporaryDirectory() as tmp:
        return generate(Path(tmp))


def stale_files() -> list[str]:
    """Generated files in specdist/v1 that differ from, lack, or outlive a fresh protoc run."""
    fresh, current = _fresh(), _generated_files(OUT_DIR)
    return sorted(name for name in fresh.keys() | current.keys() if fresh.get(name) != current.get(name))


def regenerate() -> list[str]:
    """Bring specdist/v1 up to date; return the names written or removed."""
    fresh, current = _fresh(), _generated_files(OUT_DIR)
    changed = sorted(name for name in fresh.keys() | current.keys() if fresh.get(name) != current.get(name))
    for name in changed:
        path = OUT_DIR / name
        if name in fresh:
            path.write_bytes(fresh[name])
        else:
            path.unlink()  # its .proto is gone
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specdist.protogen", description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if any generated file is stale")
    args = parser.parse_args(argv)
    rel = os.path.relpath(OUT_DIR, ROOT)  # "specdist/v1"
    if args.check:
        stale = stale_files()
        for name in stale:
            print(f"stale: {rel}/{name}")
        if stale:
            print("run: python -m specdist.protogen", file=sys.stderr)
        return 1 if stale else 0
    for name in regenerate():
        print(f"{'wrote' if (OUT_DIR / name).exists() else 'removed'}: {rel}/{name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
