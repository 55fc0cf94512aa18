"""``specdist bench tasks``: a Spec-Bench-style suite: per task and draft, acceptance, tokens per step
and speedup over plain decoding, measured side by side in one run.

Tasks (the prompts are data: ``specdist/bench/data/tasks.jsonl``, shipped with the package, one JSON
line per prompt, read by :mod:`specdist.bench.tasks_data`): ``chat`` (open questions),
``code-edit`` (rewrite a given 20-40 line Python function with one change: the answer mostly
repeats the input), ``summarize`` (a text of a few paragraphs), ``qa`` (extractive questions on
a passage) and ``multi-turn`` (answer the last turn of a chat history), 7 prompts each (chat 64 and
code-edit 32, so that 16 clients send distinct prompts: four rounds of chat, two of code editing),
about 140 to 400 tokens once rendered by the default model's chat template. Each prompt goes through the
model's chat template by :func:`specdist.engine.prompts.encode_prompt`, what ``Engine.generate(...,
chat=True)`` does, once before anything is timed (a model without a chat template gets the
conversation as plain ``User: ... Assistant:`` text).

Variants (``--drafts``): one in-process :class:`~specdist.engine.local.Engine` per name, built from
``--config`` with ``draft.method`` set to that name (``none``: no draft); ``METHOD:K`` also sets
``draft.num_speculative_tokens`` to K (``suffix:8,suffix:16`` compares two draft limits in one run).
Any method the config accepts is a variant; a name it refuses is a one-line error before any weight loads. The
config is otherwise kept, except: ``cluster.enabled`` is false (this bench runs in process),
``engine.max_model_len`` is the longest prompt + ``--max-tokens`` + 8 (the KV caches sized to
the work: attention reads only each sequence's own prefix, so this changes no step's cost) and
``engine.max_batch_size`` is at least the largest ``--concurrency``. Every engine is loaded
once, before any measurement, and all stay in memory: the engines share one copy of the
target's weights (``Engine.from_config(..., target=)``), each with its own KV cache.

Load (``--concurrency``, repeatable or comma-separated, default 1): at concurrency C, a task's
prompts are cut into ceil(n / C) batches of C requests (prompt i of batch b is the task's
prompt ``(b * C + i) mod n``: prompts repeat to fill a batch), each submitted at once to the
engine (``Engine.generate``), which runs them as one continuously batched set. C = 1 runs
prompts one at a time. Request i of batch b has seed ``1000 + b * C + i``, in every variant.
A batch ends with its slowest request: while the last ones finish, the engine runs fewer than C
requests, and with speculation the requests' speeds spread (each accepts at its own rate).

Sustained load (``--rounds R``, R > 1): at concurrency C, C clients each send R requests one after
another, a client's next request queued as soon as its previous one ends, so the engine runs C
requests at a time until the last round (what C clients of a server see). One batch of C x R
requests per task: request j is the task's prompt ``j mod n`` with seed ``1000 + j``, sent by
client ``j mod C`` as its ``j // C``-th request (:func:`run_clients`).

Repeated prompts: each pass starts with draft indexes that forgot the finished requests of the
levels and passes before (``DrafterCore.forget_finished``). A request whose prompt the engines were
sent before in its pass (an earlier batch, or the same batch: prompts repeat to fill one) is
counted in ``repeated_prompts`` (the warm-ups' 8 tokens of the first task's first prompt are not
counted). At temperature 0 it produces the same tokens again, and a draft whose index
keeps finished requests (suffix) can copy them, so its acceptance says little about new prompts;
the report says how many there were.

Interleaving: every batch runs on each variant in turn before the next batch starts, and the
order of the variants rotates by one from batch to batch (over all tasks), so slow drift of the
machine (heat, other processes) spreads over the variants instead of falling on one. Before
each concurrency level, every engine runs one untimed warm-up batch (C requests, 8 tokens).
``--repeat N`` runs every batch N times per level (N passes, the order of the variants rotating
from pass to pass too) and pools them: the sums of tokens and seconds. This VM's throughput moves
by 10-20% from one batch to the next, so a single pass of one or two batches says little.

Measured per batch: the wall time of ``generate`` (CUDA synchronised) and, from each request's
own metrics (:class:`~specdist.engine.request.RequestMetrics`), its tokens, verification steps,
drafted and accepted tokens. Reported per task, variant and concurrency, and over all tasks:
acceptance (accepted / drafted), tokens per step (tokens the target emitted per verification
step: accepted drafts + 1), output tokens/s (all the requests' tokens / the batches' wall time:
at C > 1 the aggregate throughput), and the speedup: tokens/s over the ``none`` variant's
tokens/s on the same task and concurrency in the same run. Generation stops at EOS (as in
Spec-Bench) unless ``--ignore-eos``; at temperature 0 (the default) every variant then does
the same work, since exact speculative decoding reproduces the target's greedy tokens (the
report counts the requests whose tokens equal the ``none`` variant's: a forward of another
shape may differ in its last bits and flip a near tie). The wall time includes each request's
prefill, as Spec-Bench's does.

``--json PATH`` writes one object (strict JSON), schema ``specdist.bench.tasks/1``::

    {"schema": "specdist.bench.tasks/1",
     "settings": {"config", "tasks", "drafts", "concurrency": [int], "rounds", "repeat", "max_tokens",
                  "temperature",
                  "ignore_eos", "prompts_per_task" (null: all), "quick", "chat_template",
                  "device", "torch_threads", "max_model_len", "max_batch_size"},
     "variants": [{"name", "config" (the whole config the engine was built from)}],
     "tasks": {name: {"prompts", "prompt_tokens": [int]}},
     "results": [{"concurrency", "task" (a task name, or "all" for all tasks together), "variant",
                  "requests", "tokens", "seconds", "tokens_per_s", "steps", "emitted", "drafted",
                  "accepted", "acceptance" (null: nothing drafted), "tokens_per_step" (emitted / steps),
                  "repeated_prompts" (requests whose prompt the engines were sent before in the same pass),
                  "speedup" (tokens_per_s / the none variant's; null without a none variant),
                  "same_tokens_as_none" (requests whose tokens equal none's; null without none),
                  "phase_s" (the engine's seconds per phase), "batch_s": [float] (task rows),
                  "per_request": [{"prompt", "pass", "batch", "seed", "prompt_tokens", "tokens", "finish_reason",
                                   "steps", "emitted", "drafted", "accepted"}] (task rows)}]}
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field

from specdist.bench.cluster_bench import apply_overrides, flag_items
from specdist.bench.engine_bench import speedup_text, sync_device
from specdist.bench.tasks_data import TASKS

SCHEMA = "specdist.bench.tasks/1"
DEFAULT_DRAFTS = "none,self-w8,ngram"
BASELINE = "none"
ALL = "all"  # the task name of the rows over all tasks
QUICK_PROMPTS, QUICK_TOKENS = 1, 16
WARMUP_TOKENS = 8
SEED_BASE = 1000


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config",
        default=None,
        help="config the engines are built from (default: the built-in defaults); each variant "
        "overrides its draft.method",
    )
    p.add_argument(
        "--drafts",
        default=DEFAULT_DRAFTS,
        help="comma-separated draft methods to compare, each a draft.method the config accepts, "
        "optionally METHOD:K to also set draft.num_speculative_tokens "
        "(none: no draft, the baseline of the speedups)",
    )
    p.add_argument("--tasks", default=",".join(TASKS), help="comma-separated subset of " + ",".join(TASKS))
    p.add_argument("--prompts", type=int, default=0, help="prompts per task (default 0: all of them, 7-64)")
    p.add_argument("--max-tokens", type=int, default=128, help="most new tokens per request")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature, 0 = greedy")
    p.add_argument(
        "--concurrency",
        action="append",
        default=None,
        metavar="C",
        help="requests submitted at once (repeatable or comma-separated; default 1: one at a time)",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="sustained load: C clients each send this many requests back to back, the next as "
        "soon as the last ends (default 1: each batch of C requests submitted at once)",
    )
    p.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="passes over every batch, pooled (each starts with draft indexes that forgot the passes "
        "before): this VM's run-to-run spread averages out",
    )
    p.add_argument(
        "--ignore-eos",
        action="store_true",
        help="generate --max-tokens tokens past EOS too (default: stop at EOS, as Spec-Bench does)",
    )
    p.add_argument(
        "--quick", action="store_true", help=f"smoke run: {QUICK_PROMPTS} prompt per task, {QUICK_TOKENS} new tokens"
    )
    p.add_argument(
        "--json",
        default=None,
        help="also write all results to this JSON file (schema specdist.bench.tasks/1: the docstring "
        "of specdist/bench/tasks.py)",
    )


# ---------------------------------------------------------------- results
@dataclass
class Cell:
    """One task (or all tasks), variant and concurrency: sums over its batches."""

    concurrency: int
    task: str
    variant: str
    requests: int = 0
    tokens: int = 0
    seconds: float = 0.0
    steps: int = 0
    emitted: int = 0
    drafted: int = 0
    accepted: int = 0
    same_tokens_as_none: int = 0
    repeated_prompts: int = 0  # requests whose prompt the engines were sent before in the same pass
    phase_s: dict = field(default_factory=dict)
    batch_s: list = field(default_factory=list)
    per_request: list = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def acceptance(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    @property
    def tokens_per_step(self) -> float:
        return self.emitted / self.steps if self.steps else 0.0

    def add(self, other: "Cell") -> None:
        for name in (
            "requests",
            "tokens",
            "seconds",
            "steps",
            "emitted",
            "drafted",
            "accepted",
            "same_tokens_as_none",
            "repeated_prompts",
        ):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for k, v in other.phase_s.items():
            self.phase_s[k] = self.phase_s.get(k, 0.0) + v


@dataclass
class Plan:
    tasks: list[str]
    drafts: list[str]
    concurrency: list[int]
    prompts: int  # per task
    rounds: int  # > 1: sustained load, C clients each sending this many requests back to back
    repeat: int  # passes over every batch, pooled
    max_tokens: int
    base: dict  # the config, as a full dict


# ---------------------------------------------------------------- setup
def variant_config(base: dict, name: str, **engine) -> dict:
    """``base`` (a full config dict) with the variant ``name`` (``METHOD`` or ``METHOD:K``) as its draft, in
    process, ``engine`` merged in. ValueError when K is not a positive integer."""
    method, _, k = name.partition(":")
    keep_model = method == "model"
    draft = {"method": method, "model": base["draft"].get("model") if keep_model else None}
    if k:
        if not k.isdigit() or int(k) < 1:
            raise ValueError(f"--drafts {name!r}: K in METHOD:K must be a positive integer")
        draft["num_speculative_tokens"] = int(k)
    overrides = {"draft": draft, "cluster": {"enabled": False}}
    if engine:
        overrides["engine"] = engine
    return apply_overrides(base, overrides)


def check_args(args: argparse.Namespace) -> Plan:
    """The run's plan; ValueError naming the flag (ConfigError for the config), before any weight loads."""
    from specdist.config import load_config
    from specdist.cores.proposers import check_draft
    from specdist.errors import ConfigError

    tasks = list(dict.fromkeys(flag_items(args.tasks, "--tasks")))
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        raise ValueError(f"--tasks: unknown task {unknown[0]!r}; choose from {', '.join(TASKS)}")
    drafts = flag_items(args.drafts, "--drafts")
    if len(set(drafts)) != len(drafts):
        raise ValueError(f"--drafts: a draft is named twice in {args.drafts!r}")
    levels: list[int] = []
    for value in args.concurrency or ["1"]:
        for c in flag_items(value, "--concurrency"):
            if not c.isdigit() or int(c) < 1:
                raise ValueError(f"--concurrency: need positive integers, got {value!r}")
            levels.append(int(c))
    levels = list(dict.fromkeys(levels))
    max_tokens, prompts = (QUICK_TOKENS, QUICK_PROMPTS) if args.quick else (args.max_tokens, args.prompts)
    if max_tokens < 1:
        raise ValueError(f"--max-tokens: must be >= 1, got {max_tokens}")
    if prompts < 0:
        raise ValueError(f"--prompts: must be >= 0 (0: all of them), got {prompts}")
    if args.rounds < 1:
        raise ValueError(f"--rounds: must be >= 1, got {args.rounds}")
    if args.repeat < 1:
        raise ValueError(f"--repeat: must be >= 1, got {args.repeat}")
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise ValueError(f"--temperature: must be a finite number >= 0, got {args.temperature}")
    if args.json is not None and not os.path.isdir(os.path.dirname(os.path.abspath(args.json))):
        raise ValueError(f"--json: the directory of {args.json!r} does not exist")
    base = load_config(args.config).to_dict()
    for name in drafts:
        try:
            check_draft(load_config(variant_config(base, name)).draft)
        except ConfigError as e:
            raise ValueError(f"--drafts {name!r}: {e}") from None
    return Plan(tasks, drafts, levels, prompts, args.rounds, args.repeat, max_tokens, base)


