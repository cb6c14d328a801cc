"""Static devices: hardware with no discoverer, declared in the config file.

Owns: discover_static(root, devices) -> Found. Imports nri_accel.config (StaticDevice),
nri_accel.edits (the safety rules), nri_accel.errors, nri_accel.inventory and
nri_accel.discover.{base,hostroot}.

Each `[[static.devices]]` entry becomes one Device (vendor "", attribute origin
"config") whose edits are its device nodes and env. The config gives only host paths;
nri_accel.edits' rules decide which may be emitted (a node under /dev; env that sets
neither LD_PRELOAD nor LD_AUDIT), before anything is read; type, major and minor come
from lstat of each node. An entry with a node that is refused, missing, a symlink or
not a device is left out whole, with a Problem naming it: a device granted without one
of its nodes would fail in the container, later and less clearly. A qualified name
declared twice keeps its first entry.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import MappingProxyType

from nri_accel.config import StaticDevice
from nri_accel.discover.base import Found, host_device_node
from nri_accel.discover.hostroot import HostRoot
from nri_accel.edits import UnsafeEdit, check_env, check_node_path
from nri_accel.errors import DiscoveryError
from nri_accel.inventory import ContainerEdits, Device, DeviceNode, Problem

ORIGIN = "config"


def discover_static(root: HostRoot, devices: Sequence[StaticDevice]) -> Found:
    found: list[Device] = []
    problems: list[Problem] = []
    seen: set[str] = set()
    for entry in devices:
        qualified = f"{entry.kind}={entry.name}"
        if qualified in seen:
            problems.append(Problem(f"static device {qualified}",
                                    "declared more than once in the config; the first is used"))
            continue
        seen.add(qualified)
        nodes: list[DeviceNode] = []
        try:
            for kv in entry.env:
                check_env(kv)
            for path in entry.device_nodes:
                check_node_path(path)
        except UnsafeEdit as e:
            problems.append(Problem(f"static device {qualified}", f"left out: {e}"))
            continue
        try:
            for path in entry.device_nodes:
                nodes.append(host_device_node(root, path))
        except DiscoveryError as e:
            problems.append(Problem(e.source, f"static device {qualified} left out: {e.message}"))
            continue
        found.append(Device(
            kind=entry.kind,
            name=entry.name,
            edits=ContainerEdits(env=entry.env, device_nodes=tuple(nodes)),
            attributes=MappingProxyType({"origin": ORIGIN}),
        ))
    return Found(devices=tuple(found), problems=tuple(problems))
