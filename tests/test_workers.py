"""Target and draft workers over real gRPC (grpc.aio servers in a background thread).

A small coordinator loop in this file drives Prefill -> Start -> Propose -> Verify ->
Propose ... -> Release, applying the engine's own stop rules (OutputState) and draft-length
rule, and the greedy output must equal the single-process Engine's token for token.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import threading
import time

import grpc
import pytest
import torch

from conftest import tiny_config
from specdist.models.loader import ModelSource, eos_token_ids, load_model
from specdist.sampling import process_logits
from specdist.sampling_params import SamplingParams
from specdist.stopping import OutputState
from specdist.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc
from specdist.wire import DENSE, ONE_HOT, SPARSE, encode_distribution, sampling_params_to_proto
from workers.draft_worker import DraftServicer, DraftWorker, draft_seed
from workers.target_worker import TargetServicer, TargetWorker

MAX_LEN, SLOTS, K = 64, 8, 3
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---------------------------------------------------------------- servers
class AioServer:
    """A grpc.aio server on its own event loop thread, on a free localhost port."""

    def __init__(self, add_fns, port: int = 0):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

        async def start():
            server = grpc.aio.server()
            for add in add_fns:
                add(server)
            bound = server.add_insecure_port(f"127.0.0.1:{port}")
            await server.start()
            return server, bound

        self.server, self.port = asyncio.run_coroutine_threadsafe(start(), self.loop).result(30)

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(None), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


def _target_model(tiny_models):
    return load_model(ModelSource(tiny_models["target"], None), "float32")


@pytest.fixture(scope="module")
def workers(tiny_models):
    """Target worker + a model draft worker + an n-gram draft worker, all served over gRPC."""
    target = TargetWorker(_target_model(tiny_models), SLOTS, MAX_LEN)
    model_draft = DraftWorker.from_model(load_model(ModelSource(tiny_models["draft"], None), "float32"), SLOTS, MAX_LEN)
    ngram_draft = DraftWorker.ngram(target.vocab_size, MAX_LEN)
    # the target's own weights as the draft: greedy drafts are then all accepted (the accept path)
    self_draft = DraftWorker.from_model(_target_model(tiny_models), SLOTS, MAX_LEN)
    ts = TargetServicer(target)
    ds = {name: DraftServicer(w) for name, w in (("model", model_draft), ("ngram", ngram_draft), ("self", self_draft))}
    srv_t = AioServer([lambda s: target_pb2_grpc.add_TargetWorkerServicer_to_server(ts, s)])
    srvs = {name: AioServer([lambda s, sv=sv: draft_pb2_grpc.add_DraftWorkerServicer_to_server(sv, s)])
            for name, sv in ds.items()}
    chans = [grpc.insecure_channel(f"127.0.0.1:{s.port}") for s in [srv_t, *srvs.values()]]
    out = {"target": target, "model": model_draft, "ngram": ngram_draft, "self": self_draft,
           "target_stub": target_pb2_grpc.TargetWorkerStub(chans[0]), "eos": eos_token_ids(target.runner.model)}
    for name, ch in zip(srvs, chans[1:]):
        out[f"{name}_stub"] = draft_pb2_grpc.DraftWorkerStub(ch)
    yield out
    for c in chans:
        c.close()
    for s in [srv_t, *srvs.values()]:
        s.stop()
    for s in [ts, *ds.values()]:
        s.shutdown()


# ---------------------------------------------------------------- a tiny coordinator
_ids = iter(range(10**9))


def run_generation(tstub, dstub, prompts, params, eos, k=K, seed0=1234, formats_seen=None, prefix="g", stats=None):
    """Drive requests to completion over gRPC; returns each request's output token ids."""
    ids = [f"{prefix}{next(_ids)}" for _ in prompts]
    seeds = [seed0 + i for i in range(len(prompts))]
    tstub.Prefill(target_pb2.PrefillRequest(items=[
        target_pb2.PrefillItem(request_id=i, prompt_token_ids=p, params=sampling_params_to_proto(sp), seed=s)
        for i, p, sp, s in zip(ids, prompts, params, seeds)]))
    dstub.Start(draft_pb2.StartRequest(items=[
        draft_pb2.StartItem(request_id=i, prompt_token_ids=p, params=sampling_params_to_proto(sp), seed=draft_seed(s))
        for i, p, sp, s in zip(ids, prompts, params, seeds)]))
    st = {i: {"seq": list(p), "out": OutputState(sp, eos), "acc": 0, "new": [], "params": sp}
          for i, p, sp in zip(ids, prompts, params)}
    running = list(ids)
    while running:
        ks = {}
        for i in running:
            s = st[i]
            remaining = s["params"].max_tokens - len(s["out"].token_ids)
            ks[i] = max(0, min(k, remaining - 1, MAX_LEN - len(s["seq"]) - 1))
        prop = dstub.Propose(draft_pb2.ProposeRequest(items=[
            draft_pb2.ProposeItem(request_id=i, num_accepted=st[i]["acc"], new_token_ids=st[i]["new"],
                                  num_tokens=ks[i], seq_len=len(st[i]["seq"]))
            for i in running]))
        assert [p.request_id for p in prop.proposals] == running
        if formats_seen is not None:
            for p in prop.proposals:
                formats_seen.update(d.format for d in p.probs)
        ver = tstub.Verify(target_pb2.VerifyRequest(items=[
            target_pb2.VerifyItem(request_id=i, draft_token_ids=p.token_ids, draft_probs=p.probs,
                                  seq_len=len(st[i]["seq"]))
            for i, p in zip(running, prop.proposals)]))
        done = []
        for i, p, res in zip(running, prop.proposals, ver.results):
            assert res.request_id == i and len(p.token_ids) <= ks[i]
            if stats is not None:
                stats.append((res.num_accepted, len(p.token_ids)))
            s = st[i]
            emitted = list(p.token_ids[: res.num_accepted]) + [res.next_token_id]
            s["seq"] += emitted
            s["acc"], s["new"] = res.num_accepted, [res.next_token_id]
            s["out"].append(emitted)
            if not s["out"].finished and len(s["seq"]) >= MAX_LEN:
                s["out"].finish("length")
            if s["out"].finished:
                done.append(i)
        if done:
            tstub.Release(target_pb2.TargetReleaseRequest(request_ids=done))
            dstub.Release(draft_pb2.DraftReleaseRequest(request_ids=done))
            running = [i for i in running if i not in done]
    return [st[i]["out"].token_ids for i in ids], [st[i]["seq"] for i in ids]


