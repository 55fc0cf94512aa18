"""Log-probabilities of output tokens (``SamplingParams.logprobs``, specdist/logprobs.py).

The reference is a plain transformers forward of the tiny target over prompt + output (no
cache), through :func:`specdist.cores.sampling.process_logits` with the request's settings, then the
log: every emitted token's value and every top list must match it (fp32, 1e-4), whether the
token was an accepted draft or the target's own. Then the same values through the wire (the
remote transports, the gRPC API) and the OpenAI shapes of the HTTP API, the refusals naming the
field, and requests that do not ask paying nothing.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import grpc
import openai
import pytest
import torch

try:  # the HTTP library the openai client is built on (httpx2 in recent releases)
    import httpx2 as httpx
except ImportError:
    import httpx

from support.helpers import remote_engine_like, serving_in_process, tiny_config

from specdist import Engine, InvalidArgument, SamplingParams
from specdist.client import RemoteError, SpecDistClient
from specdist.cores import verify_batch as verifying
from specdist.cores.sampling import process_logits
from specdist.logprobs import TokenLogprob

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = [1, 2, 3, 4]
TOL = 1e-4
CASES = {  # seeded, sampled with each filter; greedy: p is one-hot
    "top_p": SamplingParams(max_tokens=14, temperature=0.8, top_p=0.9, seed=11, ignore_eos=True, logprobs=5),
    "top_k": SamplingParams(max_tokens=14, temperature=1.2, top_k=3, seed=12, ignore_eos=True, logprobs=8),
    "greedy": SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=2),
}


@pytest.fixture(scope="module")
def hf_target(tiny_models):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_models["target"], torch_dtype=torch.float32).eval()


@pytest.fixture(scope="module", params=["model", "none"])
def engine(request, tiny_models):
    eng = Engine.from_config(tiny_config(tiny_models, request.param, 3))
    yield eng
    eng.close()


def reference(hf_target, prompt: list[int], output: list[int], sp: SamplingParams) -> torch.Tensor:
    """[len(output), V] log p of the processed distribution at each output position (no cache)."""
    with torch.no_grad():
        logits = hf_target(torch.tensor([prompt + output])).logits[0].float()  # [L, V]
    rows = logits[len(prompt) - 1 : len(prompt) - 1 + len(output)]  # [n, V] the logits each output token followed
    n = len(output)
    p = process_logits(
        rows, torch.full((n,), sp.temperature), torch.full((n,), sp.top_k, dtype=torch.long), torch.full((n,), sp.top_p)
    )
    return p.log()


def assert_matches(got: list[TokenLogprob], ref: torch.Tensor, output: list[int], num_top: int) -> None:
    assert len(got) == len(output) == len(ref)
    for j, (lp, tok) in enumerate(zip(got, output)):
        assert math.isfinite(lp.logprob)
        assert lp.logprob == pytest.approx(float(ref[j, tok]), abs=TOL), j
        possible = ref[j][ref[j] > -math.inf]  # tokens with p > 0 under the processed distribution
        want = possible.sort(descending=True).values[:num_top].tolist()
        assert [v for _, v in lp.top] == pytest.approx(want, abs=TOL), j  # the N largest, most likely first
        for t, v in lp.top:  # each listed id has its listed value (ties may come in any order)
            assert v == pytest.approx(float(ref[j, t]), abs=TOL), (j, t)
        assert len({t for t, _ in lp.top}) == len(lp.top)


@pytest.mark.parametrize("case", sorted(CASES))
def test_logprobs_equal_a_plain_forward_of_the_processed_distribution(engine, hf_target, case):
    sp = CASES[case]
    [out] = engine.generate([PROMPT], sp)
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids) == sp.max_tokens
    assert_matches(out.logprobs, reference(hf_target, PROMPT, out.token_ids, sp), out.token_ids, sp.logprobs)
    if engine.k and case != "greedy":  # accepted drafts and the target's own tokens both among them
        assert 0 < out.metrics.accepted < out.metrics.output_tokens
    if case == "greedy":  # one-hot p: the token has log 1 and is alone in its top list
        assert all(lp.logprob == 0.0 and lp.top == ((t, 0.0),) for lp, t in zip(out.logprobs, out.token_ids))


def test_zero_asks_for_the_token_alone_and_a_batch_mixes_askers(engine, hf_target):
    sp = dataclass_replace(CASES["top_p"], logprobs=0)
    plain = dataclass_replace(CASES["top_p"], logprobs=None, seed=5)
    few = dataclass_replace(CASES["top_k"], logprobs=1)
    outs = engine.generate([PROMPT, [2, 3], [5, 6, 1]], [sp, plain, few])
    assert outs[1].logprobs is None
    assert all(lp.top == () for lp in outs[0].logprobs)
    assert_matches(outs[0].logprobs, reference(hf_target, PROMPT, outs[0].token_ids, sp), outs[0].token_ids, 0)
    assert_matches(outs[2].logprobs, reference(hf_target, [5, 6, 1], outs[2].token_ids, few), outs[2].token_ids, 1)
    # asking changes nothing else: the same tokens as without
    [again] = engine.generate([PROMPT], dataclass_replace(sp, logprobs=None))
    assert again.token_ids == outs[0].token_ids and again.logprobs is None


def test_requests_that_do_not_ask_cost_nothing(engine, monkeypatch):
    calls = []
    real = verifying._logprob_values
    monkeypatch.setattr(verifying, "_logprob_values", lambda *a: calls.append(a) or real(*a))
    [out] = engine.generate([PROMPT], dataclass_replace(CASES["top_p"], logprobs=None))
    assert out.logprobs is None and calls == []  # no gather, no top-k over the vocabulary
    engine.generate([PROMPT], dataclass_replace(CASES["top_p"], max_tokens=2))
    assert calls  # the spy sees the askers


def test_the_wire_carries_the_same_values(tiny_models):
    eng = Engine.from_config(tiny_config(tiny_models, "model", 3))
    remote, served = remote_engine_like(eng)
    try:
        sps = [CASES["top_p"], dataclass_replace(CASES["top_k"], logprobs=None)]
        local = eng.generate([PROMPT, [3, 2]], sps)
        wired = remote.generate([PROMPT, [3, 2]], sps)
        assert [o.token_ids for o in wired] == [o.token_ids for o in local]
        assert wired[0].logprobs == local[0].logprobs  # float32 values: exact through the wire's floats
        assert wired[1].logprobs is None
    finally:
        remote.close()
        served.close()
        eng.close()


@pytest.mark.parametrize("value", [21, -1, True, 2.0])
def test_sampling_params_refuse_bad_values(value):
    with pytest.raises(InvalidArgument) as e:
        SamplingParams(logprobs=value)
    assert e.value.field == "logprobs"


def dataclass_replace(sp: SamplingParams, **changes) -> SamplingParams:
    import dataclasses

    return dataclasses.replace(sp, **changes)


# ---------------------------------------------------------------- the public APIs
@pytest.fixture(scope="module")
def srv(tiny_models):
    with serving_in_process(tiny_models) as (engine, serving), httpx.Client(trust_env=False, timeout=30) as http:
        s = SimpleNamespace(
            engine=engine,
            http=http,
            grpc=SpecDistClient(serving.address),
            model=engine.config.target.model,
            client=openai.OpenAI(
                base_url=f"http://{serving.http.address}/v1", api_key="unused", max_retries=0, http_client=http
            ),
        )
        yield s
        s.grpc.close()


SAMPLED = dict(max_tokens=10, temperature=0.8, top_p=0.9, seed=21)


def grpc_logprobs(s, prompt, n: int, **kw) -> tuple[list[int], list[TokenLogprob]]:
    ids, lps = [], []
    for chunk in s.grpc.generate(prompt, logprobs=n, ignore_eos=True, **SAMPLED, **kw):
        ids += chunk.token_ids
        lps += chunk.logprobs or []
    assert len(ids) == len(lps) == SAMPLED["max_tokens"]
    return ids, lps


def test_completions_logprobs_in_openai_shape(srv):
    ids, want = grpc_logprobs(srv, "a b c", 3)
    tok = srv.engine.tokenizer
    offsets = None  # the unstreamed answer's offsets, which the streamed one must repeat
    for stream in (False, True):
        kw = dict(model=srv.model, prompt="a b c", logprobs=3, extra_body={"ignore_eos": True}, **SAMPLED)
        if stream:
            chunks = list(srv.client.completions.create(stream=True, **kw))
            blocks = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
            text = "".join(c.choices[0].text for c in chunks if c.choices)
            lp = SimpleNamespace(
                **{
                    f: sum((getattr(b, f) for b in blocks), [])
                    for f in ("tokens", "token_logprobs", "top_logprobs", "text_offset")
                }
            )
        else:
            got = srv.client.completions.create(**kw)
            lp, text = got.choices[0].logprobs, got.choices[0].text
        assert lp.token_logprobs == [w.logprob for w in want]
        assert lp.tokens == [tok.decode([t]) for t in ids]
        assert lp.top_logprobs == [{tok.decode([t]): v for t, v in w.top} for w in want]
        # each offset is where the token's text starts in the choice's text (after the space the
        # word-level tokenizer puts between words; EOS, kept by ignore_eos, has no text)
        special = {tok.decode([t]) for t in tok.all_special_ids}
        assert all(t in special or text[o:].lstrip().startswith(t) for o, t in zip(lp.text_offset, lp.tokens))
        assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
        offsets = lp.text_offset if offsets is None else offsets
        assert lp.text_offset == offsets


def test_chat_logprobs_in_openai_shape(srv):
    ids, want = grpc_logprobs(srv, "a b", 2, apply_chat_template=True)
    tok = srv.engine.tokenizer
    for stream in (False, True):
        kw = dict(
            model=srv.model,
            messages=[{"role": "user", "content": "a b"}],
            logprobs=True,
            top_logprobs=2,
            extra_body={"ignore_eos": True},
            **SAMPLED,
        )
        if stream:
            chunks = list(srv.client.chat.completions.create(stream=True, **kw))
            content = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
        else:
            content = srv.client.chat.completions.create(**kw).choices[0].logprobs.content
        assert [e.logprob for e in content] == [w.logprob for w in want]
        assert [e.token for e in content] == [tok.decode([t]) for t in ids]
        assert all(e.bytes == list(e.token.encode()) for e in content)
        assert [[(t.token, t.logprob) for t in e.top_logprobs] for e in content] == [
            [(tok.decode([t]), v) for t, v in w.top] for w in want
        ]
    plain = srv.client.chat.completions.create(
        model=srv.model, messages=[{"role": "user", "content": "a"}], max_tokens=3, logprobs=False
    )
    assert plain.choices[0].logprobs is None  # not asked: none
    plain = srv.client.completions.create(model=srv.model, prompt="a", max_tokens=3)
    assert plain.choices[0].logprobs is None


@pytest.mark.parametrize(
    "endpoint, kwargs, param",
    [
        ("completions", dict(logprobs=21), "logprobs"),
        ("completions", dict(logprobs=-1), "logprobs"),
        ("completions", dict(extra_body={"logprobs": True}), "logprobs"),
        ("chat", dict(top_logprobs=2), "top_logprobs"),
        ("chat", dict(logprobs=False, top_logprobs=0), "top_logprobs"),
        ("chat", dict(logprobs=True, top_logprobs=21), "top_logprobs"),
        ("chat", dict(logprobs=True, top_logprobs=-1), "top_logprobs"),
        ("chat", dict(extra_body={"logprobs": 3}), "logprobs"),
    ],
)
def test_bad_http_values_name_the_field(srv, endpoint, kwargs, param):
    if endpoint == "completions":
        call, kwargs = srv.client.completions.create, {"prompt": "a", **kwargs}
    else:
        call, kwargs = srv.client.chat.completions.create, {"messages": [{"role": "user", "content": "a"}], **kwargs}
    kwargs["model"] = srv.model
    with pytest.raises(openai.BadRequestError) as e:
        call(**kwargs)
    assert e.value.body["param"] == param and e.value.body["message"].startswith(param + ":"), e.value.body


@pytest.mark.parametrize("value", [21, -1])
def test_bad_grpc_value_names_the_field(srv, value):
    with pytest.raises(RemoteError) as e:
        list(srv.grpc.generate("a", max_tokens=2, logprobs=value))
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.message.startswith("params.logprobs:"), e.value.message


def test_wire_round_trips_tell_zero_from_unset():
    from specdist.sampling_proto import sampling_params_from_proto, sampling_params_to_proto
    from specdist.transport.protocol import Verified
    from specdist.transport.wire import verified_from_proto, verified_to_proto
    from specdist.v1 import common_pb2, target_pb2

    for n in (None, 0, 20):
        msg = sampling_params_to_proto(SamplingParams(logprobs=n))
        wire = common_pb2.SamplingParams.FromString(msg.SerializeToString())
        assert sampling_params_from_proto(wire).logprobs == n
    with pytest.raises(InvalidArgument) as e:
        sampling_params_from_proto(common_pb2.SamplingParams(logprobs=21), "items[0].params")
    assert e.value.field == "items[0].params.logprobs"
    results = [
        Verified("a", 1, 4, [TokenLogprob(-0.5, ((4, -0.5), (2, -1.25))), TokenLogprob(0.0, ())]),
        Verified("b", 0, 3),
    ]
    back = verified_from_proto(target_pb2.VerifyResponse.FromString(verified_to_proto(results).SerializeToString()))
    assert back == results
