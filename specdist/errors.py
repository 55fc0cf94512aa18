"""Errors specdist raises on purpose. Each names the field or setting that is wrong."""

from __future__ import annotations


class SpecDistError(Exception):
    """Base class of every error specdist raises deliberately."""


class InvalidArgument(SpecDistError, ValueError):
    """A request field has a bad value. `field` is its dotted name (e.g. ``top_p``)."""

    def __init__(self, field: str, message: str):
        self.field = field
        self.message = message
        super().__init__(f"{field}: {message}")


class ConfigError(SpecDistError, ValueError):
    """A deployment config is invalid. `key` is the dotted path of the bad setting."""

    def __init__(self, key: str, message: str):
        self.key = key
        self.message = message
        super().__init__(f"config {key}: {message}")
