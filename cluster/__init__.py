"""Bring-up on Ray: placement groups, worker start/stop, health, Ray job entrypoints."""
