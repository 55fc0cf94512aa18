"""``specdist bench cluster``: streaming requests against a server, speculation on and off.

Load levels. ``--concurrency C1,C2,..`` runs closed-loop levels: ``requests`` streaming
requests through C client threads (a thread starts its next request when its previous one
ends). ``--request-rate R1,R2,..`` runs open-loop levels, as ``vllm bench serve`` does:
request i is sent at time t_i whatever is still running, with exponential inter-arrival
times of mean 1/R (a Poisson process of R requests/s; ``inf``: all at t = 0), drawn from
``random.Random(--seed)`` (every rate level scales the same unit-rate draws, so a run is
reproducible). Each flag that is given runs its levels (concurrency levels first); with
neither, ``--concurrency 1,4,16``. Requests per level: ``--requests``, else max(8, 2 x C)
for a concurrency level and 16 for a rate level. Request i of a level uses prompt i of
:data:`specdist.bench.engine_bench.PROMPTS` (cyclically), sampling seed 1000 + i, and
``ignore_eos``, so every request makes ``--max-tokens`` tokens.

Measured per request: the time to first token (TTFT), the time per output token after the
first (TPOT), the end-to-end latency, and every inter-token gap (ITL: the gap between two
response messages, divided evenly over the tokens the later one carried); per level: output
tokens/s and completed requests/s over the level's wall time (first send to last end), and
the acceptance rate from the server's own per-request statistics.

Targets (any mix; each is one "variant" of the results):
- ``--server HOST:PORT`` (repeatable): a running gRPC server (``specdist serve``).
- ``--http URL`` (repeatable): a running OpenAI-compatible HTTP server
  (``specdist serve --http-port``, base URL such as ``http://127.0.0.1:8000``): streaming
  ``/v1/chat/completions`` (``/v1/completions`` with ``--raw``) with
  ``stream_options.include_usage``; the token counts and drafted / accepted numbers come from
  the final ``usage``. SSE chunks carry text, not token ids, so there a chunk's gap is divided
  by the request's mean tokens per chunk (usage.completion_tokens / chunks) and counted once;
  a token whose text is held back (a partial character) arrives with the next chunk.
- ``--config C``: starts servers one after another, one per entry of :data:`VARIANTS` named
  by ``--variants``, each from C with that entry's overrides deep-merged in: the
  single-process engine when ``cluster.enabled`` is false, else the whole Ray deployment
  (local Ray cluster or ``--ray-address``; with ``cluster.replicas``, as in the variants
  ``replicas-1`` / ``deployment``, Ray Serve replicas behind the replicas' front, whose engines
  run in the replicas: no per-step breakdown for them), with the same coordinator in front, reached over
  gRPC or, with ``--protocol http``, over the HTTP API. For these it also prints the per-step
  breakdown, in ms per step and as shares of the coordinator's busy time: prefill, draft,
  verify (worker compute), network + serialization (RPC wall time minus the worker's reported
  compute), scheduling (the coordinator's own work between and around steps) and the rest
  (output bookkeeping, releases, sampling). Orchestration overhead = network +
  serialization + scheduling.

Warm-up. Before its levels, each target gets one untimed request (``WARMUP_TOKENS`` tokens; in every
pass, so each freshly started server): the first requests a server sees pay for first touches (weights
paged in, kernels loaded), which would otherwise fall on the first level of the first variant.

Passes. ``--repeat N`` measures every variant N times: pass p runs the variants in their order
rotated by p (a config variant's server, Ray deployment included, starts afresh in each pass), and
each level's figures pool its passes (requests, seconds, tokens, phases summed; percentiles over all
requests). A shared machine's throughput drifts over minutes (10-30% on the development VM:
docs/performance.md), so one pass of each variant, run one after the other, can put the drift on one of them. The report
ends with each level's pooled ratio of the first variant's output tokens/s over each other's, and each pass's ratio.

``--json PATH`` writes one object (strict JSON: no NaN or Infinity), schema
``specdist.bench.cluster/1``; a new key may be added, none is renamed or removed::

    {"schema": "specdist.bench.cluster/1",
     "settings": {"max_tokens", "temperature", "raw", "seed", "requests" (0: per-level default),
                  "concurrency": [int], "request_rate": [float | "inf"], "protocol", "repeat"},
     "variants": [{"name", "source": "config" | "server", "protocol": "grpc" | "http",
                   "address" (host:port or base URL; null for config variants),
                   "overrides" (config variants: the VARIANTS entry, else null),
                   "config" (config variants: the whole config, else null),
                   "server_info" (target_model, draft_method, ... as GetServerInfo says)}],
     "levels": [{"variant", "mode": "concurrency" | "request_rate", "label" ("C=4", "R=2/s"),
                 "concurrency": int | null, "request_rate": float | "inf" | null,
                 "requests", "wall_s", "output_tokens", "output_tokens_per_s",
                 "request_throughput" (completed requests/s),
                 "{ttft,tpot,itl,e2e}_{mean,p50,p90,p99}_ms", "acceptance" (null: nothing drafted),
                 "pipeline_hit_rate" (pipelined drafting: hits / (hits + misses), else null),
                 "draft_overlap" (config variants with pipelined drafting: draft time hidden
                                  under verification / all draft time, else null),
                 "phase_ms_per_step", "phase_share" (config variants, else {}),
                 "vs_hf_plain" (with --hf-baseline),
                 "passes_output_tokens_per_s": [float] (each pass's, in run order; one without --repeat),
                 "per_request": [{"ttft_s", "e2e_s", "tokens", "prompt_tokens", "drafted",
                                  "accepted", "pipeline_hits", "pipeline_misses", "itl_s": [float]}]
                                 # per_request: in request order (seed 1000 + i)
                }],
     "hf_plain": {"requests", "output_tokens_per_s"} | null}

``--plot PREFIX`` draws PREFIX-throughput.png (output tokens/s against each load level, one
line per variant) and PREFIX-latency.png (CDFs of TTFT and ITL per variant and level) from
that object (:mod:`specdist.bench.bench_plot`; ``python -m specdist.bench.bench_plot
results.json PREFIX`` redraws them from a ``--json`` file). The default deployment's plots::

    specdist bench cluster --config configs/default.yaml --concurrency 1,4,16 \\
        --request-rate 0.5,1,2,inf --max-tokens 64 --json cluster.json --plot cluster
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

from specdist.bench.engine_bench import PROMPTS
from specdist.errors import SpecDistError

SCHEMA = "specdist.bench.cluster/1"

# Server variants of --config: name -> config overrides, deep-merged into the config
# (a mapping merges key by key, any other value replaces). Listed in run order.
VARIANTS: dict[str, dict[str, Any]] = {
    "spec": {},  # the config as given
    "no-spec": {"draft": {"method": "none", "model": None}, "cluster": {"num_draft_workers": 0}},
    "pipelined": {
        "draft": {"pipeline": True}
    },  # drafts prepared during verification (specdist/cores/draft_pipeline.py)
    "sequential": {"draft": {"pipeline": False}},  # draft, then verify
    # one speculative group as a Ray Serve replica (cluster/serve.py) against today's deployment behind one
    # coordinator (cluster.replicas unset), the same config otherwise
    "replicas-1": {"cluster": {"enabled": True, "replicas": 1}},
    "deployment": {"cluster": {"enabled": True, "replicas": None}},
}

DEFAULT_CONCURRENCY = "1,4,16"
RATE_LEVEL_REQUESTS = 16
WARMUP_TOKENS = 16  # the untimed request sent to each target (each pass) before its levels
HTTP_TIMEOUT_S = 600.0  # a streamed request: the longest wait for its connection or its next event
_PCTS = (50, 90, 99)


class BenchError(SpecDistError):
    """A bench target failed or a flag is wrong (one line on the command line)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--server", action="append", default=[], metavar="HOST:PORT", help="measure a running gRPC server")
    p.add_argument(
        "--http",
        action="append",
        default=[],
        metavar="URL",
        help="measure a running OpenAI-compatible HTTP server (base URL, e.g. http://127.0.0.1:8000)",
    )
    p.add_argument("--config", default=None, help="start in-process servers from this config (one per --variants)")
    p.add_argument(
        "--protocol",
        choices=("grpc", "http"),
        default="grpc",
        help="with --config: reach the in-process servers over gRPC or the HTTP API",
    )
    p.add_argument(
        "--concurrency",
        default=None,
        help=f"comma-separated closed-loop concurrency levels (default {DEFAULT_CONCURRENCY} "
        "unless --request-rate is given)",
    )
    p.add_argument(
        "--request-rate",
        default=None,
        metavar="R1,R2,..",
        help="comma-separated open-loop Poisson request rates in requests/s (inf: all at once)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the Poisson arrival times")
    p.add_argument(
        "--requests",
        type=int,
        default=0,
        help=f"requests per level (default: max(8, 2 x C); {RATE_LEVEL_REQUESTS} per rate level)",
    )
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--raw", action="store_true", help="send prompts without the chat template")
    p.add_argument(
        "--json",
        default=None,
        help="also write all results to this JSON file (schema specdist.bench.cluster/1: the "
        "docstring of specdist/bench/cluster_bench.py)",
    )
    p.add_argument("--plot", default=None, metavar="PREFIX", help="draw PREFIX-throughput.png and PREFIX-latency.png")
    p.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress bar on stderr (there is none when stderr is not a terminal)",
    )
    p.add_argument("--ray-address", default=None, help="with --config and cluster.enabled: join this Ray cluster")
    p.add_argument(
        "--variants",
        default="spec,no-spec",
        help=f"with --config: which of {','.join(VARIANTS)} to run (pipelined / sequential: draft.pipeline on / off)",
    )
    p.add_argument(
        "--repeat",
        type=int,
        default=1,
        metavar="N",
        help="run every variant N times, the order rotating from pass to pass (a config variant's "
        "server started afresh each time), and pool the passes: this VM's drift spreads over "
        "the variants (default: 1)",
    )
    p.add_argument(
        "--hf-baseline",
        type=int,
        default=0,
        metavar="N",
        help="with --config: also run transformers generate on the same target, one request at a "
        "time, over N of the prompts, and print every level's tokens/s as a multiple of it",
    )


