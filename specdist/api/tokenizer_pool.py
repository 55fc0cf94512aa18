"""The coordinator's tokenizer threads: prompts templated and tokenized off the engine thread.

A text prompt is templated (``chat``) and tokenized on a small thread pool (``specdist-tokenize-*`` threads)
before its add command is queued, never on the engine thread: a huge prompt holds up no running stream. A bad
prompt is refused from there with the ``InvalidArgument`` naming the field; the engine thread only adds the
:class:`~specdist.engine.prompts.EncodedPrompt` (its text, ids and arrival), which is not encoded or checked again.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Sequence
from typing import Any, Protocol

from specdist.engine.prompts import EncodedPrompt, encode_prompt

TOKENIZER_THREADS = 2  # prompts templated and tokenized at once


class Tokenizing(Protocol):
    """What the pool reads of an engine (an Engine, a RemoteEngine, the front's FrontEngine)."""

    tokenizer: Any
    vocab_size: int
    max_model_len: int


class TokenizerPool:
    """Encodes prompts for ``engine`` (its tokenizer, vocabulary and context length) on its own threads."""

    def __init__(self, engine: Tokenizing):
        self.engine = engine
        self._pool = concurrent.futures.ThreadPoolExecutor(TOKENIZER_THREADS, "specdist-tokenize")

    async def encode(self, prompt: str | Sequence[int] | Sequence[dict], chat: bool = False) -> EncodedPrompt:
        """Template (``chat``) and tokenize a prompt (:func:`specdist.engine.prompts.encode_prompt`:
        ``InvalidArgument`` naming the field); its arrival is when this was called."""
        arrival = time.perf_counter()
        eng = self.engine
        text, ids = await asyncio.get_running_loop().run_in_executor(
            self._pool,
            lambda: encode_prompt(
                eng.tokenizer, prompt, vocab_size=eng.vocab_size, max_model_len=eng.max_model_len, chat=chat
            ),
        )
        return EncodedPrompt(text, ids, arrival)

    def shutdown(self) -> None:
        """Stop the threads; prompts not yet started are dropped."""
        self._pool.shutdown(wait=False, cancel_futures=True)
