"""Deployment config: YAML file or dict, validated at load.

Every unknown key and every bad value is a one-line :class:`ConfigError` naming
the dotted key (``draft.method``), so a typo never silently falls back to a default. The draft
methods sit above the config: their names and their own ``draft.`` keys are checked by
:func:`specdist.cores.proposers.check_draft` (the same errors), which serving calls next.

Shape::

    target:
      model: smollm2-135m-instruct   # built-in name, local HF model directory, or a .gguf file
      dtype: float32                 # float32 | bfloat16 | float16 | auto: weights, activations and KV cache;
                                     #   auto = bfloat16 on CUDA GPUs that run it natively, float16 on other
                                     #   CUDA GPUs, on the CPU the measured choice (specdist.models.dtypes)
      weights: auto                  # native: a GGUF file's Q4_0/1, Q5_0/1, Q8_0 and Q3_K to Q6_K linears run
                                     #   on their own blocks (specdist/models/native.py), not de-quantized;
                                     #   float: every weight in dtype; auto: native for a GGUF file (each
                                     #   tensor-parallel rank its part of the blocks), float otherwise
    draft:
      method: self-w8                # model | self-w8 | self-w4 | ngram | suffix | hybrid | eagle3 | none (self-w4:
                                     #   the target's own 4-bit copy, a GGUF file's own blocks where it is one;
                                     #   hybrid: self-w8 and the suffix index, the suffix draft when confident;
                                     #   eagle3: an EAGLE-3 head reading the target's hidden states)
      model: null                    # method model: a local HF causal LM with the target's vocabulary;
                                     #   eagle3: a head directory in the published EAGLE-3 layout
      dtype: float32                 # as target.dtype, for method model; self-w8 (the target's own int8
                                     #   copy) runs in target.dtype; q is float32 and fp16-exact in any dtype
      num_speculative_tokens: 4      # draft length k (the maximum under adaptive or confidence_threshold > 0)
      length_policy: adaptive        # adaptive: per request and step, from its observed acceptance and the
                                     #   measured step costs, down to 0 under load (specdist/engine/draft_length.py)
                                     #   | fixed: every request drafts k (seeded runs reproduce token for token)
      confidence_threshold: 0.0      # model drafts: stop a draft early once q(token) < this; 0 = fixed k
      q_top_k: 0                     # rejection coupling: model drafts sample from q's top q_top_k tokens only
                                     #   (q renormalised over them, and only they travel); 0: all
      # from ngram_min to suffix_min_score: the methods' own keys (any other draft.<key> too); the loader keeps
      # them in DraftConfig.settings and the method checks them (specdist.cores.proposers.check_draft)
      ngram_min: 1                   # n-gram (prompt lookup) match lengths tried, longest first
      ngram_max: 3
      suffix_max_depth: 24           # suffix / hybrid (SuffixDecoding, specdist/cores/suffix_index.py): longest
                                     #   substring counted in the index of every request's prompt and output
      suffix_min_prob: 0.1           # a suffix draft stops before its path probability (product of the
                                     #   continuation frequencies) falls below this
      suffix_max_spec_factor: 1.0    # a suffix draft has at most factor x (matched suffix length) tokens
      suffix_cache_requests: 256     # finished requests kept in the index (oldest evicted); 0: live ones only
      suffix_cache_tokens: 262144    # and their tokens at most (oldest evicted): about 1.7 kB of trie a token; with
                                     #   one index a tenant both are one budget for all the indexes (the least
                                     #   recently used tenant's oldest sequence evicted first)
      suffix_scope: tenant           # tenant: one index a tenant (a token of --auth-token-file), so that no tenant
                                     #   reads another's text through its own acceptance | shared: one for all
      suffix_min_score: 2.0          # hybrid: the suffix draft when its score (expected accepted tokens by
                                     #   the counts) is >= min(this, k), else the self-w8 model draft
      pipeline: off                  # on: model drafts and EAGLE-3 heads prepare each request's next drafts while
                                     #   the target verifies (specdist/cores/draft_pipeline.py); off: draft, then verify
      pipeline_miss: redraft         # with pipeline on, a request whose prepared prefix did not hold:
                                     #   redraft (draft it now) | skip (no drafts this step) | auto (redraft
                                     #   unless every other request of the step has its drafts ready)
    sampling:
      coupling: gumbel               # gumbel: a seeded request's tokens do not depend on the drafts (Gumbel-max,
                                     #   specdist/cores/coupling.py) | rejection: accept with min(1, p/q),
                                     #   else sample the residual
    engine:
      max_model_len: 2048            # prompt + output tokens per request
      max_batch_size: 8              # requests running at once (KV slots)
      max_prefill_tokens: null       # prompt tokens admitted in one step (at least one request); a long
                                     #   prefill holds up every running request's next token; null: no bound
      device: auto                   # auto | cpu | cuda | cuda:N
      num_threads: null              # torch intra-op threads; null keeps torch's default
      seed: null                     # seeds requests that do not bring their own: null draws each from the
                                     #   operating system's randomness (64 bits); an integer makes them repeat
      prefix_caching: true           # a prompt starting with 16+ tokens that a running or finished request
                                     #   holds takes their K/V instead of computing them (finished requests'
                                     #   slots are kept until a new request needs one)
      prefix_cache_scope: tenant     # tenant: a prompt reuses only its tenant's K/V (a token of --auth-token-file),
                                     #   so its time to first token says nothing of what other tenants sent (with
                                     #   one token or none every request is the one tenant's: all K/V is reused)
                                     #   | shared: any request's (asked for explicitly; a timing oracle between
                                     #   tenants, said on stderr at start)
      kv_cache_dtype: auto           # KV cache elements: model (the model's dtype) | float16 (read by the CPU
                                     #   attention kernels) | auto: float16 for a model on quantized blocks
                                     #   under those kernels (a native GGUF target, a self draft), else model
      cpu_kernels: auto              # specdist's C kernels (built at install; x86-64 with AVX2, FMA, F16C) for the
                                     #   CPU's matmuls and attention: auto (where they run; else torch's, said on
                                     #   stderr and in GetServerInfo) | required (refuse to start without them) | off
      compile: auto                  # on: Inductor-compiled static-shape passes over a slot cache (a compile a
                                     #   shape bucket) | off | auto (off: the paged cache's CUDA graphs on GPUs)
      compile_cache_dir: null        # Inductor's on-disk cache; null: ~/.cache/specdist/inductor
      kv_cache: auto                 # paged: K/V in blocks of kv_block_size tokens, a block table per request,
                                     #   memory per token held (specdist/models/kv/paged.py), read by the
                                     #   paged kernels on GPUs | slots: one max_model_len slot per request (the
                                     #   CPU attention kernels read these) | auto: paged on CUDA, slots on the CPU
      attention_backend: auto        # the attention backend by name (specdist/models/backends/): paged (Triton
                                     #   on CUDA), paged-torch, sdpa, cpu (the C kernels) | auto: by kv_cache,
                                     #   the device and the dtype; a named one must read the layout kv_cache gives
      kv_block_size: 16              # tokens a block (a power of two)
      kv_cache_tokens: null          # tokens each paged cache (target, model draft) holds; null: planned on a GPU
                                     #   (gpu_memory_utilization), else max_batch_size x max_model_len
      gpu_memory_utilization: 0.9    # share of the GPU's total memory the engine plans to use: the KV caches get
                                     #   total x this - weights - CUDA graphs - the peak of the eager passes -
                                     #   memory outside torch, measured at load by running them
                                     #   (specdist/models/memory_plan.py); the target's and the draft's cache
                                     #   hold the same tokens; one line on stderr and GetServerInfo's
                                     #   memory_plan say what each got; too little for one max_model_len
                                     #   sequence: an error naming this key
      cuda_graphs: auto              # on | off | auto (on for a paged cache on CUDA): each decode, verify and
                                     #   draft pass of up to 16 tokens a request is a CUDA graph replay,
                                     #   every batch bucket captured at load (specdist/models/graphs.py)
    cluster:                         # `specdist serve` on a Ray deployment (workers/ + cluster/)
      enabled: false                 # false: the in-process engine; true: Ray actors over gRPC
      tensor_parallel_size: 1        # target ranks (one node, STRICT_PACK); must divide the model's
                                     #   attention and KV head counts (checked at bring-up, before loading)
      num_draft_workers: 1           # draft replicas, one actor each; >= 1 unless draft.method is none (then 0)
      cpus_per_rank: 1.0             # Ray logical CPUs per target rank (may be fractional)
      cpus_per_draft: 1.0            # Ray logical CPUs per draft worker
      gpus_per_draft: 1.0            # GPUs per draft worker when the deployment runs on GPUs
      use_gpu: auto                  # auto (engine.device, auto: whether the cluster has GPUs) | true | false
      pin_cpus: false                # pin each worker process to one core of its node (rank r: core r, draft i:
                                     #   core tensor_parallel_size + i, modulo the cores): with one torch thread
                                     #   each, the target and the drafts never share a core
      bringup_timeout_s: 300.0       # placement + start + load + warm-up + serve, all together
      max_restarts: 3                # Ray restarts of a dead draft worker (then reloaded, warmed up and
                                     #   re-admitted); -1: without limit
      health_interval_s: 1.0         # the supervisor checks every worker this often (cluster/supervisor.py)
      health_timeout_s: 5.0          # a worker that does not answer its health check within this is hung
      rebuild_attempts: 3            # a failed target group is rebuilt up to this many times in a row,
                                     #   1 s apart, doubling; then the server stays NOT_SERVING
      collective_timeout_s: 10.0     # least time a tensor-parallel collective may wait for a rank; grows to
                                     #   20 x the measured forward time for larger forwards
      replicas: null                 # null: one speculative group behind this process's coordinator; a count, or
                                     #   {min, max, ...}: that many groups as Ray Serve replicas (cluster/serve.py),
                                     #   each a whole group (its ranks and drafts in the replica's placement group)
                                     #   with its own coordinator, chosen per request by router.policy; with
                                     #   min < max Serve's autoscaler adds and drains replicas:
                                     #   {min: 1, max: 4, target_ongoing_requests: null (engine.max_batch_size),
                                     #   upscale_delay_s: 10, downscale_delay_s: 60}
    limits:                          # what one public request may ask for (gRPC and HTTP alike); beyond a
                                     #   limit: INVALID_ARGUMENT / HTTP 400 naming the field (specdist/api/admission.py)
      max_message_bytes: 4194304     # largest gRPC message either way and HTTP request body (gRPC:
                                     #   RESOURCE_EXHAUSTED, HTTP: 413)
      max_prompt_chars: null         # characters of a text prompt (chat: of all messages together), checked
                                     #   before it is tokenized; null: 32 x engine.max_model_len
                                     #   (PROMPT_CHARS_PER_TOKEN: far more characters a token than text averages)
      max_prompt_tokens: null        # token ids of a token-id prompt; null: engine.max_model_len - 1
      max_tokens: null               # largest max_tokens (>= 16, the default); null: engine.max_model_len
      max_stop: 16                   # stop strings per request
      max_stop_chars: 256            # characters of each stop string
      max_stop_token_ids: 64         # stop_token_ids per request
      max_request_id_chars: 256      # request_id length (at most 256); visible ASCII only (it is logged)
      max_n: 16                      # choices per HTTP request (n): each is one engine request
      max_messages: 1024             # chat messages per request; each past the first costs 32 characters
                                     #   (PROMPT_CHARS_PER_TOKEN) of max_prompt_chars
      max_logprob_entries: 262144    # n x (logprobs + 1) x max_tokens of one request (HTTP: 400 naming
                                     #   logprobs / top_logprobs past it)
      http_idle_timeout_s: 15.0      # an HTTP connection with no request in progress (none yet, headers
                                     #   still arriving, or between requests) is closed after this
      http_write_timeout_s: 30.0     # an HTTP response (a stream) whose client reads nothing for this long is
                                     #   dropped and its requests cancelled
      http_connections_per_peer: 64  # open HTTP connections one client address may hold (more are closed at
                                     #   once); behind a proxy every client is the proxy's address: raise it or
                                     #   null (no cap). GET /health is outside every connection cap
      max_queued_per_tenant: null    # live requests (running + waiting) one tenant (a token of --auth-token-file)
                                     #   may hold, of --max-queued for all: beyond it RESOURCE_EXHAUSTED / HTTP 429
                                     #   while other tenants are still admitted; null: half of --max-queued
                                     #   (rounded up) with several tenants, no quota with one
      speculative_stats: true        # false: responses carry no drafted / accepted / steps counts (usage.speculative,
                                     #   RequestStats), and a stream sends one token a chunk, so that a client does
                                     #   not read its drafts' acceptance off them (the chunks' timing still follows
                                     #   the steps; draft.suffix_scope: tenant keeps other tenants' text out of drafts)
    router:                          # which replica a request goes to, with several (specdist/api/router.py)
      policy: speculative            # round-robin | least-loaded (power of two choices) | prefix (longest cached
                                     #   prefix, least load past imbalance_threshold) | speculative: the earliest
                                     #   expected finish from the replicas' measured tokens a step, step time,
                                     #   prefix caches and the sessions their suffix indexes hold
      imbalance_threshold:           # prefix: route by load instead when max - min requests > absolute and
        absolute: 32                 #   max > relative x min (SGLang's cache-aware router)
        relative: 1.5
      stats_period_s: 2.0            # a replica's stats older than this are not trusted: a replica that stops
                                     #   reporting is avoided until it reports again
      session_blocks: 2              # a request with no session (OpenAI user, gRPC session_id): the hash of its
                                     #   prompt's first this-many KV blocks is its session key
"""

