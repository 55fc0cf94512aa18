"""``self-w8`` drafting (and hybrid's, which drafts with the same int8 copy) is refused on CUDA when the config is
checked, before any model loads: one line naming ``draft.method`` (specdist.models.quant.refuse_int8_on), from the
serving assembly's check (specdist.api.preflight.check_config) and from Engine.from_config. Runs on the CPU: CUDA is
only named (or reported available), never used."""

from __future__ import annotations

import pytest
import torch
from support.helpers import tiny_config

from specdist.api.preflight import check_config
from specdist.config import load_config
from specdist.engine.local import Engine
from specdist.errors import ConfigError
from specdist.models import loader


def _no_loading(monkeypatch):
    def load_model(*args, **kwargs):
        raise AssertionError("a model was loaded before the config was refused")

    monkeypatch.setattr(loader, "load_model", load_model)


def _refused(e: pytest.ExceptionInfo) -> None:
    assert e.value.key == "draft.method" and "\n" not in str(e.value)
    assert "'self-w8' does not run on CUDA" in str(e.value) and "'self-w4'" in str(e.value)


@pytest.mark.parametrize("method", ["self-w8", "hybrid"])
def test_check_config_refuses_self_w8_on_cuda(tiny_models, monkeypatch, method):
    _no_loading(monkeypatch)
    with pytest.raises(ConfigError) as e:
        check_config(load_config(tiny_config(tiny_models, method=method, device="cuda:1")))
    _refused(e)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # auto on a machine with a GPU
    with pytest.raises(ConfigError) as e:
        check_config(load_config(tiny_config(tiny_models, method=method, device="auto")))
    _refused(e)
    on_ray = tiny_config(tiny_models, method=method, device="cpu")
    on_ray["cluster"] = {"enabled": True, "use_gpu": True}  # the workers' device: cluster.use_gpu
    with pytest.raises(ConfigError) as e:
        check_config(load_config(on_ray))
    _refused(e)


def test_check_config_passes_self_w8_on_the_cpu_and_self_w4_on_cuda(tiny_models, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    check_config(load_config(tiny_config(tiny_models, method="self-w8", device="auto")))
    check_config(load_config(tiny_config(tiny_models, method="self-w4", device="cuda")))
    on_ray = tiny_config(tiny_models, method="self-w8", device="cuda")
    on_ray["cluster"] = {"enabled": True, "use_gpu": False}  # CPU workers, whatever engine.device says
    check_config(load_config(on_ray))


def test_engine_from_config_refuses_self_w8_on_cuda_before_loading_the_target(tiny_models, monkeypatch):
    _no_loading(monkeypatch)
    with pytest.raises(ConfigError) as e:
        Engine.from_config(tiny_config(tiny_models, method="self-w8", device="cuda"))
    _refused(e)