# ---------------------------------------------------------------- load levels
@dataclass(frozen=True)
class Level:
    mode: str  # "concurrency" | "request_rate"
    value: float  # clients, or requests/s (math.inf: all at once)

    @property
    def label(self) -> str:
        if self.mode == "concurrency":
            return f"C={int(self.value)}"
        return "R=inf" if math.isinf(self.value) else f"R={self.value:g}/s"

    def requests(self, given: int) -> int:
        if given:
            return given
        return max(8, 2 * int(self.value)) if self.mode == "concurrency" else RATE_LEVEL_REQUESTS


def parse_levels(concurrency: str | None, request_rate: str | None) -> list[Level]:
    """The load levels of the two flags (module docstring); ValueError naming the flag."""
    if concurrency is None and request_rate is None:
        concurrency = DEFAULT_CONCURRENCY
    levels = []
    for c in flag_items(concurrency, "--concurrency"):
        if not c.isdigit() or int(c) < 1:
            raise ValueError(f"--concurrency: need positive integers, got {concurrency!r}")
        levels.append(Level("concurrency", int(c)))
    for r in flag_items(request_rate, "--request-rate"):
        try:
            rate = float(r)
        except ValueError:
            rate = math.nan
        if not rate > 0:  # also NaN
            raise ValueError(f"--request-rate: need positive requests/s or inf, got {request_rate!r}")
        levels.append(Level("request_rate", rate))
    return levels