PROMPTS = [[1, 2, 3, 1, 2], [4], [5, 6, 5, 6, 5, 6, 5], [2, 3]]
MAX_TOKENS = [20, 9, 30, 14]


@pytest.mark.parametrize("method", ["model", "ngram", "self"])
def test_greedy_matches_engine(workers, tiny_models, method):
    from specdist.engine import Engine

    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=(i % 2 == 0)) for i, m in enumerate(MAX_TOKENS)]
    cfg = tiny_config(tiny_models, method="ngram" if method == "ngram" else "model", k=K)
    if method == "self":
        cfg["draft"]["model"] = tiny_models["target"]
    engine = Engine.from_config(cfg)
    want = [o.token_ids for o in engine.generate(PROMPTS, params)]
    formats: set[int] = set()
    got, _ = run_generation(workers["target_stub"], workers[f"{method}_stub"], PROMPTS, params, workers["eos"],
                            formats_seen=formats, stats=(stats := []))
    assert got == want
    if method == "self":
        assert all(n_acc == k for n_acc, k in stats)  # a draft equal to the target is always accepted
    else:
        assert any(n_acc < k for n_acc, k in stats)  # rejections happened too
    assert formats <= {ONE_HOT}  # greedy and n-gram drafts ship one-hot q
    assert workers["target"].kv_slots_in_use() == 0 and workers[method].kv_slots_in_use() == 0
    assert not workers["target"].requests and not workers[method].requests


