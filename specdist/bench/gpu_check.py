"""``python -m specdist.bench.gpu_check``: the GPU checks, in one command, sized for one short lease.

Steps, each a subprocess with its own time limit (``--limit STEP=SECONDS`` changes one), run in
this order so that a cut run has done the most telling ones first:

1. ``env``: torch, CUDA, the device.
2. ``tests``: the tests marked ``cuda`` (each has a CPU twin that CI runs), one process, compilation
   off except in the compile test itself; each test's name, outcome and seconds print as it ends.
3. ``decode``: batch-1 greedy plain decoding of the built-in model (when installed) and a random
   1 B Llama against the bound their weight bytes set, beside transformers' ``generate``; device
   synchronisations a step; CUDA graph capture times (:mod:`specdist.bench.gpu_decode`).
4. ``tasks``: the task suite on the built-in model (``configs/gpu.yaml``), plain decoding against
   suffix drafts, code editing and chat, 1 and 16 clients (``specdist bench tasks``).
5. ``drafts``: ``specdist bench engine`` with the 1 B target and a random draft model, its own
   int4 copy (torch's int4 kernel), a random EAGLE-3 head and adaptive suffix drafts: each
   machinery's cost per step (random weights make acceptance meaningless).

``--quick`` runs steps 1-3 with smaller sizes (the essentials, about 3 minutes). After every step
(and every test) ``OUT/gpu_check.json`` is rewritten with what has finished, each step's results in
it: a run cut by its lease still says what passed. Every step's output goes to ``OUT/gpu_check.log``
too; the steps' own files (the tests' log, the benchmarks' JSON, the random checkpoints) to
``--raw`` (default ``OUT/raw``). Exit status 0 when every step passed. ``--device cpu --tiny`` runs the
script's own machinery on small models on the CPU (how CI checks it); a one-line reason when CUDA is
missing.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CUDA_TEST_FILES = ("tests/unit/test_paged_attention.py", "tests/unit/test_model_families.py", "tests/unit/test_dtypes.py",
                   "tests/unit/test_native_weights.py", "tests/unit/test_device_resident.py", "tests/distributed/test_tensor_parallel.py",
                   "tests/unit/test_compiled_runner.py", "tests/unit/test_coupling.py", "tests/engine/test_prefix_cache.py",
                   "tests/engine/test_eagle3.py")
LIMITS = {"env": 60, "tests": 240, "decode": 180, "tasks": 150, "drafts": 150}  # seconds, full run
QUICK_LIMITS = {"env": 60, "tests": 150, "decode": 120}
TEST_LOG_ENV = "SPECDIST_TEST_LOG"  # the pytest plugin below appends one JSON line a test there
TINY_TARGET = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2)
TINY_DRAFT = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                  num_key_value_heads=2)


# ------------------------------------------------------------------ pytest plugin (``-p specdist.bench.gpu_check``)
def pytest_runtest_logreport(report) -> None:
    """Each test's name, outcome and seconds, printed and logged the moment its call (or a failed setup) ends."""
    if report.when != "call" and not (report.when == "setup" and not report.passed):
        return
    outcome = "skipped" if report.skipped else report.outcome
    line = {"name": report.nodeid, "outcome": outcome, "seconds": round(report.duration, 3)}
    if report.skipped and isinstance(report.longrepr, tuple):
        line["reason"] = str(report.longrepr[2])
    print(f"\n[gpu_check] {outcome.upper():7s} {report.duration:7.2f}s {report.nodeid}", flush=True)
    path = os.environ.get(TEST_LOG_ENV)
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(line) + "\n")


