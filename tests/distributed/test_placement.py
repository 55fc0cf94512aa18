"""Placement groups on a local Ray cluster (conftest's shared ``local_ray``, 4 logical CPUs; CPU
bundles; GPU bundles are the same code path)."""

from __future__ import annotations

import time

import pytest
import ray

from cluster.placement import PlacementError, bundle, create_placement, remove_placement

pytestmark = pytest.mark.ray


def test_target_ranks_packed_and_drafts_separate(local_ray):
    p = create_placement(tp_size=2, num_drafts=2, use_gpu=False, cpus_per_rank=1, cpus_per_draft=0.5, timeout_s=30)
    try:
        assert p.target.bundle_specs == [{"CPU": 1.0}, {"CPU": 1.0}]
        assert [d.bundle_specs for d in p.drafts] == [[{"CPU": 0.5}], [{"CPU": 0.5}]]
        table = ray.util.placement_group_table(p.target)
        assert table["strategy"] == "STRICT_PACK" and table["state"] == "CREATED"
        deadline = time.monotonic() + 10  # the groups are ready; the resource view follows asynchronously
        while ray.available_resources().get("CPU", 0) > 1.0 + 1e-6 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert ray.available_resources().get("CPU", 0) == pytest.approx(1.0)
    finally:
        remove_placement(p)


def test_impossible_request_fails_with_clear_message_and_frees_everything(local_ray):
    t0 = time.monotonic()
    with pytest.raises(PlacementError) as ei:
        create_placement(tp_size=2, num_drafts=1, use_gpu=True, timeout_s=30)
    msg = str(ei.value)
    assert "ONE node" in msg and "missing {GPU: 2}" in msg, msg
    assert time.monotonic() - t0 < 10  # at once: no node arrangement could ever hold it
    ray.util.placement_group_table()  # the cluster still answers
    # everything reserved by the failed attempt was released
    p = create_placement(tp_size=2, num_drafts=2, use_gpu=False, cpus_per_rank=1, cpus_per_draft=1, timeout_s=30)
    remove_placement(p)


def test_bundle_validation():
    assert bundle(2, 1) == {"CPU": 2.0, "GPU": 1.0}
    with pytest.raises(ValueError):
        bundle(0, 0)