def flag_items(flag_value: str | None, flag: str) -> list[str]:
    """The items of a comma-separated flag's value (none without one); ValueError naming the flag on an empty item."""
    if flag_value is None:
        return []
    items = [x.strip() for x in flag_value.split(",")]
    if not any(items) or not all(items):
        raise ValueError(f"{flag}: a comma-separated list without empty items, got {flag_value!r}")
    return items


def poisson_arrivals(n: int, rate: float, seed: int) -> list[float]:
    """Send times (s after the first) of ``n`` requests: exponential gaps of mean 1/rate, first at 0."""
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    times, t = [], 0.0
    for _ in range(n):
        times.append(t)
        t += rng.expovariate(1.0) / rate  # unit-rate draws scaled: every rate reuses the same draws
    return times


# ---------------------------------------------------------------- one request
@dataclass
class RequestTiming:
    ttft: float
    total: float
    tokens: int
    gaps: list[float]
    drafted: int = 0
    accepted: int = 0
    prompt_tokens: int = 0
    pipeline_hits: int = 0  # pipelined drafting: steps with drafts prepared during the previous verification
    pipeline_misses: int = 0

    def record(self) -> dict:
        return {
            "ttft_s": round(self.ttft, 6),
            "e2e_s": round(self.total, 6),
            "tokens": self.tokens,
            "prompt_tokens": self.prompt_tokens,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "pipeline_hits": self.pipeline_hits,
            "pipeline_misses": self.pipeline_misses,
            "itl_s": [round(g, 6) for g in self.gaps],
        }


@dataclass
class RequestSpec:
    prompt: str
    max_tokens: int
    temperature: float
    seed: int
    chat: bool


def grpc_request(address: str, r: RequestSpec) -> RequestTiming:
    from specdist.client import SpecDistClient

    with SpecDistClient(address) as client:
        t0 = time.perf_counter()
        first, last, gaps, tokens, stats = None, None, [], 0, None
        for chunk in client.generate(
            r.prompt,
            max_tokens=r.max_tokens,
            temperature=r.temperature,
            seed=r.seed,
            ignore_eos=True,
            apply_chat_template=r.chat,
        ):
            now = time.perf_counter()
            n = len(chunk.token_ids)
            if n:
                if first is None:
                    first = now
                elif last is not None:
                    gaps.extend([(now - last) / n] * n)
                last = now
                tokens += n
            stats = chunk.stats or stats
        end = time.perf_counter()
    t = RequestTiming((first or end) - t0, end - t0, tokens, gaps)
    if stats is not None:
        t.drafted, t.accepted, t.prompt_tokens = stats.drafted, stats.accepted, stats.prompt_tokens
        t.pipeline_hits, t.pipeline_misses = stats.pipeline_hits, stats.pipeline_misses
    return t


