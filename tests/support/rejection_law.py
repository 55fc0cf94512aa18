"""The exact law of one verified draft position, for the enumeration tests.

Built from the sampler's own :func:`~specdist.cores.rejection.acceptance_probability` and
:func:`~specdist.cores.rejection.residual_distribution`, so a test that compares it with ``p`` checks the
components :func:`~specdist.cores.rejection.rejection_sample` runs.
"""

from __future__ import annotations

import torch

from specdist.cores.rejection import acceptance_probability, residual_distribution


def one_step_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The exact distribution of the token emitted at one draft position.

    Draft ``x ~ q``; with probability ``a(x)`` emit ``x``, else emit a residual sample:
    ``P(y) = q(y) a(y) + r(y) * sum_x q(x) (1 - a(x))``. Shapes: ``p``, ``q`` [..., V] -> [..., V].
    """
    a = acceptance_probability(p, q)
    accepted = q * a
    rejected_mass = (q * (1 - a)).sum(-1, keepdim=True)
    return accepted + rejected_mass * residual_distribution(p, q)
