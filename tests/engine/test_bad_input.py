"""Bad requests and bad configs: each must be a clear error naming the field or key.

Request problems raise :class:`specdist.InvalidArgument` (``.field``); deployment
config problems raise :class:`specdist.ConfigError` (``.key``). Either way the
message names the field, and a bad request leaves the engine serving and holding
no KV slot.
"""

from __future__ import annotations

import math
import os

import pytest
from support.helpers import tiny_config

import specdist
from specdist import ConfigError, Engine, InvalidArgument, SamplingParams

MAX_LEN = 12


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one torch thread (conftest)


@pytest.fixture(scope="module")
def engine(tiny_models):
    # A model draft, so both the target and the draft KV caches are checked.
    return Engine.from_config(tiny_config(tiny_models, "model", 3, max_model_len=MAX_LEN, max_batch_size=4))


def assert_idle(eng: Engine) -> None:
    assert not eng.waiting and not eng.running and not eng.has_unfinished()
    used = eng.kv_slots_in_use()
    assert set(used) == {"target", "draft"}
    assert all(v == 0 for v in used.values()), used


def assert_serves(eng: Engine) -> None:
    """After an error: nothing held, and a good request still completes."""
    assert_idle(eng)
    out = eng.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == 4 and out.finish_reason == "length"
    assert_idle(eng)


def check_invalid(excinfo, field: str) -> None:
    e = excinfo.value
    assert isinstance(e, InvalidArgument) and isinstance(e, specdist.SpecDistError) and isinstance(e, ValueError)
    assert e.field == field
    assert field in str(e)


def check_config(excinfo, key: str) -> None:
    e = excinfo.value
    assert isinstance(e, ConfigError) and isinstance(e, specdist.SpecDistError)
    assert e.key == key
    assert key in str(e)


# --------------------------------------------------------------------------- prompts
@pytest.mark.parametrize("prompt", ["", "   ", []], ids=["empty-text", "blank-text", "empty-ids"])
def test_empty_prompt(engine, prompt):
    with pytest.raises(InvalidArgument) as ei:
        engine.add_request(prompt, SamplingParams(max_tokens=2))
    check_invalid(ei, "prompt")
    assert "empty" in str(ei.value)
    assert_serves(engine)


@pytest.mark.parametrize(
    "prompt",
    [[1] * MAX_LEN, [2] * (MAX_LEN + 5), " ".join(["a"] * MAX_LEN)],
    ids=["ids-at-limit", "ids-over-limit", "text-at-limit"],
)
def test_prompt_longer_than_context(engine, prompt):
    with pytest.raises(InvalidArgument) as ei:
        engine.add_request(prompt, SamplingParams(max_tokens=2))
    check_invalid(ei, "prompt")
    assert str(MAX_LEN) in str(ei.value)
    assert_serves(engine)


def test_prompt_one_below_context_is_fine(engine):
    out = engine.generate([[1] * (MAX_LEN - 1)], SamplingParams(max_tokens=5, ignore_eos=True))[0]
    assert len(out.token_ids) == 1 and out.finish_reason == "length"
    assert_idle(engine)


@pytest.mark.parametrize("prompt", [[0, 8], [1, 2, 100], [-1], [3, 2**40]])
def test_token_id_outside_vocabulary(engine, prompt):
    with pytest.raises(InvalidArgument) as ei:
        engine.add_request(prompt)
    check_invalid(ei, "prompt")
    assert "vocabulary" in str(ei.value)
    assert_serves(engine)


@pytest.mark.parametrize("prompt", [None, [[1, 2]], ["a", "b"], [True, 2], [0, 2.5]], ids=repr)
def test_prompt_not_token_ids(engine, prompt):
    req = None
    try:
        with pytest.raises(InvalidArgument) as ei:
            req = engine.add_request(prompt)  # [0, 2.5] must not silently become [0, 2]
    finally:
        if req is not None:  # accepted by mistake: do not leave it queued for the next test
            engine.abort(req.request_id)
    check_invalid(ei, "prompt")
    assert_serves(engine)


# --------------------------------------------------------------------------- sampling params
@pytest.mark.parametrize(
    "field,value",
    [
        ("temperature", -0.1),
        ("temperature", -1),
        ("temperature", math.nan),
        ("temperature", math.inf),
        ("temperature", "1.0"),
        ("top_p", 0),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_p", -0.2),
        ("top_p", math.nan),
        ("top_k", -1),
        ("top_k", 2.0),
        ("max_tokens", 0),
        ("max_tokens", -3),
        ("max_tokens", 2.5),
        ("max_tokens", True),
        ("seed", -1),
        ("seed", 1.5),
        ("stop", [""]),
        ("stop", ["ok", ""]),
        ("stop", [3]),
        ("stop_token_ids", [-1]),
        ("stop_token_ids", ["a"]),
    ],
)
def test_bad_sampling_params(engine, field, value):
    with pytest.raises(InvalidArgument) as ei:
        SamplingParams(**{field: value})
    check_invalid(ei, field)
    assert_serves(engine)


