"""Resolve once: a config's model specs become sources (files, metadata, tokenizer) once, at start, and those
go down the layers (specdist.models.metadata.ModelSources). Counted here: the resolutions
(loader.resolve_model) of each spec and the parses of a GGUF header, on the way from a config to a running
in-process engine, and to a RemoteEngine over workers loaded as a deployment loads them (its load calls run
on in-process actors, their arguments pickled as Ray pickles them). And: loading a GGUF model leaves gguf's
and transformers' functions as they were (the caching replacements live only inside gguf_parsed_once).
"""

from __future__ import annotations

import collections
import json
import os
import pickle
import subprocess
import sys
import textwrap

import pytest
from support.helpers import tiny_config

from specdist.config import load_config
from specdist.engine.local import Engine
from specdist.errors import ConfigError
from specdist.models import families, loader
from specdist.models.families import _gguf_architecture
from specdist.models.loader import _reader_class
from specdist.models.metadata import ModelSources, resolve_sources
from specdist.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [[1, 2, 3, 1, 2], [4, 5], [6, 6, 6]]
PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture
def counted(monkeypatch):
    """Counters of what reads a model's spec or header: resolve_model per spec, the header's architecture read
    (families._gguf_architecture) and gguf's reader parses (the fast reader's constructions) per file."""
    counts = {"resolve": collections.Counter(), "architecture": collections.Counter(), "reader": collections.Counter()}
    resolve, arch = loader.resolve_model, _gguf_architecture

    def counting_resolve(spec, key="target.model"):
        counts["resolve"][spec] += 1
        return resolve(spec, key)

    def counting_arch(path):
        counts["architecture"][path] += 1
        return arch(path)

    monkeypatch.setattr(loader, "resolve_model", counting_resolve)
    monkeypatch.setattr(families, "_gguf_architecture", counting_arch)
    reader_cls = _reader_class()
    init = reader_cls.__init__

    def counting_init(self, path, *a, **k):
        counts["reader"][str(path)] += 1
        return init(self, path, *a, **k)

    monkeypatch.setattr(reader_cls, "__init__", counting_init)
    return counts


def _specs(cfg: dict) -> collections.Counter:
    """Each spec the config names, once."""
    want = collections.Counter([cfg["target"]["model"]])
    if cfg["draft"].get("model"):
        want[cfg["draft"]["model"]] += 1
    return want


@pytest.mark.parametrize("method", ["model", "eagle3", "self-w8", "suffix"])
def test_an_engine_resolves_each_spec_once(eagle3_models, counted, method):
    cfg = tiny_config(eagle3_models, method=method)
    eng = Engine.from_config(cfg)
    assert counted["resolve"] == _specs(cfg)
    assert len(eng.generate(PROMPTS, PARAMS)) == len(PROMPTS)
    assert counted["resolve"] == _specs(cfg)  # and nothing after start


def test_a_gguf_engine_reads_its_header_once(tmp_path, counted):
    """A GGUF target with its self-w4 draft: the spec resolved once, the header's architecture read once (at
    resolution), and gguf's reader parses the file once for the tokenizer, the config, the weights and the
    draft's native blocks."""
    from support.gguf_writer import write_tiny_gguf

    path = write_tiny_gguf(str(tmp_path / "tiny.gguf"))
    cfg = {
        "target": {"model": path, "weights": "native"},
        "draft": {"method": "self-w4", "num_speculative_tokens": 3},
        "engine": {"max_model_len": 64, "max_batch_size": 2, "device": "cpu"},
    }
    eng = Engine.from_config(cfg)
    assert counted["resolve"] == {path: 1}
    assert counted["architecture"] == {path: 1}
    assert sum(counted["reader"].values()) == 1
    assert len(eng.generate([[1, 2, 3]], PARAMS)[0].token_ids) == PARAMS.max_tokens
    # a worker's load (no enclosing scope): the weights and the native blocks from one parse too
    counted["reader"].clear()
    loader.load_model(loader.resolve_model(path), "float32", weights="native")
    assert sum(counted["reader"].values()) == 1