_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # the bench talks to its target directly


def http_base(url: str) -> str:
    """A ``--http`` base URL without its trailing slash (and without a trailing /v1)."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"--http: need a base URL like http://127.0.0.1:8000, got {url!r}")
    base = url.rstrip("/")
    return base[:-3] if base.endswith("/v1") else base


def _http_call(url: str, body: dict | None = None, timeout: float = 30.0):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        return _NO_PROXY.open(req, timeout=timeout)
    except urllib.error.HTTPError as e:
        try:
            msg = json.loads(e.read())["error"]["message"]
        except Exception:  # not an OpenAI-shaped error: the status line says enough
            msg = e.reason
        raise BenchError(f"{url}: HTTP {e.code}: {msg}") from None
    except (urllib.error.URLError, OSError) as e:
        raise BenchError(f"{url}: cannot connect: {getattr(e, 'reason', e)}") from None


def http_request(base: str, r: RequestSpec, model: str | None = None) -> RequestTiming:
    """One streamed completion (chat completion unless raw); see the module docstring for ITL."""
    body: dict[str, Any] = {
        "max_tokens": r.max_tokens,
        "temperature": r.temperature,
        "seed": r.seed,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if model:
        body["model"] = model
    if r.chat:
        body["messages"], path = [{"role": "user", "content": r.prompt}], "/v1/chat/completions"
    else:
        body["prompt"], path = r.prompt, "/v1/completions"
    t0 = time.perf_counter()
    chunk_times, usage, done = [], None, False
    with _http_call(base + path, body, HTTP_TIMEOUT_S) as resp:
        for line in resp:  # Server-Sent Events: "data: {json}" lines and blank separators
            if not line.startswith(b"data:"):
                continue
            now = time.perf_counter()
            data = line[5:].strip()
            if data == b"[DONE]":
                done = True
                break
            event = json.loads(data)
            if "error" in event:
                raise BenchError(f"{base + path}: {event['error'].get('message')}")
            usage = event.get("usage") or usage
            for c in event.get("choices") or ():
                text = c.get("text") if "text" in c else (c.get("delta") or {}).get("content")
                if text or c.get("finish_reason"):  # a final chunk without text may still end tokens
                    chunk_times.append(now)
    end = time.perf_counter()
    if not done:
        raise BenchError(f"{base + path}: the stream ended without data: [DONE]")
    usage = usage or {}
    tokens = usage.get("completion_tokens", len(chunk_times))
    per_chunk = tokens / len(chunk_times) if chunk_times else 1.0
    gaps = [(b - a) / per_chunk for a, b in zip(chunk_times, chunk_times[1:])]
    spec = usage.get("speculative") or {}
    return RequestTiming(
        (chunk_times[0] if chunk_times else end) - t0,
        end - t0,
        tokens,
        gaps,
        spec.get("drafted", 0),
        spec.get("accepted", 0),
        usage.get("prompt_tokens", 0),
        spec.get("pipeline_hits", 0),
        spec.get("pipeline_misses", 0),
    )


def http_server_info(base: str) -> tuple[str | None, dict]:
    """(model id, specdist server info or {}) from ``GET /v1/models``; fails fast when unreachable."""
    with _http_call(base + "/v1/models") as resp:
        cards = json.loads(resp.read()).get("data") or [{}]
    return cards[0].get("id"), cards[0].get("specdist") or {}


# ---------------------------------------------------------------- one level
@dataclass
class LevelResult:
    """One level of one variant; with ``--repeat`` the passes pooled (:meth:`merge`)."""

    variant: str
    level: Level
    requests: int
    wall_s: float
    timings: list[RequestTiming] = field(default_factory=list)
    phase_s: dict = field(default_factory=dict)  # config variants: seconds per phase, and "busy" (phase_seconds)
    steps: int = 0  # config variants: engine steps
    draft_hidden_s: float = 0.0  # pipelined drafting: draft time hidden under verification
    draft_exposed_s: float = 0.0  # draft time steps waited for
    pipelined: bool = False  # the engine reported pipelined drafting (hits or misses)
    pass_rates: list[float] = field(default_factory=list)  # output tokens/s of each pass, in run order

    def __post_init__(self) -> None:
        if not self.pass_rates and self.wall_s:
            self.pass_rates = [sum(t.tokens for t in self.timings) / self.wall_s]

    def merge(self, other: "LevelResult") -> None:
        """Pool another pass of the same variant and level: sums of requests, seconds and phases."""
        self.requests += other.requests
        self.wall_s += other.wall_s
        self.timings += other.timings
        for k, v in other.phase_s.items():
            self.phase_s[k] = self.phase_s.get(k, 0.0) + v
        self.steps += other.steps
        self.draft_hidden_s += other.draft_hidden_s
        self.draft_exposed_s += other.draft_exposed_s
        self.pipelined = self.pipelined or other.pipelined
        self.pass_rates += other.pass_rates

    @property
    def phase_ms_per_step(self) -> dict:
        steps = max(1, self.steps)
        return {k: 1e3 * v / steps for k, v in self.phase_s.items() if k != "busy"}

    @property
    def phase_share(self) -> dict:
        busy = self.phase_s.get("busy", 0.0)
        return {k: v / busy if busy else 0.0 for k, v in self.phase_s.items() if k != "busy"}

    @property
    def draft_overlap(self) -> float | None:
        """Pipelined drafting: draft time hidden under verification / all draft time; else None."""
        if not self.pipelined:
            return None
        total = self.draft_hidden_s + self.draft_exposed_s
        return self.draft_hidden_s / total if total > 0 else 0.0

    def summary(self) -> dict:
        """One entry of the JSON's ``levels`` (module docstring)."""
        lv, ts = self.level, self.timings
        toks = sum(t.tokens for t in ts)
        drafted = sum(t.drafted for t in ts)
        rate = None if lv.mode != "request_rate" else ("inf" if math.isinf(lv.value) else lv.value)
        row = {
            "variant": self.variant,
            "mode": lv.mode,
            "label": lv.label,
            "concurrency": int(lv.value) if lv.mode == "concurrency" else None,
            "request_rate": rate,
            "requests": self.requests,
            "wall_s": self.wall_s,
            "output_tokens": toks,
            "output_tokens_per_s": toks / self.wall_s if self.wall_s else 0.0,
            "request_throughput": len(ts) / self.wall_s if self.wall_s else 0.0,
        }
        series = {
            "ttft": [t.ttft for t in ts],
            "tpot": [(t.total - t.ttft) / (t.tokens - 1) for t in ts if t.tokens > 1],
            "itl": [g for t in ts for g in t.gaps],
            "e2e": [t.total for t in ts],
        }
        for name, xs in series.items():
            xs = sorted(xs)
            row[f"{name}_mean_ms"] = 1e3 * sum(xs) / len(xs) if xs else 0.0
            for q in _PCTS:
                row[f"{name}_p{q}_ms"] = _pct(xs, q) * 1e3
        row["acceptance"] = sum(t.accepted for t in ts) / drafted if drafted else None
        hits, misses = sum(t.pipeline_hits for t in ts), sum(t.pipeline_misses for t in ts)
        row["pipeline_hit_rate"] = hits / (hits + misses) if hits + misses else None
        row["draft_overlap"] = self.draft_overlap
        row["phase_share"] = self.phase_share
        row["phase_ms_per_step"] = self.phase_ms_per_step
        row["passes_output_tokens_per_s"] = list(self.pass_rates)
        row["per_request"] = [t.record() for t in ts]
        return row


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def _stderr_is_tty() -> bool:
    return sys.stderr.isatty()


