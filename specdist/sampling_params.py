"""Per-request sampling settings, validated when constructed."""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

from specdist.errors import InvalidArgument

INT32_END = 2**31  # max_tokens, top_k and token ids travel as int32 (common.proto); larger ones are refused
MAX_LOGPROBS = 20  # most top entries ``logprobs`` may ask for per token (OpenAI's and vLLM's default bound)
# The samplers use temperature and top_p as float32 (specdist.cores.sampling.SamplingRows, the wire's
# float fields), so they are checked as the float32 they become: a positive value must be a normal
# float32, [FLOAT32_MIN_NORMAL, FLOAT32_MAX]. Below it float32 makes it 0 or subnormal (flushed to 0
# where a device or compiled kernel flushes subnormals): top_p keeps nothing (NaN probabilities), a
# temperature turns greedy or divides by 0. Above it, it is inf.
FLOAT32_MIN_NORMAL = 2.0**-126  # 1.1754944e-38
FLOAT32_MAX = (2 - 2.0**-23) * 2.0**127  # 3.4028235e+38


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
    see :mod:`specdist.logprobs`. ``temperature`` and ``top_p`` are checked as the float32 values
    the samplers use (``FLOAT32_MIN_NORMAL``): one that float32 makes 0, subnormal or infinite is
    refused, and the value given is kept as given.
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
        if (
            isinstance(self.max_tokens, bool)
            or not isinstance(self.max_tokens, int)
            or not 1 <= self.max_tokens < INT32_END
        ):
            raise InvalidArgument("max_tokens", f"must be an integer >= 1 (and < 2**31), got {self.max_tokens!r}")
        t = _as_float32(self.temperature)
        if t is None or not (self.temperature == 0 or FLOAT32_MIN_NORMAL <= t <= FLOAT32_MAX):
            raise InvalidArgument(
                "temperature",
                "must be 0 or a number from 1.1754944e-38 to 3.4028235e+38 (it is "
                f"used as a float32), got {_shown(self.temperature)}",
            )
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or not 0 <= self.top_k < INT32_END:
            raise InvalidArgument("top_k", f"must be an integer >= 0 (0 disables it; < 2**31), got {self.top_k!r}")
        p = _as_float32(self.top_p)
        if p is None or not (0.0 < self.top_p <= 1.0):
            raise InvalidArgument("top_p", f"must be in (0, 1], got {_shown(self.top_p)}")
        if p < FLOAT32_MIN_NORMAL:
            raise InvalidArgument(
                "top_p",
                "must be at least 1.1754944e-38 (it is used as a float32; smaller values are 0 "
                f"or subnormal there), got {self.top_p!r}",
            )
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


def _shown(x: object) -> str:
    """``repr(x)`` for a one-line message, cut to 40 characters (an int may have thousands of digits)."""
    try:
        s = repr(x)
    except ValueError:  # an int over sys.get_int_max_str_digits()
        return f"an {type(x).__name__} too long to print"
    return s if len(s) <= 40 else s[:37] + "..."


def _as_float32(x: object) -> float | None:
    """``x`` rounded to float32 as the samplers will see it (+-inf beyond float32's range); None
    for a non-number or NaN."""
    if not _is_number(x):
        return None
    try:
        x = float(x)  # type: ignore[arg-type]
    except OverflowError:  # an int beyond float64
        return math.inf if x > 0 else -math.inf  # type: ignore[operator]
    if math.isnan(x):
        return None
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:  # rounds beyond FLOAT32_MAX
        return math.copysign(math.inf, x)


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