def test_the_sources_resolve_each_spec_once_and_keep_what_they_read(eagle3_models, counted):
    cfg = load_config(tiny_config(eagle3_models, method="eagle3"))
    sources = resolve_sources(cfg)
    assert sources.resolved and counted["resolve"] == _specs(cfg.to_dict())
    assert sources.target is sources.target and sources.draft.directory.endswith("head")
    sources.read_target_metadata()
    tokenizer, config = sources.tokenizer(), sources.config()
    assert sources.vocab_size() == 8 and 7 in sources.eos_ids()
    # what a worker receives: the resolved files and the metadata, without the tokenizer
    copy = pickle.loads(pickle.dumps(sources))
    assert copy.resolved and copy.target == sources.target and copy.draft == sources.draft
    assert (
        copy.vocab_size() == 8 and copy.eos_ids() == sources.eos_ids() and copy.config().to_dict() == config.to_dict()
    )
    assert sources.tokenizer() is tokenizer
    assert counted["resolve"] == _specs(cfg.to_dict())


def test_a_bad_spec_is_refused_at_start_naming_its_key(tiny_models, tmp_path):
    bad = str(tmp_path / "no-such-model")
    for key in ("target", "draft"):
        cfg = tiny_config(tiny_models, method="model")
        cfg[key]["model"] = bad
        with pytest.raises(ConfigError) as ei:
            resolve_sources(load_config(cfg))
        assert ei.value.key == f"{key}.model" and "no-such-model" in str(ei.value)
        with pytest.raises(ConfigError) as ei:
            Engine.from_config(cfg)
        assert ei.value.key == f"{key}.model"
    # unresolved sources (a Deployment not given any): the error comes where the spec is first used
    lazy = ModelSources(bad)
    with pytest.raises(ConfigError) as ei:
        _ = lazy.target
    assert ei.value.key == "target.model"


class _Remote:
    """An in-process actor as a Ray handle: ``handle.method.remote(*args)`` calls it on copies of the arguments
    pickled as Ray pickles them."""

    def __init__(self, actor):
        self._actor = actor

    def __getattr__(self, name):
        method = getattr(self._actor, name)

        class _Method:
            @staticmethod
            def remote(*args, **kwargs):
                args, kwargs = pickle.loads(pickle.dumps((args, kwargs)))
                return method(*args, **kwargs)

        return _Method


@pytest.mark.parametrize("method", ["model", "eagle3", "suffix"])
def test_workers_loaded_as_a_deployment_loads_them_resolve_nothing(eagle3_models, counted, method):
    """``specdist serve`` with a deployment: start_backend resolves the specs and reads the target's metadata;
    the deployment's load calls carry those sources (resolved, not specs) to the target rank and the draft
    worker, which resolve nothing; the RemoteEngine over them takes the same sources. Each spec is resolved
    once in all, and the RemoteEngine gives the in-process engine's tokens."""
    from cluster.deployment import ClusterSpec, Deployment, _Handle
    from specdist.engine.remote import RemoteEngine
    from workers.actors import DraftActor, TargetRankActor

    cfg = load_config(tiny_config(eagle3_models, method=method))
    want = _specs(cfg.to_dict())
    sources = resolve_sources(cfg).read_target_metadata()  # what start_backend does at start
    dep = Deployment(ClusterSpec(tensor_parallel_size=1, num_draft_workers=1))
    dep.config, dep.sources = cfg, sources
    target, draft = TargetRankActor(0, 1, num_threads=None), DraftActor(0, num_threads=None)
    calls = []

    class _Recording(_Remote):
        def __getattr__(self, name):
            m = super().__getattr__(name)

            class _Method:
                @staticmethod
                def remote(*args, **kwargs):
                    calls.append(args)
                    return m.remote(*args, **kwargs)

            return _Method

    try:
        load_call = dep._load_call  # noqa: SLF001 - what the deployment sends each actor to load, without Ray
        load_call(_Handle("target rank 0", _Recording(target), "target"))
        load_call(_Handle("draft 0", _Recording(draft), "draft"))
        # the load calls carry the resolved sources, not the specs
        assert isinstance(calls[0][0], ModelSources) and calls[0][0].resolved
        assert isinstance(calls[1][1], ModelSources) and calls[1][1].resolved
        assert counted["resolve"] == want
        target.warmup()
        draft.warmup()
        t_addr, d_addr = target.start_grpc("127.0.0.1", 0), draft.start_grpc("127.0.0.1", 0)
        with RemoteEngine.from_addresses(cfg, t_addr, [d_addr], sources=sources) as remote:
            got = [o.token_ids for o in remote.generate(PROMPTS, PARAMS)]
        assert counted["resolve"] == want
        local = Engine.from_config(cfg, sources=sources)
        assert got == [o.token_ids for o in local.generate(PROMPTS, PARAMS)]
        assert counted["resolve"] == want
    finally:
        target.shutdown()
        draft.shutdown()


