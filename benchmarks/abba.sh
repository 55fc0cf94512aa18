#!/usr/bin/env bash
# Before / after, side by side: `specdist bench tasks` and `specdist bench engine` of two commits, run in turn
# A B B A A B B A (this VM drifts by up to 2x within the hour; only interleaved runs compare).
#
#   benchmarks/abba.sh BEFORE_REF AFTER_REF [OUT_DIR]
#
# Each ref is checked out in a worktree under OUT_DIR and runs from there (its kernels built in place where it has
# setup.py; older refs compile theirs at first use). Prints, per task and draft method, the median tokens/s of each
# side and their ratio, then the same for each engine system and temperature.
set -euo pipefail
before=$1 after=$2 out=${3:-$(mktemp -d)}
repo=$(git rev-parse --show-toplevel)
mkdir -p "$out"
for side in before after; do
  ref=${!side}
  [ -d "$out/$side" ] || git -C "$repo" worktree add --detach "$out/$side" "$ref" >/dev/null
  if [ -f "$out/$side/setup.py" ]; then (cd "$out/$side" && python setup.py -q build_ext --inplace >/dev/null 2>&1); fi
done
i=0
for side in before after after before before after after before; do
  i=$((i + 1))
  dir=$out/$side
  (cd "$dir" && PYTHONPATH=$dir python -m specdist.cli bench tasks --config configs/local.yaml --drafts none,suffix \
     --tasks code-edit,chat --prompts 16 --max-tokens 256 --json "$out/tasks-$i-$side.json" >"$out/tasks-$i-$side.log" 2>&1)
  (cd "$dir" && PYTHONPATH=$dir python -m specdist.cli bench engine --systems engine-target,engine-spec --prompts 4 \
     --max-tokens 96 --temperatures 0,0.8 --draft self-w8 --json "$out/engine-$i-$side.json" >"$out/engine-$i-$side.log" 2>&1)
  echo "run $i ($side) done"
done
python - "$out" <<'PY'
import collections, glob, json, statistics, sys
out = sys.argv[1]
for kind, key in (("tasks", lambda r: (r["task"], r["variant"], r["concurrency"])),
                  ("engine", lambda r: (r["system"], r["temperature"]))):
    runs = collections.defaultdict(lambda: collections.defaultdict(list))
    for path in sorted(glob.glob(f"{out}/{kind}-*.json")):
        side = path.rsplit("-", 1)[1][: -len(".json")]
        data = json.load(open(path))
        for r in data["results"] if isinstance(data, dict) else data:
            runs[key(r)][side].append(r["tokens_per_s"])
    for k, v in runs.items():
        b, a = statistics.median(v["before"]), statistics.median(v["after"])
        print(f"{kind} {k}: before {b:.1f} tok/s, after {a:.1f} tok/s, after / before {a / b:.3f}")
PY
