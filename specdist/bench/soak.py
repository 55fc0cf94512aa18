"""``specdist bench soak``: a long mixed load against a server; memory, threads, fds and slots must stay flat.

It brings a server up in this process from ``--config`` (as ``bench cluster --config`` does:
the in-process engine, or with ``cluster.enabled`` the whole Ray deployment behind the
coordinator) and drives it for ``--minutes`` from ``--concurrency`` client threads over gRPC on
127.0.0.1. Each client draws its requests from ``random.Random(--seed * 1000 + client)``
(:func:`draw_request`):

- kinds: 70% run to completion, 20% are cancelled by the client after a random number of
  streamed tokens (closing the stream cancels the call), 5% are invalid (one field wrong,
  drawn from :data:`INVALID_FIELDS`; each must come back INVALID_ARGUMENT), 5% vanish: the
  client closes its channel mid-stream without cancelling the call;
- prompts of 1 to :func:`max_prompt_words` random words, ``max_tokens`` from 1 to
  ``--max-tokens``, half greedy and half sampled (temperature, top_p, top_k, seed), 30% with
  stop strings.

Any other outcome (an error status, a DEADLINE_EXCEEDED, an ``error`` or unasked ``abort``
finish, an invalid request that was served) is an unexpected outcome of the run.

A sampler thread reads, every ``--sample-interval`` seconds, for every process of the server
(this one, which also runs the clients, and each deployment actor on this machine): resident
memory, threads and open file descriptors (psutil); and the slot counters: the coordinator's
gauges (:data:`GAUGES`) and, with a deployment, each worker's in-flight requests and KV slots
(``Deployment.health()``).

At the end the load stops (clients finish the request they are in), the command waits (up to
:data:`IDLE_TIMEOUT_S`) until every counter is 0, samples once more, and judges:

- every counter back at 0, on every target rank and draft worker too;
- every process series flat: least squares over the samples under load after the warm-up (the
  first 20% of the run or its first minute, whichever is shorter: start-up allocations, lazily
  started thread pools and first-use caches settle there); a series *grows* when its fitted growth
  over the window (slope x window length) exceeds the metric's tolerance (:func:`tolerance`)
  AND the slope is more than 3 standard errors above 0 (:func:`fit_trend`);
- no unexpected request outcome.

Exit status 0 when all hold, else 1 with one line on stderr naming what grew or leaked.
``--json PATH`` writes one object (strict JSON), schema ``specdist.bench.soak/1``; a new key
may be added, none is renamed or removed::

    {"schema": "specdist.bench.soak/1",
     "settings": {"config", "minutes", "concurrency", "seed", "max_tokens", "sample_interval_s",
                  "warmup_s"},
     "server_info": {...},                      # GetServerInfo's fields, without counters
     "processes": [{"name", "pid"}],            # "server": this process; else the actor's name
     "not_sampled": [{"name", "reason"}],       # actors psutil cannot reach (another node)
     "requests": {"sent", "by_kind": {kind: n}, "outcomes": {outcome: n}, "unexpected": n,
                  "unexpected_examples": [str]},  # at most 20
     "samples": [{"t_s", "processes": {name: {"rss_bytes", "threads", "fds"} | null},
                  "counters": {gauge: n},
                  "workers": {name: {"requests", "kv_slots_in_use"}}}],
     "series": [{"process", "metric", "samples", "start", "end", "slope_per_min", "slope_se_per_min",
                 "growth", "tolerance", "verdict": "flat" | "grows" | "too few samples",
                 "idle" (the value in the sample after the load)}],
     "final": {"idle": bool, "counters": {...}, "workers": {...}, "held": [str]},
     "ok": bool, "failure": str | null}
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import socket
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from specdist.bench.cluster_bench import BenchError, InProcessServer, progress, tqdm_class

SCHEMA = "specdist.bench.soak/1"
DEFAULT_CONFIG = "configs/default.yaml"  # the default deployment, as `specdist demo`
GAUGES = ("running", "queued", "target_kv_slots_used", "draft_kv_slots_used", "active_streams", "live_requests")
WORKER_GAUGES = ("requests", "kv_slots_in_use")
METRICS = ("rss_bytes", "threads", "fds")

# request mix (kind, share); the shares add up to 1
MIX = (("complete", 0.70), ("cancel", 0.20), ("invalid", 0.05), ("vanish", 0.05))
GREEDY_SHARE = 0.5
STOP_SHARE = 0.3
WORDS = ("a", "b", "c", "d", "e", "f", "g", "the", "of", "and", "to", "in", "is", "it", "cat", "sky")
STOPS = ("c", "e f", "g", ".", "\n", " the", "and")
# the field an invalid request gets wrong (each is INVALID_ARGUMENT naming it, specdist.proto)
INVALID_FIELDS = ("temperature", "top_p", "top_k", "empty_prompt", "prompt_tokens", "max_tokens", "stop", "request_id")

REQUEST_TIMEOUT_S = 300.0  # per request: far above one request's time even under full load; reaching it is a hang
IDLE_TIMEOUT_S = 60.0  # after the load: how long the counters may take to drain to 0
MAX_EXAMPLES = 20
WARMUP_SHARE, WARMUP_MAX_S = 0.2, 60.0
SIGMAS = 3.0  # a series grows only if its slope is this many standard errors above 0
MIB = 1 << 20


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config",
        default=DEFAULT_CONFIG,
        help="config of the server to bring up here (default: configs/default.yaml, the default "
        "deployment, as `specdist demo`)",
    )
    p.add_argument("--minutes", type=float, default=20.0, help="how long to drive the load")
    p.add_argument("--concurrency", type=int, default=8, help="client threads, each one request at a time")
    p.add_argument("--seed", type=int, default=0, help="seed of the request mix (client i: seed * 1000 + i)")
    p.add_argument("--max-tokens", type=int, default=64, help="a request's max_tokens is drawn from 1 to this")
    p.add_argument("--sample-interval", type=float, default=1.0, help="seconds between samples")
    p.add_argument("--json", default=None, help=f"also write the whole run to this JSON file (schema {SCHEMA})")
    p.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress bar on stderr (there is none when stderr is not a terminal)",
    )
    p.add_argument("--ray-address", default=None, help="with cluster.enabled: join this Ray cluster")


# ---------------------------------------------------------------- the request mix
@dataclass(frozen=True)
class SoakRequest:
    kind: str  # "complete" | "cancel" | "invalid" | "vanish"
    prompt: str | tuple[int, ...]
    max_tokens: int
    temperature: float
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    request_id: str | None = None
    stop_after: int = 0  # cancel / vanish: leave after this many streamed tokens
    invalid: str | None = None  # invalid: the field it gets wrong (INVALID_FIELDS)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def max_prompt_words(limits) -> int:
    """Longest prompt in words: a quarter of the prompt-token limit (a word is at most a few
    tokens in the tokenizers served, so prompt + one output token stay within the context), at
    most 64: the soak looks for leaks over many requests, and on a CPU deployment long prompts
    would make them few."""
    return max(1, min(64, limits.max_prompt_tokens // 4))


def draw_request(rng: random.Random, limits, max_tokens: int) -> SoakRequest:
    """One request of the mix (module docstring); ``limits``: the server's :class:`specdist.api.admission.Limits`."""
    kind = rng.choices([k for k, _ in MIX], weights=[w for _, w in MIX])[0]
    words = rng.randint(1, max_prompt_words(limits))
    prompt = " ".join(rng.choice(WORDS) for _ in range(words))
    n = rng.randint(1, max(1, min(max_tokens, limits.max_tokens)))
    sampling: dict[str, Any] = {"temperature": 0.0}
    if rng.random() >= GREEDY_SHARE:
        sampling = {
            "temperature": round(rng.uniform(0.3, 1.5), 3),
            "top_p": 1.0 if rng.random() < 0.5 else round(rng.uniform(0.5, 1.0), 3),
            "top_k": 0 if rng.random() < 0.5 else rng.randint(1, 50),
            "seed": rng.randrange(2**32),
        }
    stop = tuple(rng.sample(STOPS, rng.randint(1, 2))) if rng.random() < STOP_SHARE else ()
    req = SoakRequest(kind, prompt, n, stop=stop, **sampling)
    if kind in ("cancel", "vanish"):
        return _replace(req, stop_after=rng.randint(1, n))
    if kind == "invalid":
        return invalid_request(req, rng.choice(INVALID_FIELDS), limits)
    return req


