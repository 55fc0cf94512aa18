"""``specdist bench engine``: batch-1 decoding, four systems side by side in one run.

Systems (same target, same prompts, same sampling settings, same token count), once per
``--dtype`` (several dtypes: every system in each, side by side in one report):
- ``hf-plain``     transformers ``generate`` (target only)
- ``hf-assisted``  transformers assisted generation; the assistant is the ``--draft model`` draft,
                   else the target's int8 copy (the ``self-w8`` draft)
- ``hf-lookup``    transformers prompt-lookup decoding (``prompt_lookup_num_tokens``)
- ``engine-target`` this engine, target only
- ``engine-spec``  this engine, speculative with the draft
Every request produces exactly ``--max-tokens`` tokens (EOS ignored / suppressed) so
throughputs compare equal work. The analytical prediction uses the measured
acceptance rate and the measured per-step costs of this very run.

Interleaving: after one short warm-up request per system, each prompt runs on every system in turn
before the next prompt starts, the systems' order rotating by one from prompt to prompt, so the
machine's drift (a shared machine's speed can move by tens of percent within minutes) spreads over the systems instead
of falling on whichever ran last. ``--repeat N`` makes N such passes over the prompts and pools them
(the sums of tokens and seconds).
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from dataclasses import dataclass, field

from specdist.config import COMPILE_MODES, DTYPES, LENGTH_POLICIES

PROMPTS = [
    "Explain gravity to a ten-year-old.",
    "Write a short poem about the sea.",
    "What are three tips for staying productive when working from home?",
    "Describe how a bicycle works.",
    "Summarize the water cycle in a few sentences.",
    "Give me a recipe for a simple tomato pasta.",
    "Why is the sky blue?",
    "Write a friendly email inviting a colleague to lunch.",
    "What is the difference between a virus and a bacterium?",
    "List some interesting facts about octopuses.",
]
SYSTEMS = ("hf-plain", "hf-assisted", "hf-lookup", "engine-target", "engine-spec")
HF_SPECULATIVE = ("hf-assisted", "hf-lookup")  # transformers' speculative options: "best hf" is the faster


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m-instruct", help="target model spec (built-in name, dir, .gguf)")
    p.add_argument(
        "--draft",
        default="self-w8",
        help="draft method (a draft.method: model, self-w8, self-w4, ngram, suffix, hybrid, eagle3, ...)",
    )
    p.add_argument(
        "--weights",
        default="float",
        choices=("float", "native"),
        help="the target's weights (target.weights); transformers' systems always run the floats",
    )
    p.add_argument(
        "--draft-model",
        default=None,
        help="--draft model: the draft model (same vocabulary); --draft eagle3: the head's directory",
    )
    p.add_argument(
        "--dtype",
        default="float32",
        help="comma-separated model dtypes, each of float32, bfloat16, float16, auto (target and draft)",
    )
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or auto")
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens for engine-spec")
    p.add_argument(
        "--compile",
        choices=COMPILE_MODES,
        default="auto",
        help="engine.compile of the specdist engines (compiled static-shape passes)",
    )
    p.add_argument(
        "--length-policy",
        choices=LENGTH_POLICIES,
        default="fixed",
        help="engine-spec draft lengths (fixed: k every step, what the analytical prediction assumes)",
    )
    p.add_argument("--prompts", type=int, default=8, help=f"how many chat prompts (max {len(PROMPTS)})")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperatures", default="0,0.8", help="comma-separated; 0 = greedy")
    p.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated subset of " + ",".join(SYSTEMS))
    p.add_argument("--repeat", type=int, default=1, help="passes over the prompts, pooled (each interleaved)")
    p.add_argument("--quick", action="store_true", help="smoke run: 2 prompts, 24 tokens")
    p.add_argument("--json", default=None, help="also write all results to this JSON file")


@dataclass
class Result:
    system: str
    temperature: float
    dtype: str = "float32"
    tokens: int = 0
    seconds: float = 0.0
    drafted: int = 0
    accepted: int = 0
    steps: int = 0
    phase_s: dict = field(default_factory=dict)
    peak_rss_mb: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def run(args: argparse.Namespace) -> int:
    import torch  # noqa: F401  (heavy: loaded only when the benchmark runs)

    from specdist.config import load_config
    from specdist.engine.local import Engine
    from specdist.models.devices import device_for
    from specdist.models.dtypes import resolve_dtype
    from specdist.models.fusion import quantized_copy, unfused_copy
    from specdist.models.loader import load_model, load_tokenizer, resolve_model
    from specdist.models.native import self_draft, use_native_blocks

    if args.quick:
        args.prompts, args.max_tokens = 2, 24
    if args.repeat < 1:
        raise ValueError(f"--repeat: must be >= 1, got {args.repeat}")
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    for s in systems:
        if s not in SYSTEMS:
            raise ValueError(f"--systems: unknown system {s!r}; choose from {', '.join(SYSTEMS)}")
    from specdist.cores.proposers import proposer_class, proposer_methods

    if args.draft not in proposer_methods():
        raise ValueError(f"--draft: unknown draft method {args.draft!r}; choose from {', '.join(proposer_methods())}")
    method = proposer_class(args.draft)
    if method.reads_draft_model != (args.draft_model is not None):
        readers = [m for m in proposer_methods() if proposer_class(m).reads_draft_model]
        raise ValueError(f"--draft-model: needed with --draft {' or '.join(readers)}, and only then")
    device = device_for(args.device)
    dtypes = [d.strip() for d in args.dtype.split(",") if d.strip()]
    for d in dtypes:
        if d not in DTYPES:
            raise ValueError(f"--dtype: unknown dtype {d!r}; choose from {', '.join(DTYPES)}")
    dtypes = list(dict.fromkeys(resolve_dtype(d, device) for d in dtypes))  # auto: this device's choice
    temps = [float(t) for t in args.temperatures.split(",")]
    n_prompts = max(1, min(args.prompts, len(PROMPTS)))
    log = lambda msg: print(msg, file=sys.stderr, flush=True)

    src = resolve_model(args.model, "--model")
    tok = load_tokenizer(src)
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": p}], tokenize=True, add_generation_prompt=True)
        for p in PROMPTS[:n_prompts]
    ]
    prompts = [list(p["input_ids"]) if isinstance(p, dict) or hasattr(p, "keys") else list(p) for p in prompts]
    max_len = max(len(p) for p in prompts) + args.max_tokens + 8
    results: list[Result] = []
    kv_lines: list[str] = []
    for dtype in dtypes:
        log(f"loading {args.model} ({dtype}, {device}) and the {args.draft} draft ...")
        hf_target = load_model(src, dtype, device)  # transformers' systems: the float weights
        target = hf_target
        if args.weights == "native" and src.gguf_path:
            target = unfused_copy(hf_target)
            use_native_blocks(target, src.gguf_path)
        if method.target_copy(args.draft):  # the engine's own copy, of the native target where it runs on blocks
            draft_model = self_draft(target, method.target_copy(args.draft), src.gguf_path)
        elif args.draft == "model":
            draft_model = load_model(resolve_model(args.draft_model, "--draft-model"), dtype, device)
        elif method.reads_draft_model:  # a head, as the engine loads it (int8 linears on x86 CPUs)
            from specdist.config import DraftConfig
            from specdist.cores.draft import load_draft_model
            from specdist.models.metadata import ModelSources

            draft_model = load_draft_model(
                DraftConfig(method=args.draft, model=args.draft_model),
                ModelSources(args.model, args.draft_model),
                dtype,
                device,
                target=target,
            )
        else:
            draft_model = None
        assistant = draft_model if args.draft == "model" else quantized_copy(hf_target)
        base = {
            "target": {"model": args.model, "dtype": dtype, "weights": args.weights},
            "engine": {"max_model_len": max_len, "max_batch_size": 1, "device": str(device), "compile": args.compile},
        }
        draft_cfg = {
            "method": args.draft,
            "num_speculative_tokens": args.k,
            "length_policy": args.length_policy,
            "dtype": dtype,
        }
        if method.reads_draft_model:
            draft_cfg["model"] = args.draft_model
        engines = {
            "engine-target": Engine(load_config({**base, "draft": {"method": "none"}}), target, tok),
            "engine-spec": Engine(load_config({**base, "draft": draft_cfg}), target, tok, draft_model),
        }
        for temp in temps:
            runs = {system: Result(system, temp, dtype) for system in systems}
            for system in systems:  # warm-up: one short request each, not counted
                _run_one(system, None, prompts[0], 0, 8, temp, hf_target, assistant, engines)
            order = list(systems)
            for rep in range(args.repeat):
                for i, ids in enumerate(prompts):  # every system on this prompt, in rotating order
                    log(f"[T={temp} pass {rep + 1}/{args.repeat}] prompt {i + 1}/{len(prompts)}: {', '.join(order)}")
                    for system in order:
                        _run_one(system, runs[system], ids, i, args.max_tokens, temp, hf_target, assistant, engines)
                    order = order[1:] + order[:1]
            for system in systems:
                res = runs[system]
                res.peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
                results.append(res)
                log(f"  {dtype:8s} {system:14s} T={temp:<4} {res.tokens_per_s:6.1f} tok/s")
        kv_lines.append(_kv_line(engines["engine-spec"], dtype))
        del engines, target, hf_target, draft_model, assistant

    print(format_report(results, args, kv_lines))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([r.__dict__ | {"tokens_per_s": r.tokens_per_s} for r in results], f, indent=1)
    return 0


def _kv_line(spec_engine, dtype: str) -> str:
    kv = spec_engine.target_core.cache.bytes_per_token
    draft_cache = getattr(spec_engine.draft_core, "cache", None)
    return f"KV cache ({dtype}): {kv} B/token target" + (
        f", {draft_cache.bytes_per_token} B/token draft" if draft_cache is not None else ""
    )


def sync_device(device) -> None:
    """Wait for the device, so a timer stops after the work (a CUDA call returns before it)."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _run_one(system, res, ids, i, n_new, temp, target, draft_model, engines) -> None:
    """Prompt ``ids`` (index ``i``: its seed) on one system for ``n_new`` tokens, added into ``res``
    (None: a warm-up, not counted)."""
    import torch

    from specdist.sampling_params import SamplingParams

    torch.manual_seed(1000 + i)
    if system.startswith("hf"):
        x = torch.tensor([ids], device=target.device)
        kw = dict(max_new_tokens=n_new, min_new_tokens=n_new, do_sample=temp > 0, top_k=0, top_p=1.0)
        if temp > 0:
            kw["temperature"] = temp
        if system == "hf-assisted":
            kw["assistant_model"] = draft_model
        elif system == "hf-lookup":
            kw["prompt_lookup_num_tokens"] = 10  # transformers' documented default
        sync_device(target.device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = target.generate(x, attention_mask=torch.ones_like(x), pad_token_id=0, **kw)
        sync_device(target.device)
        dt = time.perf_counter() - t0
        n = out.shape[1] - len(ids)
    else:
        eng = engines[system]
        eng.stats.reset()
        sp = SamplingParams(max_tokens=n_new, temperature=temp, seed=1000 + i, ignore_eos=True)
        t0 = time.perf_counter()
        o = eng.generate([ids], sp)[0]
        dt = time.perf_counter() - t0
        n = len(o.token_ids)
        if res is not None:
            res.drafted += o.metrics.drafted
            res.accepted += o.metrics.accepted
            res.steps += o.metrics.steps
            for k, v in eng.stats.phase_s.items():
                res.phase_s[k] = res.phase_s.get(k, 0.0) + v
    if res is not None:
        res.tokens += n
        res.seconds += dt


def format_report(results: list[Result], args, kv_lines: list[str]) -> str:
    import torch

    from specdist.engine.cost_model import expected_tokens

    dtypes = list(dict.fromkeys(r.dtype for r in results))
    draft = args.draft + (f" {args.draft_model}" if args.draft_model else "")
    lines = [
        f"specdist bench engine: target {args.model} {', '.join(dtypes)} on {args.device}, draft {draft}, "
        f"k={args.k}, batch 1, {min(args.prompts, len(PROMPTS))} prompts x {args.max_tokens} new tokens, "
        f"{args.repeat} pass(es), systems interleaved per prompt, torch threads {torch.get_num_threads()}",
        "",
        f"| dtype | T | system | tok/s | vs hf-plain | vs best hf speculative | vs {dtypes[0] if dtypes else '-'} "
        "| acceptance | tokens/step | peak RSS MB |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    by = {(r.dtype, r.system, r.temperature): r for r in results}
    for r in results:
        plain = by.get((r.dtype, "hf-plain", r.temperature))
        hf_spec = [by[key] for key in ((r.dtype, s_, r.temperature) for s_ in HF_SPECULATIVE) if key in by]
        assisted = max(hf_spec, key=lambda x: x.tokens_per_s, default=None)
        first = by.get((dtypes[0], r.system, r.temperature))
        acc = f"{r.accepted / r.drafted:.1%}" if r.drafted else "-"
        tps = f"{r.tokens / r.steps:.2f}" if r.steps else "-"
        lines.append(
            f"| {r.dtype} | {r.temperature:g} | {r.system} | {r.tokens_per_s:.1f} | {speedup_text(r, plain)} "
            f"| {speedup_text(r, assisted)} | {speedup_text(r, first)} | {acc} | {tps} | {r.peak_rss_mb:.0f} |"
        )
    if len(dtypes) > 1:
        lines.append("(peak RSS is the process's so far: a later dtype's rows include the earlier ones' peak)")
    lines.append("")
    for r in results:
        if r.system != "engine-spec" or not r.steps:
            continue
        ph = r.phase_s
        alpha = r.accepted / r.drafted if r.drafted else 0.0
        k = args.k
        t_verify = ph.get("verify", 0) / r.steps
        t_draft_tok = ph.get("draft", 0) / max(r.drafted, 1)
        t_over = (ph.get("sampling", 0) + ph.get("cache", 0) + ph.get("output", 0)) / r.steps
        el = expected_tokens(min(alpha, 1.0), k)
        # Toy model with measured costs: tokens / (prefill + (tokens / E[L]) * step cost).
        step_cost = t_verify + k * t_draft_tok + t_over
        predicted = r.tokens / (ph.get("prefill", 0.0) + r.tokens / el * step_cost)
        total = sum(ph.values()) or 1.0
        lines.append(
            f"{r.dtype} T={r.temperature:g} engine-spec per step: verify {t_verify * 1e3:.1f} ms, "
            f"draft {t_draft_tok * 1e3:.1f} ms/token, "
            f"sampling+cache+output {t_over * 1e3:.1f} ms; phase shares "
            + ", ".join(f"{k_}: {v / total:.1%}" for k_, v in ph.items())
        )
        lines.append(
            f"{r.dtype} T={r.temperature:g} analytical (alpha={alpha:.3f}, k={k}): E[L]={el:.2f} "
            f"(measured {r.tokens / r.steps:.2f} tokens/step), "
            f"predicted {predicted:.1f} tok/s, measured {r.tokens_per_s:.1f} "
            f"= {r.tokens_per_s / predicted:.0%} of prediction"
        )
    lines += kv_lines
    return "\n".join(lines)


def speedup_text(r: Result, ref: Result | None) -> str:
    """r's tokens/s over the reference's, as a table cell ("-" without a reference, or for the reference itself)."""
    if ref is None or ref is r or not ref.tokens_per_s:
        return "-"
    return f"{r.tokens_per_s / ref.tokens_per_s:.2f}x"