def progress(total: int, desc: str, enabled: bool, unit: str = "req"):
    """A tqdm bar on stderr (a terminal; in a log file the caller logs a line instead), or None."""
    if not enabled or not _stderr_is_tty():
        return None
    return tqdm_class()(total=total, desc=desc, unit=unit, file=sys.stderr, leave=True, dynamic_ncols=True)


def tqdm_class():
    """tqdm's bar class; a one-line BenchError when tqdm is not installed."""
    try:
        from tqdm import tqdm
    except ImportError:
        raise BenchError("the progress bar needs tqdm: pip install 'specdist[bench]' (or pass --no-progress)") from None
    return tqdm


def run_level(
    send: Callable[[RequestSpec], RequestTiming], variant: str, level: Level, args, log: Callable[[str], None]
) -> LevelResult:
    """``send`` every request of one level (closed or open loop) and time it."""
    n = level.requests(args.requests)
    specs = [
        RequestSpec(PROMPTS[i % len(PROMPTS)], args.max_tokens, args.temperature, 1000 + i, not args.raw)
        for i in range(n)
    ]
    bar = progress(n, f"{variant} {level.label}", not args.no_progress)
    if level.mode == "concurrency":
        workers, arrivals = int(level.value), None
    else:
        workers, arrivals = n, poisson_arrivals(n, level.value, args.seed)
    try:
        with ThreadPoolExecutor(workers) as pool:
            t0 = time.perf_counter()
            futs = []
            for i, spec in enumerate(specs):
                if arrivals is not None:
                    delay = t0 + arrivals[i] - time.perf_counter()
                    if delay > 0:
                        time.sleep(delay)  # open loop: send at the arrival time, whatever is running
                fut = pool.submit(send, spec)
                if bar is not None:
                    fut.add_done_callback(lambda _: bar.update(1))
                futs.append(fut)
            timings = [f.result() for f in futs]
            wall = time.perf_counter() - t0
    finally:
        if bar is not None:
            bar.close()
    if bar is None:
        log(f"  [{variant} {level.label}] {n} requests in {wall:.1f}s")
    return LevelResult(variant, level, n, wall, timings)