from __future__ import annotations

import dataclasses
import os
import re
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar

import yaml

from specdist.errors import ConfigError
from specdist.sampling_params import SamplingParams

DTYPES = ("float32", "bfloat16", "float16", "auto")  # specdist.models.dtypes maps the first three to torch
WEIGHTS = ("auto", "native", "float")
LENGTH_POLICIES = ("fixed", "adaptive")  # draft.length_policy (specdist.engine.draft_length)
PIPELINE_MISS = ("redraft", "skip", "auto")  # draft.pipeline_miss (specdist.cores.draft_pipeline)
# limits.max_prompt_chars when null: this many characters for each token of engine.max_model_len.
# Generous: text averages about 4 characters a token (code a few more), so a prompt that fits the
# context is not refused by it, and one far longer is refused before it is tokenized. A deployment
# whose prompts are mostly long single tokens (some tokenizers merge long runs of spaces or
# punctuation) sets limits.max_prompt_chars.
PROMPT_CHARS_PER_TOKEN = 32
MAX_REQUEST_ID_LEN = 256  # the longest request id the coordinator takes (limits.max_request_id_chars <= this)
COUPLINGS = ("gumbel", "rejection")  # how drafts are decided: specdist.cores.coupling, specdist.cores.rejection
COMPILE_MODES = ("auto", "on", "off")  # engine.compile and engine.cuda_graphs (YAML's bare on / off arrive as booleans)
KV_CACHE_KINDS = ("auto", "slots", "paged")  # engine.kv_cache
SCOPES = ("tenant", "shared")  # draft.suffix_scope (specdist.cores.suffix_index), engine.prefix_cache_scope


