"""Discovery: every discoverer run once, merged into one Inventory.

Owns: discover(root, config) (the orchestrator), assemble(results) (its pure merge
step) and host_root(root_dir, config). Imports
nri_accel.config, nri_accel.inventory, nri_accel.log, nri_accel.discover.{base,
hostroot} and nri_accel.vendors (each family's discover()); only
nri_accel.discover.nvml, the NVIDIA family's adapter, touches pynvml.

Each registered family discovers in the registry's order: the native ones (nvidia,
neuron, ...) first, the generic CDI family (static devices, then CDI specs) last. A
family never stops the others: one that raises is reported as a Problem. Merging:

- A kind found by a native family (nvidia.com/gpu, nvidia.com/mig,
  aws.amazon.com/neuron, ...) is served by it alone: static or CDI devices of that kind
  (for example the spec `nvidia-ctk cdi generate` writes) are ignored, with one Problem
  per spec file or static entry. Where the native family finds nothing (NVML
  missing), CDI devices of that kind are used as they are.
- A qualified name found twice keeps the first (static before CDI: the operator's own
  config wins over vendor files); the later one is ignored with a Problem.
- So does any other identity two devices share (nri_accel.inventory
  identity_collisions, the rules that refuse a saved inventory): a UUID a buggy driver
  reports twice, a name in another case or a PCI bus id in another padding in two spec
  files, two devices with one key. The first in this order is kept; the later one is
  ignored with a Problem naming both devices and where each comes from, so the Engine
  never holds two devices with one identity (one device granted twice, a request
  meaning another device than it names).
- A non-native family's driver entry (a CDI spec's own edits) is kept only while one of
  its devices is.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from types import MappingProxyType

from nri_accel.config import Config
from nri_accel.discover.base import Found
from nri_accel.discover.hostroot import HostRoot
from nri_accel.inventory import Device, Driver, Inventory, Problem, identity_collisions
from nri_accel.log import get_logger

log = get_logger(__name__)

CDI_DRIVER_PREFIX = "cdi:"  # the Driver of a CDI spec file's own edits: "cdi:<path>"
STATIC_ORIGIN = "config"  # the origin attribute of a static device


def host_root(root_dir: str | None, config: Config) -> HostRoot:
    """The HostRoot for `--root DIR` (default /) with the configured driver root."""
    return HostRoot.at(root_dir or "/", driver_root=config.discovery.driver_root)


def discover(root: HostRoot, config: Config) -> Inventory:
    """Run every discoverer against `root` and merge their findings. Never raises for a
    vendor: what cannot be found is a Problem in the Inventory."""
    from nri_accel.vendors import PROFILES

    started = time.perf_counter()
    results = []
    for profile in PROFILES:
        try:
            found = profile.discover(root, config)
        except Exception as e:  # a discoverer's bug must not hide the other vendors
            log.exception("discoverer_failed", source=profile.name)
            found = Found(problems=(Problem(profile.name, f"discovery failed: "
                                                          f"{type(e).__name__}: {e}"),))
        results.append((profile.name, profile.native, found))
    inventory = assemble(results)
    kinds: dict[str, int] = {}
    for d in inventory.devices:
        kinds[d.kind] = kinds.get(d.kind, 0) + 1
    log.info("discovered", devices=kinds, drivers=list(inventory.drivers),
             problems=len(inventory.problems),
             ms=round((time.perf_counter() - started) * 1000, 1))
    return inventory


def assemble(results: Iterable[tuple[str, bool, Found]]) -> Inventory:
    """Merge the families' results (name, native, found), given in precedence order
    (see the module docstring)."""
    results = list(results)
    native_kind_source: dict[str, str] = {}
    for source, native, found in results:
        if native:
            for d in found.devices:
                native_kind_source.setdefault(d.kind, source)

    devices: list[Device] = []
    wheres: list[str] = []  # what a Problem about devices[i] names
    owner: dict[str, str] = {}
    problems: list[Problem] = []
    drivers: dict[str, Driver] = {}
    optional: set[str] = set()  # drivers of a non-native family: kept only while used
    shadowed: dict[tuple[str, str, str], list[str]] = {}
    for source, is_native, found in results:
        problems += found.problems
        for d in found.devices:
            where = _where(source, d)
            native = native_kind_source.get(d.kind)
            if native is not None and native != source:
                shadowed.setdefault((where, d.kind, native), []).append(d.name)
                continue
            first = owner.get(d.qualified_name)
            if first is not None:
                problems.append(Problem(where, f"{d.qualified_name} is already provided by "
                                               f"{first}; this definition is ignored"))
                continue
            owner[d.qualified_name] = where
            devices.append(d)
            wheres.append(where)
        for drv in found.drivers:
            drivers.setdefault(drv.vendor, drv)
            if not is_native:
                optional.add(drv.vendor)
    for (where, kind, native), names in shadowed.items():
        problems.append(Problem(where, f"{kind} devices are discovered by {native}; the "
                                       f"{len(names)} defined here are ignored"))
    collisions = identity_collisions(devices)
    for c in collisions:
        problems.append(Problem(wheres[c.index], (
            f"{devices[c.index].qualified_name} is ignored: its "
            f"{c.describe(devices, origin=wheres[c.other])}")))
    if collisions:
        dropped = {c.index for c in collisions}
        devices = [d for i, d in enumerate(devices) if i not in dropped]

    used_vendors = {d.vendor for d in devices}
    drivers = {v: drv for v, drv in drivers.items() if v not in optional or v in used_vendors}
    return Inventory(devices=tuple(devices), drivers=MappingProxyType(drivers),
                     problems=tuple(dict.fromkeys(problems)))


def _where(source: str, device: Device) -> str:
    """What a Problem about `device` names: its spec file, its static entry, or its source."""
    from nri_accel.vendors.cdi.static import ORIGIN as STATIC_ORIGIN

    origin = device.attributes.get("origin", "")
    if origin == STATIC_ORIGIN:
        return f"static device {device.qualified_name}"
    return origin or source
