"""An :class:`~specdist.engine.Engine` look-alike that runs on remote workers over gRPC.

:class:`RemoteEngine` has the interface the :class:`~specdist.coordinator.Coordinator`
(and ``generate`` / ``stream`` callers) use — ``add_request``, ``abort``, ``release``,
``step``, ``running``, ``waiting``, ``has_unfinished``, ``kv_slots_in_use``, ``stats``,
``generate``, ``stream``, ``tokenizer``, ``vocab_size``, ``eos_ids``, ``max_model_len``,
``k``, ``config`` — but the models live in a target worker (``TargetWorker`` service,
possibly tensor-parallel behind its rank 0) and any number of draft workers
(``DraftWorker`` service), driven through synchronous stubs. It only imports
``specdist.v1`` (never ``workers/`` or ``cluster/``).

One ``step()``:

1. admit waiting requests: ``Prefill`` on the target (its seed = the request seed, as in
   ``Engine``: ``params.seed`` or one drawn from ``config.engine.seed``'s stream) and
   ``Start`` on the assigned draft replica with ``draft_seed(seed)`` (see below);
2. ``k_b`` per request: the engine's caps (``Engine._draft_len``) and its draft-length
   rule (:mod:`specdist.draft_length`; adaptive costs are measured per replica, so the
   requests of a slower replica draft less, or nothing, instead of holding up the step);
3. ``Propose`` on every replica in parallel (a thread pool; ONE RPC per replica with all
   its requests that draft this step), passing ``num_accepted`` / ``new_token_ids``
   accumulated since their last proposal; a replica none of whose requests drafts is
   not called;
4. ONE ``Verify`` on the target for the whole batch (the draft q's are forwarded as they
   came, no re-encoding);
5. the emitted tokens go through :class:`~specdist.stopping.OutputState` exactly like
   ``Engine.step`` (stop tokens / strings, max_tokens, then the context limit);
   finished requests are released on the target and their draft (one batched
   ``Release`` per worker).

Replica assignment (at admission, per request, in arrival order; among the replicas below
``draft_max_batch_size``): by measured speed, then load. Each replica's predicted time for
a full draft with one more request comes from the draft-length rule's cost fit (a
replica not yet measured counts as 0, so each gets tried); those within
``REPLICA_SPEED_SLACK`` (2x) of the fastest compete on the fewest live requests (started
and not yet released by this engine), then the lower measured mean ``Propose`` latency per
drafted token, then the lower index. A request stays on its replica for its whole life;
with the adaptive rule, a replica that turns slow afterwards gets shorter drafts (down to
none: its requests then decode without drafts, and the step does not wait for it).

Seeds: the draft's seed is ``seed XOR DRAFT_SEED_XOR`` — the rule of
:func:`specdist.wire.draft_seed`, shared with the draft worker; it is a fixed-point-free
bijection, so the two seeds always differ.

Errors: the worker RPCs are all-or-nothing and name the failing item
(``items[i].field: ...``). A failure naming an item fails only that request
(``finish_reason="error"``, message in ``request.error``) and the call is retried
without it; a failure naming no item (a worker down) fails only the requests of that
call; ``RESOURCE_EXHAUSTED`` at admission puts the requests back in the queue.
``step()`` itself does not raise for worker errors.

Timing (``stats.phase_s``): "prefill" (Prefill + Start), "draft" and "verify" (the RPC
wall time minus its network share), "network", "output" (client bookkeeping), "cache"
(Release RPCs). "sampling" stays 0: rejection sampling runs inside Verify on the target.
The network share of an RPC is ``wall - server compute`` when the worker reports its
compute time in the ``specdist-compute-s`` trailing metadata, else an estimate: the
minimum round trip of empty ``Release`` calls to that worker, measured on first use
(:meth:`calibrate_network`).
"""

from __future__ import annotations

import itertools
import logging
import re
import threading
import uuid
from collections import deque
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc
import torch

from specdist.config import Config, load_config
from specdist.draft_length import DraftLengthPolicy
from specdist.engine import PHASES, Engine
from specdist.errors import InvalidArgument
from specdist.request import Request, now
from specdist.sampling_params import SamplingParams
from specdist.stopping import OutputState
from specdist.v1 import draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc
from specdist.wire import draft_seed, sampling_params_to_proto

