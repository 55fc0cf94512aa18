"""Per-request sampling settings, validated when constructed."""

from __future__ import annotations

import math
from dataclasses import dataclass

from specdist.errors import InvalidArgument

INT32_END = 2**31  # max_tokens, top_k and token ids travel as int32 (common.proto); larger ones are refused
MAX_LOGPROBS = 20  # most top entries ``logprobs`` may ask for per token (OpenAI's and vLLM's default bound)


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples and when it stops.

    ``temperature == 0`` means greedy decoding (argmax; speculative output is then
    token-for-token identical to target-only greedy decoding). ``top_k == 0`` and
    ``top_p == 1`` disable those filters. ``seed`` fixes the request's own random
    stream; ``None`` draws a seed from the engine. ``logprobs``: return, for every output
    token, its log-probability under the target's processed distribution (temperature,
    top-k and top-p applied: the one it was sampled from) and that of the ``logprobs`` most
    likely tokens at its position (0: the token's own only; ``None``: nothing, at no cost);
    see :mod:`specdist.logprobs`.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None

    def __post_init__(self) -> None:
        # Accept lists from callers but store tuples so the object stays hashable.
        object.__setattr__(self, "stop", _as_tuple(self.stop, "stop", str))
        object.__setattr__(self, "stop_token_ids", _as_tuple(self.stop_token_ids, "stop_token_ids", int))
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) \
                or not 1 <= self.max_tokens < INT32_END:
            raise InvalidArgument("max_tokens", f"must be an integer >= 1 (and < 2**31), got {self.max_tokens!r}")
        if not _is_number(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidArgument("temperature", f"must be a finite number >= 0, got {self.temperature!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or not 0 <= self.top_k < INT32_END:
            raise InvalidArgument("top_k", f"must be an integer >= 0 (0 disables it; < 2**31), got {self.top_k!r}")
        if not _is_number(self.top_p) or not (0.0 < self.top_p <= 1.0):
            raise InvalidArgument("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2**64
        ):
            raise InvalidArgument("seed", f"must be an integer in [0, 2**64) or None, got {self.seed!r}")
        n = self.logprobs
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= MAX_LOGPROBS):
            raise InvalidArgument("logprobs", f"must be an integer in [0, {MAX_LOGPROBS}] or None, got {n!r}")
        for s in self.stop:
            if s == "":
                raise InvalidArgument("stop", "stop strings must be non-empty")
        for t in self.stop_token_ids:
            if not 0 <= t < INT32_END:
                raise InvalidArgument("stop_token_ids", f"token ids must be >= 0 (and < 2**31), got {t}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _as_tuple(value: object, name: str, kind: type) -> tuple:
    if value is None:
        return ()
    if isinstance(value, (str, int)):
        value = (value,)
    try:
        items = tuple(value)  # type: ignore[arg-type]
    except TypeError:
        raise InvalidArgument(name, f"must be a list of {kind.__name__}, got {value!r}") from None
    for item in items:
        if not isinstance(item, kind) or isinstance(item, bool):
            raise InvalidArgument(name, f"must be a list of {kind.__name__}, got element {item!r}")
    return items
