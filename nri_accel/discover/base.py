"""What a discoverer returns: devices, drivers and problems of one vendor or source.

Owns: the Found record, lstat_device() and host_device_node(), the one way a discoverer
turns a host device node into a DeviceNode (type, major and minor from lstat; symlinks
refused).
Imports the standard library, msgspec, nri_accel.errors, nri_accel.inventory and
nri_accel.discover.hostroot.
"""

from __future__ import annotations

import os
import stat

from msgspec import Struct

from nri_accel.discover.hostroot import HostRoot
from nri_accel.errors import DiscoveryError
from nri_accel.inventory import Device, DeviceNode, Driver, Problem


class Found(Struct, frozen=True):
    """One discoverer's result. A discoverer never raises for a missing or broken
    vendor: it returns what it could find and a Problem saying why the rest is absent."""

    devices: tuple[Device, ...] = ()
    drivers: tuple[Driver, ...] = ()
    problems: tuple[Problem, ...] = ()


def lstat_device(root: HostRoot, host_path: str) -> tuple[str, os.stat_result]:
    """The type ("c" or "b") and lstat of the host device node at `host_path`.

    Raises DiscoveryError (source: the host path) when the node is missing (its cause is
    then a FileNotFoundError), is a symlink, or is not a character or block device: a
    symlink could be swapped between this check and the container's creation.
    """
    try:
        st = root.lstat(host_path)
    except FileNotFoundError as e:
        raise DiscoveryError("device node does not exist", source=host_path) from e
    except (OSError, ValueError) as e:
        msg = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise DiscoveryError(f"cannot stat device node: {msg}", source=host_path) from e
    if stat.S_ISLNK(st.st_mode):
        raise DiscoveryError("is a symlink; device nodes must be the node itself",
                             source=host_path)
    if stat.S_ISCHR(st.st_mode):
        return "c", st
    if stat.S_ISBLK(st.st_mode):
        return "b", st
    raise DiscoveryError("is not a character or block device", source=host_path)


def host_device_node(
    root: HostRoot, host_path: str, *, container_path: str = "", permissions: str = "rwm"
) -> DeviceNode:
    """The DeviceNode for the host node at `host_path`, numbers taken from lstat
    (lstat_device: DiscoveryError when it is missing, a symlink or not a device).
    `container_path` defaults to `host_path`."""
    typ, st = lstat_device(root, host_path)
    path = container_path or host_path
    return DeviceNode(
        path=path,
        major=os.major(st.st_rdev),
        minor=os.minor(st.st_rdev),
        type=typ,
        host_path=host_path if host_path != path else "",
        permissions=permissions,
    )
