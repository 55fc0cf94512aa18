"""SamplingParams as the specdist.v1 ``SamplingParams`` message (proto/specdist/v1/common.proto).

Both sides carry that one message: a client's ``GenerateRequest.params`` (decoded by the API's
servers) and the workers' Prefill and Start items (:mod:`specdist.transport.wire`), so its
conversion lives here, below both, as :mod:`specdist.logprobs` does for a token's log-probabilities.
"""

from __future__ import annotations

from dataclasses import fields

import numpy as np

from specdist.errors import InvalidArgument
from specdist.sampling_params import SamplingParams
from specdist.v1 import common_pb2


def sampling_params_from_proto(msg: common_pb2.SamplingParams, field: str = "params") -> SamplingParams:
    """Validate a wire SamplingParams; unset optional fields take SamplingParams' defaults.

    Raises InvalidArgument naming the wire field, ``f"{field}.{name}"`` (e.g.
    ``params.top_p``): the proto fields carry SamplingParams' own field names.
    """
    kwargs = {name: getattr(msg, name) for name in ("top_k", "seed", "max_tokens", "logprobs") if msg.HasField(name)}
    for name in ("temperature", "top_p"):
        if msg.HasField(name):
            kwargs[name] = _from_float32(getattr(msg, name))
    try:
        return SamplingParams(
            **kwargs, stop=list(msg.stop), stop_token_ids=list(msg.stop_token_ids), ignore_eos=msg.ignore_eos
        )
    except InvalidArgument as e:
        raise InvalidArgument(f"{field}.{e.field}", e.message) from None


def sampling_params_to_proto(sp: SamplingParams) -> common_pb2.SamplingParams:
    """Every field set explicitly (seed and logprobs only when set: None leaves them unset); floats travel as
    float32. The message carries SamplingParams' own field names, one for one."""
    values = {f.name: getattr(sp, f.name) for f in fields(sp)}
    return common_pb2.SamplingParams(**{name: v for name, v in values.items() if v is not None})


def _from_float32(x: float) -> float:
    # The shortest decimal that rounds to the same float32, so 0.8 comes back as 0.8 and
    # not 0.800000011920929. Same float32 either way, which is what the samplers use.
    return float(str(np.float32(x)))