def invalid_request(req: SoakRequest, wrong: str, limits) -> SoakRequest:
    """``req`` with one field just past what the server accepts."""
    change: dict[str, Any] = {
        "temperature": {"temperature": -1.0},
        "top_p": {"top_p": 1.5},
        "top_k": {"top_k": -1},
        "empty_prompt": {"prompt": ""},
        "prompt_tokens": {"prompt": (0,) * (limits.max_prompt_tokens + 1)},
        "max_tokens": {"max_tokens": limits.max_tokens + 1},
        "stop": {"stop": ("x" * (limits.max_stop_chars + 1),)},
        "request_id": {"request_id": "two words"},  # a space: not a visible ASCII character
    }[wrong]
    return _replace(req, invalid=wrong, **change)


def _replace(req: SoakRequest, **kw) -> SoakRequest:
    return SoakRequest(**{**asdict(req), **kw})


# ---------------------------------------------------------------- one request
def send(client, address: str, req: SoakRequest) -> str:
    """Send ``req``; its outcome: "finished", "cancelled", "vanished", "invalid_argument" when
    expected, else "unexpected: <what happened>"."""
    from specdist.client import RemoteError

    kw = dict(
        max_tokens=req.max_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        seed=req.seed,
        stop=req.stop,
        request_id=req.request_id,
    )
    try:
        if req.kind == "vanish":
            return _vanish(address, req, kw)
        tokens, finish = 0, None
        stream = client.generate(list(req.prompt) if isinstance(req.prompt, tuple) else req.prompt, **kw)
        for chunk in stream:
            tokens += len(chunk.token_ids)
            finish = chunk.finish_reason or finish
            if req.kind == "cancel" and finish is None and tokens >= req.stop_after:
                stream.close()  # cancels the call: the server aborts the request
                return "cancelled"
    except RemoteError as e:
        if req.kind == "invalid" and e.code.name == "INVALID_ARGUMENT":
            return "invalid_argument"
        return f"unexpected: {req.kind} request ({req.invalid or 'valid'}): {e.code.name}: {e.message}"
    if req.kind == "invalid":
        return f"unexpected: invalid request ({req.invalid}) was served: finish {finish}"
    if finish not in ("stop", "length"):
        return f"unexpected: {req.kind} request ended with finish {finish}"
    return "finished"