# ---------------------------------------------------------------- in-process servers
def apply_overrides(base: dict, overrides: dict) -> dict:
    """``base`` with ``overrides`` deep-merged in (a mapping merges key by key, any other value replaces)."""
    out = dict(base)
    for key, value in overrides.items():
        if isinstance(value, dict):
            below = base.get(key)
            value = apply_overrides(below if isinstance(below, dict) else {}, value)
        out[key] = value
    return out


class InProcessServer:
    """``start_serving`` (gRPC, and the HTTP API with ``http``) over a backend, on a background event loop."""

    def __init__(self, backend, http: bool = False):
        from specdist.api.serving import start_serving

        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        try:
            self.serving = asyncio.run_coroutine_threadsafe(
                start_serving(
                    backend=backend, host="127.0.0.1", port=0, drain_seconds=1, http_port=0 if http else None
                ),
                self.loop,
            ).result(timeout=300)
        except BaseException:
            self._stop_loop()
            raise
        self.engine = backend.engine
        self.coordinator = self.serving.server.coordinator
        # the engine and its step timings are in this process (not in Serve replicas): the per-step breakdown
        self.phases = getattr(backend, "replicas", None) is None
        self.address = self.serving.address
        self.http_base = f"http://{self.serving.http.address}" if http else None

    def close(self) -> None:
        """Stop the servers and the backend (deployment, Ray if ours)."""
        try:
            asyncio.run_coroutine_threadsafe(self.serving.stop(0), self.loop).result(timeout=120)
        finally:
            self._stop_loop()

    def _stop_loop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


def phase_seconds(engine, coordinator) -> dict:
    """Seconds per phase since the stats' last reset, and the coordinator's busy time ("busy"); the
    phases the engine does not report (output bookkeeping, releases, sampling) are "other". See the
    module docstring."""
    ph = dict(engine.stats.phase_s)
    tm = coordinator.timing
    busy = tm.tick_s + tm.gap_s
    parts = {
        "prefill": ph.get("prefill", 0.0),
        "draft": ph.get("draft", 0.0),
        "verify": ph.get("verify", 0.0),
        "network+serialization": ph.get("network", 0.0),
        "scheduling": tm.scheduling_s,
    }
    parts["other"] = max(0.0, busy - sum(parts.values()))
    parts["busy"] = busy
    return parts


# ---------------------------------------------------------------- the command
def check_args(args: argparse.Namespace) -> tuple[list[Level], list[str], list[str]]:
    """(levels, config variants, --http base URLs); ValueError naming the flag, before anything starts."""
    levels = parse_levels(args.concurrency, args.request_rate)
    if not args.server and not args.http and not args.config:
        raise ValueError("--server, --http or --config: say what to measure")
    wanted = [v.strip() for v in args.variants.split(",") if v.strip()]
    if not wanted or set(wanted) - set(VARIANTS):
        raise ValueError(f"--variants: a comma-separated subset of {','.join(VARIANTS)}; got {args.variants!r}")
    if args.requests < 0:
        raise ValueError(f"--requests: must be >= 0 (0: the per-level default), got {args.requests}")
    if args.max_tokens < 1:
        raise ValueError(f"--max-tokens: must be >= 1, got {args.max_tokens}")
    if args.repeat < 1:
        raise ValueError(f"--repeat: must be >= 1, got {args.repeat}")
    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        if path is not None and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
            raise ValueError(f"{flag}: the directory of {path!r} does not exist")
    if not args.no_progress:
        tqdm_class()
    if args.plot is not None:
        from specdist.bench.bench_plot import check_matplotlib

        check_matplotlib()
    if args.config and args.protocol == "http":
        from specdist.api.preflight import check_http_dependencies

        check_http_dependencies()
    return levels, [v for v in VARIANTS if v in wanted], [http_base(u) for u in args.http]


