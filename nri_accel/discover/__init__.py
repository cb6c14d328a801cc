"""Discovery: every discoverer run once, merged into one Inventory.

Owns: discover(root, config) (the orchestrator), assemble(results) (its pure merge
step), host_root(root_dir, config) and load_or_discover() for the CLI. Imports
nri_accel.config, nri_accel.inventory, nri_accel.log, nri_accel.discover.{base,
hostroot} and the discoverers of this package (nvidia, neuron, static, cdi); only
nri_accel.discover.nvml, the nvidia discoverer's adapter, touches pynvml.

Discoverers run in a fixed order: nvidia, neuron (the native ones), static, cdi. A
discoverer never stops the others: one that raises is reported as a Problem. Merging:

- A kind found by a native discoverer (nvidia.com/gpu, nvidia.com/mig,
  aws.amazon.com/neuron) is served by it alone: static or CDI devices of that kind
  (for example the spec `nvidia-ctk cdi generate` writes) are ignored, with one Problem
  per spec file or static entry. Where the native discoverer finds nothing (NVML
  missing), CDI devices of that kind are used as they are.
- A qualified name found twice keeps the first (static before CDI: the operator's own
  config wins over vendor files); the later one is ignored with a Problem.
- A CDI spec's driver entry is kept only while one of its devices is.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from types import MappingProxyType

from nri_accel.config import Config
from nri_accel.discover.base import Found
from nri_accel.discover.cdi import DRIVER_PREFIX as CDI_DRIVER_PREFIX
from nri_accel.discover.cdi import discover_cdi
from nri_accel.discover.hostroot import HostRoot
from nri_accel.discover.neuron import discover_neuron
from nri_accel.discover.nvidia import discover_nvidia
from nri_accel.discover.static import ORIGIN as STATIC_ORIGIN
from nri_accel.discover.static import discover_static
from nri_accel.inventory import Device, Driver, Inventory, Problem
from nri_accel.log import get_logger

log = get_logger(__name__)

NATIVE_SOURCES = ("nvidia", "neuron")


def host_root(root_dir: str | None, config: Config) -> HostRoot:
    """The HostRoot for `--root DIR` (default /) with the configured driver root."""
    return HostRoot.at(root_dir or "/", driver_root=config.discovery.driver_root)


def discover(root: HostRoot, config: Config) -> Inventory:
    """Run every discoverer against `root` and merge their findings. Never raises for a
    vendor: what cannot be found is a Problem in the Inventory."""
    started = time.perf_counter()
    steps: tuple[tuple[str, Callable[[], Found]], ...] = (
        ("nvidia", lambda: discover_nvidia(root)),
        ("neuron", lambda: discover_neuron(root)),
        ("static", lambda: discover_static(root, config.static_devices)),
        ("cdi", lambda: discover_cdi(root, config.discovery.cdi_spec_dirs)),
    )
    results = []
    for source, step in steps:
        try:
            found = step()
        except Exception as e:  # a discoverer's bug must not hide the other vendors
            log.exception("discoverer_failed", source=source)
            found = Found(problems=(Problem(source, f"discovery failed: "
                                                    f"{type(e).__name__}: {e}"),))
        results.append((source, found))
    inventory = assemble(results)
    kinds: dict[str, int] = {}
    for d in inventory.devices:
        kinds[d.kind] = kinds.get(d.kind, 0) + 1
    log.info("discovered", devices=kinds, drivers=list(inventory.drivers),
             problems=len(inventory.problems),
             ms=round((time.perf_counter() - started) * 1000, 1))
    return inventory


def assemble(results: Iterable[tuple[str, Found]]) -> Inventory:
    """Merge discoverer results, given in precedence order (see the module docstring)."""
    results = list(results)
    native_kind_source: dict[str, str] = {}
    for source, found in results:
        if source in NATIVE_SOURCES:
            for d in found.devices:
                native_kind_source.setdefault(d.kind, source)

    devices: list[Device] = []
    owner: dict[str, str] = {}
    problems: list[Problem] = []
    drivers: dict[str, Driver] = {}
    shadowed: dict[tuple[str, str, str], list[str]] = {}
    for source, found in results:
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
        for drv in found.drivers:
            drivers.setdefault(drv.vendor, drv)
    for (where, kind, native), names in shadowed.items():
        problems.append(Problem(where, f"{kind} devices are discovered by {native}; the "
                                       f"{len(names)} defined here are ignored"))

    used_vendors = {d.vendor for d in devices}
    drivers = {v: drv for v, drv in drivers.items()
               if not v.startswith(CDI_DRIVER_PREFIX) or v in used_vendors}
    return Inventory(devices=tuple(devices), drivers=MappingProxyType(drivers),
                     problems=tuple(dict.fromkeys(problems)))


def _where(source: str, device: Device) -> str:
    """What a Problem about `device` names: its spec file, its static entry, or its source."""
    origin = device.attributes.get("origin", "")
    if origin == STATIC_ORIGIN:
        return f"static device {device.qualified_name}"
    return origin or source


def load_or_discover(inventory_path: str | None, root_dir: str | None,
                     config: Config) -> Inventory:
    """A saved inventory (`--inventory FILE`) or a fresh discovery of `--root DIR` (or /)."""
    if inventory_path:
        inventory = Inventory.load(inventory_path)
        log.info("inventory_loaded", path=inventory_path, devices=len(inventory.devices))
        return inventory
    return discover(host_root(root_dir, config), config)