def plain_text(conversation: list[dict]) -> str:
    """A conversation for a model without a chat template: ``User: ...`` / ``Assistant: ...`` turns."""
    turns = [f"{m['role'].capitalize()}: {m['content']}" for m in conversation]
    return "\n\n".join(turns + ["Assistant:"])


def encode_tasks(tokenizer, tasks: list[str], n: int) -> tuple[dict[str, list[list[int]]], bool]:
    """({task: prompt token ids}, whether the chat template was used): what generate(chat=True) would encode."""
    from specdist.engine.prompts import encode_prompt
    from specdist.errors import SpecDistError

    if tokenizer is None:
        raise SpecDistError("bench tasks: the target model has no tokenizer (the prompts are text)")
    chat = bool(getattr(tokenizer, "chat_template", None))
    out = {}
    for task in tasks:
        convs = TASKS[task][:n] if n else TASKS[task]
        out[task] = [
            encode_prompt(
                tokenizer, c if chat else plain_text(c), vocab_size=len(tokenizer), max_model_len=1 << 30, chat=chat
            )[1]
            for c in convs
        ]
    return out, chat


def batches(n: int, c: int, rounds: int = 1) -> list[list[int]]:
    """Prompt indices of each batch at concurrency ``c`` over ``n`` prompts; ``rounds`` > 1: the one
    batch of ``c`` clients sending ``rounds`` requests each (module docstring)."""
    if rounds > 1:
        return [[j % n for j in range(c * rounds)]]
    return [[(b * c + i) % n for i in range(c)] for b in range(math.ceil(n / c))]