# ------------------------------------------------------------------ the run
class Run:
    """The steps run so far, rewritten to ``out/gpu_check.json`` after each."""

    def __init__(self, out: str, raw: str, args: argparse.Namespace):
        self.out, self.raw = out, raw
        self.summary = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "quick": args.quick, "device": args.device,
                        "tiny": args.tiny, "steps": []}
        self.t0 = time.perf_counter()

    def save(self) -> None:
        self.summary["elapsed_s"] = round(time.perf_counter() - self.t0, 1)
        path = os.path.join(self.out, "gpu_check.json")
        with open(path + ".tmp", "w") as f:
            json.dump(self.summary, f, indent=1)
        os.replace(path + ".tmp", path)

    def step(self, name: str, cmd: list[str], limit: float, env: dict | None = None, parse=None) -> dict:
        """Run ``cmd`` under ``limit`` seconds (its process group killed past it), its output streamed to ours and
        to ``out/NAME.log``; ``parse(entry)`` adds what the step produced to its entry."""
        entry = {"name": name, "command": " ".join(cmd), "limit_s": limit, "status": "running"}
        self.summary["steps"].append(entry)
        self.save()
        print(f"\n== [{name}] (limit {limit:.0f} s) {' '.join(cmd)}", flush=True)
        t0 = time.perf_counter()
        with open(os.path.join(self.out, "gpu_check.log"), "a") as log:
            log.write(f"\n== [{name}] (limit {limit:.0f} s) {' '.join(cmd)}\n")
            proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                    env={**os.environ, **(env or {})}, start_new_session=True, bufsize=1)
            timer = threading.Timer(limit, lambda: _kill(proc))
            timer.start()
            try:
                for line in proc.stdout:
                    sys.stdout.write(line)
                    log.write(line)
                    log.flush()
                    if parse is not None and line.startswith("[gpu_check]"):  # a test ended: the summary knows
                        parse(entry)
                        self.save()
                rc = proc.wait()
            finally:
                timer.cancel()
        seconds = time.perf_counter() - t0
        timed_out = seconds >= limit and rc != 0
        entry.update(seconds=round(seconds, 1), returncode=rc,
                     status="timeout" if timed_out else ("passed" if rc == 0 else "failed"))
        if parse is not None:
            parse(entry)
        print(f"== [{name}] {entry['status']} in {seconds:.1f} s", flush=True)
        self.save()
        return entry


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _read_json(path: str):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m specdist.bench.gpu_check", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--device", default="cuda", help="cuda, cuda:N, or cpu (with --tiny: CI's smoke run)")
    p.add_argument("--tiny", action="store_true", help="small random models instead of the 1 B target")
    p.add_argument("--quick", action="store_true", help="env, tests and decode, smaller (about 3 minutes)")
    p.add_argument("--steps", default=None, help="comma-separated subset of env,tests,decode,tasks,drafts")
    p.add_argument("--limit", action="append", default=[], metavar="STEP=SECONDS", help="another time limit")
    p.add_argument("--out", default=None, help="where gpu_check.json and gpu_check.log go (default: a temp dir)")
    p.add_argument("--raw", default=None, help="where the steps' own files go (default: OUT/raw)")
    args = p.parse_args(argv)

    import tempfile

    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("gpu_check: CUDA is not available on this machine (use --device cpu --tiny for the CPU smoke run)",
              file=sys.stderr)
        return 1
    out = args.out or tempfile.mkdtemp(prefix="specdist-gpu-check-")
    raw = args.raw or os.path.join(out, "raw")
    os.makedirs(out, exist_ok=True)
    os.makedirs(raw, exist_ok=True)
    limits = dict(QUICK_LIMITS if args.quick else LIMITS)
    for item in args.limit:
        name, _, seconds = item.partition("=")
        limits[name] = float(seconds)
    steps = args.steps.split(",") if args.steps else list(limits)
    run = Run(out, raw, args)
    py = sys.executable
    cuda = args.device.startswith("cuda")
    for name in steps:
        limit = limits.get(name, LIMITS.get(name, 120))
        if name == "env":
            run.step(name, [py, "-c", ENV_SCRIPT, args.device], limit)
        elif name == "tests":
            _tests_step(run, py, limit, args)
        elif name == "decode":
            path = os.path.join(raw, "decode.json")
            cmd = [py, "-m", "specdist.bench.gpu_decode", "--device", args.device, "--json", path]
            if args.quick:
                cmd += ["--tokens", "128"]
            if args.tiny:
                cmd += ["--tiny", "--tokens", "16", "--sync-steps", "4"]
            run.step(name, cmd, limit, parse=lambda e, path=path: e.update(result=_read_json(path)))
        elif name == "tasks":
            path = os.path.join(raw, "tasks.json")
            config = "configs/gpu.yaml" if cuda else _cpu_config(raw, args.device)
            cmd = [py, "-m", "specdist.cli", "bench", "tasks", "--config", config, "--drafts", "none,suffix",
                   "--tasks", "code-edit,chat", "--concurrency", "1", "--concurrency", "16", "--json", path]
            cmd += ["--prompts", "2", "--max-tokens", "16"] if args.tiny or not cuda else ["--prompts", "16",
                                                                                          "--max-tokens", "128"]
            run.step(name, cmd, limit, parse=lambda e, path=path: e.update(result=_tasks_summary(path)))
        elif name == "drafts":
            _drafts_step(run, py, limit, args, raw)
        else:
            print(f"gpu_check: unknown step {name!r}", file=sys.stderr)
            return 2
    failed = [s["name"] for s in run.summary["steps"] if s["status"] != "passed"]
    run.summary["passed"] = not failed
    run.save()
    print(f"\ngpu_check: {'all steps passed' if not failed else 'FAILED: ' + ', '.join(failed)} "
          f"in {time.perf_counter() - run.t0:.0f} s; summary in {os.path.join(out, 'gpu_check.json')}")
    return 1 if failed else 0