def _vanish(address: str, req: SoakRequest, kw: dict) -> str:
    """A client that goes away mid-stream: its own channel, closed after ``stop_after`` tokens,
    without cancelling the call."""
    import grpc

    from specdist.client import RemoteError, generate_request
    from specdist.v1 import common_pb2, specdist_pb2_grpc

    channel = grpc.insecure_channel(address)
    try:
        call = specdist_pb2_grpc.SpecDecodeStub(channel).Generate(
            generate_request(req.prompt, **kw), timeout=REQUEST_TIMEOUT_S
        )
        tokens, finish = 0, None
        for msg in call:
            tokens += len(msg.token_ids)
            if msg.finish_reason:
                finish = msg.finish_reason
            if not finish and tokens >= req.stop_after:
                return "vanished"
    except grpc.RpcError as e:
        raise RemoteError.from_rpc(e) from None
    finally:
        channel.close()  # ends the connection's streams; the call itself is never cancelled
    if finish not in (common_pb2.FINISH_REASON_STOP, common_pb2.FINISH_REASON_LENGTH):
        return f"unexpected: vanish request ended with finish {common_pb2.FinishReason.Name(finish or 0)}"
    return "finished"


@dataclass
class Tally:
    """What the clients sent and got (thread-safe)."""

    by_kind: Counter = field(default_factory=Counter)
    outcomes: Counter = field(default_factory=Counter)
    examples: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, kind: str, outcome: str) -> None:
        with self.lock:
            self.by_kind[kind] += 1
            if outcome.startswith("unexpected"):
                self.outcomes["unexpected"] += 1
                if len(self.examples) < MAX_EXAMPLES:
                    self.examples.append(outcome[len("unexpected: ") :])
            else:
                self.outcomes[outcome] += 1

    @property
    def sent(self) -> int:
        return sum(self.by_kind.values())

    def record(self) -> dict:
        with self.lock:
            return {
                "sent": self.sent,
                "by_kind": dict(self.by_kind),
                "outcomes": dict(self.outcomes),
                "unexpected": self.outcomes["unexpected"],
                "unexpected_examples": list(self.examples),
            }