def run_clients(engine, prompts: list, params: list, clients: int) -> list:
    """``clients`` clients on one engine: request j is client ``j mod clients``'s, which queues it as
    soon as its request j - clients has ended. Outputs in request order; nothing is left running."""
    reqs: list = [None] * len(prompts)  # by request index j, filled as clients send them
    try:
        current = list(range(min(clients, len(prompts))))  # each client's request in flight
        for j in current:
            reqs[j] = engine.add_request(prompts[j], params[j])
        while current:
            engine.step()
            still = []
            for j in current:
                if not reqs[j].finished:
                    still.append(j)
                elif j + clients < len(prompts):  # the client's next request arrives now
                    reqs[j + clients] = engine.add_request(prompts[j + clients], params[j + clients])
                    still.append(j + clients)
            current = still
    finally:  # an exception or interrupt mid-run must not leave requests holding slots
        for r in reqs:
            if r is not None and not r.finished:
                engine.abort(r.request_id)
    return [r.to_output() for r in reqs]


# ---------------------------------------------------------------- the command
def run(args: argparse.Namespace) -> int:
    plan = check_args(args)
    log = lambda msg: print(msg, file=sys.stderr, flush=True)
    import torch

    from specdist.engine.local import Engine
    from specdist.models.devices import device_for
    from specdist.models.loader import gguf_parsed_once
    from specdist.models.metadata import ModelSources
    from specdist.sampling_params import SamplingParams

    engines: dict = {}
    configs: dict[str, dict] = {}
    try:
        with gguf_parsed_once():
            # the models every variant uses (the target; the base's draft model for a model draft), each spec
            # resolved once, as first used, and the tokenizer loaded once
            sources = ModelSources(plan.base["target"]["model"], plan.base["draft"].get("model"))
            tok = sources.tokenizer()
            prompts, chat = encode_tasks(tok, plan.tasks, plan.prompts)
            if not chat:
                log("[bench tasks] the model has no chat template: prompts go in as plain User:/Assistant: text")
            longest = max(len(p) for ps in prompts.values() for p in ps)
            engine_cfg = {
                "max_model_len": longest + plan.max_tokens + 8,
                "max_batch_size": max(plan.base["engine"]["max_batch_size"], *plan.concurrency),
            }
            for name in plan.drafts:
                cfg = variant_config(plan.base, name, **engine_cfg)
                log(f"[bench tasks] building the {name} engine")
                shared = next(iter(engines.values())).target_core.runner.model if engines else None
                engines[name] = Engine.from_config(cfg, target=shared, sources=sources)  # one copy of the target
                configs[name] = engines[name].config.to_dict()
        device = device_for(plan.base["engine"]["device"])
        cells: dict[tuple[int, str, str], Cell] = {}
        for c in plan.concurrency:
            for name in plan.drafts:  # untimed: first calls, allocator, the adaptive policy's cost estimates
                warm = SamplingParams(max_tokens=WARMUP_TOKENS, temperature=args.temperature, seed=0, ignore_eos=True)
                engines[name].generate([prompts[plan.tasks[0]][0]] * c, warm)
            for task in plan.tasks:
                for name in plan.drafts:
                    cells[(c, task, name)] = Cell(c, task, name)
            for rep in range(plan.repeat):
                _run_pass(plan, args, engines, prompts, cells, c, rep, device, log)
    finally:
        for eng in engines.values():
            eng.close()
    doc = _document(args, plan, cells, configs, prompts, chat, str(device), torch.get_num_threads(), engine_cfg)
    print(format_report(doc))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1, allow_nan=False)
    return 0


