"""Readers of the kernel's interfaces that several families share.

Owns: char_major() (a character driver's major in /proc/devices) and pci_numa_node()
(a PCI function's NUMA node in sysfs). Imports the standard library and
nri_accel.discover.hostroot. Each reads one small file through the HostRoot and answers
None when the kernel does not say.
"""

from __future__ import annotations

from nri_accel.discover.hostroot import HostRoot


def char_major(root: HostRoot, driver: str) -> int | None:
    """The major of character driver `driver` ("nvidia-caps", "kfd", "drm") in
    /proc/devices, whose "Character devices:" section lists "<major> <name>" lines."""
    try:
        text = root.read_text("/proc/devices")
    except (OSError, ValueError):
        return None
    in_char = False
    for line in text.splitlines():
        if line.strip().endswith("devices:"):
            in_char = line.strip() == "Character devices:"
            continue
        fields = line.split()
        if in_char and len(fields) == 2 and fields[1] == driver and fields[0].isdigit():
            return int(fields[0])
    return None


def pci_numa_node(root: HostRoot, bus_id: str) -> int | None:
    """/sys/bus/pci/devices/<bus id>/numa_node; None when absent or -1 (no affinity)."""
    if not bus_id:
        return None
    try:
        value = int(root.read_text(root.sys_path(f"bus/pci/devices/{bus_id}/numa_node")))
    except (OSError, ValueError):
        return None
    return value if value >= 0 else None