log = logging.getLogger(__name__)

COMPUTE_METADATA_KEY = "specdist-compute-s"
REMOTE_PHASES = PHASES + ("network",)
REPLICA_SPEED_SLACK = 2.0  # replicas predicted within 2x of the fastest count as equally fast (fits are noisy)
_ITEM = re.compile(r"^items\[(\d+)\]")
_PER_ITEM_CODES = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.ALREADY_EXISTS,
}
_CHANNEL_OPTIONS = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]



@dataclass
class RemoteEngineStats:
    """Like EngineStats, plus the "network" phase and RPC counters."""

    phase_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(REMOTE_PHASES, 0.0))
    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0
    rpcs: int = 0

    def reset(self) -> None:
        self.__init__()


@dataclass
class _Remote:
    """Per-request state of the remote engine (``Request.draft_state``)."""

    wire_id: str
    seed: int
    replica: int | None = None
    prefilled: bool = False  # holds a target slot
    started: bool = False  # holds a draft slot
    num_accepted: int = 0  # of the last proposal, for the next Propose
    new_tokens: list[int] = field(default_factory=list)
    proposal: object = None  # the last draft_pb2.Proposal


class _Replica:
    def __init__(self, address: str, channel: grpc.Channel):
        self.address = address
        self.channel = channel
        self.stub = draft_pb2_grpc.DraftWorkerStub(channel)
        self.live = 0
        self.propose_s = 0.0
        self.proposed_tokens = 0
        self.rtt_s: float | None = None

    @property
    def latency_per_token(self) -> float:
        return self.propose_s / self.proposed_tokens if self.proposed_tokens else 0.0