@pytest.mark.parametrize("seed", [2**64, 2**70])
def test_seed_too_large(engine, seed):
    """A seed the per-request generator cannot take must be InvalidArgument('seed'), not a raw torch error."""
    req = None
    try:
        with pytest.raises(InvalidArgument) as ei:
            req = engine.add_request([1, 2], SamplingParams(max_tokens=2, seed=seed))
    finally:
        if req is not None:
            engine.abort(req.request_id)
    check_invalid(ei, "seed")
    assert_serves(engine)


def test_largest_seed_is_fine(engine):
    out = engine.generate([[1, 2]], SamplingParams(max_tokens=2, seed=2**64 - 1, ignore_eos=True))[0]
    assert len(out.token_ids) == 2
    assert_idle(engine)


def test_params_not_sampling_params(engine):
    with pytest.raises(InvalidArgument) as ei:
        engine.add_request([1, 2], {"temperature": 0})
    check_invalid(ei, "params")
    assert_serves(engine)


def test_generate_bad_arguments(engine):
    with pytest.raises(InvalidArgument) as ei:
        engine.generate("a b c")
    check_invalid(ei, "prompts")
    with pytest.raises(InvalidArgument) as ei:
        engine.generate([1, 2, 3])
    check_invalid(ei, "prompts")
    with pytest.raises(InvalidArgument) as ei:
        engine.generate([[1], [2]], [SamplingParams()] * 3)
    check_invalid(ei, "params")
    assert_serves(engine)


@pytest.mark.parametrize("bad_at", [0, 1, 2])
@pytest.mark.parametrize("kind", ["empty", "vocab", "too-long", "params"])
def test_generate_with_one_bad_prompt(engine, kind, bad_at):
    good = [[1, 2, 3], "a b", [4]]
    params = [SamplingParams(max_tokens=5, temperature=0)] * 3
    field = "prompt"
    if kind == "empty":
        good[bad_at] = []
    elif kind == "vocab":
        good[bad_at] = [1, 9]
    elif kind == "too-long":
        good[bad_at] = [1] * (MAX_LEN + 1)
    else:
        params = list(params)
        params[bad_at] = "temperature=0"
        field = "params"
    with pytest.raises(InvalidArgument) as ei:
        engine.generate(good, params)
    check_invalid(ei, field)
    assert_serves(engine)


# --------------------------------------------------------------------------- configs
def _cfg(tiny_models, **over):
    cfg = tiny_config(tiny_models, "model", 3)
    for dotted, value in over.items():
        section, key = dotted.split("__")
        cfg.setdefault(section, {})[key] = value
    return cfg


@pytest.mark.parametrize(
    "over,key",
    [
        ({"draft__method": "medusa"}, "draft.method"),
        ({"draft__num_speculative_tokens": 0}, "draft.num_speculative_tokens"),
        ({"draft__num_speculative_tokens": -2}, "draft.num_speculative_tokens"),
        ({"draft__num_speculative_tokens": 65}, "draft.num_speculative_tokens"),
        ({"draft__num_speculative_tokens": 2.0}, "draft.num_speculative_tokens"),
        ({"draft__num_speculative_tokens": "3"}, "draft.num_speculative_tokens"),
        ({"engine__max_batch_size": "4"}, "engine.max_batch_size"),
        ({"engine__max_batch_size": 0}, "engine.max_batch_size"),
        ({"engine__max_model_len": True}, "engine.max_model_len"),
        ({"engine__device": 5}, "engine.device"),
        ({"engine__device": "tpu"}, "engine.device"),
        ({"engine__seed": -1}, "engine.seed"),
        ({"sampling__coupling": "argmax"}, "sampling.coupling"),
        ({"draft__q_top_k": -1}, "draft.q_top_k"),
        ({"sampling__couplings": "gumbel"}, "sampling.couplings"),
        ({"engine__compile": "max-autotune"}, "engine.compile"),
        ({"engine__compile": 1}, "engine.compile"),
        ({"engine__compile_cache_dir": ""}, "engine.compile_cache_dir"),
        ({"engine__max_model_len": None}, "engine.max_model_len"),
        ({"target__model": 5}, "target.model"),
        ({"target__model": ""}, "target.model"),
        ({"target__dtype": "float64"}, "target.dtype"),
        ({"engine__bogus": 1}, "engine.bogus"),
        ({"draft__num_speculative_token": 3}, "draft.num_speculative_token"),
        ({"target__path": "x"}, "target.path"),
    ],
)
def test_bad_config_values(tiny_models, over, key):
    with pytest.raises(ConfigError) as ei:
        Engine.from_config(_cfg(tiny_models, **over))
    check_config(ei, key)