ENV_SCRIPT = """
import sys, torch, transformers
dev = sys.argv[1]
print("torch", torch.__version__, "cuda", torch.version.cuda, "transformers", transformers.__version__)
if dev.startswith("cuda"):
    p = torch.cuda.get_device_properties(torch.device(dev))
    print("device", p.name, f"{p.total_memory / 2**30:.0f} GiB", p.multi_processor_count, "SMs",
          "capability", f"{p.major}.{p.minor}")
    try:
        import triton
        print("triton", triton.__version__)
    except ImportError:
        print("triton: not installed (the paged backend falls back to torch)")
"""


def _tests_step(run: Run, py: str, limit: float, args) -> None:
    files = [f for f in CUDA_TEST_FILES if os.path.isfile(os.path.join(ROOT, f))]
    log = os.path.join(run.raw, "tests.jsonl")
    open(log, "w").close()
    cmd = [py, "-m", "pytest", "-n", "0", "-p", "specdist.bench.gpu_check", "-q", "-rfE", "--no-header"]
    marks = "cuda" if args.device.startswith("cuda") else "cuda or not cuda"
    if args.tiny:  # the CPU smoke run: the plugin and the logging, on one small file
        files, marks = ["tests/unit/test_paged_attention.py"], "not cuda"
    try:
        import pytest_timeout  # noqa: F401

        cmd += ["--timeout", "120"]  # one stuck test does not eat the step
    except ImportError:
        pass
    cmd += ["-m", marks, *files]

    def parse(entry: dict) -> None:
        try:
            with open(log) as f:
                tests = [json.loads(line) for line in f if line.strip()]
        except OSError:
            tests = []
        entry["tests"] = tests
        entry["counts"] = {k: sum(t["outcome"] == k for t in tests) for k in ("passed", "failed", "skipped")}

    run.step("tests", cmd, limit, env={TEST_LOG_ENV: log}, parse=parse)


def _cpu_config(out: str, device: str) -> str:
    """configs/gpu.yaml on the CPU (float32, the paged cache): the smoke run of the tasks step."""
    import yaml

    with open(os.path.join(ROOT, "configs", "gpu.yaml")) as f:
        cfg = yaml.safe_load(f)
    cfg["target"]["dtype"] = "float32"
    cfg["engine"].update(device=device, kv_cache="paged")
    path = os.path.join(out, "cpu.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(cfg, f)
    return path


def _tasks_summary(path: str):
    data = _read_json(path)
    if data is None:
        return None
    rows = [{k: r.get(k) for k in ("concurrency", "task", "variant", "tokens_per_s", "speedup", "acceptance",
                                   "tokens_per_step", "same_tokens_as_none")} for r in data.get("results", [])]
    return {"results": rows}


def _drafts_step(run: Run, py: str, limit: float, args, out: str) -> None:
    """The 1 B target's checkpoint, a draft model and an EAGLE-3 head written once, then each draft method's
    ``bench engine`` run, sharing the step's limit."""
    import torch

    from specdist.bench.checkpoints import LLAMA_1B, LLAMA_DRAFT, write_random_eagle3_head, write_random_llama
    from specdist.models.loader import load_tokenizer, resolve_model

    t0 = time.perf_counter()
    work = os.path.join(out, "checkpoints")
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    tok = load_tokenizer(resolve_model("smollm2-135m-instruct"))  # the bench renders chat prompts with it
    vocab = len(tok)
    target = write_random_llama(os.path.join(work, "target"), vocab, dtype, seed=1, tokenizer=tok,
                                **(TINY_TARGET if args.tiny else LLAMA_1B))
    draft = write_random_llama(os.path.join(work, "draft"), vocab, dtype, seed=2, tokenizer=tok,
                               **(TINY_DRAFT if args.tiny else LLAMA_DRAFT))
    with open(os.path.join(target.path, "config.json")) as f:
        head = write_random_eagle3_head(os.path.join(work, "eagle3"), json.load(f), draft_vocab_size=vocab // 3,
                                        seed=3, dtype=dtype)
    dt = "bfloat16" if dtype == torch.bfloat16 else "float32"
    common = ["--model", target.path, "--dtype", dt, "--device", args.device, "--systems", "engine-target,engine-spec",
              "--temperatures", "0,0.8", "--prompts", "2", "--max-tokens", "16" if args.tiny else "64"]
    left = limit - (time.perf_counter() - t0)
    variants = [["--draft", "model", "--draft-model", draft.path], ["--draft", "self-w4"],
                ["--draft", "eagle3", "--draft-model", head.path], ["--draft", "suffix", "--length-policy", "adaptive"]]
    for i, extra in enumerate(variants):
        name = f"drafts-{extra[1]}"
        path = os.path.join(out, f"{name}.json")
        share = max(10.0, left / (len(variants) - i))
        t1 = time.perf_counter()
        run.step(name, [py, "-m", "specdist.cli", "bench", "engine", *common, *extra, "--json", path], share,
                 parse=lambda e, path=path: e.update(result=_read_json(path)))
        left -= time.perf_counter() - t1


if __name__ == "__main__":
    sys.exit(main())
