"""Shared fixtures: tiny random-weight Llama models saved as real HF checkpoints.

Weights are drawn with a large standard deviation so the next-token distributions
are peaked and target and draft clearly disagree: statistical tests then have
power. Each checkpoint also carries a real word-level tokenizer, so text prompts,
detokenisation and stop strings go through the same code as with real models.
"""

from __future__ import annotations

import gc
import os

import pytest
import torch
from support.helpers import (
    DRAFT_NOISE_STD,
    assert_nothing_left_on_ray,
    save_tiny_llama,
    start_local_ray,
    stop_local_ray,
)
from support.model_zoo import TINY_WORDS, save_word_tokenizer  # noqa: F401 (TINY_WORDS: id 7 is EOS)

from cluster.local import GCS_PORT_WAIT_ENV, use_loopback_ray

# Every Ray cluster of the tests (in process, `ray start`, the demo's) listens on loopback only.
# Set before any test module imports Ray, which reads it at import.
use_loopback_ray()


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
    from specdist.models.fusion import unfused_copy
    from specdist.models.loader import gguf_parsed_once, load_model, load_tokenizer, resolve_model
    from specdist.models.native import use_native_blocks

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
    last layer's output); it is distilled from the target (tests/support/eagle3_fit.py), so that about a
    third of its drafts are accepted."""
    from support.eagle3_fit import fit_head
    from transformers import AutoConfig, AutoModelForCausalLM

    from specdist.bench.checkpoints import write_random_eagle3_head

    path = str(tmp_path_factory.mktemp("eagle3") / "head")
    write_random_eagle3_head(
        path,
        AutoConfig.from_pretrained(tiny_models["target"]),
        draft_vocab_size=6,
        seed=4,
        std=0.1,
        aux_layers=[0, 1, 2],
    )
    fit_head(path, AutoModelForCausalLM.from_pretrained(tiny_models["target"]))
    return dict(tiny_models, eagle3=path)


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


GROUPS = ("ray", "helm", "cuda")  # markers whose tests share one xdist worker (pytest_collection_modifyitems)
# tiers outside the default run: their tests run only when the marker expression names them (`-m replicas`,
# `-m image`); .ci/run runs each after the README's test command, which they would take past ten minutes
OPT_IN = ("replicas", "image", "cluster_image")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """The markers place the tests on pytest-xdist's workers (``--dist loadgroup``): every test marked ``ray``
    (it starts Ray clusters, actors or jobs: they count the machine's raylets, bind Ray's fixed ports and stop
    "every local Ray cluster", so two must never overlap) runs on one worker, and so do those marked ``helm``
    (one Helm library per process) and ``cuda`` (one GPU). A ``ray`` test is also ``slow`` (a cluster's bring-up
    costs seconds): ``pytest -m "not slow"`` is the everyday tier. The tests on the shared local Ray cluster
    run one after another, where the first of them was collected, so the cluster comes up once. First among
    the hooks: xdist's own reads the ``xdist_group`` marks when it runs (after this hook, or the marks are not
    seen and the Ray tests are spread over both workers, two Ray clusters starting at once). Tests of an
    ``OPT_IN`` tier are deselected unless the marker expression names it."""
    named = config.getoption("markexpr") or ""
    opted_out = [
        item
        for item in items
        if any(item.get_closest_marker(tier) is not None and tier not in named for tier in OPT_IN)
    ]
    if opted_out:
        config.hook.pytest_deselected(items=opted_out)
        items[:] = [item for item in items if item not in opted_out]
    on_ray = [item for item in items if _uses_local_ray(item)]
    if on_ray:
        first = items.index(on_ray[0])
        others = [item for item in items if not _uses_local_ray(item)]
        items[:] = others[:first] + on_ray + others[first:]
    for item in items:
        if _uses_local_ray(item) and item.get_closest_marker("ray") is None:
            raise pytest.UsageError(f"{item.nodeid} starts Ray: mark it (or its module) pytest.mark.ray")
        for group in GROUPS:
            if item.get_closest_marker(group) is not None:
                item.add_marker(pytest.mark.xdist_group(group))
                break
        if item.get_closest_marker("ray") is not None:
            item.add_marker(pytest.mark.slow)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """After the last test of a run on the shared local Ray cluster (its fixtures torn down): stop it."""
    result = yield
    if _uses_local_ray(item) and (nextitem is None or not _uses_local_ray(nextitem)):
        stop_local_ray()
    return result
