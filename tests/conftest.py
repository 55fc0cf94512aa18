"""Shared fixtures: tiny random-weight Llama models saved as real HF checkpoints.

Weights are drawn with a large standard deviation so the next-token distributions
are peaked and target and draft clearly disagree: statistical tests then have
power. Each checkpoint also carries a real word-level tokenizer, so text prompts,
detokenisation and stop strings go through the same code as with real models.
"""

from __future__ import annotations

import contextlib
import gc

import asyncio
import os
import subprocess
import threading
import time

import pytest
import torch

from cluster.local import GCS_PORT_WAIT_ENV, init_local_ray, use_loopback_ray
from model_zoo import TINY_WORDS, save_word_tokenizer  # noqa: F401 (TINY_WORDS: id 7 is EOS)

# Every Ray cluster of the tests (in process, `ray start`, the demo's) listens on loopback only.
# Set before any test module imports Ray, which reads it at import.
use_loopback_ray()


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


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models: one intra-op thread is several times faster (and steadier on a shared 2-core box).
    A module takes it with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def smollm2_loaded():
    """The built-in model's (tokenizer, model in float32 on the CPU, model on its native blocks), rebuilt
    from its GGUF file once per session, from one parse of the file (tens of seconds). Engines over the
    model keep their own KV caches; none changes its weights."""
    from specdist.models.loader import gguf_parsed_once, load_model, load_tokenizer, resolve_model
    from specdist.models.native import use_native_blocks
    from specdist.models.fusion import unfused_copy

    src = resolve_model("smollm2-135m-instruct")
    with gguf_parsed_once():
        tokenizer, model = load_tokenizer(src), load_model(src, "float32")
        native = unfused_copy(model)  # on its own GGUF blocks, as `target.weights: native` loads it
        use_native_blocks(native, src.gguf_path)
        return tokenizer, model, native


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_loaded):
    return smollm2_loaded[0]


@pytest.fixture(scope="session")
def smollm2_model(smollm2_loaded):
    return smollm2_loaded[1]


@pytest.fixture(scope="session")
def smollm2_native_model(smollm2_loaded):
    """The built-in model on its own GGUF blocks (``target.weights: native``)."""
    return smollm2_loaded[2]


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """Paths of a tiny target, a tiny draft (same vocabulary), and a draft with another vocabulary."""
    root = tmp_path_factory.mktemp("tiny")
    return {
        "target": save_tiny_llama(str(root / "target"), seed=1),
        "draft": save_tiny_llama(str(root / "draft"), seed=2, layers=1),
        "draft_vocab9": save_tiny_llama(str(root / "draft9"), seed=3, vocab_size=9, layers=1),
    }


@pytest.fixture(scope="session")
def eagle3_models(tiny_models, tmp_path_factory):
    """``tiny_models`` and ``"eagle3"``: an EAGLE-3 head for the tiny target in the published layout.
    Its draft vocabulary is 6 of the 8 tokens (d2t); it reads the target's layers 0, 1 and 2 (2: the
    last layer's output); it is distilled from the target (tests/eagle3_fit.py), so that about a
    third of its drafts are accepted."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from eagle3_fit import fit_head
    from specdist.bench.checkpoints import write_random_eagle3_head

    path = str(tmp_path_factory.mktemp("eagle3") / "head")
    write_random_eagle3_head(path, AutoConfig.from_pretrained(tiny_models["target"]), draft_vocab_size=6, seed=4,
                             std=0.1, aux_layers=[0, 1, 2])
    fit_head(path, AutoModelForCausalLM.from_pretrained(tiny_models["target"]))
    return dict(tiny_models, eagle3=path)


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
        name, add = (target_pb2.DESCRIPTOR.services_by_name["TargetWorker"].full_name,
                     target_pb2_grpc.add_TargetWorkerServicer_to_server)
    else:
        name, add = (draft_pb2.DESCRIPTOR.services_by_name["DraftWorker"].full_name,
                     draft_pb2_grpc.add_DraftWorkerServicer_to_server)
    return GrpcHostThread({name: lambda server: add(servicer, server)}, "127.0.0.1", port, servicer.message_limit,
                          token=secret)


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
    remote = RemoteEngine(engine.config, served.target_address, served.draft_addresses, tokenizer=engine.tokenizer,
                          vocab_size=engine.vocab_size, eos_ids=engine.eos_ids, worker_secret=secret, **kwargs)
    return remote, served


def healthy_replicas(engine) -> int:
    """How many of a scheduler's draft replicas are not ejected."""
    return sum(rep.ejected_at is None for rep in engine.replicas)


def set_scheduler_clock(monkeypatch, t: list[float]) -> None:
    """The scheduler's clock (its step timing, the draft pool's probes, the release retries) reads
    ``t[0]``, which the test advances: their schedules without sleeps."""
    from specdist.engine import calls, draft_pool, output, scheduler

    for module in (scheduler, draft_pool, calls, output):
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