class RemoteEngine:
    """Engine interface over a remote target worker and draft workers (see the module docstring)."""

    def __init__(
        self,
        config: str | dict | Config | None,
        target_address: str,
        draft_addresses: Sequence[str] = (),
        tokenizer=None,
        vocab_size: int | None = None,
        eos_ids: frozenset[int] | Sequence[int] = frozenset(),
        draft_max_batch_size: int | None = None,
        rpc_timeout_s: float = 120.0,
    ):
        self.config = cfg = load_config(config)
        ec = cfg.engine
        if vocab_size is None:
            if tokenizer is None:
                raise InvalidArgument("vocab_size", "is required without a tokenizer")
            vocab_size = len(tokenizer)
        self.tokenizer = tokenizer
        self.vocab_size = int(vocab_size)
        self.eos_ids = frozenset(int(e) for e in eos_ids)
        self.max_model_len = ec.max_model_len
        self.max_batch_size = ec.max_batch_size
        self.draft_max_batch_size = draft_max_batch_size or ec.max_batch_size
        self.rpc_timeout_s = rpc_timeout_s
        self.target_address = target_address
        self._target_channel = grpc.insecure_channel(target_address, options=_CHANNEL_OPTIONS)
        self.target = target_pb2_grpc.TargetWorkerStub(self._target_channel)
        self._target_rtt_s: float | None = None
        use_drafts = cfg.draft.enabled and len(draft_addresses) > 0
        self.replicas = [
            _Replica(a, grpc.insecure_channel(a, options=_CHANNEL_OPTIONS)) for a in (draft_addresses if use_drafts else ())
        ]
        self.k = cfg.draft.num_speculative_tokens if self.replicas else 0
        self.length_policy = DraftLengthPolicy(self.k, cfg.draft.length_policy, num_replicas=max(1, len(self.replicas)))
        self._pool = ThreadPoolExecutor(max_workers=max(1, len(self.replicas)), thread_name_prefix="specdist-propose")
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.stats = RemoteEngineStats()
        self._ids = itertools.count()
        self._wire_ids = itertools.count()
        self._uid = uuid.uuid4().hex[:8]
        self._seeds = torch.Generator().manual_seed(ec.seed)
        self._target_live = 0
        self._count_lock = threading.Lock()  # Propose/Start RPCs run on the pool

    @classmethod
    def from_addresses(
        cls, config: str | dict | Config | None, target_address: str, draft_addresses: Sequence[str] = (), **kwargs
    ) -> "RemoteEngine":
        """Load only the target's tokenizer and config (vocabulary size, EOS ids); no weights."""
        from transformers import AutoConfig

        from specdist.models.loader import eos_token_ids, load_tokenizer, resolve_model

        cfg = load_config(config)
        src = resolve_model(cfg.target.model, "target.model")
        tokenizer = load_tokenizer(src)
        extra = {"gguf_file": src.gguf_file} if src.gguf_file else {}
        mcfg = AutoConfig.from_pretrained(src.directory, local_files_only=True, **extra)
        gen = None
        try:
            from transformers import GenerationConfig

            gen = GenerationConfig.from_model_config(mcfg)
            gen = GenerationConfig.from_pretrained(src.directory, local_files_only=True, **extra)
        except Exception:  # no generation_config.json: the model config's values (from_model_config) stand
            pass

        class _Meta:  # what eos_token_ids reads from a model
            config = mcfg
            generation_config = gen

        vocab = int(getattr(mcfg, "vocab_size", None) or getattr(mcfg.get_text_config(), "vocab_size"))
        return cls(cfg, target_address, draft_addresses, tokenizer=tokenizer, vocab_size=vocab,
                   eos_ids=eos_token_ids(_Meta, tokenizer), **kwargs)

    def close(self) -> None:
        """Release everything still live, then close the channels and the thread pool."""
        for r in list(self.waiting) + list(self.running):
            self.abort(r.request_id)
        self._pool.shutdown(wait=True)
        self._target_channel.close()
        for rep in self.replicas:
            rep.channel.close()

    def __enter__(self) -> "RemoteEngine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------- requests (Engine's semantics)
    _tokenize = Engine._tokenize
    _check_request = Engine._check_request
    _draft_len = Engine._draft_len
    generate = Engine.generate
    stream = Engine.stream
    abort = Engine.abort
    has_unfinished = Engine.has_unfinished

    def add_request(
        self, prompt: str | Sequence[int], params: SamplingParams | None = None, request_id: str | None = None
    ) -> Request:
        params, text, ids, seed = self._check_request(prompt, params)
        req = Request(
            request_id=request_id if request_id is not None else str(next(self._ids)),
            prompt=text,
            prompt_ids=ids,
            params=params,
            generator=torch.Generator(),  # unused here: the target worker draws the uniforms
            output=OutputState(params, self.eos_ids, self.tokenizer),
            draft_state=_Remote(f"{self._uid}-{next(self._wire_ids)}", int(seed)),
        )
        req.metrics.prompt_tokens = len(ids)
        req.metrics.arrival_time = now()
        self.waiting.append(req)
        return req

    def release(self, r: Request) -> None:
        """Free everything the request holds (queue entry, remote slots). Idempotent."""
        self._release_many([r])

    def kv_slots_in_use(self) -> dict[str, int]:
        """Live requests on the workers as this engine knows them (admitted, not yet released)."""
        used = {"target": self._target_live}
        if self.replicas:
            used["draft"] = sum(rep.live for rep in self.replicas)
            for i, rep in enumerate(self.replicas):
                used[f"draft/{i}"] = rep.live
        return used

    def replica_of(self, r: Request) -> int | None:
        return r.draft_state.replica

    # ---------------------------------------------------------------- the step
    def step(self) -> list[Request]:
        """One verification for every running request. Returns the requests that advanced."""
        self._admit()
        if not self.running:
            return []
        if self._target_rtt_s is None:
            self.calibrate_network()
        t = self.stats.phase_s
        reqs = list(self.running)
        policy = self.length_policy
        tc = now()
        chosen = policy.choose([self._draft_len(r) for r in reqs], [r.acceptance for r in reqs],
                               [r.draft_state.replica or 0 for r in reqs],
                               [r.metrics.steps == 0 and not self.waiting for r in reqs])
        ks = {id(r): k for r, k in zip(reqs, chosen)}

        # ---- Propose: one RPC per replica, in parallel, for the requests that draft
        t0 = now()
        if self.replicas:
            by_rep: dict[int, list[Request]] = {}
            for r in reqs:
                if ks[id(r)] > 0:
                    by_rep.setdefault(r.draft_state.replica, []).append(r)
            futs = [(i, self._pool.submit(self._propose, i, rs, ks)) for i, rs in by_rep.items()]
            net = 0.0
            for i, f in futs:
                net = max(net, f.result())
            wall = now() - t0
            t["network"] += min(net, wall)
            t["draft"] += wall - min(net, wall)
        reqs = [r for r in reqs if not r.finished]
        if not reqs:
            self._release_finished(self.running[:])
            return []

        # ---- Verify: one RPC for the whole batch
        t1 = now()
        items = []
        for r in reqs:
            st: _Remote = r.draft_state
            p = st.proposal
            items.append(target_pb2.VerifyItem(
                request_id=st.wire_id, seq_len=len(r.seq),
                draft_token_ids=p.token_ids if p is not None else [], draft_probs=p.probs if p is not None else []))
        results, failed, net = self._call_isolating(
            self.target.Verify, items, lambda its: target_pb2.VerifyRequest(items=its), self._target_rtt_s)
        self._fail(reqs, failed, "verify")
        wall = now() - t1
        t["network"] += min(net, wall)
        t["verify"] += wall - min(net, wall)
        policy.observe_verify(sum(len(it.draft_token_ids) + 1 for it in items), wall, len(items))

        # ---- outputs, exactly like Engine.step
        t2 = now()
        advanced = []
        res_by_idx = dict(zip([i for i in range(len(reqs)) if i not in failed], results.results if results else []))
        for b, r in enumerate(reqs):
            res = res_by_idx.get(b)
            if res is None:
                continue
            st = r.draft_state
            drafted = list(st.proposal.token_ids) if st.proposal is not None else []
            n_acc = int(res.num_accepted)
            new = drafted[:n_acc] + [int(res.next_token_id)]
            if st.proposal is not None:  # the draft holds this proposal: tell it how much survived
                st.num_accepted = n_acc
            st.new_tokens.append(int(res.next_token_id))  # since the last proposal (several if it skipped)
            st.proposal = None
            policy.observe_acceptance(r.acceptance, len(drafted), n_acc)
            kept = r.output.append(new)
            m = r.metrics
            m.steps += 1
            m.drafted += len(drafted)
            m.accepted += n_acc
            self.stats.drafted += len(drafted)
            self.stats.accepted += n_acc
            self.stats.emitted += kept
            if m.first_token_time is None and (kept or r.finished):
                m.first_token_time = now()
            if not r.finished and len(r.seq) >= self.max_model_len:
                r.output.finish("length")
            advanced.append(r)
        self.stats.steps += 1
        t3 = now()
        t["output"] += t3 - t2
        policy.end_step()
        policy.observe_overhead((t0 - tc) + (t3 - t2))
        self._release_finished(self.running[:])
        return advanced

    # ---------------------------------------------------------------- internals
    def _propose(self, i: int, rs: list[Request], ks: dict[int, int]) -> float:
        """Propose for one replica's requests (runs on the pool). Returns the estimated network time."""
        rep = self.replicas[i]
        items = []
        for r in rs:
            st: _Remote = r.draft_state
            items.append(draft_pb2.ProposeItem(
                request_id=st.wire_id, num_accepted=st.num_accepted, new_token_ids=st.new_tokens,
                num_tokens=ks[id(r)], seq_len=len(r.seq)))
        t0 = now()
        resp, failed, net = self._call_isolating(
            rep.stub.Propose, items, lambda its: draft_pb2.ProposeRequest(items=its), rep.rtt_s)
        wall = now() - t0
        ok = [r for j, r in enumerate(rs) if j not in failed]
        ntok = 0
        for r, p in zip(ok, resp.proposals if resp is not None else []):
            st = r.draft_state
            st.proposal = p
            st.num_accepted, st.new_tokens = 0, []  # committed on the draft
            ntok += len(p.token_ids)
        if ntok:
            rep.propose_s += wall
            rep.proposed_tokens += ntok
            passes = max(len(p.token_ids) for p in resp.proposals)
            self.length_policy.observe_draft(i, passes, ntok, wall)
        for j, msg in failed.items():  # finished here, released by the step (engine thread) afterwards
            self._mark_error(rs[j], f"draft worker {rep.address}: {msg}")
        return net

    def _call_isolating(self, method, items: list, build, rtt: float | None):
        """Call ``method(build(items))``; a failure naming ``items[i]`` drops that item and retries.

        Returns (response or None, {original index: error message}, estimated network seconds).
        A failure naming no item fails every remaining item.
        """
        idx = list(range(len(items)))
        failed: dict[int, str] = {}
        net = 0.0
        while idx:
            t0 = now()
            try:
                resp, call = method.with_call(build([items[i] for i in idx]), timeout=self.rpc_timeout_s)
            except grpc.RpcError as e:
                net += now() - t0
                self._count_rpc()
                details = e.details() or ""
                m = _ITEM.match(details)
                if m and e.code() in _PER_ITEM_CODES and int(m.group(1)) < len(idx):
                    failed[idx.pop(int(m.group(1)))] = f"{e.code().name}: {details}"
                    continue
                for i in idx:
                    failed[i] = f"{e.code().name}: {details}"
                return None, failed, net
            wall = now() - t0
            self._count_rpc()
            net += _network_share(wall, call, rtt)
            return resp, failed, net
        return None, failed, net

    def _pick_replica(self, free: list[int], live: list[int]) -> int:
        """The replica for a new request (``live``: its requests incl. this admission's so far).

        Predicted time of a full draft (k passes) with one more request, from the fitted
        per-replica costs (0 while unmeasured, so every replica gets tried); the replicas within
        ``REPLICA_SPEED_SLACK`` of the fastest compete on fewest live requests, then the lower
        measured Propose time per token, then the lower index. A replica slower by more than
        the slack gets new requests only once the fast ones' growing batches catch up with it.
        """
        fits = self.length_policy.draft_cost
        k = max(1, self.k)  # a full draft: one call, k passes, k rows per request
        pred = {i: fits[i].predict(1, k, k * (live[i] + 1)) if fits[i].ready else 0.0 for i in free}
        best = min(pred.values())
        near = [i for i in free if pred[i] <= best * REPLICA_SPEED_SLACK + 1e-9]
        return min(near, key=lambda i: (live[i], self.replicas[i].latency_per_token, i))

    def _admit(self) -> None:
        new: list[Request] = []
        cap = [self.draft_max_batch_size - rep.live for rep in self.replicas]
        while self.waiting and self._target_live + len(new) < self.max_batch_size:
            r = self.waiting[0]
            if self.replicas:
                free = [i for i in range(len(self.replicas)) if cap[i] > 0]
                if not free:
                    break
                i = self._pick_replica(free, [self.draft_max_batch_size - c for c in cap])
                cap[i] -= 1
                r.draft_state.replica = i
            new.append(self.waiting.popleft())
        if not new:
            return
        t0 = now()
        # target first: all or nothing per call, bad items failed alone
        items = [target_pb2.PrefillItem(request_id=r.draft_state.wire_id, prompt_token_ids=r.prompt_ids,
                                        params=sampling_params_to_proto(r.params), seed=r.draft_state.seed)
                 for r in new]
        resp, failed, _ = self._call_isolating(
            self.target.Prefill, items, lambda its: target_pb2.PrefillRequest(items=its), None)
        requeue = []
        for j, r in enumerate(new):
            if j in failed:
                if failed[j].startswith("RESOURCE_EXHAUSTED"):
                    requeue.append(r)
                else:
                    self._mark_error(r, f"target worker: {failed[j]}")
            else:
                r.draft_state.prefilled = True
                self._target_live += 1
        admitted = [r for j, r in enumerate(new) if j not in failed]
        if self.replicas and admitted:
            by_rep: dict[int, list[Request]] = {}
            for r in admitted:
                by_rep.setdefault(r.draft_state.replica, []).append(r)
            futs = [(i, rs, self._pool.submit(self._start, i, rs)) for i, rs in by_rep.items()]
            for i, rs, f in futs:
                for r, err in zip(rs, f.result()):
                    if err is None:
                        r.draft_state.started = True
                        self.replicas[i].live += 1
                    elif err.startswith("RESOURCE_EXHAUSTED"):
                        requeue.append(r)
                    else:
                        self._mark_error(r, f"draft worker {self.replicas[i].address}: {err}")
        for r in reversed(requeue):  # back to the queue front, slots freed
            self._release_remote([r])
            r.draft_state.replica = None
            self.waiting.appendleft(r)
        self.running.extend(r for r in admitted if r not in requeue)
        self._release_finished([r for r in new if r.finished])
        self.stats.phase_s["prefill"] += now() - t0

    def _start(self, i: int, rs: list[Request]) -> list[str | None]:
        items = [draft_pb2.StartItem(request_id=r.draft_state.wire_id, prompt_token_ids=r.prompt_ids,
                                     params=sampling_params_to_proto(r.params), seed=draft_seed(r.draft_state.seed))
                 for r in rs]
        _, failed, _ = self._call_isolating(
            self.replicas[i].stub.Start, items, lambda its: draft_pb2.StartRequest(items=its), None)
        return [failed.get(j) for j in range(len(rs))]

    def _count_rpc(self) -> None:
        with self._count_lock:
            self.stats.rpcs += 1

    def _mark_error(self, r: Request, message: str) -> None:
        if not r.finished:
            r.error = message
            r.output.finish("error")
        log.warning("request %s failed: %s", r.request_id, message)

    def _fail(self, reqs: list[Request], failed: dict[int, str], what: str) -> None:
        for j, msg in failed.items():
            self._mark_error(reqs[j], f"target worker ({what}): {msg}")

    def _release_finished(self, reqs: list[Request]) -> None:
        done = [r for r in reqs if r.finished]
        if done:
            t0 = now()
            self._release_many(done)
            self.stats.phase_s["cache"] += now() - t0

    def _release_many(self, reqs: list[Request]) -> None:
        for r in reqs:
            if r in self.waiting:
                self.waiting.remove(r)
            if r in self.running:
                self.running.remove(r)
            if r.metrics.finish_time is None:
                r.metrics.finish_time = now()
        self._release_remote(reqs)

    def _release_remote(self, reqs: list[Request]) -> None:
        """Release on the target and each draft (one RPC per worker). Best effort: Release is idempotent."""
        tgt = [r for r in reqs if r.draft_state.prefilled]
        if tgt:
            try:
                self.target.Release(target_pb2.TargetReleaseRequest(request_ids=[r.draft_state.wire_id for r in tgt]),
                                    timeout=self.rpc_timeout_s)
            except grpc.RpcError as e:
                log.warning("target Release failed (%s); the worker may keep %d slots", e.code(), len(tgt))
            self._count_rpc()
            for r in tgt:
                r.draft_state.prefilled = False
                self._target_live -= 1
        by_rep: dict[int, list[Request]] = {}
        for r in reqs:
            if r.draft_state.started:
                by_rep.setdefault(r.draft_state.replica, []).append(r)
        for i, rs in by_rep.items():
            rep = self.replicas[i]
            try:
                rep.stub.Release(draft_pb2.DraftReleaseRequest(request_ids=[r.draft_state.wire_id for r in rs]),
                                 timeout=self.rpc_timeout_s)
            except grpc.RpcError as e:
                log.warning("draft %s Release failed (%s)", rep.address, e.code())
            self._count_rpc()
            for r in rs:
                r.draft_state.started = False
                rep.live -= 1

    def calibrate_network(self, tries: int = 5) -> dict[str, float]:
        """Minimum round trip of an empty Release to each worker (the network estimate's unit)."""

        def rtt(call) -> float:
            best = float("inf")
            for _ in range(tries):
                t0 = now()
                try:
                    call()
                except grpc.RpcError:
                    return 0.0
                best = min(best, now() - t0)
            return best

        self._target_rtt_s = rtt(lambda: self.target.Release(target_pb2.TargetReleaseRequest(),
                                                              timeout=self.rpc_timeout_s))
        out = {"target": self._target_rtt_s}
        for i, rep in enumerate(self.replicas):
            rep.rtt_s = rtt(lambda rep=rep: rep.stub.Release(draft_pb2.DraftReleaseRequest(),
                                                              timeout=self.rpc_timeout_s))
            out[f"draft/{i}"] = rep.rtt_s
        return out


def _network_share(wall: float, call, rtt: float | None) -> float:
    try:
        for key, value in call.trailing_metadata() or ():
            if key == COMPUTE_METADATA_KEY:
                return max(0.0, wall - float(value))
    except Exception:  # noqa: BLE001 - metadata is optional
        pass
    return min(wall, rtt or 0.0)
