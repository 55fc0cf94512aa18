"""Hybrid drafts (``draft.method: hybrid``): the suffix index *and* a model runner (the target's int8 copy).

Per request and step the suffix draft is taken when its score (expected accepted tokens by the counts) is at
least ``min(draft.suffix_min_score, k)`` (k: the tokens asked for; a score of k means every token certain by the
counts), otherwise the model drafts. Both choices depend on committed tokens only, so they are fixed before
verification. A request whose suffix draft was taken skips the model: its KV cache catches up on every
committed token at its next model pass.
"""

from __future__ import annotations

from specdist.cores.proposers.base import BuildContext, Draft, DraftRequest, register
from specdist.cores.proposers.model import SelfDraftProposer
from specdist.cores.proposers.suffix import Suffixed, SuffixKeys, SuffixProposer
from specdist.cores.suffix_index import SuffixSettings
from specdist.models.runner import CausalLMRunner


@register
class HybridProposer(SelfDraftProposer):
    methods = ("hybrid",)
    drafts_ahead = False  # the suffix drafts cost nothing to prepare; the pipeline is for model drafts
    settings = SuffixKeys

    def __init__(
        self,
        runner: CausalLMRunner,
        settings: SuffixSettings | None = None,
        confidence_threshold: float = 0.0,
        q_top_k: int = 0,
    ):
        super().__init__(runner, confidence_threshold, q_top_k, method="hybrid")
        self.suffix = SuffixProposer(runner.vocab_size, settings)
        self.drafts_by_source = {"suffix": 0, "model": 0}  # request steps drafted by each

    @classmethod
    def build(cls, dc, ctx: BuildContext) -> "HybridProposer":
        return cls(
            cls.runner_of(ctx, dc.method), cls.settings_of(dc).index_settings(), dc.confidence_threshold, dc.q_top_k
        )

    @classmethod
    def target_copy(cls, method: str) -> str | None:
        return "self-w8"

    def start(self, r: DraftRequest[Suffixed]) -> None:
        self.suffix.start(r)

    def commit(self, r: DraftRequest[Suffixed], kept, n_acc: int, prev: int, prepared, hidden) -> None:
        self.suffix.commit(r, kept, n_acc, prev, prepared, hidden)
        super().commit(r, kept, n_acc, prev, prepared, hidden)

    def propose(self, reqs: list[DraftRequest[Suffixed]], ks: list[int]) -> list[Draft]:
        drafts = [self.suffix.lookup(r, k) for r, k in zip(reqs, ks)]
        out = [Draft(d.tokens, match_lengths=d.depths) if d is not None else Draft([]) for d in drafts]
        # the model drafts the others: confident means expected accepted >= min_score, or all k tokens certain
        min_score = self.suffix.settings.min_score
        rows = [
            b for b, (d, k) in enumerate(zip(drafts, ks)) if k > 0 and not (d.tokens and d.score >= min(min_score, k))
        ]
        self.drafts_by_source["model"] += len(rows)
        self.drafts_by_source["suffix"] += sum(k > 0 for k in ks) - len(rows)
        if rows:
            toks, qs, _ = self.draft_model([reqs[b] for b in rows], [ks[b] for b in rows])
            for b, t, q in zip(rows, toks, qs):
                out[b] = Draft(t, q)
        return out

    def release(self, r: DraftRequest[Suffixed]) -> None:
        self.suffix.release(r)

    def forget_finished(self) -> None:
        self.suffix.forget_finished()

    def index_stats(self) -> dict[str, int]:
        return self.suffix.index_stats()

    def stats(self) -> dict:
        return self.suffix.stats() | {
            "hybrid_suffix_drafts": self.drafts_by_source["suffix"],
            "hybrid_model_drafts": self.drafts_by_source["model"],
        }
