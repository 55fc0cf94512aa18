"""Placement groups for one specdist deployment.

- The target's tensor-parallel ranks go into ONE placement group with ``STRICT_PACK``:
  all ranks on the same node, so their all-reduces stay on the node's fast links
  (NVLink on GPUs, shared memory / loopback on CPU).
- Each draft replica gets its own single-bundle group (``PACK``), so drafts can land
  on any node with room, including a different one from the target.
- Bundles ask for one GPU each when the deployment runs on GPUs, CPU only otherwise;
  the choice is made from the device, the code path is the same.

The target's group is placed first, then the drafts' (a draft placed first could take room the
target's one node needs). Before creating anything, the request is checked against the live nodes' total resources
(:func:`cannot_fit`): a deployment that no node arrangement can hold fails at once, naming the
resources it misses. One that fits the nodes but not what they have free now is waited for
with a timeout (other work may free room); on timeout every group created so far is removed
and the error names what was requested and what the nodes have free.

After bring-up, a node that dies takes its bundles with it: Ray places them again on a node
with room, and until it can, :func:`unplaced` says what the group waits for.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from specdist.errors import SpecDistError

PLACED_POLL_S = 0.05  # how often bring-up asks Ray whether the groups are placed


class PlacementError(SpecDistError):
    """The cluster cannot host the requested deployment (in time)."""


@dataclass
class DeploymentPlacement:
    target: object  # ray PlacementGroup with tp_size bundles (STRICT_PACK)
    drafts: list = field(default_factory=list)  # one PlacementGroup per draft replica
    target_bundle: dict = field(default_factory=dict)
    draft_bundle: dict = field(default_factory=dict)
    # Within a Serve replica's group (place_within): the bundle index of rank 0 and of draft 0 in ``target``,
    # which then also holds the drafts; the group is the replica's, so it is never removed here.
    target_offset: int = 0
    draft_offset: int | None = None

    @property
    def owned(self) -> bool:
        return self.draft_offset is None

    @property
    def groups(self) -> list:
        return [self.target, *self.drafts] if self.owned else []

    def target_slot(self, rank: int) -> tuple[object, int]:
        """(placement group, bundle index) of target rank ``rank``."""
        return self.target, self.target_offset + rank

    def draft_slot(self, index: int) -> tuple[object, int]:
        """(placement group, bundle index) of draft ``index``."""
        if self.owned:
            return self.drafts[index], 0
        return self.target, self.draft_offset + index


COORDINATOR_BUNDLE = {"CPU": 0.1}  # a Serve replica's own bundle: its coordinator (the engine thread, gRPC calls)


def replica_bundles(
    tp_size: int,
    num_drafts: int,
    use_gpu: bool,
    cpus_per_rank: float = 1.0,
    cpus_per_draft: float = 1.0,
    gpus_per_draft: float = 1.0,
) -> tuple[list[dict], str]:
    """The bundles and strategy of one Serve replica's placement group: its coordinator's bundle first (Serve
    places the replica actor there), then one per target rank, then one per draft (:func:`place_within`).
    STRICT_PACK with tensor parallelism (the ranks' collectives stay on one node), else PACK."""
    tb = bundle(cpus_per_rank, 1.0 if use_gpu else 0.0)
    db = bundle(cpus_per_draft, gpus_per_draft if use_gpu else 0.0)
    bundles = [dict(COORDINATOR_BUNDLE)] + [dict(tb) for _ in range(tp_size)] + [dict(db) for _ in range(num_drafts)]
    return bundles, "STRICT_PACK" if tp_size > 1 else "PACK"


def place_within(group: object, tp_size: int, num_drafts: int) -> DeploymentPlacement:
    """The placement of a deployment inside a Serve replica's group laid out by :func:`replica_bundles`: placed
    already (the replica runs in it), and removed with the replica by Serve."""
    specs = getattr(group, "bundle_specs", None)
    if specs is not None and len(specs) < 1 + tp_size + num_drafts:
        raise PlacementError(
            f"the replica's placement group has {len(specs)} bundles; {tp_size} target rank(s) and "
            f"{num_drafts} draft(s) need {1 + tp_size + num_drafts} (cluster/placement.replica_bundles)"
        )
    tb = dict(specs[1]) if specs else {}
    db = dict(specs[1 + tp_size]) if specs and num_drafts else {}
    return DeploymentPlacement(group, [], tb, db, target_offset=1, draft_offset=1 + tp_size)


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
    """Reserve resources for the target ranks and the draft replicas (the target's group placed
    first), or raise PlacementError."""
    from ray.util.placement_group import placement_group, remove_placement_group

    if tp_size < 1:
        raise ValueError(f"tp_size must be >= 1, got {tp_size}")
    if num_drafts < 0:
        raise ValueError(f"num_drafts must be >= 0, got {num_drafts}")
    tb = bundle(cpus_per_rank, 1.0 if use_gpu else 0.0)
    db = bundle(cpus_per_draft, gpus_per_draft if use_gpu else 0.0)
    nodes = live_nodes()
    why = cannot_fit(tp_size, tb, num_drafts, db, nodes)
    if why:
        raise PlacementError(f"placement cannot fit on the cluster's {len(nodes)} node(s): {why}")
    deadline = time.monotonic() + timeout_s
    target = placement_group([dict(tb) for _ in range(tp_size)], strategy="STRICT_PACK", name=f"{name}-target")
    placement = DeploymentPlacement(target, [], tb, db)
    # the target first: drafts placed before it could take room its one node needs
    waiting = _wait_placed([target], deadline)
    if not waiting:
        placement.drafts = [
            placement_group([dict(db)], strategy="PACK", name=f"{name}-draft-{i}") for i in range(num_drafts)
        ]
        waiting = _wait_placed(placement.drafts, deadline)
    if waiting:
        free = free_per_node()
        for pg in placement.groups:
            remove_placement_group(pg)
        missing = [pg.bundle_specs for pg in waiting]
        now = cannot_fit(tp_size, tb, num_drafts, db, free)
        raise PlacementError(
            f"placement not ready after {timeout_s:.0f}s: target needs {tp_size} x {fmt(tb)} on ONE node, "
            f"drafts need {num_drafts} x {fmt(db)}; still waiting for {missing}"
            f"{f'; with what the nodes have free: {now}' if now else ''}; free per node: {_fmt_nodes(free)}"
        )
    return placement


def _wait_placed(groups: list, deadline: float) -> list:
    """Poll the groups' state until each is placed or the deadline passes; returns those not placed."""
    import ray

    waiting = list(groups)
    while waiting:
        waiting = [pg for pg in waiting if ray.util.placement_group_table(pg)["state"] != "CREATED"]
        if not waiting or time.monotonic() >= deadline:
            break
        time.sleep(PLACED_POLL_S)
    return waiting


# ---------------------------------------------------------------- fitting
def fmt(resources: dict) -> str:
    """``{CPU: 2, GPU: 1}``: the CPU and GPU amounts (what bundles ask for), compactly."""
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in resources.items()) + "}"


