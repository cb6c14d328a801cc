"""The one exception root of nri-accel and its families.

Owns: NriAccelError and its subclasses, and cut() (how a message quotes a value that
may be megabytes long). Imports nothing from the project.

Every error that reaches a user names what it is about: the annotation key, the
environment variable, the config key, the device id or the file. `source` carries
that name and `str(err)` always starts with it, so a refused container's message
reads ``annotation devices.nri-accel.io/pod: unknown device "nvidia.com/gpu=9"``.
The ttrpc subpackage is a standalone library and has its own root (TtrpcError).

A refusal carries `status`: the name of the gRPC/ttrpc status code the runtime quotes
("rpc error: code = ... desc = ...") in the error kubelet shows, so it says what kind of
refusal it is. The NRI stub reads it from the exception, whatever its type, and an
exception without one is a bug (answered UNKNOWN, logged with its traceback).
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

    status = "INVALID_ARGUMENT"


class PolicyError(RequestError):
    """A request is well formed but the trust policy does not allow it."""

    status = "PERMISSION_DENIED"


class NotFoundError(RequestError):
    """A request names a device this node does not have."""

    status = "NOT_FOUND"


class AllocationError(RequestError):
    """A request is valid and allowed, but the node cannot satisfy it now (devices held
    by other containers, unhealthy, or too few)."""

    status = "RESOURCE_EXHAUSTED"


class InternalError(NriAccelError):
    """A bug met while serving one request: the runtime gets a readable reason, the
    traceback is logged, the daemon goes on."""

    status = "INTERNAL"


class StateError(RequestError):
    """The grant state is not known well enough to serve the request safely (no
    checkpoint could be read and the runtime has not synchronised yet)."""

    status = "UNAVAILABLE"


def cut(text: str, limit: int) -> str:
    """`text` as a message quotes it: whole, or its first `limit` characters and "..."
    (what a pod, a spec or a request names may be megabytes long)."""
    return text if len(text) <= limit else text[:limit] + "..."