def run(args: argparse.Namespace) -> int:
    levels, variants, bases = check_args(args)
    log = lambda msg: print(msg, file=sys.stderr, flush=True)
    pooled: dict[tuple[str, Level], LevelResult] = {}  # (variant, level) -> its passes pooled

    def measure(name: str, send: Callable[[RequestSpec], RequestTiming], srv: InProcessServer | None = None):
        # one untimed request first: a server's first requests pay for first touches (weights paged in, kernels
        # loaded, allocations), which would fall on whichever level and variant comes first
        send(RequestSpec(PROMPTS[0], min(WARMUP_TOKENS, args.max_tokens), args.temperature, 999, not args.raw))
        for lv in levels:
            if srv is not None and srv.phases:
                srv.engine.stats.reset()
                srv.coordinator.timing.reset()
            res = run_level(send, name, lv, args, log)
            if srv is not None and srv.phases:
                st = srv.engine.stats
                res.phase_s, res.steps = phase_seconds(srv.engine, srv.coordinator), st.steps
                res.draft_hidden_s, res.draft_exposed_s = st.draft_hidden_s, st.phase_s.get("draft", 0.0)
                res.pipelined = bool(st.pipeline_hits or st.pipeline_misses)
            key = (name, lv)
            if key in pooled:
                pooled[key].merge(res)
            else:
                pooled[key] = res

    targets: list[tuple[str, Callable[[], None]]] = []  # (variant, measure it once), in the first pass's order
    described: dict[str, dict] = {}  # variant -> its JSON entry, written once
    if args.server:
        from specdist.client import RemoteError, SpecDistClient
    for address in args.server:
        try:
            with SpecDistClient(address, timeout=30) as c:
                info = asdict(c.server_info())
        except RemoteError as e:
            raise BenchError(f"--server {address}: {e}") from None
        info.pop("counters", None)
        described[address] = _variant(address, "server", "grpc", address, info)
        targets.append((address, lambda a=address: measure(a, lambda r: grpc_request(a, r))))
    for base in bases:
        model, info = http_server_info(base)
        described[base] = _variant(base, "server", "http", base, info)
        targets.append((base, lambda b=base, m=model: measure(b, lambda r: http_request(b, r, m))))
    if args.config:
        from specdist.api.admission import server_info
        from specdist.api.serving import start_backend
        from specdist.config import load_config

        base_cfg = load_config(args.config).to_dict()

        def serve_and_measure(name: str, cfg: dict) -> None:
            where = (
                "the in-process engine"
                if not cfg["cluster"]["enabled"]
                else "a Ray deployment"
                if cfg["cluster"].get("replicas") is None
                else "Ray Serve replicas"
            )
            log(f"starting a server on {where}: {name}")
            srv = InProcessServer(start_backend(cfg, args.ray_address, log=log), http=args.protocol == "http")
            try:
                if name not in described:
                    described[name] = _variant(
                        name, "config", args.protocol, None, server_info(srv.engine), VARIANTS[name], cfg
                    )
                if args.protocol == "http":
                    send = lambda r, b=srv.http_base: http_request(b, r)
                else:
                    send = lambda r, a=srv.address: grpc_request(a, r)
                measure(name, send, srv)
            finally:
                srv.close()

        for name in variants:
            cfg = load_config(apply_overrides(base_cfg, VARIANTS[name])).to_dict()
            targets.append((name, lambda n=name, c=cfg: serve_and_measure(n, c)))
    # --repeat: every variant once per pass, the order rotating by one from pass to pass (a config
    # variant's server starts afresh each pass), so the machine's drift spreads over the variants
    for p in range(args.repeat):
        order = targets[p % len(targets) :] + targets[: p % len(targets)]
        if args.repeat > 1:
            log(f"pass {p + 1}/{args.repeat}: " + ", ".join(name for name, _ in order))
        for _, go in order:
            go()
    results = list(pooled.values())  # the first pass's order: variant by variant, level by level
    doc = {
        "schema": SCHEMA,
        "settings": {
            "max_tokens": args.max_tokens,
            "temperature": args.temperature,
            "raw": args.raw,
            "seed": args.seed,
            "requests": args.requests,
            "concurrency": [int(lv.value) for lv in levels if lv.mode == "concurrency"],
            "request_rate": [
                lv.value if math.isfinite(lv.value) else "inf" for lv in levels if lv.mode == "request_rate"
            ],
            "protocol": args.protocol,
            "repeat": args.repeat,
        },
        "variants": [described[name] for name, _ in targets],
        "levels": [r.summary() for r in results],
        "hf_plain": None,
    }
    if args.config and args.hf_baseline > 0:
        hf = hf_plain_tokens_per_s(args.config, args.hf_baseline, args, log)
        for r in doc["levels"]:
            r["vs_hf_plain"] = r["output_tokens_per_s"] / hf
        doc["hf_plain"] = {"requests": args.hf_baseline, "output_tokens_per_s": hf}
    print(format_table(doc))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1, allow_nan=False)
    if args.plot:
        from specdist.bench.bench_plot import plot_results

        for path in plot_results(doc, args.plot):
            print(f"wrote {path}")
    return 0


def _variant(
    name: str,
    source: str,
    protocol: str,
    address: str | None,
    info: dict,
    overrides: dict | None = None,
    config: dict | None = None,
) -> dict:
    """One entry of the JSON's ``variants`` (module docstring)."""
    return {
        "name": name,
        "source": source,
        "protocol": protocol,
        "address": address,
        "overrides": overrides,
        "config": config,
        "server_info": info,
    }