def test_unknown_top_level_key(tiny_models):
    cfg = tiny_config(tiny_models, "model", 3)
    cfg["speculative"] = {"k": 3}
    with pytest.raises(ConfigError) as ei:
        Engine.from_config(cfg)
    check_config(ei, "speculative")


@pytest.mark.parametrize("section", ["target", "draft", "engine"])
def test_section_not_a_mapping(tiny_models, section):
    cfg = tiny_config(tiny_models, "model", 3)
    cfg[section] = "oops"
    with pytest.raises(ConfigError) as ei:
        Engine.from_config(cfg)
    check_config(ei, section)


def test_draft_model_with_non_model_method(tiny_models):
    cfg = tiny_config(tiny_models, "ngram", 3)
    cfg["draft"]["model"] = tiny_models["draft"]
    with pytest.raises(ConfigError) as ei:
        Engine.from_config(cfg)
    check_config(ei, "draft.model")


def test_model_method_without_draft_model(tiny_models):
    cfg = tiny_config(tiny_models, "model", 3)
    del cfg["draft"]["model"]
    with pytest.raises(ConfigError) as ei:
        Engine.from_config(cfg)
    check_config(ei, "draft.model")


def test_draft_with_other_vocabulary(tiny_models):
    cfg = tiny_config(tiny_models, "model", 3)
    cfg["draft"]["model"] = tiny_models["draft_vocab9"]
    with pytest.raises(ConfigError) as ei:
        Engine.from_config(cfg)
    check_config(ei, "draft.model")
    assert "9" in str(ei.value) and "8" in str(ei.value)


@pytest.mark.parametrize("which", ["target", "draft"])
def test_model_path_missing(tiny_models, tmp_path, which):
    cfg = tiny_config(tiny_models, "model", 3)
    cfg[which]["model"] = str(tmp_path / "no-such-model")
    with pytest.raises(ConfigError) as ei:
        Engine.from_config(cfg)
    check_config(ei, f"{which}.model")
    assert "no-such-model" in str(ei.value)


@pytest.mark.parametrize("which", ["target", "draft"])
def test_directory_without_config_json(tiny_models, tmp_path, which):
    d = tmp_path / "empty-model-dir"
    d.mkdir()
    (d / "model.safetensors").write_bytes(b"")
    cfg = tiny_config(tiny_models, "model", 3)
    cfg[which]["model"] = str(d)
    with pytest.raises(ConfigError) as ei:
        Engine.from_config(cfg)
    check_config(ei, f"{which}.model")
    assert "config.json" in str(ei.value)


def test_missing_gguf(tiny_models, tmp_path):
    cfg = tiny_config(tiny_models, "none", 3)
    cfg["target"]["model"] = str(tmp_path / "model.Q4_0.gguf")
    with pytest.raises(ConfigError) as ei:
        Engine.from_config(cfg)
    check_config(ei, "target.model")
    assert "model.Q4_0.gguf" in str(ei.value)


def test_bad_yaml_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("target:\n  model: [unclosed\ndraft: {method: model\n", encoding="utf-8")
    with pytest.raises(ConfigError) as ei:
        Engine.from_config(str(path))
    assert isinstance(ei.value, ConfigError) and ei.value.key == "<file>"
    assert str(path) in str(ei.value) and "YAML" in str(ei.value)


def test_yaml_file_with_bad_key(tiny_models, tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_text(
        f"target:\n  model: {tiny_models['target']}\ndraft:\n  method: ngram\n  num_speculative_tokens: 0\n",
        encoding="utf-8",
    )
    with pytest.raises(ConfigError) as ei:
        Engine.from_config(os.fspath(path))
    check_config(ei, "draft.num_speculative_tokens")


def test_yaml_file_not_a_mapping(tmp_path):
    path = tmp_path / "list.yaml"
    path.write_text("- a\n- b\n", encoding="utf-8")
    with pytest.raises(ConfigError) as ei:
        Engine.from_config(str(path))
    check_config(ei, "<root>")


def test_config_file_missing(tmp_path):
    path = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError) as ei:
        Engine.from_config(str(path))
    assert ei.value.key == "<file>" and str(path) in str(ei.value)


def test_good_yaml_file_loads(tiny_models, tmp_path):
    path = tmp_path / "ok.yaml"
    path.write_text(
        f"target:\n  model: {tiny_models['target']}\ndraft:\n  method: ngram\n  num_speculative_tokens: 2\n"
        "engine:\n  max_model_len: 32\n  device: cpu\n",
        encoding="utf-8",
    )
    eng = Engine.from_config(str(path))
    out = eng.generate(["a b c"], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == 3