@pytest.mark.slow
def test_loading_leaves_gguf_and_transformers_as_they_were(tmp_path):
    """In a fresh process (a clean import order): gguf's GGUFReader and get_tensor_name_map and transformers'
    load_gguf_checkpoint are captured before specdist is imported; loading a GGUF model and its tokenizer
    replaces them inside gguf_parsed_once only, and leaves the originals in place after."""
    from support.gguf_writer import write_tiny_gguf

    path = write_tiny_gguf(str(tmp_path / "tiny.gguf"))
    script = textwrap.dedent(f"""
        import json
        import gguf
        import transformers.modeling_gguf_pytorch_utils as gguf_utils

        def current():
            return (gguf.GGUFReader, gguf.get_tensor_name_map, gguf_utils.load_gguf_checkpoint)

        before = current()
        import specdist
        from specdist.engine.local import Engine
        from specdist.models.loader import gguf_parsed_once, load_model, load_tokenizer, resolve_model
        from specdist.models.metadata import ModelSources

        out = {{"after_import": [a is b for a, b in zip(current(), before)]}}
        src = resolve_model({path!r})
        with gguf_parsed_once():
            out["inside"] = [a is b for a, b in zip(current(), before)]
            load_tokenizer(src)
            load_model(src, "float32", weights="native")
            with gguf_parsed_once():
                pass
            out["inside_after_nested"] = [a is b for a, b in zip(current(), before)]
        out["after_load"] = [a is b for a, b in zip(current(), before)]
        ModelSources({path!r}).read_target_metadata()
        Engine.from_config({{"target": {{"model": {path!r}}}, "draft": {{"method": "none"}},
                             "engine": {{"max_model_len": 32, "max_batch_size": 1, "device": "cpu"}}}})
        out["after_engine"] = [a is b for a, b in zip(current(), before)]
        print(json.dumps(out))
    """)
    run = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["after_import"] == [True] * 3
    assert out["inside"] == [False] * 3 and out["inside_after_nested"] == [False] * 3
    assert out["after_load"] == [True] * 3 and out["after_engine"] == [True] * 3


def test_the_fast_reader_is_gone_once_the_scope_closes(tmp_path):
    """In this process too: after a load, gguf.GGUFReader makes gguf's own readers again."""
    import gguf
    from support.gguf_writer import write_tiny_gguf

    from specdist.models.loader import gguf_parsed_once

    path = write_tiny_gguf(str(tmp_path / "tiny.gguf"))
    with gguf_parsed_once():
        inside = gguf.GGUFReader(path)
    assert type(inside) is _reader_class()
    assert type(gguf.GGUFReader(path)) is gguf.gguf_reader.GGUFReader
