"""Draft proposers: they guess the next k tokens of each request.

- :class:`ModelProposer` runs a small causal LM (a separate model, or the target's
  own int8 copy for ``self-w8``) over its own slot KV cache and samples each draft
  token from the *processed* draft distribution ``q`` (same transform as the target).
- :class:`NgramProposer` (prompt lookup) copies the continuation of the latest
  earlier occurrence of the sequence's last n tokens; its ``q`` is one-hot, so it
  returns no probabilities.

Both keep per-request state on ``request.draft_state`` and are told after every
verification how many draft tokens survived, so a model draft rolls its cache back
to the accepted prefix in O(1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdist.kv_cache import SlotKVCache
from specdist.models.runner import CausalLMRunner
from specdist.request import Request
from specdist.sampling import process_logits, sample_from


@dataclass
class DraftBatch:
    tokens: torch.Tensor  # [B, K] long, -1 past each row's num_draft
    probs: torch.Tensor | None  # [B, K, V] processed q; None means one-hot on tokens
    num_draft: torch.Tensor  # [B] long


def sampling_tensors(reqs: list[Request]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-request (temperature [B], top_k [B], top_p [B]) for :func:`process_logits`."""
    temp = torch.tensor([r.params.temperature for r in reqs], dtype=torch.float32)
    top_k = torch.tensor([r.params.top_k for r in reqs], dtype=torch.long)
    top_p = torch.tensor([r.params.top_p for r in reqs], dtype=torch.float32)
    return temp, top_k, top_p


class ModelProposer:
    """Drafts with a model. With ``confidence_threshold > 0`` a request stops drafting early
    once the draft's untempered probability of its latest token is below the threshold (the
    token is still proposed). The rule looks only at the draft's own distribution, so the
    draft length is decided before verification and exactness is unaffected."""

    returns_probs = True

    def __init__(self, runner: CausalLMRunner, confidence_threshold: float = 0.0):
        self.runner = runner
        self.confidence_threshold = confidence_threshold

    @property
    def cache(self):
        return self.runner.cache

    def start(self, reqs: list[Request], prefilled: "SlotKVCache | None" = None) -> None:
        """Take a slot per request and prefill it with all prompt tokens but the last.

        ``prefilled``: a cache of the same layout where each request's ``target_slot`` already
        holds those tokens (the target's, when the draft is its own quantized copy): their K/V
        are copied instead of computed. Exactness does not depend on it (the draft samples
        from the q it reports, whatever its cache holds); it saves a second prefill.
        """
        for r in reqs:
            r.draft_state = self.cache.allocate()
        todo = [r for r in reqs if len(r.prompt_ids) > 1]
        if todo and prefilled is not None:
            for r in todo:
                self.cache.copy_prefix(prefilled, r.target_slot, r.draft_state, len(r.prompt_ids) - 1)
        elif todo:
            self.runner.forward([r.draft_state for r in todo], [r.prompt_ids[:-1] for r in todo], [0] * len(todo))

    def release(self, req: Request) -> None:
        if req.draft_state is not None:
            self.cache.free(req.draft_state)
            req.draft_state = None

    def propose(self, reqs: list[Request], ks: list[int]) -> DraftBatch:
        bsz, kmax = len(reqs), max(ks)
        vocab = self.runner.vocab_size
        tokens = torch.full((bsz, kmax), -1, dtype=torch.long)
        probs = torch.zeros(bsz, kmax, vocab)
        temp, top_k, top_p = sampling_tensors(reqs)
        last: dict[int, int] = {}
        ks = list(ks)  # shortened in place when a request stops early
        for j in range(kmax):
            rows = [b for b in range(bsz) if ks[b] > j]
            if not rows:
                break
            if j == 0:  # catch up on everything the draft cache has not seen yet (1 or 2 tokens usually)
                inputs = [reqs[b].seq[self.cache.lengths[reqs[b].draft_state] :] for b in rows]
            else:
                inputs = [[last[b]] for b in rows]
            logits = self.runner.forward([reqs[b].draft_state for b in rows], inputs, [1] * len(rows))[:, 0]
            idx = torch.tensor(rows)
            q = process_logits(logits, temp[idx], top_k[idx], top_p[idx])  # [n, V]
            u = torch.stack([reqs[b].uniforms(1)[0] for b in rows])
            x = sample_from(q, u)  # [n]
            probs[idx, j] = q
            tokens[idx, j] = x
            for b, t in zip(rows, x.tolist()):
                last[b] = t
            if self.confidence_threshold > 0:
                # Confidence = the draft's untempered (T = 1, unfiltered) probability of its token,
                # so greedy requests (one-hot q) are judged too.
                conf = torch.softmax(logits.float(), -1).gather(-1, x[:, None]).squeeze(-1)  # [n]
                for b, c in zip(rows, conf.tolist()):
                    if c < self.confidence_threshold:
                        ks[b] = j + 1
        return DraftBatch(tokens, probs, torch.tensor(ks, dtype=torch.long))

    def commit(self, req: Request, prev_seq_len: int, num_accepted: int) -> None:
        """Roll the draft cache back to the tokens the target kept (O(1))."""
        slot = req.draft_state
        keep = min(self.cache.lengths[slot], prev_seq_len + num_accepted)
        self.cache.rollback(slot, keep)


class NgramProposer:
    """Prompt lookup decoding (no model): q is one-hot, so acceptance probability is p(x)."""

    returns_probs = False

    def __init__(self, ngram_min: int = 1, ngram_max: int = 3):
        self.ngram_min, self.ngram_max = ngram_min, ngram_max

    def start(self, reqs: list[Request]) -> None:
        pass

    def release(self, req: Request) -> None:
        pass

    def commit(self, req: Request, prev_seq_len: int, num_accepted: int) -> None:
        pass

    def lookup(self, seq: list[int], k: int) -> list[int]:
        """Continuation (up to k tokens) of the latest earlier match of the longest suffix n-gram."""
        length = len(seq)
        for n in range(min(self.ngram_max, length - 1), self.ngram_min - 1, -1):
            suffix = seq[length - n :]
            for start in range(length - n - 1, -1, -1):
                if seq[start : start + n] == suffix:
                    return seq[start + n : start + n + k]
        return []

    def propose(self, reqs: list[Request], ks: list[int]) -> DraftBatch:
        bsz, kmax = len(reqs), max(ks)
        tokens = torch.full((bsz, kmax), -1, dtype=torch.long)
        num = torch.zeros(bsz, dtype=torch.long)
        for b, (r, k) in enumerate(zip(reqs, ks)):
            guess = self.lookup(r.seq, k) if k > 0 else []
            if guess:
                tokens[b, : len(guess)] = torch.tensor(guess)
                num[b] = len(guess)
        return DraftBatch(tokens, None, num)