def _fmt_nodes(nodes: dict) -> str:
    return ", ".join(fmt(_compute(r)) for r in nodes.values()) or "no live node"


def _compute(resources: dict) -> dict:
    return {k: float(resources.get(k, 0.0)) for k in ("CPU", "GPU") if k == "CPU" or resources.get(k)}


def _times(b: dict, n: int) -> dict:
    return {k: v * n for k, v in b.items()}


def _missing(need: dict, have: dict) -> dict:
    return {k: v - have.get(k, 0.0) for k, v in need.items() if have.get(k, 0.0) + 1e-9 < v}


def _count(b: dict, have: dict) -> int:
    """How many bundles ``b`` fit in ``have``."""
    return min(int(have.get(k, 0.0) / v + 1e-9) for k, v in b.items())


def cannot_fit(tp_size: int, tb: dict, num_drafts: int, db: dict, nodes: dict) -> str | None:
    """Why ``tp_size`` target bundles ``tb`` on ONE node plus ``num_drafts`` draft bundles ``db``
    anywhere can never be placed on ``nodes`` (node id -> resources), naming what is missing; None
    when some arrangement holds them. Exact for this shape: the target's node is tried in turn,
    and identical draft bundles fit wherever each node's remainder holds whole ones."""
    need = _times(tb, tp_size)
    hosts = [n for n, have in nodes.items() if not _missing(need, have)]
    if not hosts:
        closest = min(nodes.values(), key=lambda h: sum(_missing(need, h).values()), default={})
        return (
            f"the target needs {tp_size} x {fmt(tb)} = {fmt(need)} on ONE node; no node has it "
            f"(missing {fmt(_missing(need, closest))} on the closest node, which has "
            f"{fmt(_compute(closest))} in all)"
        )
    best = 0
    for host in hosts:
        rest = {
            n: ({k: v - need.get(k, 0.0) for k, v in have.items()} if n == host else have) for n, have in nodes.items()
        }
        best = max(best, sum(_count(db, have) for have in rest.values()))
        if best >= num_drafts:
            return None
    short = num_drafts - best
    return (
        f"the {num_drafts} draft(s) need {fmt(db)} each; with the target placed only {best} fit "
        f"(missing {fmt(_times(db, short))} for the other {short})"
    )


def live_nodes() -> dict:
    """node id -> its total resources, for the nodes alive now."""
    import ray

    return {n["NodeID"]: dict(n["Resources"]) for n in ray.nodes() if n["Alive"]}


def free_per_node() -> dict:
    """node id -> the resources it has free now, for the live nodes."""
    from ray._private.state import available_resources_per_node  # Ray's per-node view (a DeveloperAPI)

    alive = live_nodes()
    return {n: dict(free) for n, free in available_resources_per_node().items() if n in alive}


def unplaced(pg, what: str) -> str | None:
    """Why placement group ``pg`` (``what`` it holds, for the message) is not placed now: it lost its
    node and Ray waits for one with room; None when every bundle sits on a live node."""
    import ray

    table = ray.util.placement_group_table(pg)
    alive = live_nodes()
    if table["state"] == "CREATED" and all(n in alive for n in table["bundles_to_node_id"].values()):
        return None
    bundles = [{k: float(v) for k, v in b.items()} for b in table["bundles"].values()]
    free = free_per_node()
    if table["strategy"] == "STRICT_PACK":
        need = {k: sum(b.get(k, 0.0) for b in bundles) for k in bundles[0]}
        where = "on one node"
    else:
        need, where = bundles[0], "on a node"
    room = [h for h in free.values() if not _missing(need, h)]
    closest = min(free.values(), key=lambda h: sum(_missing(need, h).values()), default={})
    if room:  # Ray has not placed it yet: it will
        return f"{what} waits to be placed again (needs {fmt(need)} {where})"
    return (
        f"{what} waits for a node with room: it needs {fmt(need)} {where}, missing "
        f"{fmt(_missing(need, closest))} on the closest node (free per node: {_fmt_nodes(free)})"
    )


def remove_placement(placement: DeploymentPlacement) -> None:
    from ray.util.placement_group import remove_placement_group

    for pg in placement.groups:  # (none for a Serve replica's group: Serve removes it)
        try:
            remove_placement_group(pg)
        except Exception:  # already removed, or the cluster is gone
            pass
