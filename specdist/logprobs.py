"""Log-probabilities of output tokens, as the target computed them (``SamplingParams.logprobs``).

What they are: for each output token, ``log p(token)`` under the target's PROCESSED
distribution ``p`` at its position (temperature, top-k and top-p applied: the distribution the
token was sampled from, :func:`specdist.cores.sampling.process_logits`), and the ``logprobs`` most
likely tokens under that ``p``. This is vLLM's ``logprobs-mode: processed_logprobs``; vLLM's
default returns the raw model's log-softmax instead. A greedy request's ``p`` is one-hot, so
its token has 0.0 and its top list holds that token alone. Tokens with ``p = 0`` never appear
in a top list (their log-probability would be -inf), so a list may be shorter than asked.

How they are made: the verifier already holds ``p`` for every position it emits a token at
(accepted drafts and the final token). For the requests that asked, it gathers ``log p`` of
the emitted tokens and (when ``logprobs > 0``) takes the top entries over the vocabulary, on
the device, and brings them to the host in the same copy as the step's accepted counts
(:meth:`specdist.cores.target.VerifierCore.verify`); :func:`split_rows` reads them back here.
Requests that did not ask cost nothing. No extra forward.

Torch-free (the public client imports it): the dataclass, the host-side reading of the
verifier's flat values, and the ``TokenLogprob`` wire message (common.proto).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from specdist.v1 import common_pb2


@dataclass(frozen=True)
class TokenLogprob:
    """One output token's log-probability, and the most likely tokens at its position."""

    logprob: float  # log p(token) under the processed distribution; finite (p > 0)
    top: tuple[tuple[int, float], ...] = ()  # (token id, log p), most likely first; p = 0 left out


def values_per_position(num_top: int) -> int:
    """Flat values the verifier sends per (request, position): log p(token), then ``num_top``
    log-probabilities and ``num_top`` token ids of the top entries."""
    return 1 + 2 * num_top


def split_rows(
    values: Sequence[float], positions: int, num_top: int, emitted: Sequence[int], asked: Sequence[int]
) -> list[list[TokenLogprob]]:
    """Read the verifier's flat values back: row ``a`` holds ``positions`` positions of
    :func:`values_per_position` ``(num_top)`` values each; its first ``emitted[a]`` positions are
    its emitted tokens, and it asked for ``asked[a]`` (<= num_top) top entries."""
    width = values_per_position(num_top)
    out = []
    for a, (n, want) in enumerate(zip(emitted, asked)):
        row = []
        for j in range(n):
            at = (a * positions + j) * width
            logps, ids = values[at + 1 : at + 1 + want], values[at + 1 + num_top : at + 1 + num_top + want]
            top = tuple((int(t), lp) for t, lp in zip(ids, logps) if lp != -math.inf)
            row.append(TokenLogprob(values[at], top))
        out.append(row)
    return out


def to_proto(logprobs: Iterable[TokenLogprob]) -> list[common_pb2.TokenLogprob]:
    return [
        common_pb2.TokenLogprob(
            logprob=lp.logprob, top_token_ids=[t for t, _ in lp.top], top_logprobs=[v for _, v in lp.top]
        )
        for lp in logprobs
    ]


def from_proto(messages: Iterable[common_pb2.TokenLogprob]) -> list[TokenLogprob]:
    return [TokenLogprob(m.logprob, tuple(zip(m.top_token_ids, m.top_logprobs))) for m in messages]