def test_sampled_tokens_in_target_support(workers, tiny_models):
    """temperature 1, top_k 3: every emitted token has p > 0 under the target's processed p."""
    params = [SamplingParams(temperature=1.0, top_k=3, max_tokens=24, ignore_eos=True)] * 3
    prompts = [[1, 2, 3], [4, 5], [6]]
    formats: set[int] = set()
    _, seqs = run_generation(workers["target_stub"], workers["model_stub"], prompts, params, workers["eos"],
                             formats_seen=formats, seed0=7)
    assert SPARSE in formats  # top-k 3 of 8 is a small support
    model = workers["target"].runner.model
    with torch.inference_mode():
        for prompt, seq in zip(prompts, seqs):
            logits = model(torch.tensor([seq[:-1]])).logits[0]  # [T, V]
            n = len(seq) - len(prompt)
            p = process_logits(logits[-n:], torch.ones(n), torch.full((n,), 3), torch.ones(n))
            emitted = torch.tensor(seq[len(prompt):])
            assert bool((p.gather(-1, emitted[:, None]) > 0).all())
    # dense q (no top-k/top-p) also verifies: the fp16 path end to end
    formats.clear()
    run_generation(workers["target_stub"], workers["model_stub"], [[1, 2]],
                   [SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)], workers["eos"],
                   formats_seen=formats)
    assert DENSE in formats or ONE_HOT in formats
    assert workers["target"].kv_slots_in_use() == 0 and workers["model"].kv_slots_in_use() == 0


def _code(fn, *args):
    with pytest.raises(grpc.RpcError) as ei:
        fn(*args)
    return ei.value.code(), ei.value.details()


