"""``specdist bench cluster``: concurrent gRPC streams against a server, speculation on and off.

For every server variant and every concurrency level C, ``requests`` streaming
``Generate`` calls run through C client threads (closed loop: a thread starts its next
request when the previous one ends). Per request we record the time to first token
(TTFT), the time per output token after the first (TPOT) and every inter-token gap
(ITL: the gap between two response messages, divided evenly over the tokens the later
one carried); per level, output tokens/s over the level's wall time and the acceptance
rate from the servers' own per-request stats.

Variants: ``--server HOST:PORT`` (repeatable) measures running servers; ``--config C``
starts servers one after another from C as given ("spec") and from C with
``draft.method: none`` ("no-spec"): the single-process engine when ``cluster.enabled`` is
false, else the whole Ray deployment (tensor-parallel target and draft workers over gRPC,
local Ray cluster or ``--ray-address``), with the same gRPC server and coordinator in
front. For these it also prints the per-step breakdown, in ms per step and as shares of
the coordinator's busy time: prefill, draft, verify (worker compute), network +
serialization (RPC wall time minus the worker's reported compute), scheduling (the
coordinator's own work between and around steps) and the rest (output bookkeeping,
releases, sampling). Orchestration overhead = network + serialization + scheduling.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from specdist.bench.engine_bench import PROMPTS


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--server", action="append", default=[], metavar="HOST:PORT", help="measure a running server")
    p.add_argument("--config", default=None, help="start in-process servers from this config (spec and no-spec)")
    p.add_argument("--concurrency", default="1,4,16", help="comma-separated concurrency levels")
    p.add_argument("--requests", type=int, default=0, help="requests per level (default: max(8, 2 x concurrency))")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--raw", action="store_true", help="send prompts without the chat template")
    p.add_argument("--json", default=None, help="also write all results to this JSON file")
    p.add_argument("--ray-address", default=None, help="with --config and cluster.enabled: join this Ray cluster")
    p.add_argument("--variants", default="spec,no-spec", help="with --config: which of spec,no-spec to run")
    p.add_argument("--hf-baseline", type=int, default=0, metavar="N",
                   help="with --config: also run transformers generate on the same target, one request at a "
                        "time, over N of the prompts, and print every level's tokens/s as a multiple of it")


@dataclass
class RequestTiming:
    ttft: float
    total: float
    tokens: int
    gaps: list[float]
    drafted: int = 0
    accepted: int = 0


@dataclass
class LevelResult:
    variant: str
    concurrency: int
    requests: int
    wall_s: float
    timings: list[RequestTiming] = field(default_factory=list)
    phase_share: dict = field(default_factory=dict)
    phase_ms_per_step: dict = field(default_factory=dict)

    def summary(self) -> dict:
        toks = sum(t.tokens for t in self.timings)
        gaps = sorted(g for t in self.timings for g in t.gaps)
        ttft = sorted(t.ttft for t in self.timings)
        tpot = sorted((t.total - t.ttft) / (t.tokens - 1) for t in self.timings if t.tokens > 1)
        drafted = sum(t.drafted for t in self.timings)
        return {
            "variant": self.variant,
            "concurrency": self.concurrency,
            "requests": self.requests,
            "output_tokens_per_s": toks / self.wall_s if self.wall_s else 0.0,
            "ttft_p50_ms": _pct(ttft, 50) * 1e3,
            "ttft_p99_ms": _pct(ttft, 99) * 1e3,
            "tpot_p50_ms": _pct(tpot, 50) * 1e3,
            "itl_p50_ms": _pct(gaps, 50) * 1e3,
            "itl_p99_ms": _pct(gaps, 99) * 1e3,
            "acceptance": sum(t.accepted for t in self.timings) / drafted if drafted else None,
            "phase_share": self.phase_share,
            "phase_ms_per_step": self.phase_ms_per_step,
        }


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def one_request(address: str, prompt: str, max_tokens: int, temperature: float, seed: int, chat: bool) -> RequestTiming:
    from specdist.client import SpecDistClient

    with SpecDistClient(address) as client:
        t0 = time.perf_counter()
        first, last, gaps, tokens, stats = None, None, [], 0, None
        for chunk in client.generate(prompt, max_tokens=max_tokens, temperature=temperature, seed=seed,
                                     ignore_eos=True, apply_chat_template=chat):
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
        t.drafted, t.accepted = stats.drafted, stats.accepted
    return t


def run_level(address: str, variant: str, concurrency: int, requests: int, args, log) -> LevelResult:
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(requests)]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        futs = [pool.submit(one_request, address, p, args.max_tokens, args.temperature, 1000 + i, not args.raw)
                for i, p in enumerate(prompts)]
        timings = []
        for i, f in enumerate(futs):
            timings.append(f.result())
            log(f"  [{variant} C={concurrency}] {i + 1}/{requests} done")
    return LevelResult(variant, concurrency, requests, time.perf_counter() - t0, timings)


class InProcessServer:
    """A ``specdist.server.serve`` instance on a background event loop (free port)."""

    def __init__(self, engine, backend=None):
        self.engine = engine
        self.backend = backend  # a serve_cli.Backend (Ray deployment) closed with the server
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        from specdist.server import serve

        self.server, self.coordinator = asyncio.run_coroutine_threadsafe(
            serve(engine, "127.0.0.1", 0), self.loop
        ).result(timeout=300)
        self.address = f"127.0.0.1:{self.server.port}"

    def close(self) -> None:
        try:
            asyncio.run_coroutine_threadsafe(self.server.stop(0), self.loop).result(timeout=60)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=10)
        finally:
            if self.backend is not None:
                self.backend.close()


def breakdown(engine, coordinator, steps: int) -> tuple[dict, dict]:
    """(ms per step, share of busy time) per phase; see the module docstring."""
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
    steps = max(1, steps)
    return ({k: 1e3 * v / steps for k, v in parts.items()},
            {k: v / busy if busy else 0.0 for k, v in parts.items()})


def run(args: argparse.Namespace) -> int:
    levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    if not levels or min(levels) < 1:
        raise ValueError(f"--concurrency: need positive integers, got {args.concurrency!r}")
    if not args.server and not args.config:
        raise ValueError("--server or --config: say what to measure")
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    results: list[LevelResult] = []
    for address in args.server:
        for c in levels:
            n = args.requests or max(8, 2 * c)
            results.append(run_level(address, address, c, n, args, log))
    if args.config:
        from specdist.config import load_config
        from specdist.serve_cli import start_backend

        base = load_config(args.config).to_dict()
        off = {**base, "draft": {**base["draft"], "method": "none", "model": None}}
        if base["cluster"]["enabled"]:
            off["cluster"] = {**base["cluster"], "num_draft_workers": 0}
        wanted = [v.strip() for v in args.variants.split(",") if v.strip()]
        if not wanted or set(wanted) - {"spec", "no-spec"}:
            raise ValueError(f"--variants: a comma-separated subset of spec,no-spec; got {args.variants!r}")
        for variant, cfg in (("spec", base), ("no-spec", off)):
            if variant not in wanted:
                continue
            where = "a Ray deployment" if cfg["cluster"]["enabled"] else "the in-process engine"
            log(f"starting a server on {where}: {variant}")
            backend = start_backend(cfg, args.ray_address, log=log)
            srv = InProcessServer(backend.engine, backend)
            try:
                for c in levels:
                    n = args.requests or max(8, 2 * c)
                    srv.engine.stats.reset()
                    srv.coordinator.timing.reset()
                    res = run_level(srv.address, variant, c, n, args, log)
                    res.phase_ms_per_step, res.phase_share = breakdown(
                        srv.engine, srv.coordinator, srv.engine.stats.steps)
                    results.append(res)
            finally:
                srv.close()
    rows = [r.summary() for r in results]
    if args.config and args.hf_baseline > 0:
        hf = hf_plain_tokens_per_s(args.config, args.hf_baseline, args, log)
        for r in rows:
            r["vs_hf_plain"] = r["output_tokens_per_s"] / hf
        rows.append({"variant": "hf-plain", "concurrency": 1, "requests": args.hf_baseline,
                     "output_tokens_per_s": hf})
    print(format_table(rows, args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


def hf_plain_tokens_per_s(config, n: int, args, log) -> float:
    """transformers ``generate`` on the config's target, one request at a time (the reference)."""
    import torch

    from specdist.config import load_config
    from specdist.models.loader import load_model, load_tokenizer, resolve_model

    cfg = load_config(config)
    src = resolve_model(cfg.target.model, "target.model")
    model = load_model(src, cfg.target.dtype, torch.device("cpu"))
    tok = load_tokenizer(src)
    sample = args.temperature > 0
    kw = dict(do_sample=sample, max_new_tokens=args.max_tokens, min_new_tokens=args.max_tokens, pad_token_id=0)
    if sample:
        kw.update(temperature=args.temperature, top_k=0, top_p=1.0)
    tokens, seconds = 0, 0.0
    for i in range(n + 1):  # the first one warms up and is not counted
        p = PROMPTS[i % len(PROMPTS)]
        ids = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True) if not args.raw \
            else tok.encode(p, add_special_tokens=False)
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


