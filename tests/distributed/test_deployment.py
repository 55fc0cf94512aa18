"""Deployments on a local Ray cluster, driven by the same scheduler as the in-process Engine.

- A 1-rank target + 1 EAGLE-3 draft worker: seeded sampled requests give the Engine's tokens bit for bit
  (one seed rule, one step, the same cores; only tensor parallelism may change float sums), which
  under the Gumbel coupling are also the tokens of the Engine without drafts.
- A bring-up that fails (a missing model) or times out names the culprit and cleans up.

A served tensor-parallel deployment from bring-up to a clean stop (health, loopback, the worker
secret, gRPC and HTTP equal to the Engine, faults, drain, stop) is tests/distributed/test_worker_faults.py;
one with two draft workers is tests/distributed/test_cluster_bench.py's.
"""

from __future__ import annotations

import pytest
import torch
from support.helpers import assert_nothing_left_on_ray, tiny_config

from cluster.deployment import ClusterSpec, Deployment
from specdist.engine.local import Engine
from specdist.engine.remote import RemoteEngine
from specdist.sampling_params import SamplingParams

pytestmark = pytest.mark.ray

BRING_UP_TIMEOUT_S = 180
K = 3
PROMPTS = [[1, 2, 3, 1, 2], [4], [5, 6, 5, 6, 5, 6, 5], [2, 3]]
MAX_TOKENS = [20, 9, 30, 14]


def _assert_nothing_left():
    assert_nothing_left_on_ray()  # groups removed, actors dead, the cluster's 4 CPUs free again


def test_one_rank_deployment_gives_the_engines_tokens_bit_for_bit(local_ray, eagle3_models):
    """Seeded sampling (T 0.8, top-p 0.9), 4 prompts in one batch, fixed draft lengths: the
    in-process Engine and a 1-rank target + 1 draft worker deployment emit the same tokens. The
    draft worker runs an EAGLE-3 head (the other Ray tests draft with models): the target's hidden
    states travel with every Prefill and Verify result to the coordinator and on to the worker."""
    tiny_models = eagle3_models
    cfg = tiny_config(tiny_models, method="eagle3", k=K)
    params = [
        SamplingParams(temperature=0.8, top_p=0.9, max_tokens=m, seed=100 + i, ignore_eos=True)
        for i, m in enumerate(MAX_TOKENS)
    ]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in the actors: the same GEMM kernels and summation order
    try:
        want = [o.token_ids for o in Engine.from_config(cfg).generate(PROMPTS, params)]
        # sampling.coupling gumbel (the default): no draft at all gives the same tokens
        plain = Engine.from_config(tiny_config(tiny_models, method="none"))
        assert [o.token_ids for o in plain.generate(PROMPTS, params)] == want
    finally:
        torch.set_num_threads(threads)
    spec = ClusterSpec(tensor_parallel_size=1, num_draft_workers=1, cpus_per_rank=0.5, cpus_per_draft=0.5)
    dep = Deployment(spec)
    try:
        target_addr, draft_addrs = dep.start(cfg, timeout_s=BRING_UP_TIMEOUT_S)
        with RemoteEngine.from_addresses(
            cfg, target_addr, draft_addrs, worker_secret=dep.worker_secret, worker_tls=dep.worker_tls
        ) as remote:
            outs = remote.generate(PROMPTS, params)
        assert [o.token_ids for o in outs] == want
        assert sum(o.metrics.accepted for o in outs) > 0 and any(o.metrics.accepted < o.metrics.drafted for o in outs)
    finally:
        dep.stop()
    _assert_nothing_left()


def test_failed_and_timed_out_bring_up_name_the_culprit_and_clean_up(local_ray, tiny_models, tmp_path):
    from cluster.deployment import DeploymentError

    spec = ClusterSpec(tensor_parallel_size=1, num_draft_workers=1, cpus_per_rank=0.5, cpus_per_draft=0.5)
    cfg = tiny_config(tiny_models, method="model", k=K)
    cfg["draft"]["model"] = str(tmp_path / "no-such-model")
    dep = Deployment(spec)
    with pytest.raises(DeploymentError) as ei:
        dep.start(cfg, timeout_s=BRING_UP_TIMEOUT_S)
    assert "draft 0 failed in phase 'load'" in str(ei.value) and "no-such-model" in str(ei.value)
    assert "draft.model" in str(ei.value)
    assert not dep.actors() and dep.placement is None
    _assert_nothing_left()

    dep = Deployment(spec)
    with pytest.raises(DeploymentError) as ei:
        dep.start(tiny_config(tiny_models, method="model", k=K), timeout_s=0.5)
    msg = str(ei.value)
    assert "did not come up within" in msg and "phase" in msg and ("target rank 0" in msg or "draft 0" in msg), msg
    _assert_nothing_left()
