"""specdist: exact speculative decoding, from one process to a Ray cluster."""

from specdist.errors import ConfigError, InvalidArgument, SpecDistError
from specdist.sampling_params import SamplingParams

__all__ = ["Engine", "SamplingParams", "RequestOutput", "InvalidArgument", "ConfigError", "SpecDistError"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # The engine pulls in torch and transformers; load it on first use so that
    # light imports (config, errors, cost model) stay fast.
    if name == "Engine":
        from specdist.engine.local import Engine

        return Engine
    if name == "RequestOutput":
        from specdist.engine.request import RequestOutput

        return RequestOutput
    raise AttributeError(name)