def _run_pass(plan: Plan, args, engines: dict, prompts: dict, cells: dict, c: int, rep: int, device, log) -> None:
    """One pass over every task's batches at concurrency ``c``, each batch on every variant in turn
    (the order rotating), into ``cells``. It starts with draft indexes that forgot every finished
    request (a pass does not draft from what the levels or passes before generated)."""
    from specdist.sampling_params import SamplingParams

    for eng in engines.values():
        if eng.draft_core is not None:
            eng.draft_core.forget_finished()
    sent: set[tuple[str, int]] = set()  # (task, prompt index) every engine was sent in this pass
    rnd = rep  # the variants' order rotates from batch to batch, and from pass to pass
    for task in plan.tasks:
        ps = prompts[task]
        for b, idx in enumerate(batches(len(ps), c, plan.rounds)):
            params = [
                SamplingParams(
                    max_tokens=plan.max_tokens,
                    temperature=args.temperature,
                    seed=SEED_BASE + b * c + i,
                    ignore_eos=args.ignore_eos,
                )
                for i in range(len(idx))
            ]
            repeated = 0
            for i in idx:
                repeated += (task, i) in sent
                sent.add((task, i))
            for name in plan.drafts:
                cells[(c, task, name)].repeated_prompts += repeated
            order = plan.drafts[rnd % len(plan.drafts) :] + plan.drafts[: rnd % len(plan.drafts)]
            rnd += 1
            outs = {}
            for name in order:
                eng = engines[name]
                eng.stats.reset()
                sync_device(device)
                t0 = time.perf_counter()
                if plan.rounds > 1:
                    outs[name] = run_clients(eng, [ps[i] for i in idx], params, c)
                else:
                    outs[name] = eng.generate([ps[i] for i in idx], params)
                sync_device(device)
                dt = time.perf_counter() - t0
                _record(cells[(c, task, name)], rep, b, idx, params, outs[name], dt, eng.stats.phase_s)
            if BASELINE in outs:
                for name, got in outs.items():
                    cells[(c, task, name)].same_tokens_as_none += sum(
                        o.token_ids == ref.token_ids for o, ref in zip(got, outs[BASELINE])
                    )
        where = f" (pass {rep + 1} of {plan.repeat}, pooled so far)" if plan.repeat > 1 else ""
        log(
            f"[bench tasks] C={c} {task}{where}: "
            + ", ".join(_progress_item(cells[(c, task, n)], cells.get((c, task, BASELINE))) for n in plan.drafts)
        )


