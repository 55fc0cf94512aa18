"""A Ray cluster of this one machine, bound to loopback.

``ray.init(_node_ip_address="127.0.0.1")`` and ``ray start --node-ip-address 127.0.0.1`` do not
bind Ray to loopback: Ray replaces a loopback address with the machine's routable one
(``ray._private.services.resolve_ip_for_localhost``), so the GCS, raylet and workers listen on
the network. Ray keeps loopback only in its single-machine mode, which it turns on by default
on macOS and Windows and everywhere when ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``. Ray reads
that variable when it is imported, and the processes it starts (raylet, workers, a job's
driver) inherit it.
"""

from __future__ import annotations

import os
import sys

SINGLE_MACHINE_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
GCS_PORT_WAIT_ENV = "RAY_gcs_server_port_wait_time_s"  # seconds ray.init waits for the GCS server to start


def use_loopback_ray() -> None:
    """Make the Ray clusters this process starts from now on single-machine ones on loopback.

    Call it before ``import ray`` where possible: Ray reads the variable at import. When Ray is
    already imported, its module constant is switched too (read at each address lookup).
    """
    os.environ.update(SINGLE_MACHINE_ENV)
    constants = sys.modules.get("ray._private.ray_constants")
    if constants is not None and getattr(constants, "ENABLE_RAY_CLUSTER", False):
        constants.ENABLE_RAY_CLUSTER = False


def init_local_ray(num_cpus: int | None = None, loopback: bool = True) -> None:
    """Start a Ray cluster of this machine with ``num_cpus`` logical CPUs (None: as many as it
    has); ``loopback``: every Ray process listens on 127.0.0.1 only."""
    if loopback:
        use_loopback_ray()
    # Ray waits 30 s for its GCS server to write its port, then fails the start; on a small machine
    # busy with other work (a two-core box running the test suite's other worker) the GCS has taken
    # longer. 120 s unless the operator set it (Ray's own variable, read by ray.init).
    os.environ.setdefault(GCS_PORT_WAIT_ENV, "120")
    import ray

    # address "local": a cluster of its own, also where another Ray runs on this machine (ray.init without an
    # address would join the latest one it finds running, or refuse num_cpus on finding several)
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