def run_client(address: str, rng: random.Random, limits, max_tokens: int, deadline: float, tally: Tally) -> None:
    """One client: a request at a time until ``deadline`` (monotonic)."""
    from specdist.client import SpecDistClient

    with SpecDistClient(address, timeout=REQUEST_TIMEOUT_S) as client:
        while time.monotonic() < deadline:
            req = draw_request(rng, limits, max_tokens)
            try:
                outcome = send(client, address, req)
            except Exception as e:  # anything a client meets is an outcome of the run
                outcome = f"unexpected: {req.kind} request: {type(e).__name__}: {e}"
            tally.add(req.kind, outcome)


# ---------------------------------------------------------------- what the sampler reads
def process_stats(pid: int) -> dict[str, int] | None:
    """Resident memory, threads and open file descriptors of ``pid``; None when it is gone."""
    import psutil

    try:
        p = psutil.Process(pid)
        return {"rss_bytes": p.memory_info().rss, "threads": p.num_threads(), "fds": p.num_fds()}
    except psutil.Error:
        return None


def _local_ips() -> set[str]:
    import psutil

    ips = {"127.0.0.1", "localhost", socket.gethostname()}
    for addrs in psutil.net_if_addrs().values():
        ips.update(a.address for a in addrs)
    return ips


def deployment_processes(deployment) -> tuple[list[tuple[str, int]], list[dict]]:
    """([(name, pid)] of this process and each actor on this machine, [{name, reason}] not sampled)."""
    procs, skipped = [("server", os.getpid())], []
    if deployment is None:
        return procs, skipped
    local = _local_ips()
    for name, h in deployment.health().items():
        if "pid" not in h:
            skipped.append({"name": name, "reason": h.get("error", "no pid in health()")})
        elif h.get("node_ip") not in local:
            skipped.append({"name": name, "reason": f"runs on {h.get('node_ip')}, not on this machine"})
        else:
            procs.append((name, int(h["pid"])))
    return procs, skipped


def worker_counters(deployment) -> dict[str, dict[str, int]]:
    """Each worker's in-flight requests and KV slots in use (VerifierCore / DrafterCore health());
    {} without a deployment."""
    if deployment is None:
        return {}
    out = {}
    for name, h in deployment.health().items():
        # an actor that does not answer holds what it held: -1 marks it unknown (never 0)
        out[name] = {g: int(h.get(g, -1)) for g in WORKER_GAUGES}
    return out


def take_sample(t_s: float, procs: list[tuple[str, int]], coordinator, deployment) -> dict:
    counters = coordinator.counters()
    return {
        "t_s": round(t_s, 3),
        "processes": {name: process_stats(pid) for name, pid in procs},
        "counters": {g: counters[g] for g in GAUGES},
        "workers": worker_counters(deployment),
    }


def held(sample: dict) -> list[str]:
    """Every counter of ``sample`` that is not 0, as "name = value"."""
    out = [f"{g} = {v}" for g, v in sample["counters"].items() if v]
    for w, gs in sample["workers"].items():
        out += [f"{w} {g} = {gs[g]}" for g in WORKER_GAUGES if gs[g]]
    return out


class Sampler(threading.Thread):
    """Calls ``read(t_s)`` every ``interval_s`` seconds until stopped; keeps what it returns."""

    def __init__(
        self,
        read: Callable[[float], dict],
        interval_s: float,
        t0: float,
        on_sample: Callable[[dict], None] = lambda s: None,
    ):
        super().__init__(daemon=True, name="soak-sampler")
        self.read, self.interval_s, self.t0, self.on_sample = read, interval_s, t0, on_sample
        self.samples: list[dict] = []
        self.errors: list[str] = []
        self.stopping = threading.Event()

    def run(self) -> None:
        next_t = time.monotonic()
        while not self.stopping.is_set():
            try:
                s = self.read(time.monotonic() - self.t0)
                self.samples.append(s)
                self.on_sample(s)
            except Exception as e:  # a failed reading is reported, not fatal to the run
                if len(self.errors) < MAX_EXAMPLES:
                    self.errors.append(f"{type(e).__name__}: {e}")
            next_t += self.interval_s
            self.stopping.wait(max(0.0, next_t - time.monotonic()))

    def stop(self) -> None:
        self.stopping.set()
        self.join()