def _record(cell: Cell, rep: int, b: int, idx: list[int], params, outs, seconds: float, phase_s: dict) -> None:
    cell.seconds += seconds
    cell.batch_s.append(seconds)
    for k, v in phase_s.items():
        cell.phase_s[k] = cell.phase_s.get(k, 0.0) + v
    for i, (p, sp, o) in enumerate(zip(idx, params, outs)):
        m = o.metrics
        cell.requests += 1
        cell.tokens += len(o.token_ids)
        cell.steps += m.steps
        cell.emitted += m.emitted
        cell.drafted += m.drafted
        cell.accepted += m.accepted
        cell.per_request.append(
            {
                "prompt": p,
                "pass": rep,
                "batch": b,
                "seed": sp.seed,
                "prompt_tokens": len(o.prompt_token_ids),
                "tokens": len(o.token_ids),
                "finish_reason": o.finish_reason,
                "steps": m.steps,
                "emitted": m.emitted,
                "drafted": m.drafted,
                "accepted": m.accepted,
            }
        )


def _progress_item(cell: Cell, base: Cell | None) -> str:
    ratio = speedup_text(cell, base)
    return f"{cell.variant} {cell.tokens_per_s:.1f} tok/s" + ("" if ratio == "-" else f" ({ratio})")


def _row(cell: Cell, base: Cell | None, detail: bool) -> dict:
    row = {
        "concurrency": cell.concurrency,
        "task": cell.task,
        "variant": cell.variant,
        "requests": cell.requests,
        "tokens": cell.tokens,
        "seconds": cell.seconds,
        "tokens_per_s": cell.tokens_per_s,
        "steps": cell.steps,
        "emitted": cell.emitted,
        "drafted": cell.drafted,
        "accepted": cell.accepted,
        "acceptance": cell.acceptance,
        "tokens_per_step": cell.tokens_per_step,
        "speedup": cell.tokens_per_s / base.tokens_per_s if base is not None and base.tokens_per_s else None,
        "same_tokens_as_none": cell.same_tokens_as_none if base is not None else None,
        "repeated_prompts": cell.repeated_prompts,
        "phase_s": dict(cell.phase_s),
    }
    if detail:
        row["batch_s"] = list(cell.batch_s)
        row["per_request"] = list(cell.per_request)
    return row


