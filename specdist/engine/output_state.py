"""A request's output state: stop tokens, stop strings, max_tokens, and incremental text.

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

All of this runs on the host once per engine step, so its cost per token must not
grow with the output: the text is decoded incrementally (:class:`IncrementalDetokenizer`
decodes a window of a few tokens, never the whole output), stop strings are searched
for only in the text that changed plus ``len(longest stop) - 1`` characters before it,
and the text is kept as a list of pieces that is joined only when ``text`` is read.
"""

from __future__ import annotations

import weakref

from specdist.sampling_params import SamplingParams

REPLACEMENT = "\ufffd"  # what decoding gives for bytes of a UTF-8 character not yet complete

# A window whose text does not settle (pushes that each end inside a character, a run
# of invalid bytes, tokens without text) is cut once this many tokens are unread,
# keeping at least the last _KEEP_UNREAD unread: a UTF-8 character is at most 4 bytes,
# so the bytes of 4 more tokens decide every character before them (tokens carry at
# least one byte; special tokens are dropped).
_MAX_UNREAD = 16
_KEEP_UNREAD = 4
_MAX_CONTEXT = 8  # tokens of context tried (a character spans at most 4 byte tokens)


class IncrementalDetokenizer:
    """``tokenizer.decode(ids, skip_special_tokens=True)``, kept up to date a few tokens at a time.

    Prefix-offset / read-offset decoding (as in HF TGI and vLLM). Only a window is
    decoded: the *context* (the last released token or few, so the tokenizer sees the
    same neighbourhood, e.g. whether a SentencePiece word keeps its leading space)
    followed by the *unread* tokens. The new text is the window's text minus the
    context's text. While the window's text ends in U+FFFD (bytes of a character
    that the next token may complete), or has not grown, the tokens stay unread and
    their text is only ``pending``.

    Invariant: the concatenation of everything :meth:`push` returned, plus ``pending``,
    equals the decoding of every token pushed so far. Cost per token: O(1) decodes of
    a window of O(1) tokens, whatever the output length. Special tokens are dropped on
    the way in, since decoding skips them anyway.

    One decoder departs from the invariant: byte fallback (SentencePiece ``<0xNN>``
    tokens) decodes a whole run of byte tokens as one unit, so while the run's last
    character is incomplete, or if any byte in it is invalid, the full decoding turns
    the *whole run* into U+FFFD, characters completed earlier included. Here those
    characters stay as released; the two texts agree again at every character boundary
    of a run of valid characters (what models emit).
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._skip = skipped_ids(tokenizer)
        self._context: list[int] = []
        self._context_text = ""
        self._unread: list[int] = []
        self.pending = ""  # text of the unread tokens: not final (it may end in U+FFFD)

    def push(self, tokens: list[int]) -> str:
        """Add tokens; return the text that became final with them (possibly "")."""
        new = [t for t in tokens if t not in self._skip]
        if not new:
            return ""
        self._unread.extend(new)
        window = self._decode(self._context + self._unread)
        if window.endswith(REPLACEMENT) or len(window) <= len(self._context_text):
            self.pending = window[len(self._context_text) :]
            return self._cut() if len(self._unread) > _MAX_UNREAD else ""
        return self._release(len(self._unread), window)

    def _release(self, n: int, window: str) -> str:
        """Make the first n unread tokens final; ``window`` is the text of the context and them."""
        released = window[len(self._context_text) :]
        self._set_context(self._context + self._unread[:n], window)
        self._unread = self._unread[n:]
        self.pending = self._decode(self._context + self._unread)[len(self._context_text) :] if self._unread else ""
        return released

    def _cut(self) -> str:
        """Release part of a long unread run, so that windows stay a few tokens long.

        First choice: the latest character boundary among the unread tokens (a prefix
        whose text does not end in U+FFFD), exactly what a push ending there would have
        released; several pushes in a row may each end inside a character. A run
        without any (bytes that never form a character) is cut _KEEP_UNREAD tokens
        before its end, if the text up to the cut is the start of the window's text.
        """
        keep = len(self._unread) - _KEEP_UNREAD
        for n in range(keep, 0, -1):
            head = self._decode(self._context + self._unread[:n])
            if not head.endswith(REPLACEMENT) and len(head) > len(self._context_text):
                return self._release(n, head)
        head = self._decode(self._context + self._unread[:keep])
        window = self._context_text + self.pending
        if len(head) < len(self._context_text) or not window.startswith(head):
            return ""  # the cut splits a character whose bytes are still arriving: wait
        if len(head) == len(self._context_text):  # tokens without text: drop them, keep the context
            self._unread = self._unread[keep:]
            return ""
        return self._release(keep, head)

    def _set_context(self, ids: list[int], text: str) -> None:
        """Make the context the shortest suffix of ``ids`` that decodes on its own to the end of ``text``.

        ``text`` is the decoding of ``ids``. A suffix that starts inside a character
        (a byte-level token holding its last bytes, a run of SentencePiece byte tokens
        entered midway) decodes to something else and would shift every later slice.
        Usually the last token alone qualifies: one decode of one token.
        """
        for n in range(1, min(len(ids), _MAX_CONTEXT) + 1):
            context_text = self._decode(ids[-n:])
            if text.endswith(context_text):
                break
        self._context, self._context_text = ids[-n:], context_text

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


_SKIPPED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def skipped_ids(tokenizer) -> frozenset[int]:
    """Ids that ``decode(..., skip_special_tokens=True)`` leaves out (cached per tokenizer).

    A Hugging Face fast tokenizer skips the added tokens marked special in its Rust
    backend (often more than ``all_special_ids``); other tokenizers skip ``all_special_ids``.
    """
    try:
        return _SKIPPED[tokenizer]
    except (KeyError, TypeError):
        pass
    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)  # or a bare ``tokenizers.Tokenizer``
    if hasattr(backend, "get_added_tokens_decoder"):
        ids = frozenset(i for i, tok in backend.get_added_tokens_decoder().items() if tok.special)
    else:
        ids = frozenset(getattr(tokenizer, "all_special_ids", None) or ())
    try:
        _SKIPPED[tokenizer] = ids
    except TypeError:
        pass  # not weakly referenceable: recomputed per request
    return ids


class OutputState:
    """One request's output: token ids, text, and why it finished (see the module docstring)."""

    def __init__(self, params: SamplingParams, eos_ids: frozenset[int], tokenizer=None):
        self.params = params
        self.tokenizer = tokenizer
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids |= eos_ids
        self.stop_ids = frozenset(stop_ids)
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self._detok = IncrementalDetokenizer(tokenizer) if tokenizer is not None else None
        # text == "".join(self._parts) + self._pending; only _pending may still change
        self._parts: list[str] = []  # final text, one non-empty piece per release
        self._size = 0  # len of the final text
        self._pending = ""
        self._streamed = 0  # characters of text already handed out by take_delta()
        self._holdback = max((len(s) for s in params.stop), default=1) - 1

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def text(self) -> str:
        """The decoded output so far: O(len) to read after appends, O(1) to read again."""
        if len(self._parts) > 1:
            self._parts = ["".join(self._parts)]
        final = self._parts[0] if self._parts else ""
        return final + self._pending if self._pending else final

    def append(self, tokens: list[int]) -> int:
        """Append newly generated tokens until a stop; returns how many were kept."""
        per_token = bool(self.params.stop) and self._detok is not None  # stop strings need each token's text
        kept = 0
        for tok in tokens:
            if self.finished:
                break
            if tok in self.stop_ids:
                self.finish("stop", tok)
                break
            self.token_ids.append(tok)
            kept += 1
            if per_token:
                changed_from = self._push([tok])
                self._check_stop_strings(changed_from)
            if not self.finished and len(self.token_ids) >= self.params.max_tokens:
                self.finish("length")
        if self._detok is not None and not per_token and kept:
            self._push(self.token_ids[-kept:])
        return kept

    def finish(self, reason: str, stop_reason: int | str | None = None) -> None:
        if self.finish_reason is None:
            self.finish_reason, self.stop_reason = reason, stop_reason

    def take_delta(self) -> str:
        """Text produced since the last call that is safe to show."""
        fresh = self._suffix(self._streamed)  # text[_streamed:]
        end = len(fresh)  # relative to _streamed
        if not self.finished:
            end -= self._holdback
            while end > 0 and fresh[end - 1] == REPLACEMENT:
                end -= 1
        if end <= 0:
            return ""
        self._streamed += end
        return fresh[:end]

    def _push(self, tokens: list[int]) -> int:
        """Feed tokens to the detokenizer; return the first text position that may have changed."""
        changed_from = self._size  # everything before it is final
        released = self._detok.push(tokens)
        if released:
            self._parts.append(released)
            self._size += len(released)
        self._pending = self._detok.pending
        return changed_from

    def _check_stop_strings(self, changed_from: int) -> None:
        """Earliest stop string in the text (the text before ``changed_from`` was already searched).

        A new occurrence overlaps the changed text, so it starts at most
        ``len(longest stop) - 1`` characters before it: O(new text + longest stop) per call.
        """
        start = max(0, changed_from - self._holdback)
        window = self._suffix(start)
        hits = [(i, s) for s in self.params.stop if (i := window.find(s)) >= 0]
        if hits:
            idx, s = min(hits)
            self._truncate(start + idx)
            self.finish("stop", s)

    def _suffix(self, start: int) -> str:
        """``text[start:]``, touching only the pieces it spans: O(len(text) - start)."""
        if start >= self._size:
            return self._pending[start - self._size :]
        need, i, got = self._size - start, len(self._parts), 0
        while got < need:
            i -= 1
            got += len(self._parts[i])
        return "".join([self._parts[i][got - need :], *self._parts[i + 1 :], self._pending])

    def _truncate(self, end: int) -> None:
        """Cut the text to ``text[:end]``; ``end`` lies within the last few pieces."""
        if end >= self._size:
            self._pending = self._pending[: end - self._size]
            return
        self._pending = ""
        while self._parts and self._size - len(self._parts[-1]) >= end:
            self._size -= len(self._parts.pop())
        if self._size > end:  # the last piece straddles end
            self._parts[-1] = self._parts[-1][: len(self._parts[-1]) - (self._size - end)]
            self._size = end
