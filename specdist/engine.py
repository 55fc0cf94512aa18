"""The single-process speculative decoding engine.

One ``step()`` advances every running request by one verification:

1. admit waiting requests into free KV slots and prefill target and draft caches
   with all prompt tokens but the last (which is fed with the first draft); a
   ``self-w8`` draft copies the target's prompt K/V instead of a second prefill;
2. choose each request's draft length ``k_b`` with the configured rule
   (:mod:`specdist.draft_length`: a fixed k, or adaptive from its observed acceptance and
   the measured step costs), capped so neither ``max_tokens`` nor the context limit can
   be overrun inside a draft;
3. ``propose``: the draft guesses ``k_b`` tokens per request;
4. ``verify``: one target forward over ``[last token, d_1..d_kb]`` per request (a
   ragged batch), processed with the same sampling transform as the draft;
5. ``rejection_sample``: accept a prefix, emit the residual or bonus token;
6. ``rollback``: each request's target and draft caches keep only the accepted
   prefix (O(1)); stop conditions cut the output; finished requests free their slots.

Requests join and leave between steps (continuous batching).
"""

from __future__ import annotations

import itertools
import operator
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from specdist.config import Config, load_config
from specdist.draft_length import DraftLengthPolicy
from specdist.errors import ConfigError, InvalidArgument
from specdist.models.loader import eos_token_ids
from specdist.models.runner import CausalLMRunner
from specdist.proposers import DraftBatch, ModelProposer, NgramProposer, sampling_tensors
from specdist.request import Request, RequestOutput, now
from specdist.sampling import process_logits
from specdist.sampling_params import SamplingParams
from specdist.stopping import OutputState
from specdist.verification import rejection_sample

PHASES = ("prefill", "draft", "verify", "sampling", "cache", "output")


@dataclass
class EngineStats:
    """Wall time per phase (seconds) and token counters since the last reset."""

    phase_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0

    def reset(self) -> None:
        self.__init__()


