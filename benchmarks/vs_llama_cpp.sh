#!/usr/bin/env bash
# specdist against llama.cpp's plain decode of the same GGUF file on the same cores
# (docs/performance.md, "Against llama.cpp"): llama-bench tg128, then specdist's plain decode and its
# speculative decode of configs/local.yaml's setup (the file's own blocks, suffix drafts up to 16,
# adaptive length) on 8 chat prompts, then llama-bench again. Compare specdist's tokens/s with the
# mean of the two llama-bench runs.
#
#   benchmarks/vs_llama_cpp.sh                  # the built-in model's GGUF file (Q4_1)
#   benchmarks/vs_llama_cpp.sh smol-Q4_K_M.gguf # any GGUF file of a supported family
#   PLAIN=1 benchmarks/vs_llama_cpp.sh FILE     # plain decode only (engine-target)
#
# LLAMA_BENCH names the llama-bench binary (default: llama-bench on PATH); THREADS the cores (default 2).
set -euo pipefail
LLAMA_BENCH=${LLAMA_BENCH:-llama-bench}
THREADS=${THREADS:-2}
FILE=${1:-$(python -c "from specdist.models.loader import resolve_model; print(resolve_model('smollm2-135m-instruct').gguf_path)")}
if [ -n "${PLAIN:-}" ]; then SYSTEMS=engine-target; else SYSTEMS=engine-target,engine-spec; fi

echo "== llama-bench (before): $FILE"
"$LLAMA_BENCH" -m "$FILE" -p 64 -n 128 -t "$THREADS" -r 3
echo "== specdist"
python -m specdist.cli bench engine --model "$FILE" --weights native --draft suffix --k 16 --length-policy adaptive \
    --systems "$SYSTEMS" --prompts 8 --max-tokens 128 --temperatures 0
echo "== llama-bench (after)"
"$LLAMA_BENCH" -m "$FILE" -p 64 -n 128 -t "$THREADS" -r 3
