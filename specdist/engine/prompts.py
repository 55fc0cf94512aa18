"""One rule for turning a prompt into token ids, used by the engine, the servers and the CLI.

- A text prompt needs a tokenizer and must not be empty.
  - ``chat=False``: encoded with the tokenizer's special tokens (a Llama or Mistral
    tokenizer prepends BOS, as the model was trained to see);
  - ``chat=True``: wrapped as one user message in the model's chat template (with the
    generation prompt), then encoded *without* special tokens: the template writes its
    own BOS, and adding another would double it.
- With ``chat=True`` the prompt may also be a conversation: a list of messages
  (``{"role": ..., "content": ...}`` dicts), rendered by the template the same way.
- A token-id prompt is used as given: integers inside the vocabulary, at least one.
- Either way the prompt must leave room for one generated token within ``max_model_len``.

Everything here needs only the tokenizer, so callers can check a prompt before loading
any weights. Errors are :class:`~specdist.errors.InvalidArgument` naming the field.

A prompt is encoded once per request, where it arrives (:meth:`EngineBase.add_request
<specdist.engine.base.EngineBase.add_request>`, the coordinator's tokenizer threads), and travels
as an :class:`EncodedPrompt` to the scheduler, which takes it as checked.
"""

from __future__ import annotations

import operator
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from specdist.errors import InvalidArgument


@dataclass(frozen=True)
class EncodedPrompt:
    """A prompt templated, tokenized and checked (:func:`encode_prompt`): ``text`` (None for token ids),
    ``ids``; ``arrival``: when it arrived (``time.perf_counter()``, the engine's clock), before the tokenizing."""

    text: str | None
    ids: list[int]
    arrival: float = field(default_factory=time.perf_counter)


def is_conversation(prompt: object) -> bool:
    """Whether ``prompt`` is a list of chat messages (dicts) rather than text or token ids."""
    return isinstance(prompt, (list, tuple)) and bool(prompt) and all(isinstance(m, dict) for m in prompt)


def render_chat(tokenizer, conversation: str | Sequence[dict]) -> str:
    """A conversation (text: one user turn) in the model's chat template, ending with the assistant's prompt."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise InvalidArgument("apply_chat_template", "the model has no chat template")
    messages = [{"role": "user", "content": conversation}] if isinstance(conversation, str) else list(conversation)
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as e:  # a template that cannot render this input
        raise InvalidArgument("apply_chat_template", f"the chat template failed: {e}") from None


def encode_prompt(
    tokenizer, prompt: str | Sequence[int], *, vocab_size: int, max_model_len: int, chat: bool = False
) -> tuple[str | None, list[int]]:
    """(prompt text or None, prompt token ids), checked as the module docstring says."""
    conversation = chat and is_conversation(prompt)
    if isinstance(prompt, str) or conversation:
        if tokenizer is None:
            raise InvalidArgument("prompt", "text prompts need a model with a tokenizer; pass token ids")
        if not prompt:
            raise InvalidArgument("prompt", "is empty")
        text = render_chat(tokenizer, prompt) if chat else prompt
        ids = list(tokenizer.encode(text, add_special_tokens=not chat))
    else:
        if chat:
            raise InvalidArgument("apply_chat_template", "needs a text prompt, not token ids")
        try:
            if isinstance(prompt, (bytes, bytearray)) or any(isinstance(t, bool) for t in prompt):
                raise TypeError
            ids = [operator.index(t) for t in prompt]  # ints (numpy ints too); 2.5 or "3" are errors
        except TypeError:
            raise InvalidArgument("prompt", "must be text or a list of integer token ids") from None
        text = None
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise InvalidArgument("prompt", f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
    if not ids:
        raise InvalidArgument("prompt", "is empty")
    if len(ids) >= max_model_len:
        raise InvalidArgument(
            "prompt", f"has {len(ids)} tokens; the context limit is {max_model_len} (prompt + output)"
        )
    return text, ids
