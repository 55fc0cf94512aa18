"""Output assembly: stop tokens, stop strings, max_tokens, and incremental text.

Rules (applied token by token, in order):
- a stop token (EOS unless ``ignore_eos``, or any of ``stop_token_ids``) ends the
  request with ``finish_reason="stop"``; the stop token itself is not part of the
  output, and nothing after it is ever appended;
- a stop string ends the request as soon as the decoded text contains it; the text
  is cut just before the stop string and ``token_ids`` end at the token that
  completed it;
- reaching ``max_tokens`` ends it with ``finish_reason="length"``.
Streaming holds back a trailing incomplete UTF-8 character and, when stop strings
are set, the last ``len(longest stop) - 1`` characters, so a stop string is never
streamed before it is recognised.
"""

from __future__ import annotations

from specdist.sampling_params import SamplingParams


class OutputState:
    def __init__(self, params: SamplingParams, eos_ids: frozenset[int], tokenizer=None):
        self.params = params
        self.tokenizer = tokenizer
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids |= eos_ids
        self.stop_ids = frozenset(stop_ids)
        self.token_ids: list[int] = []
        self.text = ""
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self._streamed = 0  # characters of text already handed out by take_delta()
        self._holdback = max((len(s) for s in params.stop), default=1) - 1

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def append(self, tokens: list[int]) -> int:
        """Append newly generated tokens until a stop; returns how many were kept."""
        kept = 0
        for tok in tokens:
            if self.finished:
                break
            if tok in self.stop_ids:
                self.finish("stop", tok)
                break
            self.token_ids.append(tok)
            kept += 1
            if self.params.stop and self.tokenizer is not None:
                self._decode()
                self._check_stop_strings()
            if not self.finished and len(self.token_ids) >= self.params.max_tokens:
                self.finish("length")
        if self.tokenizer is not None and not self.params.stop:
            self._decode()
        return kept

    def finish(self, reason: str, stop_reason: int | str | None = None) -> None:
        if self.finish_reason is None:
            self.finish_reason, self.stop_reason = reason, stop_reason

    def take_delta(self) -> str:
        """Text produced since the last call that is safe to show."""
        end = len(self.text)
        if not self.finished:
            end -= self._holdback
            while end > self._streamed and self.text[end - 1] == "\ufffd":
                end -= 1
        if end <= self._streamed:
            return ""
        delta = self.text[self._streamed : end]
        self._streamed = end
        return delta

    def _decode(self) -> None:
        self.text = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)

    def _check_stop_strings(self) -> None:
        hits = [(i, s) for s in self.params.stop if (i := self.text.find(s)) >= 0]
        if hits:
            idx, s = min(hits)
            self.text = self.text[:idx]
            self.finish("stop", s)
