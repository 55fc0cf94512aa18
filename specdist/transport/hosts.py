"""Host strings as the servers, the workers and the deployment read them."""

from __future__ import annotations


def bare_host(host: str) -> str:
    """``host`` as sockets take it: an IPv6 literal without the brackets of ``[::1]:8000``."""
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host