def format_table(rows: list[dict], args) -> str:
    lines = [
        f"specdist bench cluster: {args.max_tokens} new tokens per request, temperature {args.temperature:g}",
        "",
        "| variant | C | requests | out tok/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | ITL p50 ms | ITL p99 ms | acceptance |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    hf = next((r for r in rows if r["variant"] == "hf-plain"), None)
    rows = [r for r in rows if r is not hf]
    for r in rows:
        acc = f"{r['acceptance']:.1%}" if r["acceptance"] is not None else "-"
        lines.append(
            f"| {r['variant']} | {r['concurrency']} | {r['requests']} | {r['output_tokens_per_s']:.1f} "
            f"| {r['ttft_p50_ms']:.0f} | {r['ttft_p99_ms']:.0f} | {r['tpot_p50_ms']:.1f} | {r['itl_p50_ms']:.1f} "
            f"| {r['itl_p99_ms']:.1f} | {acc} |"
        )
    if hf is not None:
        lines += ["", f"transformers generate, one request at a time on the same target ({hf['requests']} requests): "
                      f"{hf['output_tokens_per_s']:.1f} tokens/s. Each level as a multiple of it: " + ", ".join(
                          f"{r['variant']} C={r['concurrency']} {r['vs_hf_plain']:.2f}x" for r in rows)]
    shares = [r for r in rows if r["phase_share"]]
    if shares:
        names = list(shares[0]["phase_ms_per_step"])
        lines += ["", "Per-step breakdown, ms per step (share of the coordinator's busy time); "
                      "orchestration = network+serialization + scheduling:", "",
                  "| variant | C | " + " | ".join(names) + " | orchestration |",
                  "|---|---|" + "---|" * (len(names) + 1)]
        for r in shares:
            ms, sh = r["phase_ms_per_step"], r["phase_share"]
            orch = sh["network+serialization"] + sh["scheduling"]
            lines.append(f"| {r['variant']} | {r['concurrency']} | " + " | ".join(
                f"{ms[k]:.1f} ({sh[k]:.1%})" for k in names) + f" | {orch:.1%} |")
    return "\n".join(lines)
