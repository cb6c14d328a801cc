"""Readers of the kernel's interfaces that several families share.

Owns: read() and read_stripped() (small sysfs/procfs files), parse_uint() (the one
strict reader of numbers in them), proc_devices() and
char_major() (character majors by driver name), link_name() and resolved_name() (where a
sysfs link leads), pci_numa_node() (a PCI function's NUMA node) and node_checked() (a host
device node from lstat whose type, major and minor are then checked against what the
driver says they must be). Imports the standard library, nri_accel.errors,
nri_accel.inventory and nri_accel.discover.{base,hostroot}. Every path goes through the
HostRoot; nothing here raises for a missing or malformed file: callers get None and
decide (node_checked raises DiscoveryError, as host_device_node does).

/proc/devices (fs/proc/devices.c, chrdev_show): a "Character devices:" section of
"%3d %s" lines (major, name registered by the driver), then a blank line and
"Block devices:". Only the character section is read.
"""

from __future__ import annotations

import os

from nri_accel.discover.base import host_device_node
from nri_accel.discover.hostroot import HostRoot, walk_in_root
from nri_accel.errors import DiscoveryError
from nri_accel.inventory import MAX_MAJOR, DeviceNode, Problem

PROC_DEVICES = "/proc/devices"
MAX_DIGITS = 20  # parse_uint: enough for any 64-bit value, far below int()'s 4300
MAX_UINT = (1 << 64) - 1  # parse_uint's default range: a u64 sysfs value


def read(root: HostRoot, host_path: str, problems: list[Problem] | None = None) -> str | None:
    """The text of a (sysfs, procfs) file, None when it cannot be read. With `problems`,
    a file that is there but cannot be read (a FIFO, a device, over the size limit,
    permissions) adds a Problem naming it; a missing one adds none."""
    try:
        return root.read_text(host_path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except (OSError, ValueError) as e:
        if problems is not None:
            reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
            problems.append(Problem(host_path, f"unreadable: {reason}"))
        return None


def read_stripped(root: HostRoot, host_path: str,
                  problems: list[Problem] | None = None) -> str | None:
    """read() without surrounding whitespace; None for a missing or empty file."""
    text = read(root, host_path, problems)
    text = text.strip() if text is not None else None
    return text or None


def parse_uint(text: str, *, maximum: int = MAX_UINT) -> int | None:
    """`text` (surrounding whitespace ignored) as a number from 0 to `maximum`, or None:
    ASCII digits only (str.isdigit() takes "²", which int() refuses) and at most
    MAX_DIGITS of them (int() refuses 4301 digits and is slow well before)."""
    text = text.strip()
    if not 0 < len(text) <= MAX_DIGITS or not (text.isascii() and text.isdigit()):
        return None
    value = int(text)
    return value if value <= maximum else None


def proc_devices(root: HostRoot) -> dict[str, frozenset[int]] | None:
    """Character-device majors by driver name from /proc/devices; None if unreadable.
    Lines whose major is not a number up to MAX_MAJOR are skipped."""
    text = read(root, PROC_DEVICES)
    if text is None:
        return None
    majors: dict[str, set[int]] = {}
    in_char = False
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.endswith(":"):
            in_char = stripped == "Character devices:"
            continue
        parts = stripped.split(None, 1)
        if in_char and len(parts) == 2:
            major = parse_uint(parts[0], maximum=MAX_MAJOR)
            if major is not None:
                majors.setdefault(parts[1], set()).add(major)
    return {name: frozenset(m) for name, m in majors.items()}


def char_major(root: HostRoot, driver: str) -> int | None:
    """The (lowest) character major `driver` ("nvidia-caps", "kfd", "drm") registered in
    /proc/devices; None when it has none or the file cannot be read."""
    majors = (proc_devices(root) or {}).get(driver)
    return min(majors) if majors else None


def link_name(root: HostRoot, host_path: str) -> str | None:
    """The last component of a symlink's target (a sysfs "driver" link), else None."""
    try:
        return os.path.basename(os.readlink(root.local(host_path)).rstrip("/")) or None
    except (OSError, ValueError):
        return None


def resolved_name(root: HostRoot, host_path: str) -> str | None:
    """The last component of `host_path` with every symlink resolved inside the root (a
    sysfs "device" link names the PCI function it leads to), else None."""
    try:
        return os.path.basename(walk_in_root(root.root or "/", host_path)) or None
    except (OSError, ValueError):
        return None


def pci_numa_node(root: HostRoot, bus_id: str) -> int | None:
    """The NUMA node of PCI function `bus_id` (sysfs numa_node; -1 means none)."""
    text = read_stripped(root, root.sys_path(f"bus/pci/devices/{bus_id}/numa_node"))
    try:
        node = int(text) if text is not None else -1
    except ValueError:
        return None
    return node if node >= 0 else None


def node_checked(
    root: HostRoot,
    host_path: str,
    *,
    majors: dict[str, frozenset[int]] | None,
    driver: str,
    minor: int | None,
) -> DeviceNode:
    """host_device_node() of a character device that must belong to `driver`.

    Numbers come from lstat (symlinks refused); the major must be one /proc/devices lists
    for `driver` (skipped when /proc/devices could not be read: `majors` None) and the
    minor must be `minor` when given. Raises DiscoveryError (source: the host path).
    """
    node = host_device_node(root, host_path)
    if node.type != "c":
        raise DiscoveryError("is a block device; a character device was expected",
                             source=host_path)
    if majors is not None:
        allowed = majors.get(driver)
        if not allowed:
            raise DiscoveryError(f"no {driver!r} character major in {PROC_DEVICES}: the "
                                 "driver that owns this node is not loaded", source=host_path)
        if node.major not in allowed:
            raise DiscoveryError(
                f"major {node.major} is not the {driver!r} major "
                f"({', '.join(str(m) for m in sorted(allowed))}) in {PROC_DEVICES}",
                source=host_path)
    if minor is not None and node.minor != minor:
        raise DiscoveryError(f"minor {node.minor} is not the expected {minor}",
                             source=host_path)
    return node
