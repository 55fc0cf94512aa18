"""Helpers the tests share: tiny checkpoints and configs, servers over in-process cores, polling, the
shared local Ray cluster's start and stop, and frozen draft-length rules. Fixtures are in tests/conftest.py."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import threading
import time

import pytest
import torch

from cluster.local import init_local_ray
from support.model_zoo import TINY_WORDS, save_word_tokenizer  # noqa: F401 (TINY_WORDS: id 7 is EOS)


def save_tiny_llama(path: str, seed: int, vocab_size: int = 8, std: float = 0.35, layers: int = 2) -> str:
    """Write a random Llama checkpoint (safetensors + tokenizer) to ``path`` and return it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        eos_token_id=7,
        bos_token_id=0,
        pad_token_id=None,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, std)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    save_word_tokenizer(path, vocab_size)
    return path


def wait_until(what: str, cond, limit_s: float, poll_s: float = 0.02):
    """Poll ``cond()`` every ``poll_s`` until it returns something true (returned), or fail with
    an AssertionError naming ``what`` after ``limit_s`` seconds: tests wait on state, bounded."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {limit_s:g}s waiting for {what}")


def devices(min_gpus: int = 1) -> list:
    """``pytest.mark.parametrize("device", devices())``: the CPU case CI runs, and its CUDA twin
    (marker ``cuda``: skipped with the reason here, run by ``python -m specdist.bench.gpu_check``)."""
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    why = f"needs {min_gpus} CUDA GPU(s), found {have}"
    return ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(have < min_gpus, reason=why)])]


def tiny_config(tiny_models, method: str = "model", k: int = 3, length_policy: str = "fixed", **engine) -> dict:
    """A config over the tiny models. ``fixed`` draft lengths by default: seeded runs then
    reproduce token for token, which most tests compare (the adaptive rule has its own tests)."""
    draft = {"method": method, "num_speculative_tokens": k, "length_policy": length_policy}
    if method == "model":
        draft["model"] = tiny_models["draft"]
    elif method == "eagle3":
        draft["model"] = tiny_models["eagle3"]
    return {
        "target": {"model": tiny_models["target"]},
        "draft": draft,
        "engine": {"max_model_len": 64, "max_batch_size": 8, "device": "cpu", **engine},
    }


def host_servicer(servicer, port: int = 0, secret: str | None = None):
    """A TargetServicer or DraftServicer (or a subclass) on 127.0.0.1:``port`` (0: a free port), on the
    host the workers use (:class:`specdist.transport.grpc_host.GrpcHostThread`: health, the servicer's
    message limit, SERVING from the start; ``secret`` required of every caller but health's)."""
    from specdist.transport.grpc_host import GrpcHostThread
    from specdist.v1 import draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc
    from workers.target_worker import TargetServicer

    if isinstance(servicer, TargetServicer):
        name, add = (
            target_pb2.DESCRIPTOR.services_by_name["TargetWorker"].full_name,
            target_pb2_grpc.add_TargetWorkerServicer_to_server,
        )
    else:
        name, add = (
            draft_pb2.DESCRIPTOR.services_by_name["DraftWorker"].full_name,
            draft_pb2_grpc.add_DraftWorkerServicer_to_server,
        )
    return GrpcHostThread(
        {name: lambda server: add(servicer, server)}, "127.0.0.1", port, servicer.message_limit, token=secret
    )


class ServedCores:
    """A VerifierCore and DrafterCores served over real gRPC on 127.0.0.1 (free ports), each on the
    host the workers use (:func:`host_servicer`): what a deployment's workers do, without Ray.
    ``close()`` stops all. ``secret``: every port requires it as a bearer token, as a deployment's
    worker ports do."""

    def __init__(self, target_core, draft_cores=(), secret: str | None = None):
        from workers.draft_worker import DraftServicer
        from workers.target_worker import TargetServicer

        self.secret = secret
        self.servicers = [TargetServicer(target_core)] + [DraftServicer(c) for c in draft_cores]
        self.hosts = []
        try:
            for servicer in self.servicers:
                self.hosts.append(host_servicer(servicer, secret=secret))
        except BaseException:
            self.close()
            raise
        self.target_address = f"127.0.0.1:{self.hosts[0].port}"
        self.draft_addresses = [f"127.0.0.1:{h.port}" for h in self.hosts[1:]]

    def close(self) -> None:
        for host in self.hosts:
            host.stop(0)
        for s in self.servicers:
            s.runner.close()

    def __enter__(self) -> "ServedCores":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def remote_engine_like(engine, secret: str | None = None, **kwargs):
    """(RemoteEngine, ServedCores): ``engine``'s own target and draft cores behind gRPC, driven by
    the same scheduler over the remote transports, with ``engine``'s config (and ``secret`` on
    both sides)."""
    from specdist.engine.remote import RemoteEngine

    served = ServedCores(engine.target_core, [engine.draft_core] if engine.draft_core is not None else [], secret)
    remote = RemoteEngine(
        engine.config,
        served.target_address,
        served.draft_addresses,
        tokenizer=engine.tokenizer,
        vocab_size=engine.vocab_size,
        eos_ids=engine.scheduler.eos_ids,
        worker_secret=secret,
        **kwargs,
    )
    return remote, served


def healthy_replicas(engine) -> int:
    """How many of a scheduler's draft replicas are not ejected."""
    return sum(rep.ejected_at is None for rep in engine.scheduler.replicas)


def set_scheduler_clock(monkeypatch, t: list[float]) -> None:
    """The scheduler's clock (its step timing, the draft pool's probes, the release retries) reads
    ``t[0]``, which the test advances: their schedules without sleeps."""
    from specdist.engine import calls, draft_pool, output_processor, scheduler

    for module in (scheduler, draft_pool, calls, output_processor):
        monkeypatch.setattr(module, "now", lambda: t[0])


class LoopThread:
    """An asyncio event loop on a daemon thread; ``run(coro)`` waits for the result."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = 60):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def raylets() -> int:
    """How many raylet processes run on this machine (0 once every local Ray cluster is down)."""
    out = subprocess.run("ps aux | grep -c '[r]aylet'", shell=True, capture_output=True, text=True)
    return int(out.stdout.strip() or 0)


DRAFT_NOISE_STD = 0.1  # the noisy draft's weight perturbation (see the models fixture)


# ---------------------------------------------------------------- one local Ray cluster
LOCAL_RAY_CPUS = 4


def stop_local_ray() -> None:
    """Shut this process's Ray cluster down, if one is up, and wait until no raylet is left."""
    import time

    import ray

    if ray.is_initialized():
        ray.shutdown()
    deadline = time.monotonic() + 20
    while raylets() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert raylets() == 0, "a raylet outlived ray.shutdown()"


def start_local_ray() -> None:
    """init_local_ray(LOCAL_RAY_CPUS), once more if its raylet never registered. Ray forks its processes from
    this one with a Python preexec_fn, which is unsafe where threads run (a test worker has gRPC servers and thread
    pools by then): a start can leave the raylet without a line of log, and ray.init gives up after its fixed
    30 s ("The current node timed out during startup"). The next start in the same process comes up."""
    import ray

    try:
        init_local_ray(LOCAL_RAY_CPUS)
    except Exception as e:  # noqa: BLE001 - Ray raises a plain Exception for it
        if "timed out during startup" not in str(e):
            raise
        ray.shutdown()
        init_local_ray(LOCAL_RAY_CPUS)


def assert_nothing_left_on_ray() -> None:
    """Every placement group removed, every actor dead, and all LOCAL_RAY_CPUS free again
    (resources come back asynchronously after the groups are removed: polled for up to 20 s)."""
    import time

    import ray
    from ray._private.state import actors as actor_table

    table = ray.util.placement_group_table()
    assert all(pg["state"] == "REMOVED" for pg in table.values()), table
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and (
        any(a["State"] != "DEAD" for a in actor_table().values())
        or ray.available_resources().get("CPU", 0) < LOCAL_RAY_CPUS
    ):
        time.sleep(0.2)
    assert all(a["State"] == "DEAD" for a in actor_table().values()), actor_table()
    assert ray.available_resources().get("CPU", 0) == pytest.approx(LOCAL_RAY_CPUS)


def model_drafter(model, max_batch_size: int, max_model_len: int, confidence_threshold: float = 0.0):
    """A drafter core drafting with ``model`` (the ``model`` method's proposer over a runner of its own)."""
    from specdist.cores.draft import DrafterCore
    from specdist.cores.proposers.model import ModelProposer
    from specdist.models.runner import CausalLMRunner

    return DrafterCore(
        ModelProposer(CausalLMRunner(model, max_batch_size, max_model_len), confidence_threshold), max_model_len
    )


def frozen_adaptive_policy(k: int, chosen: list[int] | None = None):
    """The adaptive rule with costs frozen at synthetic values (real wall times would make a run, though not its
    law, nondeterministic: a slow moment prices drafts out): draft 4 ms a pass + 25 us a row, verify 60 ms + 25 us
    a token, no probing. Its choices then depend on acceptances (and match lengths) only: set it as an engine's
    ``length_policy``. ``k``: the most a request drafts; ``chosen``: each k it picks is appended."""
    from specdist.engine.draft_length import DraftLengthPolicy

    pol = DraftLengthPolicy(k, "adaptive")
    for _ in range(20):
        pol.observe_draft(0, 1, 1, 0.004025)
        pol.observe_draft(0, 2, 6, 0.00815)
        pol.observe_draft(0, 3, 4, 0.0121)
        pol.observe_verify(1, 0.060025)
        pol.observe_verify(9, 0.060225)
    pol.observe_overhead(0.0)
    pol.last_drafted = [10**9]  # no probing either
    for name in ("observe_draft", "observe_verify", "observe_overhead"):
        setattr(pol, name, lambda *a: None)
    if chosen is not None:
        inner = pol.choose

        def choose(caps, accs, replicas=None, first=None, match_lengths=None):
            ks = inner(caps, accs, replicas, first, match_lengths)
            chosen.extend(ks)
            return ks

        pol.choose = choose
    return pol


TINY_CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} g {% endfor %}"