class Engine:
    def __init__(self, config: Config, target: torch.nn.Module, tokenizer=None, draft: torch.nn.Module | None = None):
        self.config = config
        ec = config.engine
        self.tokenizer = tokenizer
        self.max_model_len = ec.max_model_len
        self.target = CausalLMRunner(target, ec.max_batch_size, ec.max_model_len)
        self.vocab_size = self.target.vocab_size
        self.eos_ids = eos_token_ids(target, tokenizer)
        self.k = config.draft.num_speculative_tokens if config.draft.enabled else 0
        self.length_policy = DraftLengthPolicy(self.k, config.draft.length_policy)
        self.proposer: ModelProposer | NgramProposer | None = None
        if config.draft.method == "ngram":
            self.proposer = NgramProposer(config.draft.ngram_min, config.draft.ngram_max)
        elif draft is not None:
            if int(draft.config.vocab_size) != self.vocab_size:
                raise ConfigError(
                    "draft.model",
                    f"vocabulary size {draft.config.vocab_size} differs from the target's {self.vocab_size}",
                )
            self.proposer = ModelProposer(
                CausalLMRunner(draft, ec.max_batch_size, ec.max_model_len), config.draft.confidence_threshold
            )
        elif config.draft.enabled:
            raise ConfigError("draft.method", f"{config.draft.method!r} needs a draft model")
        # self-w8: the draft is the target's own int8 copy, so the target's prompt K/V (same layout)
        # stand in for the draft's own: one prefill instead of two (ModelProposer.start)
        self.share_prompt_kv = (
            config.draft.method == "self-w8" and isinstance(self.proposer, ModelProposer)
            and self.target.cache.same_layout(self.proposer.cache)
        )
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.stats = EngineStats()
        self._ids = itertools.count()
        self._seeds = torch.Generator().manual_seed(ec.seed)

    # ---------------------------------------------------------------- building
    @classmethod
    def from_config(cls, source: str | dict | Config | None = None) -> "Engine":
        from specdist.models.loader import load_model, load_tokenizer, resolve_model

        cfg = load_config(source)
        if cfg.engine.num_threads:
            torch.set_num_threads(cfg.engine.num_threads)
        device = _device(cfg.engine.device)
        src = resolve_model(cfg.target.model, "target.model")
        target = load_model(src, cfg.target.dtype, device)
        tokenizer = load_tokenizer(src)
        draft = None
        if cfg.draft.method == "model":
            dsrc = resolve_model(cfg.draft.model, "draft.model")
            draft = load_model(dsrc, cfg.draft.dtype, device)
            _check_same_vocab(target, tokenizer, draft, load_tokenizer(dsrc))
        elif cfg.draft.method == "self-w8":
            from specdist.models.quant import quantized_copy

            draft = quantized_copy(target)
        return cls(cfg, target, tokenizer, draft)

    # ---------------------------------------------------------------- requests
    def add_request(
        self, prompt: str | Sequence[int], params: SamplingParams | None = None, request_id: str | None = None
    ) -> Request:
        params, text, ids, seed = self._check_request(prompt, params)
        req = Request(
            request_id=request_id if request_id is not None else str(next(self._ids)),
            prompt=text,
            prompt_ids=ids,
            params=params,
            generator=torch.Generator().manual_seed(seed),
            output=OutputState(params, self.eos_ids, self.tokenizer),
        )
        req.metrics.prompt_tokens = len(ids)
        req.metrics.arrival_time = now()
        self.waiting.append(req)
        return req

    def _check_request(
        self, prompt: str | Sequence[int], params: SamplingParams | None
    ) -> tuple[SamplingParams, str | None, list[int], int]:
        """Validate a new request: (params, prompt text, prompt ids, seed). Shared with RemoteEngine."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidArgument("params", f"must be SamplingParams, got {type(params).__name__}")
        text, ids = self._tokenize(prompt)
        if params.stop and self.tokenizer is None:
            raise InvalidArgument("stop", "stop strings need a model with a tokenizer")
        seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, (1,), generator=self._seeds))
        return params, text, ids, seed

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free everything it holds. False if it is unknown or done."""
        for req in list(self.waiting) + self.running:
            if req.request_id == request_id:
                req.output.finish("abort")
                self.release(req)
                return True
        return False

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def generate(
        self, prompts: Sequence[str | Sequence[int]], params: SamplingParams | Sequence[SamplingParams] | None = None
    ) -> list[RequestOutput]:
        """Run a batch of prompts together to completion; outputs in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            raise InvalidArgument("prompts", "must be a list of prompts (text or token-id lists)")
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise InvalidArgument("params", f"got {len(plist)} SamplingParams for {len(prompts)} prompts")
        reqs = []
        try:
            for p, sp in zip(prompts, plist):
                reqs.append(self.add_request(p, sp))
        except Exception:
            for r in reqs:
                self.abort(r.request_id)
            raise
        try:
            while any(not r.finished for r in reqs):
                self.step()
        finally:  # an exception or interrupt mid-run must not leave slots or queue entries behind
            for r in reqs:
                if not r.finished:
                    self.abort(r.request_id)
        return [r.to_output() for r in reqs]

    def stream(self, prompt: str | Sequence[int], params: SamplingParams | None = None) -> Iterator[str]:
        """Yield text pieces as they are produced; the final output is then ``self.last_output``."""
        req = self.add_request(prompt, params)
        try:
            while not req.finished:
                self.step()
                delta = req.output.take_delta()
                if delta:
                    yield delta
            tail = req.output.take_delta()
            if tail:
                yield tail
        finally:
            if not req.finished:
                self.abort(req.request_id)
        self.last_output = req.to_output()

    # ---------------------------------------------------------------- the step
    def step(self) -> list[Request]:
        """One verification for every running request. Returns the requests that advanced."""
        self._admit()
        if not self.running:
            return []
        t = self.stats.phase_s
        reqs = sorted(self.running, key=lambda r: r.target_slot)  # contiguous slots attend via views
        tc = now()
        ks = self.length_policy.choose([self._draft_len(r) for r in reqs], [r.acceptance for r in reqs],
                                       first=[r.metrics.steps == 0 and not self.waiting for r in reqs])
        bsz = len(reqs)

        t0 = now()
        if self.proposer is not None and max(ks) > 0:
            draft = self.proposer.propose(reqs, ks)
        else:
            draft = DraftBatch(torch.full((bsz, 0), -1, dtype=torch.long), None, torch.zeros(bsz, dtype=torch.long))
        t1 = now()
        t["draft"] += t1 - t0

        nd = draft.num_draft.tolist()
        kdim = max(nd)  # an n-gram draft may find fewer than k tokens for everyone
        if draft.tokens.shape[1] != kdim:
            probs_q = draft.probs[:, :kdim] if draft.probs is not None else None
            draft = DraftBatch(draft.tokens[:, :kdim], probs_q, draft.num_draft)
        inputs = [[r.seq[-1]] + draft.tokens[b, : nd[b]].tolist() for b, r in enumerate(reqs)]
        write0 = self.target.timings.cache_write_s
        logits = self.target.forward([r.target_slot for r in reqs], inputs, [n + 1 for n in nd])  # [B, K+1, V]
        t2 = now()
        t["verify"] += t2 - t1
        t["cache"] += self.target.timings.cache_write_s - write0

        pos_valid = torch.arange(kdim + 1)[None, :] <= draft.num_draft[:, None]  # [B, K+1]
        temp, top_k, top_p = sampling_tensors(reqs)
        rows = pos_valid.nonzero()[:, 0]  # request index of each valid (request, position)
        probs = torch.zeros(bsz, kdim + 1, self.vocab_size)
        probs[pos_valid] = process_logits(logits[:, : kdim + 1][pos_valid], temp[rows], top_k[rows], top_p[rows])
        acc_u = torch.ones(bsz, kdim, dtype=torch.float64)
        smp_u = torch.empty(bsz, dtype=torch.float64)
        for b, r in enumerate(reqs):
            u = r.uniforms(nd[b] + 1)
            acc_u[b, : nd[b]] = u[:-1]
            smp_u[b] = u[-1]
        res = rejection_sample(probs, draft.probs, draft.tokens, draft.num_draft, acc_u, smp_u)
        t3 = now()
        t["sampling"] += t3 - t2
        policy = self.length_policy
        policy.observe_draft(0, kdim, sum(nd), t1 - t0)
        policy.observe_verify(sum(nd) + bsz, t3 - t1, bsz)

        n_acc = res.num_accepted.tolist()
        emitted_rows = res.tokens.tolist()
        for b, r in enumerate(reqs):
            prev_len = len(r.seq)
            self.target.cache.rollback(r.target_slot, prev_len + n_acc[b])  # keeps last token + accepted drafts
            if self.proposer is not None:
                self.proposer.commit(r, prev_len, n_acc[b])
        t4 = now()
        t["cache"] += t4 - t3

        for b, r in enumerate(reqs):
            new = emitted_rows[b][: n_acc[b] + 1]
            kept = r.output.append(new)
            m = r.metrics
            m.steps += 1
            m.drafted += nd[b]
            m.accepted += n_acc[b]
            policy.observe_acceptance(r.acceptance, nd[b], n_acc[b])
            self.stats.drafted += nd[b]
            self.stats.accepted += n_acc[b]
            self.stats.emitted += kept
            if m.first_token_time is None and (kept or r.finished):
                m.first_token_time = now()
            if not r.finished and len(r.seq) >= self.max_model_len:
                r.output.finish("length")
            if r.finished:
                self.release(r)
        self.stats.steps += 1
        t5 = now()
        t["output"] += t5 - t4
        policy.end_step()
        policy.observe_overhead((t0 - tc) + (t5 - t3))  # everything but draft, verify and sampling
        return reqs

    # ---------------------------------------------------------------- internals
    def _draft_len(self, r: Request) -> int:
        remaining = r.params.max_tokens - len(r.output.token_ids)  # tokens it may still emit
        room = self.max_model_len - len(r.seq)  # context left
        return max(0, min(self.k, remaining - 1, room - 1))

    def _admit(self) -> None:
        new: list[Request] = []
        while self.waiting and self.target.cache.num_free > len(new):
            new.append(self.waiting.popleft())
        if not new:
            return
        t0 = now()
        for r in new:
            r.target_slot = self.target.cache.allocate()
        todo = [r for r in new if len(r.prompt_ids) > 1]
        if todo:
            t1 = now()
            self.target.forward([r.target_slot for r in todo], [r.prompt_ids[:-1] for r in todo], [0] * len(todo))
            self.length_policy.observe_verify(sum(len(r.prompt_ids) - 1 for r in todo), now() - t1)
        if isinstance(self.proposer, ModelProposer):
            self.proposer.start(new, self.target.cache if self.share_prompt_kv else None)
        elif self.proposer is not None:
            self.proposer.start(new)
        self.running.extend(new)
        self.stats.phase_s["prefill"] += now() - t0

    def release(self, r: Request) -> None:
        """Free everything the request holds (queue entry, KV slots). Idempotent."""
        if r in self.waiting:
            self.waiting.remove(r)
        if r in self.running:
            self.running.remove(r)
        if r.target_slot is not None:
            self.target.cache.free(r.target_slot)
            r.target_slot = None
        if self.proposer is not None:
            self.proposer.release(r)
        if r.metrics.finish_time is None:
            r.metrics.finish_time = now()

    def _tokenize(self, prompt: str | Sequence[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidArgument("prompt", "text prompts need a model with a tokenizer; pass token ids")
            ids = self.tokenizer.encode(prompt, add_special_tokens=False)
            text = prompt
        else:
            try:
                if any(isinstance(t, bool) for t in prompt):
                    raise TypeError
                ids = [operator.index(t) for t in prompt]  # ints (numpy ints too); 2.5 or "3" are errors
            except TypeError:
                raise InvalidArgument("prompt", "must be text or a list of integer token ids") from None
            text = None
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise InvalidArgument("prompt", f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        if not ids:
            raise InvalidArgument("prompt", "is empty")
        if len(ids) >= self.max_model_len:
            raise InvalidArgument(
                "prompt", f"has {len(ids)} tokens; the context limit is {self.max_model_len} (prompt + output)"
            )
        return text, ids

    def kv_slots_in_use(self) -> dict[str, int]:
        used = {"target": self.target.cache.num_used}
        if isinstance(self.proposer, ModelProposer):
            used["draft"] = self.proposer.cache.num_used
        return used


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def _check_same_vocab(target, target_tok, draft, draft_tok) -> None:
    if int(draft.config.vocab_size) != int(target.config.vocab_size):
        raise ConfigError(
            "draft.model",
            f"vocabulary size {draft.config.vocab_size} differs from the target's {target.config.vocab_size}",
        )
    if target_tok is not None and draft_tok is not None and target_tok.get_vocab() != draft_tok.get_vocab():
        raise ConfigError("draft.model", "tokenizer vocabulary differs from the target's (same size, other tokens)")
