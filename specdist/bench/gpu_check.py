"""``python -m specdist.bench.gpu_check``: the GPU checks, in one command, on a machine with CUDA.

1. the tests marked ``cuda`` (the model families' greedy equality and logits on the GPU, bf16,
   device-resident verification, the compiled pass, the Gumbel noise's bits against the CPU's, prefix
   caching's copies and rollbacks in a CUDA cache, ``engine.kv_cache_dtype`` keeping the model's dtype there, GGUF
   K-quant, IQ4_XS and IQ grid-type mixes on their blocks through torch's int4 kernels (IQ types as byte halves, as
   Q8_0; Q2_K, Q3_K, Q6_K and the per-16 IQ types staying in the model's dtype there: their block forms are the CPU
   kernels'); the 2-rank NCCL tensor-parallel checks, floats and each rank's part of a GGUF file's blocks, run when two
   GPUs exist and are skipped with their reason otherwise). Each has a CPU twin that CI runs;
2. ``specdist bench engine`` with a random-weight bf16 Llama of about 1 B parameters as the
   target and a random 4-layer draft (same tokenizer), target alone against speculation,
   printing tokens/s. Random weights make acceptance meaningless; the numbers are the
   step's throughput on the device;
3. the same with the target's own int4 copy as the draft (``--draft self-w4``: the int4
   weight-only kernel on the device, :class:`specdist.models.quant.Int4GroupLinear`);
4. step 3 with compiled passes (``--compile on``: ``torch.compile`` with CUDA graphs, one per
   shape bucket, :meth:`specdist.models.runner.CausalLMRunner.compile`);
5. step 2 with a random EAGLE-3 head for the target (``--draft eagle3``: the target keeps three
   layers' hidden states, the head drafts from them, :mod:`specdist.models.eagle3`), in the
   published layout with a draft vocabulary of a third of the target's. Its acceptance says
   nothing; the machinery's cost per step does;
6. suffix drafts under the adaptive rule (``--draft suffix --length-policy adaptive``): proposals made in
   full, priced position by position by their match lengths and cut (:mod:`specdist.engine.draft_length`),
   verified on the device; random weights repeat little, so this measures the bookkeeping, not gains.

``--device cpu --tiny`` runs steps 2-6 with small models on the CPU (how CI checks the script).
Exit status: 0 when every step passed, 1 otherwise; a one-line reason when CUDA is missing.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

CUDA_TEST_FILES = ("tests/test_model_families.py", "tests/test_dtypes.py", "tests/test_native_weights.py",
                   "tests/test_device_resident.py", "tests/test_tensor_parallel.py", "tests/test_compiled_runner.py",
                   "tests/test_coupling.py", "tests/test_prefix_cache.py")
TINY_TARGET = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2)
TINY_DRAFT = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                  num_key_value_heads=2)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m specdist.bench.gpu_check", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--device", default="cuda", help="cuda, cuda:N, or cpu (with --tiny: CI's smoke run)")
    p.add_argument("--tiny", action="store_true", help="small random models instead of the 1 B target")
    p.add_argument("--skip-tests", action="store_true", help="only the benchmark")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--workdir", default=None, help="where the random checkpoints go (default: a temp dir)")
    args = p.parse_args(argv)

    import torch

    from specdist.bench.checkpoints import LLAMA_1B, LLAMA_DRAFT, write_random_eagle3_head, write_random_llama
    from specdist.models.loader import load_tokenizer, resolve_model

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("gpu_check: CUDA is not available on this machine (use --device cpu --tiny for the CPU smoke run)",
              file=sys.stderr)
        return 1
    dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    print(f"torch {torch.__version__}; device {args.device}"
          + (f": {torch.cuda.get_device_name(torch.device(args.device))}, {torch.cuda.device_count()} GPU(s), "
             f"bf16 {torch.cuda.is_bf16_supported()}" if args.device.startswith("cuda") else ""), flush=True)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    failed: list[str] = []

    if not args.skip_tests:
        files = [f for f in CUDA_TEST_FILES if os.path.isfile(os.path.join(root, f))]
        print(f"\n== tests marked cuda: {' '.join(files)}", flush=True)
        rc = subprocess.call([sys.executable, "-m", "pytest", "-q", "-rs", "-m", "cuda", *files], cwd=root)
        if rc != 0:
            failed.append(f"tests (pytest exit {rc})")

    work = args.workdir or tempfile.mkdtemp(prefix="specdist-gpu-check-")
    tok = load_tokenizer(resolve_model("smollm2-135m-instruct"))
    vocab = len(tok)
    t0 = time.perf_counter()
    target = write_random_llama(os.path.join(work, "target"), vocab, getattr(torch, dtype), seed=1, tokenizer=tok,
                                **(TINY_TARGET if args.tiny else LLAMA_1B))
    draft = write_random_llama(os.path.join(work, "draft"), vocab, getattr(torch, dtype), seed=2, tokenizer=tok,
                               **(TINY_DRAFT if args.tiny else LLAMA_DRAFT))
    with open(os.path.join(target.path, "config.json")) as f:
        head = write_random_eagle3_head(os.path.join(work, "eagle3"), json.load(f), draft_vocab_size=vocab // 3,
                                        seed=3, dtype=getattr(torch, dtype))
    print(f"\n== random checkpoints in {work}: target {target.num_params / 1e9:.2f} B params, "
          f"draft {draft.num_params / 1e9:.3f} B, EAGLE-3 head {head.num_params / 1e6:.0f} M, {dtype}, "
          f"written in {time.perf_counter() - t0:.0f} s", flush=True)
    common = ["--dtype", dtype, "--device", args.device, "--systems", "engine-target,engine-spec",
              "--temperatures", "0,0.8", "--prompts", str(args.prompts), "--max-tokens", str(args.max_tokens)]
    for draft_args in (["--draft", "model", "--draft-model", draft.path], ["--draft", "self-w4"],
                       ["--draft", "self-w4", "--compile", "on"], ["--draft", "eagle3", "--draft-model", head.path],
                       ["--draft", "suffix", "--length-policy", "adaptive"]):
        bench = [sys.executable, "-m", "specdist.cli", "bench", "engine", "--model", target.path, *draft_args, *common]
        print("== " + " ".join(bench[2:]), flush=True)
        rc = subprocess.call(bench, cwd=root)
        if rc != 0:
            failed.append(f"bench engine {' '.join(draft_args)} (exit {rc})")

    print("\ngpu_check: " + ("all steps passed" if not failed else "FAILED: " + "; ".join(failed)))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