@contextlib.contextmanager
def serving_in_process(tiny_models):
    """``specdist serve --http-port`` in process over the tiny target with a model draft (k = 3) and a
    word chat template: gRPC and HTTP on one coordinator, free loopback ports. Yields
    (engine, serving); stops both after."""
    from specdist import Engine
    from specdist.api.serving import Backend, start_serving

    engine = Engine.from_config(tiny_config(tiny_models, "model", 3))
    engine.tokenizer.chat_template = TINY_CHAT_TEMPLATE
    lt = LoopThread()
    serving = lt.run(start_serving(backend=Backend(engine), host="127.0.0.1", port=0, http_port=0, drain_seconds=1))
    try:
        yield engine, serving
    finally:
        lt.run(serving.stop())
        lt.close()


async def collect(coord, prompt, params=None, **kwargs) -> list:
    """Every delta of one request, through the public streaming path (``open``, then the stream)."""
    stream = await coord.open(prompt, params, **kwargs)
    try:
        return [d async for d in stream]
    finally:
        stream.close()


# ----------------------------------------------------------------------------- engine
def sample_engine(
    models: dict,
    case,
    n: int,
    seed0: int,
    max_batch_size: int | None = None,
    setup=None,
    transport: str = "local",
    kv: str = "slots",
):
    """N seeded samples from the scheduler over local transports (Engine) or over gRPC
    (RemoteEngine, the same target and draft cores behind real servicers on 127.0.0.1). ``kv``: the
    KV cache (engine.kv_cache): slots, or paged (blocks of 4 tokens, the paged backend's torch form)."""
    from specdist.engine.local import Engine
    from support.gtest import BATCH, MAX_MODEL_LEN, K

    cfg = tiny_config(
        models,
        method=case.method,
        k=K,
        max_batch_size=max_batch_size or BATCH,
        max_model_len=MAX_MODEL_LEN,
        kv_cache=kv,
        kv_block_size=4,
    )
    cfg["sampling"] = {"coupling": case.coupling}
    if transport == "serve":
        params = case_params(case, n, seed0)
        return sample_through_replicas(cfg, list(case.prompt), params)
    eng = Engine.from_config(cfg)
    served = None
    if transport == "remote":
        eng, served = remote_engine_like(eng)
    if setup is not None:
        setup(eng)
    params = case_params(case, n, seed0)
    # One call: requests join the running batch as others finish (continuous batching),
    # so batches mix requests at different positions and draft lengths.
    try:
        return eng.generate([list(case.prompt)] * n, params)
    finally:
        if served is not None:
            eng.close()
            served.close()