def test_bad_inputs_get_status_codes(workers):
    t, d = workers["target_stub"], workers["model_stub"]
    C = grpc.StatusCode
    P = target_pb2.PrefillItem
    sp = sampling_params_to_proto(SamplingParams(temperature=0.0))

    def prefill(*items):
        return t.Prefill(target_pb2.PrefillRequest(items=list(items)))

    def verify(*items):
        return t.Verify(target_pb2.VerifyRequest(items=list(items)))

    cases = [
        (lambda: prefill(P(request_id="x", prompt_token_ids=[1], params=sp), P(request_id="x", prompt_token_ids=[2])),
         C.INVALID_ARGUMENT, "items[1].request_id"),
        (lambda: prefill(P(request_id="x", prompt_token_ids=[1, 99])), C.INVALID_ARGUMENT, "items[0].prompt_token_ids"),
        (lambda: prefill(P(request_id="x", prompt_token_ids=[])), C.INVALID_ARGUMENT, "items[0].prompt_token_ids"),
        (lambda: prefill(P(request_id="x", prompt_token_ids=[1] * MAX_LEN)), C.INVALID_ARGUMENT,
         "items[0].prompt_token_ids"),
        (lambda: prefill(P(request_id="x", prompt_token_ids=[1],
                           params=common_pb2.SamplingParams(top_p=1.5))), C.INVALID_ARGUMENT, "items[0].params.top_p"),
        (lambda: prefill(*[P(request_id=f"s{i}", prompt_token_ids=[1]) for i in range(SLOTS + 1)]),
         C.RESOURCE_EXHAUSTED, "items"),
        (lambda: verify(target_pb2.VerifyItem(request_id="nope", seq_len=1)), C.NOT_FOUND, "items[0].request_id"),
    ]
    for fn, code, field in cases:
        got, details = _code(fn)
        assert got == code and details.startswith(field + ":"), (code, field, got, details)
    assert workers["target"].kv_slots_in_use() == 0  # all or nothing: nothing admitted

    prefill(P(request_id="ok", prompt_token_ids=[1, 2, 3], params=sp, seed=1))
    got, details = _code(prefill, P(request_id="ok", prompt_token_ids=[1]))
    assert got == C.ALREADY_EXISTS and details.startswith("items[0].request_id")
    V = target_pb2.VerifyItem
    onehot = common_pb2.DraftDistribution(format=ONE_HOT)
    bad_verify = [
        (V(request_id="ok", seq_len=2), C.FAILED_PRECONDITION, "items[0].seq_len"),
        (V(request_id="ok", seq_len=3, draft_token_ids=[8], draft_probs=[onehot]), C.INVALID_ARGUMENT,
         "items[0].draft_token_ids"),
        (V(request_id="ok", seq_len=3, draft_token_ids=[1, 2], draft_probs=[onehot]), C.INVALID_ARGUMENT,
         "items[0].draft_probs"),
        (V(request_id="ok", seq_len=3, draft_token_ids=[1], draft_probs=[common_pb2.DraftDistribution()]),
         C.INVALID_ARGUMENT, "items[0].draft_probs[0].format"),
        (V(request_id="ok", seq_len=3, draft_token_ids=[1],
           draft_probs=[common_pb2.DraftDistribution(format=DENSE, values=b"\x00\x3c")]),
         C.INVALID_ARGUMENT, "items[0].draft_probs[0].values"),
        (V(request_id="ok", seq_len=3, draft_token_ids=[1], draft_probs=[
            encode_distribution(torch.tensor([0.5, 0, 0.5, 0, 0, 0, 0, 0]), SPARSE)]),
         C.INVALID_ARGUMENT, "items[0].draft_probs[0].values"),  # q(drafted token) == 0
        (V(request_id="ok", seq_len=3, draft_token_ids=[1] * MAX_LEN, draft_probs=[onehot] * MAX_LEN),
         C.INVALID_ARGUMENT, "items[0].draft_token_ids"),
    ]
    for item, code, field in bad_verify:
        got, details = _code(verify, item)
        assert got == code and details.startswith(field), (code, field, got, details)
    # nothing advanced: a correct verify still sees seq_len 3
    res = verify(V(request_id="ok", seq_len=3)).results[0]
    assert res.num_accepted == 0
    t.Release(target_pb2.TargetReleaseRequest(request_ids=["ok", "never-existed"]))  # unknown ids ignored

    # draft worker
    S, PI = draft_pb2.StartItem, draft_pb2.ProposeItem

    def start(*items):
        return d.Start(draft_pb2.StartRequest(items=list(items)))

    def propose(*items):
        return d.Propose(draft_pb2.ProposeRequest(items=list(items)))

    draft_cases = [
        (lambda: start(S(request_id="a", prompt_token_ids=[1]), S(request_id="a", prompt_token_ids=[1])),
         C.INVALID_ARGUMENT, "items[1].request_id"),
        (lambda: start(S(request_id="a", prompt_token_ids=[-1])), C.INVALID_ARGUMENT, "items[0].prompt_token_ids"),
        (lambda: start(S(request_id="a", prompt_token_ids=[1] * MAX_LEN)), C.INVALID_ARGUMENT,
         "items[0].prompt_token_ids"),
        (lambda: start(*[S(request_id=f"s{i}", prompt_token_ids=[1]) for i in range(SLOTS + 1)]),
         C.RESOURCE_EXHAUSTED, "items"),
        (lambda: propose(PI(request_id="zz", seq_len=1)), C.NOT_FOUND, "items[0].request_id"),
    ]
    for fn, code, field in draft_cases:
        got, details = _code(fn)
        assert got == code and details.startswith(field + ":"), (code, field, got, details)
    start(S(request_id="b", prompt_token_ids=[1, 2], params=sp, seed=5))
    for item, code, field in [
        (PI(request_id="b", seq_len=3), C.FAILED_PRECONDITION, "items[0].seq_len"),
        (PI(request_id="b", seq_len=3, num_accepted=1), C.INVALID_ARGUMENT, "items[0].num_accepted"),
        (PI(request_id="b", seq_len=3, new_token_ids=[8]), C.INVALID_ARGUMENT, "items[0].new_token_ids"),
        (PI(request_id="b", seq_len=2, num_tokens=MAX_LEN), C.INVALID_ARGUMENT, "items[0].num_tokens"),
    ]:
        got, details = _code(propose, item)
        assert got == code and details.startswith(field), (code, field, got, details)
    got, _ = _code(start, S(request_id="b", prompt_token_ids=[1]))
    assert got == C.ALREADY_EXISTS
    assert len(propose(PI(request_id="b", seq_len=2, num_tokens=2)).proposals[0].token_ids) == 2
    d.Release(draft_pb2.DraftReleaseRequest(request_ids=["b"]))
    assert workers["target"].kv_slots_in_use() == 0 and workers["model"].kv_slots_in_use() == 0
    assert workers["target"].health()["ok"] and workers["model"].health()["requests"] == 0


def test_shipped_q_is_the_sampled_q(workers):
    """A sampled model draft ships fp16_exact(processed q), which decodes bit for bit on the target side."""
    from specdist.wire import decode_distribution, fp16_exact

    d = workers["model"]
    prompt = [3, 1, 4]
    for top_k, fmt in ((0, DENSE), (2, SPARSE)):
        sp = sampling_params_to_proto(SamplingParams(temperature=0.7, top_k=top_k))
        d.start(draft_pb2.StartRequest(items=[draft_pb2.StartItem(request_id="q", prompt_token_ids=prompt,
                                                                  params=sp, seed=3)]))
        prop = d.propose(draft_pb2.ProposeRequest(items=[draft_pb2.ProposeItem(
            request_id="q", num_tokens=1, seq_len=len(prompt), preferred_format=fmt)])).proposals[0]
        d.release(draft_pb2.DraftReleaseRequest(request_ids=["q"]))
        with torch.inference_mode():
            logits = d.proposer.runner.model(torch.tensor([prompt])).logits[0, -1:]
        q = process_logits(logits, torch.tensor([0.7]), torch.tensor([top_k]), torch.ones(1))[0]
        got = decode_distribution(prop.probs[0], d.vocab_size, prop.token_ids[0])
        assert prop.probs[0].format == fmt
        assert torch.allclose(got, fp16_exact(q), atol=2e-3)  # batched vs HF forward: rounding only
        assert got[prop.token_ids[0]] > 0
    assert d.kv_slots_in_use() == 0