@dataclass
class TargetConfig:
    model: str = "smollm2-135m-instruct"
    dtype: str = "float32"
    weights: str = "auto"

    def validate(self, key: str) -> None:
        _check_nonempty(self.model, f"{key}.model")
        _check_choice(self.dtype, DTYPES, f"{key}.dtype")
        _check_choice(self.weights, WEIGHTS, f"{key}.weights")


@dataclass
class DraftConfig:
    """How requests are drafted: the method (a name :mod:`specdist.cores.proposers` registers; ``none``: no
    drafting) and the settings every method reads. Any other ``draft.`` key is one method's own setting
    (``ngram_min``, ``suffix_max_depth``, ...) and lands in ``settings``: the config sits below the methods, so
    the method's name, whether it reads ``draft.model`` and its own settings are checked by
    :func:`specdist.cores.proposers.check_draft`, which everything that serves a config calls before loading."""

    method: str = "self-w8"
    model: str | None = None
    dtype: str = "float32"
    num_speculative_tokens: int = 4
    confidence_threshold: float = 0.0
    length_policy: str = "adaptive"
    pipeline: bool = False  # YAML on/off read as booleans
    pipeline_miss: str = "redraft"
    q_top_k: int = 0  # rejection coupling: drafts sample from q's top q_top_k tokens only (0: all)
    settings: dict[str, Any] = field(default_factory=dict)  # every other draft.<key>, as written: the methods'

    EXTRA_KEYS: ClassVar[str] = "settings"  # build_section puts keys that are no field here

    def validate(self, key: str) -> None:
        _check_nonempty(self.method, f"{key}.method")
        if self.model is not None:
            _check_nonempty(self.model, f"{key}.model")
        _check_choice(self.pipeline_miss, PIPELINE_MISS, f"{key}.pipeline_miss")
        _check_choice(self.dtype, DTYPES, f"{key}.dtype")
        _check_int(self.num_speculative_tokens, f"{key}.num_speculative_tokens", 1, 64)
        _check_choice(self.length_policy, LENGTH_POLICIES, f"{key}.length_policy")
        if not 0.0 <= self.confidence_threshold < 1.0:
            raise ConfigError(f"{key}.confidence_threshold", f"must be in [0, 1), got {self.confidence_threshold!r}")
        _check_int(self.q_top_k, f"{key}.q_top_k", 0, 1 << 24)
        if not isinstance(self.settings, dict):
            raise ConfigError(f"{key}.settings", f"must be a mapping, got {type(self.settings).__name__}")
        fields = {f.name for f in dataclasses.fields(self)}
        for name in self.settings:
            if not isinstance(name, str) or name in fields:
                raise ConfigError(f"{key}.settings", f"{name!r} is not a method's own setting")

    @property
    def enabled(self) -> bool:
        return self.method != "none"


