"""The draft worker: proposes tokens, and ships the exact q each one was sampled from.

:class:`DraftWorker` (a plain class; a Ray actor will host it later) holds a
:class:`~specdist.proposers.ModelProposer` (a separate draft model, or the target's int8
``self-w8`` copy) or a :class:`~specdist.proposers.NgramProposer`, and per request the
committed token sequence, the SamplingParams, its own seeded generator and (model drafts)
a KV slot. :class:`DraftServicer` exposes it over ``grpc.aio``.

``propose`` first commits what the target emitted (``num_accepted`` of the previous
proposal, then ``new_token_ids``), rolling the draft cache back to the accepted prefix in
O(1) exactly like ``ModelProposer.commit``, then drafts ``num_tokens`` tokens.

Distribution formats (see ``DraftDistribution`` in common.proto):

- n-gram drafts and greedy requests: q is one-hot -> ONE_HOT (no payload);
- sampled model drafts: the draft computes the processed q, then SAMPLES FROM
  ``r = fp16_exact(q)`` — the exact distribution the target decodes from the wire —
  and ships r as SPARSE_FP16 when its support is small (top-k / top-p, or a peaked q:
  fewer than ``SPARSE_MAX_FRACTION`` of the vocabulary nonzero) else DENSE_FP16; a
  one-point r goes as ONE_HOT. Any of these represents r exactly (entries that round to
  zero in fp16 are zero in r), so ``preferred_format`` is honoured whenever it is
  DENSE_FP16 or SPARSE_FP16, and ONE_HOT only where r is one-hot.

Seeds: ``StartItem.seed`` must differ from the target's ``PrefillItem.seed`` so the draft's
samples are independent of the target's acceptance uniforms. The coordinator derives it
with :func:`draft_seed`: ``target_seed XOR DRAFT_SEED_XOR`` (a fixed odd 64-bit constant),
which is a bijection on uint64 with no fixed point, so the two seeds always differ and a
fixed ``params.seed`` still reproduces the whole run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from concurrent.futures import ThreadPoolExecutor

import torch

from specdist.errors import InvalidArgument
from specdist.models.runner import CausalLMRunner
from specdist.proposers import ModelProposer, NgramProposer
from specdist.sampling import process_logits, sample_from
from specdist.sampling_params import SamplingParams
from specdist.v1 import common_pb2, draft_pb2, draft_pb2_grpc
from specdist.wire import (  # noqa: F401  (draft_seed re-exported for callers)
    DENSE,
    ONE_HOT,
    SPARSE,
    DRAFT_SEED_XOR,
    draft_seed,
    encode_distribution,
    fp16_exact,
    sampling_params_from_proto,
)
from workers.target_worker import (
    AlreadyExists,
    BlockingCallRunner,
    FailedPrecondition,
    NotFound,
    ResourceExhausted,
    check_prompt,
    check_request_ids,
    check_token_ids,
    sampling_tensors_of,
)

SPARSE_MAX_FRACTION = 0.4  # sparse costs ~5 bytes per entry (fp16 + varint id), dense 2 per vocab entry



@dataclass
class _DraftRequest:
    seq: list[int]  # committed tokens (prompt + output)
    params: SamplingParams
    generator: torch.Generator = field(repr=False)
    slot: int | None = None  # model drafts: KV slot holding a prefix of seq (+ stale drafts)
    proposal: list[int] = field(default_factory=list)  # tokens of the last Proposal


class DraftWorker:
    """Not thread-safe: one call at a time (the servicer runs calls on a single thread)."""

    def __init__(self, proposer: ModelProposer | NgramProposer, vocab_size: int, max_model_len: int):
        self.proposer = proposer
        self.vocab_size = int(vocab_size)
        self.max_model_len = max_model_len
        self.requests: dict[str, _DraftRequest] = {}

    @classmethod
    def from_model(
        cls, model: torch.nn.Module, max_batch_size: int, max_model_len: int, confidence_threshold: float = 0.0
    ) -> "DraftWorker":
        """A model draft (pass ``specdist.models.quant.quantized_copy(target)`` for self-w8)."""
        runner = CausalLMRunner(model, max_batch_size, max_model_len)
        return cls(ModelProposer(runner, confidence_threshold), runner.vocab_size, max_model_len)

    @classmethod
    def ngram(cls, vocab_size: int, max_model_len: int, ngram_min: int = 1, ngram_max: int = 3) -> "DraftWorker":
        return cls(NgramProposer(ngram_min, ngram_max), vocab_size, max_model_len)

    @property
    def _model(self) -> ModelProposer | None:
        return self.proposer if isinstance(self.proposer, ModelProposer) else None

    # ------------------------------------------------------------ RPCs
    def start(self, msg: draft_pb2.StartRequest) -> draft_pb2.StartResponse:
        items = list(msg.items)
        check_request_ids([it.request_id for it in items])
        parsed = []
        for i, it in enumerate(items):
            if it.request_id in self.requests:
                raise AlreadyExists(f"items[{i}].request_id", f"request {it.request_id!r} is already started")
            prompt = check_prompt(it.prompt_token_ids, self.vocab_size, self.max_model_len,
                                  f"items[{i}].prompt_token_ids")
            params = sampling_params_from_proto(it.params, f"items[{i}].params")
            parsed.append((it.request_id, prompt, params, it.seed))
        model = self._model
        if model is not None and len(items) > model.cache.num_free:
            raise ResourceExhausted("items", f"{len(items)} requests need KV slots; {model.cache.num_free} are free")
        new = []
        for rid, prompt, params, seed in parsed:
            r = _DraftRequest(prompt, params, torch.Generator().manual_seed(seed))
            if model is not None:
                r.slot = model.cache.allocate()
            self.requests[rid] = r
            new.append(r)
        todo = [r for r in new if model is not None and len(r.seq) > 1]
        if todo:
            model.runner.forward([r.slot for r in todo], [r.seq[:-1] for r in todo], [0] * len(todo))
        return draft_pb2.StartResponse(request_ids=[p[0] for p in parsed])

    def propose(self, msg: draft_pb2.ProposeRequest) -> draft_pb2.ProposeResponse:
        items = list(msg.items)
        check_request_ids([it.request_id for it in items])
        plan = []
        for i, it in enumerate(items):
            r = self.requests.get(it.request_id)
            if r is None:
                raise NotFound(f"items[{i}].request_id", f"unknown request {it.request_id!r}")
            if it.num_accepted > len(r.proposal):
                raise InvalidArgument(
                    f"items[{i}].num_accepted", f"is {it.num_accepted}; the last proposal had {len(r.proposal)} tokens"
                )
            new = check_token_ids(it.new_token_ids, self.vocab_size, f"items[{i}].new_token_ids")
            seq_len = len(r.seq) + it.num_accepted + len(new)
            if it.seq_len != seq_len:
                raise FailedPrecondition(
                    f"items[{i}].seq_len", f"is {it.seq_len}; request {it.request_id!r} would hold {seq_len} tokens"
                )
            if it.num_tokens and seq_len + it.num_tokens + 1 > self.max_model_len:
                raise InvalidArgument(
                    f"items[{i}].num_tokens",
                    f"{it.num_tokens} draft tokens after {seq_len} would pass the context limit {self.max_model_len}",
                )
            if it.preferred_format not in (0, DENSE, SPARSE, ONE_HOT):
                raise InvalidArgument(f"items[{i}].preferred_format", f"unknown format {it.preferred_format}")
            plan.append((r, int(it.num_accepted), new, int(it.num_tokens), int(it.preferred_format)))

        # ---- commit (all validated: nothing below can fail on the inputs)
        for r, n_acc, new, _, _ in plan:
            prev = len(r.seq)
            r.seq.extend(r.proposal[:n_acc] + new)
            r.proposal = []
            if r.slot is not None:
                cache = self._model.cache
                cache.rollback(r.slot, min(cache.lengths[r.slot], prev + n_acc))

        # ---- draft
        reqs = [p[0] for p in plan]
        ks = [p[3] for p in plan]
        if isinstance(self.proposer, NgramProposer):
            toks = [self.proposer.lookup(r.seq, k) if k > 0 else [] for r, k in zip(reqs, ks)]
            dists = [[common_pb2.DraftDistribution(format=ONE_HOT) for _ in t] for t in toks]
        else:
            toks, dists = self._propose_model(reqs, ks, [p[4] for p in plan])
        out = draft_pb2.ProposeResponse()
        for it, r, t, d in zip(items, reqs, toks, dists):
            r.proposal = list(t)
            out.proposals.add(request_id=it.request_id, token_ids=t, probs=d)
        return out

    def _propose_model(self, reqs: list[_DraftRequest], ks: list[int], prefs: list[int]):
        model = self._model
        runner, cache = model.runner, model.cache
        bsz = len(reqs)
        toks: list[list[int]] = [[] for _ in range(bsz)]
        dists: list[list[common_pb2.DraftDistribution]] = [[] for _ in range(bsz)]
        ks = list(ks)  # shortened when a confidence threshold stops a request early
        temp, top_k, top_p = sampling_tensors_of([r.params for r in reqs])
        for j in range(max(ks, default=0)):
            rows = [b for b in range(bsz) if ks[b] > j]
            if not rows:
                break
            rows.sort(key=lambda b: reqs[b].slot)  # contiguous slots attend through views
            if j == 0:  # everything the cache has not seen yet (usually 1 or 2 tokens)
                inputs = [reqs[b].seq[cache.lengths[reqs[b].slot]:] for b in rows]
            else:
                inputs = [[toks[b][-1]] for b in rows]
            logits = runner.forward([reqs[b].slot for b in rows], inputs, [1] * len(rows))[:, 0]  # [n, V]
            idx = torch.tensor(rows)
            q = process_logits(logits, temp[idx], top_k[idx], top_p[idx])  # [n, V]
            for n, b in enumerate(rows):
                r = reqs[b]
                if r.params.temperature <= 0:  # greedy: q is one-hot on the argmax
                    x = int(q[n].argmax())
                    dists[b].append(common_pb2.DraftDistribution(format=ONE_HOT))
                else:
                    rq = fp16_exact(q[n])  # the q the target will decode: sample from exactly it
                    u = torch.rand(1, generator=r.generator, dtype=torch.float64)
                    x = int(sample_from(rq[None], u)[0])
                    dists[b].append(encode_distribution(rq, _choose_format(rq, prefs[b], self.vocab_size)))
                toks[b].append(x)
            if model.confidence_threshold > 0:
                conf = torch.softmax(logits.float(), -1)
                for n, b in enumerate(rows):
                    if float(conf[n, toks[b][-1]]) < model.confidence_threshold:
                        ks[b] = j + 1
        return toks, dists

    def release(self, msg: draft_pb2.DraftReleaseRequest) -> draft_pb2.DraftReleaseResponse:
        for rid in msg.request_ids:
            r = self.requests.pop(rid, None)
            if r is not None and r.slot is not None:
                self._model.cache.free(r.slot)
        return draft_pb2.DraftReleaseResponse()

    # ------------------------------------------------------------ introspection
    def kv_slots_in_use(self) -> int:
        return self._model.cache.num_used if self._model is not None else 0

    def health(self) -> dict:
        return {
            "ok": True,
            "method": "ngram" if self._model is None else "model",
            "requests": len(self.requests),
            "kv_slots_in_use": self.kv_slots_in_use(),
            "vocab_size": self.vocab_size,
            "max_model_len": self.max_model_len,
        }


def _choose_format(r: torch.Tensor, preferred: int, vocab_size: int) -> int:
    """A format that carries r (already fp16-exact) exactly; the preference when it can."""
    support = int((r > 0).sum())
    if support == 1 and preferred in (0, ONE_HOT):
        return ONE_HOT
    if preferred in (DENSE, SPARSE):
        return preferred
    return SPARSE if support < SPARSE_MAX_FRACTION * vocab_size else DENSE


class DraftServicer(draft_pb2_grpc.DraftWorkerServicer):
    """grpc.aio servicer over a :class:`DraftWorker`; blocking calls run on one thread."""

    def __init__(self, worker: DraftWorker, executor: ThreadPoolExecutor | None = None):
        self.worker = worker
        self.runner = BlockingCallRunner("draft-worker", executor)

    async def Start(self, request, context):
        return await self.runner.call(self.worker.start, request, context)

    async def Propose(self, request, context):
        return await self.runner.call(self.worker.propose, request, context)

    async def Release(self, request, context):
        return await self.runner.call(self.worker.release, request, context)

    def shutdown(self) -> None:
        self.runner.close()