def hf_plain_tokens_per_s(config, n: int, args, log) -> float:
    """transformers ``generate`` on the config's target, one request at a time (the reference)."""
    import torch

    from specdist.config import load_config
    from specdist.models.loader import gguf_parsed_once, load_model, load_tokenizer, resolve_model

    cfg = load_config(config)
    src = resolve_model(cfg.target.model, "target.model")
    with gguf_parsed_once():
        model = load_model(src, cfg.target.dtype, torch.device("cpu"))
        tok = load_tokenizer(src)
    sample = args.temperature > 0
    kw = dict(do_sample=sample, max_new_tokens=args.max_tokens, min_new_tokens=args.max_tokens, pad_token_id=0)
    if sample:
        kw.update(temperature=args.temperature, top_k=0, top_p=1.0)
    tokens, seconds = 0, 0.0
    for i in range(n + 1):  # the first one warms up and is not counted
        p = PROMPTS[i % len(PROMPTS)]
        ids = (
            tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
            if not args.raw
            else tok.encode(p, add_special_tokens=False)
        )
        ids = list(ids["input_ids"]) if hasattr(ids, "keys") else list(ids)
        x = torch.tensor([ids])
        torch.manual_seed(1000 + i)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(x, attention_mask=torch.ones_like(x), **kw)
        if i:
            seconds += time.perf_counter() - t0
            tokens += out.shape[1] - x.shape[1]
        log(f"  [hf-plain] {i}/{n} done")
    return tokens / seconds


def format_table(doc: dict) -> str:
    s = doc["settings"]
    rows = doc["levels"]
    lines = [
        f"specdist bench cluster: {s['max_tokens']} new tokens per request, temperature {s['temperature']:g}",
        "",
        "| variant | load | requests | req/s | out tok/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | ITL p50 ms "
        "| ITL p99 ms | acceptance | pipeline hits | draft overlap |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def pct(x: float | None) -> str:
        return f"{x:.1%}" if x is not None else "-"

    for r in rows:
        lines.append(
            f"| {r['variant']} | {r['label']} | {r['requests']} | {r['request_throughput']:.2f} "
            f"| {r['output_tokens_per_s']:.1f} | {r['ttft_p50_ms']:.0f} | {r['ttft_p99_ms']:.0f} "
            f"| {r['tpot_p50_ms']:.1f} | {r['itl_p50_ms']:.1f} | {r['itl_p99_ms']:.1f} | {pct(r['acceptance'])} "
            f"| {pct(r['pipeline_hit_rate'])} | {pct(r['draft_overlap'])} |"
        )
    names = list(dict.fromkeys(r["variant"] for r in rows))
    if len(names) > 1:  # each level: the first variant's pooled out tok/s over each other's
        lines += [
            "",
            f"Out tok/s of {names[0]} over each other variant, per level (pooled over "
            f"{s['repeat']} pass{'es' if s['repeat'] > 1 else ''}; each pass in run order):",
            "",
        ]
        first = {r["label"]: r for r in rows if r["variant"] == names[0]}
        for r in rows:
            a = first.get(r["label"])
            if r["variant"] == names[0] or a is None or not r["output_tokens_per_s"]:
                continue
            per = ", ".join(
                f"{x / y:.2f}" for x, y in zip(a["passes_output_tokens_per_s"], r["passes_output_tokens_per_s"])
            )
            lines.append(
                f"- {r['label']}: {names[0]} / {r['variant']} = "
                f"{a['output_tokens_per_s'] / r['output_tokens_per_s']:.2f}x"
                + (f" (passes: {per})" if s["repeat"] > 1 else "")
            )
    hf = doc["hf_plain"]
    if hf is not None:
        lines += [
            "",
            f"transformers generate, one request at a time on the same target ({hf['requests']} requests): "
            f"{hf['output_tokens_per_s']:.1f} tokens/s. Each level as a multiple of it: "
            + ", ".join(f"{r['variant']} {r['label']} {r['vs_hf_plain']:.2f}x" for r in rows),
        ]
    shares = [r for r in rows if r["phase_share"]]
    if shares:
        names = list(shares[0]["phase_ms_per_step"])
        lines += [
            "",
            "Per-step breakdown, ms per step (share of the coordinator's busy time); "
            "orchestration = network+serialization + scheduling:",
            "",
            "| variant | load | " + " | ".join(names) + " | orchestration |",
            "|---|---|" + "---|" * (len(names) + 1),
        ]
        for r in shares:
            ms, sh = r["phase_ms_per_step"], r["phase_share"]
            orch = sh["network+serialization"] + sh["scheduling"]
            lines.append(
                f"| {r['variant']} | {r['label']} | "
                + " | ".join(f"{ms[k]:.1f} ({sh[k]:.1%})" for k in names)
                + f" | {orch:.1%} |"
            )
    return "\n".join(lines)
