"""The keyed randomness of a request: its seeds, the streams' roles and the counter-based uniforms.

Seeds: the verifier gets a request's seed itself, the drafter :func:`draft_seed` of it, on either
transport, so one seed gives one output wherever it runs. Every uniform is counter-based (an
element of a SplitMix64 stream, all 64 seed bits used): the drafter samples the draft token at
sequence position ``n`` with :func:`draft_uniform` ``(draft seed, n)``; the verifier accepts or
rejects the draft token at position ``n`` with :func:`target_uniforms` ``(seed, ACCEPT_ROLE, [n])``
and samples the residual or bonus token at position ``n`` with ``(seed, SAMPLE_ROLE, [n])``. They are
functions of the position, not of how many draws came before, so drafting the same positions
ahead of time (pipelined drafting, :mod:`specdist.cores.draft_pipeline`) or again after a rejection gives the
tokens sequential drafting gives, and the target's draws do not depend on the draft lengths.

The Gumbel-max coupling (:mod:`specdist.cores.coupling`) keys its noise with the drafter's seed and
its own role, on the same SplitMix64 function (:func:`mix64`, on the host here and in int64 on any
torch device there).

Pure integer arithmetic: imports nothing, so every layer (the cores, the scheduler, the workers) uses
this one definition.
"""

from __future__ import annotations

from collections.abc import Iterable

M64 = 0xFFFFFFFFFFFFFFFF  # uint64 arithmetic wraps modulo 2^64
GOLDEN = 0x9E3779B97F4A7C15  # SplitMix64's increment: consecutive elements of a stream are GOLDEN apart
MIX_C1, MIX_C2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB  # the multipliers of SplitMix64's output function

# The draft's random stream must differ from the target's (else draft samples and acceptance
# uniforms could be correlated, which breaks exactness). XOR with a fixed odd 64-bit constant is
# a bijection on uint64 without fixed points, so the two seeds always differ and a fixed request
# seed still reproduces the whole run.
DRAFT_SEED_XOR = 0x9E3779B97F4A7C15

# The target's two streams of a request: the uniforms that accept or reject draft tokens and
# those that sample the final (residual or bonus) token. Each is keyed by ``seed ^ role``. The
# drafter keeps its own key ``draft_seed(seed) = seed ^ DRAFT_SEED_XOR`` (its cores only ever see
# that seed, and a remote drafter must not need to know the roles); the three constants are
# distinct and nonzero, so one request's three keys are pairwise distinct and its three streams
# are distinct SplitMix64 streams.
ACCEPT_ROLE = 0xD1B54A32D192ED03
SAMPLE_ROLE = 0x8CB92BA72F3D8DD7


def draft_seed(seed: int) -> int:
    """The drafter's seed for a request whose verifier gets ``seed``."""
    return (int(seed) ^ DRAFT_SEED_XOR) & M64


def mix64(x: int) -> int:
    """The SplitMix64 output function on the host (a bijection on uint64 with full avalanche)."""
    x = ((x ^ (x >> 30)) * MIX_C1) & M64
    x = ((x ^ (x >> 27)) * MIX_C2) & M64
    return x ^ (x >> 31)


def _stream_uniforms(key: int, positions: Iterable[int]) -> list[float]:
    """Elements ``positions`` of the SplitMix64 stream that starts at the mixed ``key``, as uniforms
    in [0, 1) (53 bits). Counter-based: any position, in any order, any number of times."""
    start = mix64(int(key) & M64)
    return [(mix64((start + (int(n) + 1) * GOLDEN) & M64) >> 11) * 2.0**-53 for n in positions]


def draft_uniform(seed: int, position: int) -> float:
    """The uniform that samples the draft token at sequence ``position`` (``seed``: the drafter's)."""
    return _stream_uniforms(seed, (position,))[0]


def target_uniforms(seed: int, role: int, positions: Iterable[int]) -> list[float]:
    """The target's uniforms of one ``role`` (ACCEPT_ROLE or SAMPLE_ROLE) for the tokens at sequence
    ``positions`` of the request with ``seed``: pure functions of (seed, position, role)."""
    return _stream_uniforms(int(seed) ^ role, positions)
