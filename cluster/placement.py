"""Placement groups for one specdist deployment.

- The target's tensor-parallel ranks go into ONE placement group with ``STRICT_PACK``:
  all ranks on the same node, so their all-reduces stay on the node's fast links
  (NVLink on GPUs, shared memory / loopback on CPU).
- Each draft replica gets its own single-bundle group (``PACK``), so drafts can land
  on any node with room, including a different one from the target.
- Bundles ask for one GPU each when the deployment runs on GPUs, CPU only otherwise;
  the choice is made from the device, the code path is the same.

Bring-up waits for the groups with a timeout; on timeout every group created so far
is removed and the error names what was requested and what the cluster has free.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specdist.errors import SpecDistError


class PlacementError(SpecDistError):
    """The cluster cannot host the requested deployment (in time)."""


@dataclass
class DeploymentPlacement:
    target: object  # ray PlacementGroup with tp_size bundles (STRICT_PACK)
    drafts: list = field(default_factory=list)  # one PlacementGroup per draft replica
    target_bundle: dict = field(default_factory=dict)
    draft_bundle: dict = field(default_factory=dict)

    @property
    def groups(self) -> list:
        return [self.target, *self.drafts]


def bundle(cpus: float, gpus: float) -> dict[str, float]:
    if cpus <= 0 and gpus <= 0:
        raise ValueError("a bundle needs some CPU or GPU")
    b = {"CPU": float(cpus)} if cpus > 0 else {}
    if gpus > 0:
        b["GPU"] = float(gpus)
    return b


def create_placement(
    tp_size: int,
    num_drafts: int,
    use_gpu: bool,
    cpus_per_rank: float = 1.0,
    cpus_per_draft: float = 1.0,
    gpus_per_draft: float = 1.0,
    timeout_s: float = 60.0,
    name: str = "specdist",
) -> DeploymentPlacement:
    """Reserve resources for the target ranks and the draft replicas, or raise PlacementError."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    if tp_size < 1:
        raise ValueError(f"tp_size must be >= 1, got {tp_size}")
    if num_drafts < 0:
        raise ValueError(f"num_drafts must be >= 0, got {num_drafts}")
    tb = bundle(cpus_per_rank, 1.0 if use_gpu else 0.0)
    db = bundle(cpus_per_draft, gpus_per_draft if use_gpu else 0.0)
    target = placement_group([dict(tb) for _ in range(tp_size)], strategy="STRICT_PACK", name=f"{name}-target")
    drafts = [placement_group([dict(db)], strategy="PACK", name=f"{name}-draft-{i}") for i in range(num_drafts)]
    placement = DeploymentPlacement(target, drafts, tb, db)
    pending = {pg.ready(): pg for pg in placement.groups}
    ready, not_ready = ray.wait(list(pending), num_returns=len(pending), timeout=timeout_s)
    if not_ready:
        free = ray.available_resources()
        for pg in placement.groups:
            remove_placement_group(pg)
        missing = [pending[r].bundle_specs for r in not_ready]
        raise PlacementError(
            f"placement not ready after {timeout_s:.0f}s: target needs {tp_size} x {tb} on ONE node, "
            f"drafts need {num_drafts} x {db}; still waiting for {missing}; cluster has free {free}"
        )
    return placement


def remove_placement(placement: DeploymentPlacement) -> None:
    from ray.util.placement_group import remove_placement_group

    for pg in placement.groups:
        try:
            remove_placement_group(pg)
        except Exception:  # already removed, or the cluster is gone
            pass