# ---------------------------------------------------------------- the verdict
def tolerance(metric: str, level: float) -> float:
    """How much a series may grow over the window before it counts as growing (in its unit).

    rss_bytes: max(32 MiB, 5% of its level). RSS moves in allocator-sized steps (glibc's heaps and
    per-thread arenas, torch's CPU allocator) as batch shapes and prompt lengths vary, so a few
    tens of MiB of movement is not a leak; a model process of several GiB also varies by a few
    percent with what its caches hold. A leak of a kilobyte per request is beyond this after
    about 30k requests; anything worse per request, far sooner.
    threads: max(4, 10% of its level). gRPC's C core runs a dynamic thread pool that adds workers
    under a burst and reaps them when idle, and Python's pools start their threads lazily; with 8
    clients in the process under test the count moved between 31 and 35 within seconds, and a
    6-second window once fitted +2.02. A leak per request adds hundreds over a soak.
    fds: 2. Channels and their pollers open once; a leak per request adds hundreds.
    """
    if metric == "rss_bytes":
        return max(32 * MIB, 0.05 * level)
    if metric == "threads":
        return max(4.0, 0.1 * level)
    return 2.0


@dataclass
class Trend:
    samples: int
    start: float
    end: float
    slope_per_min: float
    slope_se_per_min: float
    growth: float  # slope x window length: the fitted growth over the window
    tolerance: float
    verdict: str  # "flat" | "grows" | "too few samples"


def fit_trend(t_s: list[float], y: list[float], tol: float) -> Trend:
    """Least-squares line through (t, y) (t in seconds; slope reported per minute); the series
    grows when the fitted growth over the window exceeds ``tol`` AND the slope is more than
    :data:`SIGMAS` standard errors above 0 (a one-off spike moves the fit little and is no trend;
    a slow, steady climb smaller than ``tol`` is noise or settling, not a leak worth failing)."""
    n = len(y)
    if n < 3:
        return Trend(n, y[0] if y else math.nan, y[-1] if y else math.nan, 0.0, math.inf, 0.0, tol, "too few samples")
    t = [x / 60.0 for x in t_s]  # minutes
    tm, ym = sum(t) / n, sum(y) / n
    sxx = sum((a - tm) ** 2 for a in t)
    if sxx == 0:
        return Trend(n, y[0], y[-1], 0.0, math.inf, 0.0, tol, "too few samples")
    slope = sum((a - tm) * (b - ym) for a, b in zip(t, y)) / sxx
    resid = sum((b - ym - slope * (a - tm)) ** 2 for a, b in zip(t, y))
    se = math.sqrt(resid / (n - 2) / sxx)
    growth = slope * (t[-1] - t[0])
    grows = growth > tol and slope > SIGMAS * se
    return Trend(n, y[0], y[-1], slope, se, growth, tol, "grows" if grows else "flat")


def warmup_s(duration_s: float) -> float:
    """The first 20% of the run or its first minute, whichever is shorter (not fitted)."""
    return min(WARMUP_SHARE * duration_s, WARMUP_MAX_S)


def trends(samples: list[dict], procs: list[tuple[str, int]], warmup: float, end: float, idle: dict) -> list[dict]:
    """One row per process and metric: its :class:`Trend` over the samples taken under load after
    the warm-up (``warmup`` <= t <= ``end``, the end of the load: while the clients finish their
    last requests and once they are gone, this process holds fewer threads, which is no trend),
    and its value in ``idle``, the sample after the load."""
    rows = []
    for name, _ in procs:
        for metric in METRICS:
            pts = [
                (s["t_s"], s["processes"][name][metric])
                for s in samples
                if warmup <= s["t_s"] <= end and s["processes"].get(name) is not None
            ]
            ts, ys = [p[0] for p in pts], [float(p[1]) for p in pts]
            level = sum(ys) / len(ys) if ys else 0.0
            tr = fit_trend(ts, ys, tolerance(metric, level))
            after = idle["processes"].get(name)
            rows.append(
                {"process": name, "metric": metric, **asdict(tr), "idle": None if after is None else after[metric]}
            )
    return rows


