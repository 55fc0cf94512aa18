"""A prompt is encoded once per request (specdist.engine.prompts): templated, tokenized and checked
where it arrives, then handed down as an EncodedPrompt that nothing encodes or checks again, both
through the engine's own drivers (Engine.generate / stream / add_request) and through the
coordinator (Coordinator.open, which encodes on its tokenizer threads)."""

from __future__ import annotations

import asyncio
import sys

import pytest
from support.helpers import tiny_config

from specdist.api.coordinator import Coordinator
from specdist.engine import prompts
from specdist.engine.local import Engine
from specdist.sampling_params import SamplingParams

PARAMS = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)


@pytest.fixture
def engine(tiny_models):
    eng = Engine.from_config(tiny_config(tiny_models, "ngram", 2))
    yield eng
    eng.close()


@pytest.fixture
def counts(engine, monkeypatch) -> dict[str, int]:
    """Calls of the prompt rule (encode_prompt, wherever it was imported) and of the tokenizer's encode."""
    n = {"encode_prompt": 0, "tokenizer": 0}
    rule, tokenize = prompts.encode_prompt, engine.tokenizer.encode

    def counted_rule(*args, **kwargs):
        n["encode_prompt"] += 1
        return rule(*args, **kwargs)

    def counted_tokenize(*args, **kwargs):
        n["tokenizer"] += 1
        return tokenize(*args, **kwargs)

    for name, module in list(sys.modules.items()):
        if name.startswith("specdist") and getattr(module, "encode_prompt", None) is rule:
            monkeypatch.setattr(module, "encode_prompt", counted_rule)
    monkeypatch.setattr(engine.tokenizer, "encode", counted_tokenize)
    return n


def test_engine_generate_encodes_each_prompt_once(engine, counts) -> None:
    outs = engine.generate(["a b c", [1, 2, 3]], PARAMS)
    assert counts == {"encode_prompt": 2, "tokenizer": 1}  # one rule each; only the text is tokenized
    assert outs[0].prompt == "a b c" and outs[0].prompt_token_ids == engine.tokenizer.encode("a b c")
    assert [len(o.token_ids) for o in outs] == [3, 3]


def test_engine_stream_encodes_its_prompt_once(engine, counts) -> None:
    assert "".join(engine.stream("a b", PARAMS)) == engine.last_output.text
    assert counts == {"encode_prompt": 1, "tokenizer": 1}


def test_coordinator_open_encodes_each_prompt_once(engine, counts) -> None:
    async def run() -> list:
        async with Coordinator(engine) as coord:
            outs = []
            for prompt in ("a b c", [1, 2, 3]):
                stream = await coord.open(prompt, PARAMS)
                outs.append([d async for d in stream])
            return outs

    text, ids = asyncio.run(run())
    assert counts == {"encode_prompt": 2, "tokenizer": 1}  # not again on the engine thread
    for deltas in (text, ids):
        assert deltas[-1].finish_reason == "length"
        assert sum(len(d.token_ids) for d in deltas) == 3
        m = deltas[-1].metrics
        assert m.arrival_time <= m.first_token_time  # the arrival is the prompt's, before its tokenizing


def test_an_encoded_prompt_is_taken_as_it_is(engine, counts) -> None:
    encoded = engine.encode("a b c")
    req = engine.add_request(encoded, PARAMS)
    assert counts == {"encode_prompt": 1, "tokenizer": 1}  # the encode above; add_request encodes nothing
    assert (req.prompt, req.prompt_ids, req.metrics.arrival_time) == ("a b c", encoded.ids, encoded.arrival)
    assert req.metrics.prompt_tokens == len(encoded.ids)
    engine.abort(req.request_id)
