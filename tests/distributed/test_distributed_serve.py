"""`specdist serve` on a Ray deployment: the cluster config's errors, and a bring-up that fails.

Serving on a deployment, from bring-up to a clean stop, is tests/distributed/test_deployment.py's first test.
"""

from __future__ import annotations

import pytest
import ray
from support.helpers import tiny_config

pytestmark = pytest.mark.ray


def _cluster_config(tiny_models) -> dict:
    cfg = tiny_config(tiny_models, method="model", k=3)
    cfg["cluster"] = {
        "enabled": True,
        "tensor_parallel_size": 2,
        "num_draft_workers": 2,
        "cpus_per_rank": 0.5,
        "cpus_per_draft": 0.5,
        "bringup_timeout_s": 180,
    }
    return cfg


def test_cluster_config_errors_name_the_key(tiny_models):
    from specdist.config import load_config
    from specdist.errors import ConfigError

    cfg = _cluster_config(tiny_models)
    cfg["cluster"]["num_draft_workers"] = 0
    with pytest.raises(ConfigError, match=r"cluster\.num_draft_workers.*>= 1 when draft.method is 'model'"):
        load_config(cfg)
    cfg = _cluster_config(tiny_models)
    cfg["cluster"]["use_gpu"] = "maybe"
    with pytest.raises(ConfigError, match=r"cluster\.use_gpu"):
        load_config(cfg)
    cfg = _cluster_config(tiny_models)
    cfg["cluster"]["enabled"] = "yes"
    with pytest.raises(ConfigError, match=r"cluster\.enabled"):
        load_config(cfg)
    assert load_config(None).cluster.enabled is False


def test_tp_that_does_not_divide_heads_fails_bring_up_and_cleans_up(local_ray, tiny_models):
    """3 ranks over 4 heads: the deployment names the phase and the reason, and leaves nothing behind."""
    from cluster.deployment import DeploymentError
    from specdist.api.serving import start_backend

    cfg = _cluster_config(tiny_models)
    cfg["cluster"].update(tensor_parallel_size=3, num_draft_workers=1)
    with pytest.raises(DeploymentError, match=r"not divisible by 3"):
        start_backend(cfg)
    assert all(pg["state"] == "REMOVED" for pg in ray.util.placement_group_table().values())