def _fmt(metric: str, v: float) -> str:
    if not math.isfinite(v):
        return "-"
    return f"{v / MIB:.1f} MiB" if metric == "rss_bytes" else f"{v:g}" if v == int(v) else f"{v:.2f}"


def format_table(rows: list[dict]) -> str:
    lines = [
        "| process | metric | start | end | slope/min | growth | tolerance | verdict | idle after |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        m = r["metric"]
        lines.append(
            f"| {r['process']} | {m} | {_fmt(m, r['start'])} | {_fmt(m, r['end'])} "
            f"| {_fmt(m, r['slope_per_min'])} | {_fmt(m, r['growth'])} | {_fmt(m, r['tolerance'])} "
            f"| {r['verdict']} | {_fmt(m, math.nan if r['idle'] is None else r['idle'])} |"
        )
    return "\n".join(lines)


def failure_line(
    rows: list[dict], final_held: list[str], idle: bool, tally: dict, gone: list[str], sampler_errors: list[str]
) -> str | None:
    """One line naming everything that grew, leaked or went wrong; None when nothing did."""
    parts = [
        f"{r['process']} {r['metric']} grows {_fmt(r['metric'], r['growth'])} over the window "
        f"(tolerance {_fmt(r['metric'], r['tolerance'])})"
        for r in rows
        if r["verdict"] == "grows"
    ]
    if final_held:
        parts.append(
            ("not idle after %gs: " % IDLE_TIMEOUT_S if not idle else "held at the end: ") + ", ".join(final_held)
        )
    if gone:
        parts.append("process gone: " + ", ".join(gone))
    if tally["unexpected"]:
        parts.append(f"{tally['unexpected']} unexpected request outcome(s), e.g. {tally['unexpected_examples'][0]}")
    if sampler_errors:
        parts.append(f"{len(sampler_errors)} failed sample(s), e.g. {sampler_errors[0]}")
    return "; ".join(parts) or None


# ---------------------------------------------------------------- the command
def check_args(args: argparse.Namespace) -> None:
    """ValueError naming the flag, before anything starts."""
    if not (args.minutes > 0 and math.isfinite(args.minutes)):
        raise ValueError(f"--minutes: must be a positive number, got {args.minutes}")
    if args.concurrency < 1:
        raise ValueError(f"--concurrency: must be >= 1, got {args.concurrency}")
    if args.max_tokens < 1:
        raise ValueError(f"--max-tokens: must be >= 1, got {args.max_tokens}")
    if not (args.sample_interval > 0 and math.isfinite(args.sample_interval)):
        raise ValueError(f"--sample-interval: must be a positive number of seconds, got {args.sample_interval}")
    if args.json is not None and not os.path.isdir(os.path.dirname(os.path.abspath(args.json))):
        raise ValueError(f"--json: the directory of {args.json!r} does not exist")
    if not args.no_progress:
        tqdm_class()
    try:
        import psutil  # noqa: F401
    except ImportError:
        raise BenchError("bench soak needs psutil: pip install psutil") from None


def wait_idle(read: Callable[[], dict], timeout_s: float | None = None) -> tuple[bool, dict]:
    """Poll ``read()`` (a sample) until no counter is held (:func:`held`) or ``timeout_s`` (default
    :data:`IDLE_TIMEOUT_S`) passes: (idle, last sample)."""
    deadline = time.monotonic() + (IDLE_TIMEOUT_S if timeout_s is None else timeout_s)
    while True:
        s = read()
        if not held(s):
            return True, s
        if time.monotonic() >= deadline:
            return False, s
        time.sleep(0.05)


def run(args: argparse.Namespace) -> int:
    check_args(args)
    from specdist.api.admission import Limits
    from specdist.api.serving import start_backend
    from specdist.client import SpecDistClient
    from specdist.config import load_config

    log = lambda msg: print(msg, file=sys.stderr, flush=True)
    cfg = load_config(args.config).to_dict()
    where = "a Ray deployment" if cfg["cluster"]["enabled"] else "the in-process engine"
    log(f"starting a server on {where}")
    srv = InProcessServer(start_backend(cfg, args.ray_address, log=log))
    try:
        deployment = srv.serving.backend.deployment
        with SpecDistClient(srv.address, timeout=30) as c:
            info = asdict(c.server_info())
        info.pop("counters", None)
        limits = Limits.of(srv.engine)
        procs, skipped = deployment_processes(deployment)
        duration = args.minutes * 60.0
        warm = warmup_s(duration)
        tally = Tally()
        bar = progress(max(1, round(duration)), "soak", not args.no_progress, unit="s")

        def on_sample(s: dict) -> None:
            if bar is not None:
                bar.n = min(bar.total, int(s["t_s"]))
                bar.set_postfix(requests=tally.sent, unexpected=tally.outcomes["unexpected"], refresh=True)

        t0 = time.monotonic()
        read = lambda t: take_sample(t, procs, srv.coordinator, deployment)
        sampler = Sampler(read, args.sample_interval, t0, on_sample)
        sampler.start()
        log(
            f"soak: {args.minutes:g} min, {args.concurrency} clients, sampling {len(procs)} process(es) "
            f"every {args.sample_interval:g}s (warm-up {warm:g}s not fitted)"
        )
        clients = [
            threading.Thread(
                target=run_client,
                name=f"soak-client-{i}",
                daemon=True,
                args=(srv.address, random.Random(args.seed * 1000 + i), limits, args.max_tokens, t0 + duration, tally),
            )
            for i in range(args.concurrency)
        ]
        try:
            for th in clients:
                th.start()
            for th in clients:
                th.join(duration + REQUEST_TIMEOUT_S + 60)  # the last request ends by its own deadline
        finally:
            sampler.stop()
            if bar is not None:
                bar.n = min(bar.total, round(time.monotonic() - t0))
                bar.close()
        stuck = [th.name for th in clients if th.is_alive()]
        idle, last = wait_idle(lambda: read(time.monotonic() - t0))
        samples = sampler.samples + [last]
        rows = trends(samples, procs, warm, duration, last)
        requests = tally.record()
        if stuck:
            requests["unexpected"] += len(stuck)
            requests["unexpected_examples"].append(f"{', '.join(stuck)} still in a request after its deadline")
        gone = [name for name, _ in procs if last["processes"].get(name) is None]
        final_held = held(last)
        failure = failure_line(rows, final_held, idle, requests, gone, sampler.errors)
    finally:
        srv.close()
    doc = {
        "schema": SCHEMA,
        "settings": {
            "config": args.config,
            "minutes": args.minutes,
            "concurrency": args.concurrency,
            "seed": args.seed,
            "max_tokens": args.max_tokens,
            "sample_interval_s": args.sample_interval,
            "warmup_s": warm,
        },
        "server_info": info,
        "processes": [{"name": n, "pid": p} for n, p in procs],
        "not_sampled": skipped,
        "requests": requests,
        "samples": samples,
        "series": [_finite(r) for r in rows],
        "final": {"idle": idle, "counters": last["counters"], "workers": last["workers"], "held": final_held},
        "ok": failure is None,
        "failure": failure,
    }
    print(format_report(doc, rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1, allow_nan=False)
    if failure is not None:
        print(f"specdist: bench soak failed: {failure}", file=sys.stderr)
        return 1
    return 0


def _finite(row: dict) -> dict:
    """A series row for strict JSON: inf / NaN (too few samples) as null."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}


def format_report(doc: dict, rows: list[dict]) -> str:
    s, r = doc["settings"], doc["requests"]
    out = [
        f"specdist bench soak: {s['minutes']:g} min, {s['concurrency']} clients, {r['sent']} requests "
        f"({', '.join(f'{k} {v}' for k, v in sorted(r['by_kind'].items()))}); outcomes: "
        f"{', '.join(f'{k} {v}' for k, v in sorted(r['outcomes'].items()))}",
        f"fitted after a {s['warmup_s']:g}s warm-up; grows = fitted growth > tolerance and slope > "
        f"{SIGMAS:g} standard errors above 0",
        "",
        format_table(rows),
        "",
        "counters at the end: " + (", ".join(doc["final"]["held"]) or "all 0"),
    ]
    for skip in doc["not_sampled"]:
        out.append(f"not sampled: {skip['name']} ({skip['reason']})")
    return "\n".join(out)