# ---------------------------------------------------------------- tensor parallel (2 ranks)
TP_TIMEOUT_S = 120


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_tensor_parallel_target_over_grpc(workers, tiny_models, tmp_path):
    from specdist.engine import Engine

    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in MAX_TOKENS]
    want = [o.token_ids for o in Engine.from_config(tiny_config(tiny_models, method="model", k=K)).generate(
        PROMPTS, params)]

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    env.update(OMP_NUM_THREADS="1", TQDM_DISABLE="1", HF_HUB_OFFLINE="1")
    dist_port, grpc_port = _free_port(), _free_port()
    logs = [open(tmp_path / f"tp_rank{r}.log", "w+") for r in range(2)]
    procs = [
        subprocess.Popen([sys.executable, os.path.abspath(__file__), str(r), "2", str(dist_port), str(grpc_port),
                          tiny_models["target"]],
                         cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=logs[r], stderr=subprocess.STDOUT)
        for r in range(2)
    ]
    chan = grpc.insecure_channel(f"127.0.0.1:{grpc_port}")
    try:
        grpc.channel_ready_future(chan).result(timeout=TP_TIMEOUT_S)
        got, _ = run_generation(target_pb2_grpc.TargetWorkerStub(chan), workers["model_stub"], PROMPTS, params,
                                workers["eos"], prefix="tp")
        assert got == want
        for p in procs:
            p.stdin.close()  # rank 0 shuts down on EOF and releases rank 1
        deadline = time.monotonic() + 30
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
        assert [p.returncode for p in procs] == [0, 0]
    except BaseException:
        texts = []
        for f in logs:
            f.seek(0)
            texts.append(f.read()[-3000:])
        print("\n".join(f"--- rank {r} ---\n{t}" for r, t in enumerate(texts)))
        raise
    finally:
        chan.close()
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for f in logs:
            f.close()
    assert workers["model"].kv_slots_in_use() == 0


def _tp_rank(rank: int, world_size: int, dist_port: int, grpc_port: int, ckpt: str) -> None:
    torch.set_num_threads(1)
    import torch.distributed as dist

    from workers.tensor_parallel import init_process_group, shard_model

    model = load_model(ModelSource(ckpt, None), "float32")
    init_process_group(rank, world_size, "127.0.0.1", dist_port, "cpu")
    model = shard_model(model, world_size)
    worker = TargetWorker(model, SLOTS, MAX_LEN, rank=rank, world_size=world_size)
    if rank == 0:
        servicer = TargetServicer(worker)
        server = AioServer([lambda s: target_pb2_grpc.add_TargetWorkerServicer_to_server(servicer, s)], grpc_port)
        sys.stdin.read()  # serve until the parent closes our stdin
        server.stop()
        servicer.shutdown()
        assert worker.kv_slots_in_use() == 0
    else:
        worker.follow()
        assert worker.kv_slots_in_use() == 0  # releases reached the follower before shutdown
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":  # one TP rank: <rank> <world_size> <dist_port> <grpc_port> <checkpoint>
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    _tp_rank(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])


def test_wildcard_bind_reports_a_dialable_address() -> None:
    """Workers bound on 0.0.0.0 (Kubernetes pods) must report an address others can dial."""
    import ipaddress

    from workers.actors import _node_ip, _reachable_host

    for wildcard in ("0.0.0.0", "::"):
        host = _reachable_host(wildcard)
        assert host == _node_ip() and not ipaddress.ip_address(host).is_unspecified
    assert _reachable_host("10.1.2.3") == "10.1.2.3"
    assert _reachable_host("127.0.0.1") == "127.0.0.1"