def case_params(case, n: int, seed0: int) -> list:
    """A sampling case's ``n`` requests' parameters, seeds ``seed0`` on, run to ``max_tokens`` (EOS ignored)."""
    from specdist.sampling_params import SamplingParams

    return [
        SamplingParams(
            max_tokens=case.max_tokens,
            temperature=case.temperature,
            top_k=case.top_k,
            top_p=case.top_p,
            seed=seed0 + i,
            ignore_eos=True,
        )
        for i in range(n)
    ]


def sample_through_replicas(cfg: dict, prompt: list[int], params: list, replicas: int = 2, concurrency: int = 64):
    """Each request of ``params`` (on ``prompt``) through ``replicas`` Ray Serve replicas of ``cfg`` (one target rank
    and one draft worker each, on the tests' local Ray; round-robin, so every replica serves), ``concurrency``
    at a time through the front (ReplicaFront). Outputs like Engine.generate's: ``token_ids``, ``finish_reason``,
    ``metrics``; ``replica`` says which replica ran it."""
    import asyncio
    from types import SimpleNamespace

    from specdist.api.serving import start_backend
    from specdist.config import load_config

    cfg = {
        **cfg,
        "cluster": {
            "enabled": True,
            "tensor_parallel_size": 1,
            "num_draft_workers": 1,
            "cpus_per_rank": 0.5,
            "cpus_per_draft": 0.5,
            "bringup_timeout_s": 240,
            "replicas": replicas,
        },
        "router": {"policy": "round-robin", "stats_period_s": 5.0},
    }
    backend = start_backend(load_config(cfg), max_queued=max(256, concurrency))
    front = backend.replicas.front
    lt = LoopThread()

    async def one(p):
        s = await front.open(prompt, p)
        ids, last = [], None
        async for d in s:
            ids += d.token_ids
            last = d
        return SimpleNamespace(
            token_ids=ids, finish_reason=last.finish_reason, metrics=last.metrics, replica=s.replica_id
        )

    async def every():
        gate = asyncio.Semaphore(concurrency)

        async def gated(p):
            async with gate:
                return await one(p)

        return await asyncio.gather(*(gated(p) for p in params))

    try:
        return lt.run(every(), timeout=900)
    finally:
        lt.close()
        backend.close()