def _document(
    args, plan: Plan, cells: dict, configs: dict, prompts: dict, chat: bool, device: str, threads: int, engine_cfg: dict
) -> dict:
    results = []
    for c in plan.concurrency:
        totals = {name: Cell(c, ALL, name) for name in plan.drafts}
        for task in plan.tasks:
            for name in plan.drafts:
                cell = cells[(c, task, name)]
                totals[name].add(cell)
                results.append(_row(cell, cells.get((c, task, BASELINE)), detail=True))
        for name in plan.drafts:
            results.append(_row(totals[name], totals.get(BASELINE), detail=False))
    return {
        "schema": SCHEMA,
        "settings": {
            "config": args.config,
            "tasks": plan.tasks,
            "drafts": plan.drafts,
            "concurrency": plan.concurrency,
            "rounds": plan.rounds,
            "repeat": plan.repeat,
            "max_tokens": plan.max_tokens,
            "temperature": args.temperature,
            "ignore_eos": args.ignore_eos,
            "prompts_per_task": plan.prompts or None,
            "quick": args.quick,
            "chat_template": chat,
            "device": device,
            "torch_threads": threads,
            **engine_cfg,
        },
        "variants": [{"name": name, "config": configs[name]} for name in plan.drafts],
        "tasks": {task: {"prompts": len(ps), "prompt_tokens": [len(p) for p in ps]} for task, ps in prompts.items()},
        "results": results,
    }


