"""What ``specdist serve`` checks before the model loads (seconds; a deployment a minute or more).

That ``--port`` (and ``--http-port``, ``--metrics-port``) can be bound now; that the config's draft section serves
(a method with its settings, a target copy the device runs); and that the optional dependencies it needs are
installed (Ray: the ``[distributed]`` extra; FastAPI and uvicorn for ``--http-port``: the ``[http]`` extra).
Each failure is one line naming the fix.
"""

from __future__ import annotations

import errno
import importlib.util
import socket
import sys
from typing import Any

from specdist.errors import ListenError, SpecDistError

INSTALL_DISTRIBUTED = 'pip install -e ".[distributed]"'
INSTALL_HTTP = 'pip install -e ".[http]"'


class MissingDependency(SpecDistError):
    """An optional dependency the config needs is not installed."""


def check_listen(host: str, port: int) -> None:
    """Raise ListenError unless ``host:port`` can be bound now.

    Binds (and closes) a socket per address ``host`` resolves to, with SO_REUSEADDR as grpc
    sets it, so a port in TIME_WAIT passes and a port someone listens on does not. (grpc also
    sets SO_REUSEPORT; this check does not, so a second server on the port of a running one is
    refused here instead of silently sharing its port.)
    """
    if not 0 <= port <= 65535:
        raise ListenError(f"cannot listen on {host}:{port}: the port must be in [0, 65535]")
    from specdist.transport.hosts import bare_host

    try:
        infos = socket.getaddrinfo(bare_host(host) or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ListenError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    errors: list[OSError] = []
    bound = 0
    for family, type_, proto, _, addr in infos:
        try:
            with socket.socket(family, type_, proto) as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind(addr)
                bound += 1
        except OSError as e:
            errors.append(e)
    busy = [e for e in errors if e.errno == errno.EADDRINUSE]
    if busy or not bound:
        e = (busy or errors)[0]
        why = "the port is in use" if e.errno == errno.EADDRINUSE else (e.strerror or str(e))
        raise ListenError(f"cannot listen on {host}:{port}: {why}")


def check_config(cfg: Any) -> Any:
    """What a loaded config needs before anything starts, beyond what load_config checks: a draft method that
    serves ``draft.method`` with its settings (:func:`specdist.cores.proposers.resolve_draft`: a ConfigError
    naming the key), and the extras it runs on (MissingDependency naming the extra when one is not installed).
    Returns the draft section resolved (a ResolvedDraft), for
    :func:`specdist.api.serving.start_backend` to take instead of checking
    it again."""
    from specdist.cores.proposers import resolve_draft
    from specdist.models.backends import backend_class

    draft = resolve_draft(cfg.draft, cfg.target.dtype)
    _check_draft_device(cfg, draft.copy)
    if cfg.engine.attention_backend != "auto":
        backend_class(cfg.engine.attention_backend)  # a ConfigError naming the key and the registered names
    if cfg.cluster.enabled and not _importable("ray"):
        raise MissingDependency(f"cluster.enabled needs Ray: {INSTALL_DISTRIBUTED}")
    return draft


def _check_draft_device(cfg: Any, copy: str | None) -> None:
    """A draft whose target copy (``copy``) cannot run on the device the models will: ``self-w8`` (and hybrid's) on CUDA
    (:func:`specdist.models.quant.refuse_int8_on`), a one-line ConfigError naming ``draft.method``. In process the
    device is ``engine.device`` (auto: CUDA when this machine has it); on Ray ``cluster.use_gpu``, else
    ``engine.device`` when it names one (auto there: the deployment checks it once it knows the cluster's GPUs)."""
    from specdist.models.devices import device_for
    from specdist.models.quant import refuse_int8_on

    if copy is None:
        return
    device = cfg.engine.device
    if cfg.cluster.enabled:
        gpu = cfg.cluster.gpu
        device = ("cuda" if gpu else "cpu") if gpu is not None else device
        if device == "auto":
            return
    refuse_int8_on(copy, device_for(device).type)


def check_http_dependencies() -> None:
    """Raise MissingDependency naming the extra unless FastAPI and uvicorn are installed."""
    missing = [m for m in ("fastapi", "uvicorn") if not _importable(m)]
    if missing:
        raise MissingDependency(f"--http-port needs {' and '.join(missing)}: {INSTALL_HTTP}")


def _importable(module: str) -> bool:
    """Whether ``import module`` would find it (without importing it: Ray takes seconds)."""
    if module in sys.modules:
        return sys.modules[module] is not None  # None: imports of it are blocked
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False