@pytest.fixture(scope="session")
def models(tiny_models, tmp_path_factory) -> dict[str, str]:
    """The tiny target, and a draft = target + N(0, 0.1^2) noise on every weight matrix.

    The session's tiny draft (an independent random model) only reaches ~0.2 acceptance
    on this target; the noisy copy gives 0.4-0.75, i.e. many rejections *and* many full
    acceptances, while staying far enough from the target for the power checks below.
    """
    import shutil

    from transformers import AutoModelForCausalLM

    path = tmp_path_factory.mktemp("freq") / "draft_noisy"
    shutil.copytree(tiny_models["target"], path)  # same config and tokenizer
    model = AutoModelForCausalLM.from_pretrained(tiny_models["target"])
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.add_(torch.randn(p.shape, generator=gen) * DRAFT_NOISE_STD)
    model.save_pretrained(path)
    return {"target": tiny_models["target"], "draft": str(path)}


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
    while time.monotonic() < deadline and (any(a["State"] != "DEAD" for a in actor_table().values())
                                           or ray.available_resources().get("CPU", 0) < LOCAL_RAY_CPUS):
        time.sleep(0.2)
    assert all(a["State"] == "DEAD" for a in actor_table().values()), actor_table()
    assert ray.available_resources().get("CPU", 0) == pytest.approx(LOCAL_RAY_CPUS)


@pytest.fixture
def local_ray():
    """A local Ray cluster (LOCAL_RAY_CPUS logical CPUs, node address 127.0.0.1) shared by the tests
    that ask for it: the first starts it, and it is stopped (no raylet left) after the last of a run
    of such tests (pytest_collection_modifyitems puts them next to each other). Whatever a test
    placed on it must be gone when it ends (assert_nothing_left_on_ray), so each test finds the
    cluster as empty as a fresh one."""
    import ray

    if not ray.is_initialized():
        start_local_ray()
    yield
    try:
        assert_nothing_left_on_ray()
    except BaseException:
        stop_local_ray()  # the next test gets a fresh cluster instead of this one's leftovers
        raise


def _uses_local_ray(item) -> bool:
    return "local_ray" in getattr(item, "fixturenames", ())


# The modules that start Ray clusters, actors or jobs. Under pytest-xdist (the suite runs on two
# workers, pyproject.toml) they all run on one worker, one after another: they count the machine's
# raylets, bind Ray's fixed ports and stop "every local Ray cluster", so two of them must never overlap.
RAY_MODULES = frozenset({"test_cli", "test_cluster_bench", "test_deployment",
                         "test_distributed_serve", "test_multinode", "test_placement", "test_ray_job",
                         "test_worker_faults"})


def pytest_configure(config):
    """The suite's processes keep models, engines and servers of many tests alive at once, and the
    engine tests allocate small objects per token: at the default thresholds (a young collection every
    700 allocations) the cyclic collector takes about a seventh of their CPU time. Young collections
    100x rarer; nothing here relies on when cycles are freed (each test releases what it holds).

    Under pytest-xdist each worker takes its share of the cores for torch's intra-op threads:
    two workers of two threads each on two cores would oversubscribe them, and OpenMP's spinning
    threads slow down badly when they do.

    Every Ray cluster a test starts (in process, ``ray start --head``, ``ray.cluster_utils.Cluster``) waits
    up to 120 s for its GCS server, not Ray's 30: beside the other worker's tests it has taken longer
    (cluster/local.py)."""
    os.environ.setdefault(GCS_PORT_WAIT_ENV, "120")
    gc.set_threshold(100_000, 50, 100)
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        torch.set_num_threads(max(1, torch.get_num_threads() // workers))  # torch's default: the cores it may use


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    """The tests on the shared local Ray cluster run one after another, where the first of them was
    collected, so the cluster comes up once (each bring-up and shutdown costs seconds). Every test of
    a Ray module goes to one pytest-xdist worker (``--dist loadgroup``), in this order. First among the
    hooks: xdist's own reads the ``xdist_group`` marks when it runs (after this hook, or the marks are
    not seen and the Ray modules' tests are spread over both workers, two Ray clusters starting at once)."""
    on_ray = [item for item in items if _uses_local_ray(item)]
    if on_ray:
        first = items.index(on_ray[0])
        others = [item for item in items if not _uses_local_ray(item)]
        items[:] = others[:first] + on_ray + others[first:]
    for item in items:
        if item.path.stem in RAY_MODULES:
            item.add_marker(pytest.mark.xdist_group("ray"))
        elif _uses_local_ray(item):
            raise pytest.UsageError(f"{item.nodeid} starts Ray: add its module to conftest.RAY_MODULES")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """After the last test of a run on the shared local Ray cluster (its fixtures torn down): stop it."""
    result = yield
    if _uses_local_ray(item) and (nextitem is None or not _uses_local_ray(nextitem)):
        stop_local_ray()
    return result


def model_drafter(model, max_batch_size: int, max_model_len: int, confidence_threshold: float = 0.0):
    """A drafter core drafting with ``model`` (the ``model`` method's proposer over a runner of its own)."""
    from specdist.cores.draft import DrafterCore
    from specdist.cores.proposers.model import ModelProposer
    from specdist.models.runner import CausalLMRunner

    return DrafterCore(ModelProposer(CausalLMRunner(model, max_batch_size, max_model_len), confidence_threshold),
                       max_model_len)


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