KV_CACHE_DTYPES = ("auto", "model", "float16")  # engine.kv_cache_dtype
# engine.cpu_kernels: specdist's C kernels where they run here, else torch's (auto); always, refusing to start
# without them (required); never (off). specdist.models.kernels.cpu_kernels.configure applies it.
CPU_KERNEL_MODES = ("auto", "required", "off")


def check_kv_cache_dtype(value, key: str = "engine.kv_cache_dtype") -> None:
    """ConfigError naming ``key`` unless ``value`` is one of :data:`KV_CACHE_DTYPES`."""
    if value not in KV_CACHE_DTYPES:
        raise ConfigError(key, f"must be one of {', '.join(KV_CACHE_DTYPES)}, got {value!r}")


@dataclass
class EngineConfig:
    max_model_len: int = 2048
    max_batch_size: int = 8
    max_prefill_tokens: int | None = None
    device: str = "auto"
    num_threads: int | None = None
    seed: int | None = None  # None: unseeded requests draw their seeds from the OS (secure, differ per start)
    compile: bool | str = "auto"  # Inductor-compiled static passes over a slot cache: on (true), off (false, and auto)
    compile_cache_dir: str | None = None  # inductor's on-disk cache; None: ~/.cache/specdist/inductor
    prefix_caching: bool = True  # reuse prompt K/V across requests (specdist.models.kv.prefix.PrefixCache)
    prefix_cache_scope: str = "tenant"  # tenant | shared: whose K/V a request reuses (shared only when asked for)
    kv_cache_dtype: str = "auto"  # KV cache elements: auto | model | float16 (specdist.models.runner.kv_dtype)
    cpu_kernels: str = "auto"  # auto | required | off (CPU_KERNEL_MODES)
    kv_cache: str = "auto"  # auto | slots | paged (specdist.models.kv.options.KVOptions)
    attention_backend: str = "auto"  # a registered backend's name (specdist.models.backends) | auto
    kv_block_size: int = 16
    kv_cache_tokens: int | None = None
    gpu_memory_utilization: float = 0.9
    cuda_graphs: bool | str = "auto"  # captured passes of the paged cache: on, off, auto (on CUDA)

    def validate(self, key: str) -> None:
        _check_int(self.max_model_len, f"{key}.max_model_len", 2, 1 << 20)
        check_kv_cache_dtype(self.kv_cache_dtype, f"{key}.kv_cache_dtype")
        if self.cpu_kernels not in CPU_KERNEL_MODES:
            raise ConfigError(
                f"{key}.cpu_kernels", f"must be one of {', '.join(CPU_KERNEL_MODES)}, got {self.cpu_kernels!r}"
            )
        _check_int(self.max_batch_size, f"{key}.max_batch_size", 1, 1 << 16)
        if self.max_prefill_tokens is not None:
            _check_int(self.max_prefill_tokens, f"{key}.max_prefill_tokens", 1, 1 << 30)
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise ConfigError(f"{key}.device", f"must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if self.num_threads is not None:
            _check_int(self.num_threads, f"{key}.num_threads", 1, 1024)
        if self.seed is not None:
            _check_int(self.seed, f"{key}.seed", 0, 2**63 - 1)
        if not (isinstance(self.compile, bool) or (isinstance(self.compile, str) and self.compile in COMPILE_MODES)):
            raise ConfigError(
                f"{key}.compile", f"must be one of {', '.join(COMPILE_MODES)} (or true / false), got {self.compile!r}"
            )
        if self.compile_cache_dir is not None:
            _check_nonempty(self.compile_cache_dir, f"{key}.compile_cache_dir")
        if not isinstance(self.prefix_caching, bool):
            raise ConfigError(f"{key}.prefix_caching", f"must be true or false, got {self.prefix_caching!r}")
        if self.prefix_cache_scope not in SCOPES:
            raise ConfigError(
                f"{key}.prefix_cache_scope", f"must be one of {', '.join(SCOPES)}, got {self.prefix_cache_scope!r}"
            )
        if self.kv_cache not in KV_CACHE_KINDS:
            raise ConfigError(f"{key}.kv_cache", f"must be one of {', '.join(KV_CACHE_KINDS)}, got {self.kv_cache!r}")
        if not (
            isinstance(self.attention_backend, str) and re.fullmatch(r"[a-z0-9][a-z0-9_-]*", self.attention_backend)
        ):
            raise ConfigError(
                f"{key}.attention_backend", f"must be auto or a backend's name, got {self.attention_backend!r}"
            )
        _check_int(self.kv_block_size, f"{key}.kv_block_size", 1, 1 << 12)
        if self.kv_block_size & (self.kv_block_size - 1):
            raise ConfigError(f"{key}.kv_block_size", f"must be a power of two, got {self.kv_block_size}")
        if self.kv_cache_tokens is not None:
            _check_int(self.kv_cache_tokens, f"{key}.kv_cache_tokens", self.max_model_len, 1 << 40)
        u = self.gpu_memory_utilization
        if isinstance(u, bool) or not isinstance(u, (int, float)) or not 0 < u <= 1:
            raise ConfigError(f"{key}.gpu_memory_utilization", f"must be a number in (0, 1], got {u!r}")
        if not (isinstance(self.cuda_graphs, bool) or self.cuda_graphs in COMPILE_MODES):
            raise ConfigError(
                f"{key}.cuda_graphs",
                f"must be one of {', '.join(COMPILE_MODES)} (or true / false), got {self.cuda_graphs!r}",
            )
        if self.compiled("cpu") and self.kv_cache == "paged":
            raise ConfigError(
                f"{key}.compile",
                "the compiled static pass reads a slot cache: with kv_cache paged "
                "use cuda_graphs (on GPUs) and compile off",
            )

    def compiled(self, device_type: str) -> bool:
        """Whether models run Inductor-compiled static passes (over a slot cache) on a device of this type: only
        when ``compile`` is on. ``auto`` is off everywhere: on a CPU each shape bucket takes tens of seconds to
        compile (docs/performance.md), and on GPUs the paged cache's CUDA graphs do the job in
        seconds (``cuda_graphs``)."""
        return {True: "on", False: "off"}.get(self.compile, self.compile) == "on"

    def paged(self, device_type: str) -> bool:
        """Whether runners keep a paged KV cache on a device of this type (auto: on CUDA, unless the compiled
        static pass, which reads slots, is on)."""
        return self.kv_cache == "paged" or (
            self.kv_cache == "auto" and device_type == "cuda" and not self.compiled(device_type)
        )

    def graphs(self, device_type: str) -> bool:
        """Whether runners capture CUDA graphs of their paged passes on a device of this type."""
        mode = {True: "on", False: "off"}.get(self.cuda_graphs, self.cuda_graphs)
        return device_type == "cuda" and self.paged(device_type) and mode in ("on", "auto")


@dataclass
class ClusterConfig:
    """How ``specdist serve`` runs the models: in process (``enabled: false``) or as a Ray deployment."""

    enabled: bool = False
    tensor_parallel_size: int = 1
    num_draft_workers: int = 1
    cpus_per_rank: float = 1.0
    cpus_per_draft: float = 1.0
    gpus_per_draft: float = 1.0
    use_gpu: bool | str = "auto"
    pin_cpus: bool = False
    bringup_timeout_s: float = 300.0
    max_restarts: int = 3
    health_interval_s: float = 1.0
    health_timeout_s: float = 5.0
    rebuild_attempts: int = 3
    collective_timeout_s: float = 10.0
    replicas: object | None = None  # a count or a mapping: see ReplicasConfig.of

    def validate(self, key: str) -> None:
        if self.replicas is not None:
            ReplicasConfig.of(self.replicas, f"{key}.replicas")
        if not isinstance(self.enabled, bool):
            raise ConfigError(f"{key}.enabled", f"must be true or false, got {self.enabled!r}")
        _check_int(self.tensor_parallel_size, f"{key}.tensor_parallel_size", 1, 1024)
        _check_int(self.num_draft_workers, f"{key}.num_draft_workers", 0, 1024)
        _check_int(self.max_restarts, f"{key}.max_restarts", -1, 1000)
        _check_int(self.rebuild_attempts, f"{key}.rebuild_attempts", 0, 100)
        for name in (
            "cpus_per_rank",
            "cpus_per_draft",
            "bringup_timeout_s",
            "health_interval_s",
            "health_timeout_s",
            "collective_timeout_s",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ConfigError(f"{key}.{name}", f"must be a number > 0, got {value!r}")
        if (
            isinstance(self.gpus_per_draft, bool)
            or not isinstance(self.gpus_per_draft, (int, float))
            or not 0 < self.gpus_per_draft <= 1024
        ):
            raise ConfigError(f"{key}.gpus_per_draft", f"must be a number > 0, got {self.gpus_per_draft!r}")
        if self.use_gpu not in ("auto", True, False) or (
            isinstance(self.use_gpu, int) and not isinstance(self.use_gpu, bool)
        ):
            raise ConfigError(f"{key}.use_gpu", f"must be auto, true or false, got {self.use_gpu!r}")

    @property
    def gpu(self) -> bool | None:
        """use_gpu as a tri-state: None = auto."""
        return None if self.use_gpu == "auto" else bool(self.use_gpu)

    @property
    def replica_plan(self) -> "ReplicasConfig | None":
        """``replicas`` resolved (None: no Serve replicas, one group behind this process)."""
        return None if self.replicas is None else ReplicasConfig.of(self.replicas, "cluster.replicas")


@dataclass(frozen=True)
class ReplicasConfig:
    """``cluster.replicas``: how many speculative groups run as Ray Serve replicas. A count is fixed
    (``min == max``); a mapping with ``min < max`` turns on Serve's autoscaling between them, aiming at
    ``target_ongoing_requests`` a replica (None: ``engine.max_batch_size``, a full batch)."""

    min: int = 1
    max: int = 1
    target_ongoing_requests: float | None = None
    upscale_delay_s: float = 10.0
    downscale_delay_s: float = 60.0

    @property
    def autoscaling(self) -> bool:
        return self.max > self.min

    @classmethod
    def of(cls, value: Any, key: str = "cluster.replicas") -> "ReplicasConfig":
        if isinstance(value, ReplicasConfig):
            return value
        if isinstance(value, bool) or not isinstance(value, (int, dict)):
            raise ConfigError(key, f"must be a count or a mapping {{min, max, ...}}, got {value!r}")
        if isinstance(value, int):
            _check_int(value, key, 1, 4096)
            return cls(value, value)
        data = dict(value)
        if "min" in data and "max" not in data:
            data["max"] = data["min"]
        out = build_section(cls, data, key)
        _check_int(out.min, f"{key}.min", 1, 4096)
        _check_int(out.max, f"{key}.max", 1, 4096)
        if out.max < out.min:
            raise ConfigError(f"{key}.max", f"must be >= min ({out.min}), got {out.max}")
        t = out.target_ongoing_requests
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t < float("inf")):
            raise ConfigError(f"{key}.target_ongoing_requests", f"must be a number > 0 or null, got {t!r}")
        for name in ("upscale_delay_s", "downscale_delay_s"):
            v = getattr(out, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < float("inf"):
                raise ConfigError(f"{key}.{name}", f"must be a number >= 0, got {v!r}")
        return out


@dataclass
class LimitsConfig:
    """What one public request may ask for; :mod:`specdist.api.admission` applies it to gRPC and HTTP."""

    max_message_bytes: int = 4 << 20
    max_prompt_chars: int | None = None  # None: PROMPT_CHARS_PER_TOKEN * engine.max_model_len
    max_prompt_tokens: int | None = None
    max_tokens: int | None = None
    max_stop: int = 16
    max_stop_chars: int = 256
    max_stop_token_ids: int = 64
    max_request_id_chars: int = 256
    max_n: int = 16
    max_messages: int = 1024  # chat messages per request (each past the first costs MESSAGE_COST_CHARS more)
    max_logprob_entries: int = 262144  # n x (logprobs + 1) x max_tokens of one request
    http_idle_timeout_s: float = 15.0  # an HTTP connection without a request in progress this long is closed
    http_write_timeout_s: float = 30.0  # an HTTP response whose client reads nothing this long is dropped
    http_connections_per_peer: int | None = 64  # open HTTP connections one client address may hold; None: any
    speculative_stats: bool = True  # responses carry the drafted / accepted / steps counts
    max_queued_per_tenant: int | None = None  # a tenant's live requests; None: see tenant_quota

    def validate(self, key: str) -> None:
        _check_int(self.max_message_bytes, f"{key}.max_message_bytes", 1024, 2**31 - 1)
        if not isinstance(self.speculative_stats, bool):
            raise ConfigError(f"{key}.speculative_stats", f"must be true or false, got {self.speculative_stats!r}")
        for name in ("max_stop", "max_stop_chars", "max_stop_token_ids", "max_n"):
            _check_int(getattr(self, name), f"{key}.{name}", 1, 2**31 - 1)
        if self.max_prompt_chars is not None:
            _check_int(self.max_prompt_chars, f"{key}.max_prompt_chars", 1, 2**31 - 1)
        if self.max_prompt_tokens is not None:
            _check_int(self.max_prompt_tokens, f"{key}.max_prompt_tokens", 1, 2**31 - 1)
        if self.max_tokens is not None:  # at least the default a request without max_tokens gets
            _check_int(self.max_tokens, f"{key}.max_tokens", SamplingParams.max_tokens, 2**31 - 1)
        _check_int(self.max_request_id_chars, f"{key}.max_request_id_chars", 1, MAX_REQUEST_ID_LEN)
        _check_int(self.max_messages, f"{key}.max_messages", 1, 2**31 - 1)
        _check_int(self.max_logprob_entries, f"{key}.max_logprob_entries", 1, 2**31 - 1)
        for name in ("http_idle_timeout_s", "http_write_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ConfigError(f"{key}.{name}", f"must be a number > 0, got {value!r}")
        if self.http_connections_per_peer is not None:
            _check_int(self.http_connections_per_peer, f"{key}.http_connections_per_peer", 1, 2**31 - 1)
        if self.max_queued_per_tenant is not None:
            _check_int(self.max_queued_per_tenant, f"{key}.max_queued_per_tenant", 1, 2**31 - 1)

    def tenant_quota(self, max_queued: int, tenants: int) -> int | None:
        """The live requests one tenant may hold on a server of ``max_queued`` places and ``tenants`` tenants:
        ``max_queued_per_tenant``, or by default half the places (rounded up) with several tenants, so that one
        tenant cannot take every place; None: no quota (one tenant)."""
        if self.max_queued_per_tenant is not None:
            return self.max_queued_per_tenant
        return -(-max_queued // 2) if tenants > 1 else None


@dataclass
class SamplingConfig:
    """How drafts are decided (specdist/cores/coupling.py): ``gumbel`` makes a seeded request's tokens
    independent of the drafts; ``rejection`` is the seed documents' rule."""

    coupling: str = "gumbel"

    def validate(self, key: str) -> None:
        _check_choice(self.coupling, COUPLINGS, f"{key}.coupling")


ROUTER_POLICIES = ("round-robin", "least-loaded", "prefix", "speculative")  # router.policy (specdist.api.router)


@dataclass
class ImbalanceThreshold:
    """When the ``prefix`` policy routes by load: the most and least loaded replicas' requests differ by more
    than ``absolute`` and the most is more than ``relative`` x the least (both must hold, as in SGLang)."""

    absolute: int = 32
    relative: float = 1.5

    def validate(self, key: str) -> None:
        _check_int(self.absolute, f"{key}.absolute", 0, 1 << 30)
        if (
            isinstance(self.relative, bool)
            or not isinstance(self.relative, (int, float))
            or not 1.0 <= self.relative < float("inf")
        ):
            raise ConfigError(f"{key}.relative", f"must be a number >= 1, got {self.relative!r}")


@dataclass
class RouterConfig:
    """How a request picks one of several replicas (:mod:`specdist.api.router`)."""

    policy: str = "speculative"
    imbalance_threshold: ImbalanceThreshold = field(default_factory=ImbalanceThreshold)
    stats_period_s: float = 2.0
    session_blocks: int = 2

    def validate(self, key: str) -> None:
        _check_choice(self.policy, ROUTER_POLICIES, f"{key}.policy")
        self.imbalance_threshold.validate(f"{key}.imbalance_threshold")
        p = self.stats_period_s
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p < float("inf"):
            raise ConfigError(f"{key}.stats_period_s", f"must be a number > 0, got {p!r}")
        _check_int(self.session_blocks, f"{key}.session_blocks", 1, 1 << 16)


@dataclass
class Config:
    target: TargetConfig = field(default_factory=TargetConfig)
    draft: DraftConfig = field(default_factory=DraftConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    router: RouterConfig = field(default_factory=RouterConfig)

    def validate(self) -> "Config":
        self.target.validate("target")
        self.draft.validate("draft")
        self.sampling.validate("sampling")
        self.engine.validate("engine")
        self.cluster.validate("cluster")
        self.limits.validate("limits")
        self.router.validate("router")
        if self.cluster.replicas is not None and not self.cluster.enabled:
            raise ConfigError("cluster.replicas", "needs cluster.enabled: true (each replica is a Ray deployment)")
        if self.cluster.enabled:  # cross-section rules only matter for a deployment
            n = self.cluster.num_draft_workers
            if self.draft.enabled and n < 1:
                raise ConfigError(
                    "cluster.num_draft_workers", f"must be >= 1 when draft.method is {self.draft.method!r}, got {n}"
                )
            if not self.draft.enabled and n > 0:
                raise ConfigError(
                    "cluster.num_draft_workers", f"must be 0 when draft.method is 'none' (nothing to draft), got {n}"
                )
            if self.engine.compile in (True, "on") and self.cluster.tensor_parallel_size > 1:
                raise ConfigError(
                    "engine.compile",
                    "compiled passes run on one rank; with tensor_parallel_size "
                    f"{self.cluster.tensor_parallel_size} use auto (drafts compiled on CUDA) or off",
                )
        return self

    def to_dict(self) -> dict[str, Any]:
        """The config as YAML would write it: the draft methods' own settings as ``draft.`` keys again."""
        d = dataclasses.asdict(self)
        d["draft"].update(d["draft"].pop("settings"))
        return d


def tenant_scope_line(cfg: Config, tenants: int) -> str | None:
    """What a server with ``tenants`` tenants (tokens of --auth-token-file) shares between them, in one line for
    stderr at start: None with one tenant (or none), a warning when prompt K/V or suffix drafts are shared."""
    if tenants < 2:
        return None
    shared = (
        [f"engine.prefix_cache_scope: {cfg.engine.prefix_cache_scope}"]
        if cfg.engine.prefix_cache_scope == "shared"
        else []
    )
    if cfg.draft.method in ("suffix", "hybrid") and cfg.draft.settings.get("suffix_scope") == "shared":
        shared.append("draft.suffix_scope: shared")
    if shared:
        return (
            f"warning: {tenants} tenants share prompt K/V or drafts ({', '.join(shared)}): a tenant's timing or "
            "acceptance tells what another sent"
        )
    return f"{tenants} tenants: prompt K/V reused within a tenant only (engine.prefix_cache_scope: tenant)"


def load_config(source: str | os.PathLike | dict | Config | None) -> Config:
    """Build a validated :class:`Config` from a YAML path, a dict, a Config, or None (defaults)."""
    if isinstance(source, Config):
        return source.validate()
    if source is None:
        return Config().validate()
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        if not os.path.isfile(path):
            raise ConfigError("<file>", f"config file {path!r} does not exist")
        with open(path, encoding="utf-8") as f:
            try:
                data = yaml.safe_load(f)
            except yaml.YAMLError as e:
                raise ConfigError("<file>", f"{path} is not valid YAML: {str(e).splitlines()[0]}") from None
        data = {} if data is None else data
    else:
        data = source
    if not isinstance(data, dict):
        raise ConfigError("<root>", f"must be a mapping, got {type(data).__name__}")
    return build_section(Config, data, "").validate()


def build_section(cls: type, data: Any, prefix: str) -> Any:
    """The dataclass ``cls`` from the mapping ``data`` (a config section at the dotted ``prefix``): each value
    coerced to its field's type, sections built recursively; a key that is no field is a ConfigError, unless
    ``cls.EXTRA_KEYS`` names a dict field that takes such keys as they are. Not validated (``validate``)."""
    if not isinstance(data, dict):
        raise ConfigError(prefix or "<root>", f"must be a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    extra = getattr(cls, "EXTRA_KEYS", None)
    kwargs: dict[str, Any] = {extra: {}} if extra else {}
    for key, value in data.items():
        dotted = f"{prefix}.{key}" if prefix else str(key)
        if key == extra:
            if not isinstance(value, dict):
                raise ConfigError(dotted, f"must be a mapping, got {type(value).__name__}")
            kwargs[extra].update(value)
        elif key in names:
            hint = hints[key]
            kwargs[key] = (
                build_section(hint, value, dotted) if dataclasses.is_dataclass(hint) else _coerce(value, hint, dotted)
            )
        elif extra and isinstance(key, str):
            kwargs[extra][key] = value
        else:
            raise ConfigError(dotted, f"unknown key (expected one of: {', '.join(sorted(names))})")
    return cls(**kwargs)


def _coerce(value: Any, hint: Any, key: str) -> Any:
    args = typing.get_args(hint)
    optional = type(None) in args
    if value is None:
        if optional:
            return None
        raise ConfigError(key, "must not be null")
    base = next((a for a in args if a is not type(None)), hint) if args else hint
    if hint is bool and value in ("on", "off"):  # YAML 1.1 reads bare on/off as booleans; quoted, they are strings
        return value == "on"
    if hint is bool and not isinstance(value, bool):
        raise ConfigError(key, f"must be true or false (on or off), got {value!r}")
    if base is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise ConfigError(key, f"must be an integer, got {value!r}")
    if base is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(key, f"must be a number, got {value!r}")
        return float(value)
    if base is str and not isinstance(value, str):
        raise ConfigError(key, f"must be a string, got {value!r}")
    return value


def _check_choice(value: Any, choices: tuple[str, ...], key: str) -> None:
    if value not in choices:
        raise ConfigError(key, f"must be one of {', '.join(choices)}; got {value!r}")


def _check_int(value: Any, key: str, lo: int, hi: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ConfigError(key, f"must be an integer in [{lo}, {hi}], got {value!r}")


def _check_nonempty(value: Any, key: str) -> None:
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(key, f"must be a non-empty string, got {value!r}")
