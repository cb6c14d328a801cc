"""The one exception root of nri-accel and its families.

Owns: NriAccelError and its subclasses. Imports nothing from the project.

Every error that reaches a user names what it is about: the annotation key, the
environment variable, the config key, the device id or the file. `source` carries
that name and `str(err)` always starts with it, so a refused container's message
reads ``annotation devices.nri-accel.io/pod: unknown device "nvidia.com/gpu=9"``.
The ttrpc subpackage is a standalone library and has its own root (TtrpcError).
"""

from __future__ import annotations


class NriAccelError(Exception):
    """Root of every error nri-accel raises on purpose."""

    def __init__(self, message: str, *, source: str = "") -> None:
        self.source = source
        self.message = message
        super().__init__(f"{source}: {message}" if source else message)


class ConfigError(NriAccelError):
    """The configuration file or a command-line option is invalid (source: key or flag)."""


class DiscoveryError(NriAccelError):
    """A discoverer could not read part of the host (source: path or vendor)."""


class InventoryError(NriAccelError):
    """A saved inventory file cannot be loaded (source: file or JSON path)."""


class RequestError(NriAccelError):
    """A container's request is malformed (source: annotation key or env name).

    Fails that one container's creation; never the daemon.
    """


class PolicyError(RequestError):
    """A request is well formed but the trust policy does not allow it."""


class AllocationError(RequestError):
    """A request is valid and allowed, but the node cannot satisfy it."""