def format_report(doc: dict) -> str:
    s = doc["settings"]
    base = doc["variants"][0]["config"]
    d = next((v["config"]["draft"] for v in doc["variants"] if v["name"] != BASELINE), base["draft"])
    ks = sorted({v["config"]["draft"]["num_speculative_tokens"] for v in doc["variants"] if v["name"] != BASELINE})
    counts = [t["prompts"] for t in doc["tasks"].values()]
    lo, hi = min(counts), max(counts)
    lines = [
        f"specdist bench tasks: target {base['target']['model']} {base['target']['dtype']} on {s['device']}, "
        f"drafts {', '.join(s['drafts'])} (k={', '.join(map(str, ks)) or d['num_speculative_tokens']}, "
        f"{d['length_policy']}), "
        f"{len(s['tasks'])} tasks x {lo if lo == hi else f'{lo}-{hi}'} prompt{'s' if hi > 1 else ''}, "
        f"up to {s['max_tokens']} new tokens, temperature {s['temperature']:g}, "
        f"{'EOS ignored' if s['ignore_eos'] else 'stops at EOS'}, torch threads {s['torch_threads']}",
    ]
    has_none = any(v["name"] == BASELINE for v in doc["variants"])
    for c in s["concurrency"]:
        rows = [r for r in doc["results"] if r["concurrency"] == c]
        if s.get("rounds", 1) > 1:
            how = (
                f"{c} client{'s' if c > 1 else ''} sending {s['rounds']} requests each back to back, aggregate tokens/s"
            )
        else:
            how = "one request at a time" if c == 1 else f"{c} requests submitted at once, aggregate tokens/s"
        if s.get("repeat", 1) > 1:
            how += f"; {s['repeat']} passes pooled"
        lines += [
            "",
            f"Concurrency {c} ({how}):",
            "",
            "| task | variant | requests | tokens | acceptance | tokens/step | tok/s | speedup vs none |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in rows:
            acc = f"{r['acceptance']:.1%}" if r["acceptance"] is not None else "-"
            speedup = f"{r['speedup']:.2f}x" if r["speedup"] is not None and r["variant"] != BASELINE else "-"
            task = "all tasks" if r["task"] == ALL else r["task"]
            lines.append(
                f"| {task} | {r['variant']} | {r['requests']} | {r['tokens']} | {acc} "
                f"| {r['tokens_per_step']:.2f} | {r['tokens_per_s']:.1f} | {speedup} |"
            )
        if has_none and s["temperature"] == 0:
            same = [r for r in rows if r["task"] == ALL and r["variant"] != BASELINE]
            if same:
                lines.append(
                    "Greedy, same tokens as none: "
                    + ", ".join(f"{r['variant']} {r['same_tokens_as_none']}/{r['requests']}" for r in same)
                )
        total = next((r for r in rows if r["task"] == ALL), None)
        if total is not None and total.get("repeated_prompts") and s["temperature"] == 0:
            lines.append(
                f"{total['repeated_prompts']} of {total['requests']} requests repeat a prompt the engines "
                "were sent before in the same pass: at temperature 0 their output is the same as before, "
                "and a draft that indexes finished requests (suffix) can copy it"
            )
    if not has_none:
        lines += ["", "(no 'none' variant in --drafts: no speedups)"]
    return "\n".join(lines)
