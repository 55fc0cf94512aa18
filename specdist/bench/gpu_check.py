"""``python -m specdist.bench.gpu_check``: the GPU checks, in one command, sized for one short lease.

Steps, each a subprocess with its own time limit (``--limit STEP=SECONDS`` changes one), run in
this order so that a cut run has done the most telling ones first:

1. ``env``: torch, CUDA, the device.
2. ``tests``: the fast tests marked ``cuda`` (each has a CPU twin that CI runs; ``slow`` ones left for step
   4), the telling files first (:data:`FIRST`), one process, pytest-timeout's limit on each test; each
   test's name, outcome and seconds print as it ends.
3. ``decode``: batch-1 greedy plain decoding of the built-in model (when installed) and a random
   1 B Llama against the bound their weight bytes set, beside transformers' ``generate``; device
   synchronisations a step; CUDA graph capture times (:mod:`specdist.bench.gpu_decode`).
4. ``tests-slow``: the slow tests marked ``cuda`` (the model families' speculative decoding, the native
   weights, the compiled runner).
5. ``tasks``: the task suite on the built-in model (``configs/gpu.yaml``), plain decoding against
   suffix drafts, code editing and chat, 1 and 16 clients (``specdist bench tasks``).
6. ``drafts``: ``specdist bench engine`` with the 1 B target and a random draft model, its own
   int4 copy (torch's int4 kernel), a random EAGLE-3 head and adaptive suffix drafts: each
   machinery's cost per step (random weights make acceptance meaningless). The checkpoints are
   written (and the built-in tokenizer found) by a step of its own, ``drafts-setup``, within the
   step's limit; the variants share what is left.

``--quick`` runs steps 1-3 (the essentials). Both runs fit their lease by construction: the start-up
(:data:`STARTUP_S`) and the steps' limits add to at most :data:`QUICK_S` (5 minutes) and :data:`FULL_S` (8);
a test checks the sums. After every step (and every test) ``OUT/gpu_check.json`` is rewritten with what has
finished, each step's results in it: a run cut by its lease still says what passed, and a step that fails,
overruns or cannot start is recorded there with its reason (``status``, ``error``), never a traceback of
this script's. Every step's output goes to ``OUT/gpu_check.log`` too; the steps' own files (the tests' log,
the benchmarks' JSON, the random checkpoints) to ``--raw`` (default ``OUT/raw``). Exit status 0 when every
step passed. ``--device cpu --tiny`` runs the script's own machinery on small models on the CPU (how CI
checks it); a one-line reason when CUDA is missing.
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
# the files of cuda tests that tell most, run first in their order; every other file with cuda tests follows by
# name (:func:`cuda_test_files` finds them)
FIRST = (
    "tests/unit/test_paged_attention.py",
    "tests/unit/test_model_families.py",
    "tests/unit/test_coupling.py",
    "tests/unit/test_dtypes.py",
    "tests/unit/test_device_resident.py",
    "tests/unit/test_graph_capture.py",
    "tests/unit/test_native_weights.py",
    "tests/unit/test_compiled_runner.py",
    "tests/engine/test_prefix_cache.py",
    "tests/engine/test_eagle3.py",
    "tests/distributed/test_tensor_parallel.py",
)
QUICK_S, FULL_S = 300, 480  # the leases the runs are sized for: --quick within 5 minutes, the full run within 8
STARTUP_S = 20  # this script's own start before its first step (python, torch's import, the CUDA check)
# seconds per step, in the order they run; on an H100 (torch 2.11) the quick run's env took 6 s, all the cuda
# tests 139 s (fast and slow together), decode 63 s (transformers' generate of 128 tokens at 13 tok/s included)
LIMITS = {"env": 15, "tests": 140, "decode": 75, "tests-slow": 80, "tasks": 70, "drafts": 80}
QUICK_LIMITS = {"env": 15, "tests": 160, "decode": 90}
TEST_TIMEOUT_S = 60  # pytest-timeout's limit on one test (a hung test fails alone instead of eating its step)
DRAFTS_SETUP_S = 25  # of the drafts step's limit: writing the random checkpoints, finding the built-in tokenizer
MIN_VARIANT_S = 5  # a drafts variant left less than this is skipped, not started
TEST_LOG_ENV = "SPECDIST_TEST_LOG"  # the pytest plugin below appends one JSON line a test there
TINY_TARGET = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
)
TINY_DRAFT = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2
)


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
        self.summary = {
            "started": time.strftime("%Y-%m-%d %H:%M:%S"),
            "quick": args.quick,
            "device": args.device,
            "tiny": args.tiny,
            "steps": [],
        }
        self.t0 = time.perf_counter()

    def save(self) -> None:
        self.summary["elapsed_s"] = round(time.perf_counter() - self.t0, 1)
        path = os.path.join(self.out, "gpu_check.json")
        with open(path + ".tmp", "w") as f:
            json.dump(self.summary, f, indent=1)
        os.replace(path + ".tmp", path)

    def step(self, name: str, cmd: list[str], limit: float, env: dict | None = None, parse=None) -> dict:
        """Run ``cmd`` under ``limit`` seconds (its process group killed past it), its output streamed to ours and
        to ``out/gpu_check.log``; ``parse(entry)`` adds what the step produced to its entry. A command that cannot
        start, or a ``parse`` that raises, fails the step with the reason in its entry."""
        entry = {"name": name, "command": " ".join(cmd), "limit_s": limit, "status": "running"}
        self.summary["steps"].append(entry)
        self.save()
        print(f"\n== [{name}] (limit {limit:.0f} s) {' '.join(cmd)}", flush=True)
        t0 = time.perf_counter()
        rc, error = None, None
        with open(os.path.join(self.out, "gpu_check.log"), "a") as log:
            log.write(f"\n== [{name}] (limit {limit:.0f} s) {' '.join(cmd)}\n")
            try:
                proc = subprocess.Popen(
                    cmd,
                    cwd=ROOT,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                    env={**os.environ, **(env or {})},
                    start_new_session=True,
                    bufsize=1,
                )
            except OSError as e:
                error = f"cannot start: {e}"
            else:
                timer = threading.Timer(limit, lambda: _kill(proc))
                timer.start()
                try:
                    for line in proc.stdout:
                        sys.stdout.write(line)
                        log.write(line)
                        log.flush()
                        if parse is not None and line.startswith("[gpu_check]"):  # a test ended: the summary knows
                            error = _parsed(parse, entry) or error
                            self.save()
                    rc = proc.wait()
                finally:
                    timer.cancel()
        seconds = time.perf_counter() - t0
        timed_out = rc is not None and seconds >= limit and rc != 0
        if parse is not None and rc is not None:
            error = _parsed(parse, entry) or error
        status = "timeout" if timed_out else ("passed" if rc == 0 and error is None else "failed")
        entry.update(seconds=round(seconds, 1), returncode=rc, status=status, **({"error": error} if error else {}))
        print(f"== [{name}] {status} in {seconds:.1f} s{': ' + error if error else ''}", flush=True)
        self.save()
        return entry

    def not_run(self, name: str, status: str, reason: str, limit: float = 0.0) -> dict:
        """A step recorded without running: ``status`` "skipped" or "failed", with the reason."""
        entry = {"name": name, "limit_s": limit, "status": status, "error": reason, "seconds": 0.0}
        self.summary["steps"].append(entry)
        print(f"\n== [{name}] {status}: {reason}", flush=True)
        self.save()
        return entry


def _parsed(parse, entry: dict) -> str | None:
    """``parse(entry)``; the reason it failed as one line, or None."""
    try:
        parse(entry)
    except Exception as e:  # a step's own output the summary cannot read: the step fails, the run goes on
        return f"its results could not be read: {type(e).__name__}: {e}"
    return None


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


def plan(quick: bool, steps: str | None = None, limits: list[str] = ()) -> list[tuple[str, float]]:
    """The steps a run takes, in order, with their limits in seconds: all of :data:`LIMITS` (``quick``:
    :data:`QUICK_LIMITS`), or the comma-separated ``steps``; ``limits``: ``STEP=SECONDS`` overrides."""
    table = dict(QUICK_LIMITS if quick else LIMITS)
    for item in limits:
        name, _, seconds = item.partition("=")
        table[name] = float(seconds)
    names = steps.split(",") if steps else list(table)
    return [(name, table.get(name, LIMITS.get(name, 60))) for name in names]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m specdist.bench.gpu_check",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--device", default="cuda", help="cuda, cuda:N, or cpu (with --tiny: CI's smoke run)")
    p.add_argument("--tiny", action="store_true", help="small random models instead of the 1 B target")
    p.add_argument("--quick", action="store_true", help="env, tests and decode (within 5 minutes)")
    p.add_argument("--steps", default=None, help="comma-separated subset of " + ",".join(LIMITS))
    p.add_argument("--limit", action="append", default=[], metavar="STEP=SECONDS", help="another time limit")
    p.add_argument("--out", default=None, help="where gpu_check.json and gpu_check.log go (default: a temp dir)")
    p.add_argument("--raw", default=None, help="where the steps' own files go (default: OUT/raw)")
    args = p.parse_args(argv)

    import tempfile

    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(
            "gpu_check: CUDA is not available on this machine (use --device cpu --tiny for the CPU smoke run)",
            file=sys.stderr,
        )
        return 1
    steps = plan(args.quick, args.steps, args.limit)
    unknown = [name for name, _ in steps if name not in LIMITS]
    if unknown:
        print(f"gpu_check: unknown step {unknown[0]!r} (the steps: {', '.join(LIMITS)})", file=sys.stderr)
        return 2
    out = args.out or tempfile.mkdtemp(prefix="specdist-gpu-check-")
    raw = args.raw or os.path.join(out, "raw")
    os.makedirs(out, exist_ok=True)
    os.makedirs(raw, exist_ok=True)
    run = Run(out, raw, args)
    for name, limit in steps:
        try:
            _run_step(run, name, limit, args)
        except Exception as e:  # what a step does in this process (reading a config): recorded, the run goes on
            run.not_run(name, "failed", f"{type(e).__name__}: {e}", limit)
    failed = [s["name"] for s in run.summary["steps"] if s["status"] != "passed"]
    run.summary["passed"] = not failed
    run.save()
    print(
        f"\ngpu_check: {'all steps passed' if not failed else 'FAILED: ' + ', '.join(failed)} "
        f"in {time.perf_counter() - run.t0:.0f} s; summary in {os.path.join(out, 'gpu_check.json')}"
    )
    return 1 if failed else 0


def _run_step(run: Run, name: str, limit: float, args) -> None:
    py, raw = sys.executable, run.raw
    cuda = args.device.startswith("cuda")
    if name == "env":
        run.step(name, [py, "-c", ENV_SCRIPT, args.device], limit)
    elif name in ("tests", "tests-slow"):
        _tests_step(run, name, py, limit, args)
    elif name == "decode":
        path = os.path.join(raw, "decode.json")
        cmd = [py, "-m", "specdist.bench.gpu_decode", "--device", args.device, "--json", path]
        if args.quick:
            cmd += ["--tokens", "128"]
        if args.tiny:
            cmd += ["--tiny", "--tokens", "8", "--hf-tokens", "8", "--sync-steps", "4"]
        run.step(name, cmd, limit, parse=lambda e, path=path: e.update(result=_read_json(path)))
    elif name == "tasks":
        path = os.path.join(raw, "tasks.json")
        config = "configs/gpu.yaml" if cuda else _cpu_config(raw, args.device)
        cmd = [
            py,
            "-m",
            "specdist.cli",
            "bench",
            "tasks",
            "--config",
            config,
            "--drafts",
            "none,suffix",
            "--tasks",
            "code-edit,chat",
            "--concurrency",
            "1",
            "--concurrency",
            "16",
            "--json",
            path,
        ]
        cmd += (
            ["--prompts", "2", "--max-tokens", "16"]
            if args.tiny or not cuda
            else ["--prompts", "16", "--max-tokens", "128"]
        )
        run.step(name, cmd, limit, parse=lambda e, path=path: e.update(result=_tasks_summary(path)))
    elif name == "drafts":
        _drafts_step(run, py, limit, args, raw)


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


def cuda_test_files() -> list[str]:
    """The test files with tests marked ``cuda`` (``devices()``'s CUDA twins, or the marker itself): those of
    :data:`FIRST` in its order, then the others by name."""
    found = []
    for folder, _, names in os.walk(os.path.join(ROOT, "tests")):
        for n in names:
            if n.startswith("test_") and n.endswith(".py"):
                with open(os.path.join(folder, n)) as f:
                    text = f.read()
                if "devices(" in text or "mark.cuda" in text:
                    found.append(os.path.relpath(os.path.join(folder, n), ROOT).replace(os.sep, "/"))
    return sorted(found, key=lambda f: (FIRST.index(f) if f in FIRST else len(FIRST), f))


def tests_command(name: str, py: str, limit: float, device: str, tiny: bool) -> list[str]:
    """The pytest command of step ``name``: ``tests`` the fast cuda tests, ``tests-slow`` the slow ones (on the
    CPU, the same files whole; ``tiny``: CI's smoke run, the plugin and the logging on one small file), each
    test under pytest-timeout's limit (:data:`TEST_TIMEOUT_S`, at most the step's)."""
    slow = "slow" if name == "tests-slow" else "not slow"
    files = cuda_test_files()
    marks = f"cuda and {slow}" if device.startswith("cuda") else f"(cuda or not cuda) and {slow}"
    if tiny:
        files, marks = ["tests/unit/test_paged_attention.py"], f"not cuda and {slow}"
    return [
        py,
        "-m",
        "pytest",
        "-n",
        "0",
        "-p",
        "specdist.bench.gpu_check",
        "-q",
        "-rfE",
        "--no-header",
        "--timeout",
        str(int(min(TEST_TIMEOUT_S, limit))),
        "-m",
        marks,
        *files,
    ]


def _tests_step(run: Run, name: str, py: str, limit: float, args) -> None:
    log = os.path.join(run.raw, f"{name}.jsonl")
    open(log, "w").close()

    def parse(entry: dict) -> None:
        try:
            with open(log) as f:
                tests = [json.loads(line) for line in f if line.strip()]
        except OSError:
            tests = []
        entry["tests"] = tests
        entry["counts"] = {k: sum(t["outcome"] == k for t in tests) for k in ("passed", "failed", "skipped")}

    run.step(name, tests_command(name, py, limit, args.device, args.tiny), limit, env={TEST_LOG_ENV: log}, parse=parse)


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
    rows = [
        {
            k: r.get(k)
            for k in (
                "concurrency",
                "task",
                "variant",
                "tokens_per_s",
                "speedup",
                "acceptance",
                "tokens_per_step",
                "same_tokens_as_none",
            )
        }
        for r in data.get("results", [])
    ]
    return {"results": rows}


CHECKPOINTS_SCRIPT = """
import sys
from specdist.bench.gpu_check import write_checkpoints
write_checkpoints(*sys.argv[1:])
"""


def write_checkpoints(work: str, device: str, tiny: str) -> None:
    """The drafts step's models, written under ``work``: the random target (the 1 B Llama; ``tiny`` "1": a toy), a
    random draft model and a random EAGLE-3 head, over the built-in model's tokenizer (the bench renders chat
    prompts with it); their paths in ``work/checkpoints.json``. Run as the step ``drafts-setup``."""
    import torch

    from specdist.bench.checkpoints import LLAMA_1B, LLAMA_DRAFT, write_random_eagle3_head, write_random_llama
    from specdist.models.loader import load_tokenizer, resolve_model

    small = tiny == "1"
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    tok = load_tokenizer(resolve_model("smollm2-135m-instruct"))
    vocab = len(tok)
    target = write_random_llama(
        os.path.join(work, "target"), vocab, dtype, seed=1, tokenizer=tok, **(TINY_TARGET if small else LLAMA_1B)
    )
    print(f"target: {target.num_params / 1e9:.3f} B parameters at {target.path}", flush=True)
    draft = write_random_llama(
        os.path.join(work, "draft"), vocab, dtype, seed=2, tokenizer=tok, **(TINY_DRAFT if small else LLAMA_DRAFT)
    )
    with open(os.path.join(target.path, "config.json")) as f:
        head = write_random_eagle3_head(
            os.path.join(work, "eagle3"), json.load(f), draft_vocab_size=vocab // 3, seed=3, dtype=dtype
        )
    paths = {
        "target": target.path,
        "draft": draft.path,
        "eagle3": head.path,
        "dtype": "bfloat16" if dtype == torch.bfloat16 else "float32",
    }
    with open(os.path.join(work, "checkpoints.json"), "w") as f:
        json.dump(paths, f)


DRAFT_VARIANTS = ("model", "self-w4", "eagle3", "suffix")


def _drafts_step(run: Run, py: str, limit: float, args, out: str) -> None:
    """``drafts-setup`` (:func:`write_checkpoints`, in a process of its own under :data:`DRAFTS_SETUP_S` of the
    limit), then each draft method's ``bench engine`` run, sharing what is left of the limit; a variant left
    less than :data:`MIN_VARIANT_S` is recorded as skipped. The sub-steps' limits add to at most ``limit``."""
    t0 = time.perf_counter()
    work = os.path.join(out, "checkpoints")
    setup = run.step(
        "drafts-setup",
        [py, "-c", CHECKPOINTS_SCRIPT, work, args.device, "1" if args.tiny else "0"],
        min(DRAFTS_SETUP_S, limit),
    )
    paths = _read_json(os.path.join(work, "checkpoints.json")) if setup["status"] == "passed" else None
    if paths is None:
        for v in DRAFT_VARIANTS:
            run.not_run(f"drafts-{v}", "skipped", f"drafts-setup {setup['status']}: no checkpoints")
        return
    common = [
        "--model",
        paths["target"],
        "--dtype",
        paths["dtype"],
        "--device",
        args.device,
        "--systems",
        "engine-target,engine-spec",
        "--temperatures",
        "0,0.8",
        "--prompts",
        "2",
        "--max-tokens",
        "16" if args.tiny else "64",
    ]
    extra = {
        "model": ["--draft-model", paths["draft"]],
        "self-w4": [],
        "eagle3": ["--draft-model", paths["eagle3"]],
        "suffix": ["--length-policy", "adaptive"],
    }
    for i, v in enumerate(DRAFT_VARIANTS):
        name = f"drafts-{v}"
        share = (limit - (time.perf_counter() - t0)) / (len(DRAFT_VARIANTS) - i)
        if share < MIN_VARIANT_S:
            run.not_run(name, "skipped", f"{share:.0f} s of the drafts step's {limit:.0f} s left")
            continue
        path = os.path.join(out, f"{name}.json")
        run.step(
            name,
            [py, "-m", "specdist.cli", "bench", "engine", *common, "--draft", v, *extra[v], "--json", path],
            share,
            parse=lambda e, path=path: e.update(result=_read_json(path)),
        )


if __name__ == "__main__":
    sys.exit(main())
