"""Device health over time: each family's health watch, and what a refresh lost.

Owns: HealthWatches (each family's health watch, Profile.health_monitor, over the
current inventory, reporting every change of a family's unhealthy devices) and
carry_vanished() (a refresh that no longer finds a device keeps it, unhealthy). Imports
the standard library, msgspec, nri_accel.discover.hostroot (types), nri_accel.inventory,
nri_accel.log and nri_accel.vendors. Both daemons use both: `device-plugin` reports
unhealthy devices to kubelet, `run` grants them to no new container
(Inventory.with_health marks them; nri_accel.select refuses them by name).

A device is unhealthy when discovery says so (a Gaudi whose driver status is not
operational, a CDI device whose node is gone, ...), when its family's watch says so
(NVIDIA: critical XIDs, double-bit ECC errors, a GPU off the bus), or when it
disappeared: a device of a native family the last inventory had and a refresh no longer
finds (its node gone, NVML no longer listing it) stays listed, unhealthy, "not found by
the last discovery", until a discovery finds it again, so kubelet sees it Unhealthy
rather than silently less capacity. A part whose whole is still there (a MIG device
after a MIG reconfiguration, a NeuronCore of a present device) was removed on purpose
and is not carried. A watch's marks start over when the
family's devices change (its watch is restarted on the new inventory).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING

from msgspec import structs

from nri_accel.inventory import VANISHED, Device, Inventory
from nri_accel.log import get_logger
from nri_accel.vendors import PROFILES, family_of, parent_of

if TYPE_CHECKING:
    from nri_accel.config import Config
    from nri_accel.discover.hostroot import HostRoot
    from nri_accel.vendors.base import HealthWatch

log = get_logger(__name__)

OnFamilyHealth = Callable[[str, Mapping[str, str]], None]  # family, Device.key -> reason


class HealthWatches:
    """Each family's health watch over the current inventory, reporting
    `on_health(family, unhealthy)` on the loop. update() with each new Inventory
    restarts the watch of a family whose devices changed: the marks of the devices it
    still has carry over (reported first, and unhealthy in the new watch until it
    rechecks them), those of the devices gone are dropped; stop() ends them all."""

    def __init__(self, root: HostRoot, config: Config, on_health: OnFamilyHealth) -> None:
        self._root = root
        self._config = config
        self._on_health = on_health
        self._watches: dict[str, tuple[tuple[str, ...], HealthWatch | None]] = {}
        self._reported: dict[str, Mapping[str, str]] = {}  # family -> its latest map

    async def update(self, inventory: Inventory) -> None:
        for profile in PROFILES:
            keys = tuple(d.key for d in inventory.devices
                         if d.healthy and family_of(d.kind) is profile)
            current = self._watches.get(profile.name)
            if current is not None and current[0] == keys:
                continue
            if current is not None and current[1] is not None:
                await asyncio.to_thread(current[1].stop)
                log.info("health_watch_restarted", family=profile.name,
                         reason="the family's devices changed")
            present = set(keys)
            kept = {k: why for k, why in self._reported.get(profile.name, {}).items()
                    if k in present}
            self._report(profile.name, kept)
            watch = None
            if keys:
                name = profile.name

                def report(unhealthy: Mapping[str, str], name: str = name) -> None:
                    self._report(name, unhealthy)

                watch = profile.health_monitor(self._root, inventory, self._config, report,
                                               kept)
                if watch is not None:
                    watch.start()
            self._watches[profile.name] = (keys, watch)

    def _report(self, family: str, unhealthy: Mapping[str, str]) -> None:
        self._reported[family] = unhealthy
        self._on_health(family, unhealthy)

    async def stop(self) -> None:
        watches = [w for _, w in self._watches.values() if w is not None]
        self._watches.clear()
        await asyncio.gather(*(asyncio.to_thread(w.stop) for w in watches))


def carry_vanished(old: Inventory, new: Inventory) -> Inventory:
    """`new`, plus each device a native family discovered that `old` had and `new` no
    longer has, marked unhealthy (VANISHED), except a part whose whole `new` still has
    and a whole whose parts `new` has (removed on purpose: a MIG reconfiguration, an
    AMD GPU's change of compute partition mode). A carried device whose name a present
    device now has is renamed to its stable id (an index belongs to the device that has
    it now). The CDI family's devices are what spec files and the config describe: one
    whose node is gone is listed unhealthy by its discovery, one whose description is
    gone was removed on purpose."""
    have = {d.key for d in new.devices}
    wholes = {w.key for d in new.devices if (w := parent_of(d, new)) is not None}
    gone = [d for d in old.devices if d.key not in have and _found_by_its_family(d)
            and d.key not in wholes and not _whole_still_there(d, old, have)]
    if not gone:
        return new
    for d in gone:
        if d.healthy:
            log.warning("device_vanished", device=d.key, name=d.qualified_name,
                        effect="kept as Unhealthy until a discovery finds it again")
    # The ids a present device answers to stay its own: a renumbered GPU "1" is the
    # new GPU 1, and the vanished one answers only to what stays true of it.
    taken = {(d.kind, i.lower()) for d in new.devices for i in d.ids}
    carried = tuple(structs.replace(
        d, healthy=False, attributes=MappingProxyType({**d.attributes, "health": VANISHED}),
        name=d.stable_id if (d.kind, d.name.lower()) in taken else d.name,
        aliases=tuple(a for a in d.aliases if (d.kind, a.lower()) not in taken))
        for d in gone)
    return dataclasses.replace(new, devices=new.devices + carried)


def _whole_still_there(device: Device, old: Inventory, have: set[str]) -> bool:
    """Whether `device` is a part whose whole, as `old` knew it (a parent's name is an
    index: the device that has it in the new inventory may be another), is among the
    keys `have`."""
    whole = parent_of(device, old)
    return whole is not None and whole.key in have


def _found_by_its_family(device: Device) -> bool:
    """Discovered by its native family itself (Device.vendor is the family's name), not
    described by a CDI spec or the config (habana.ai/gaudi from a vendor's spec file)."""
    family = family_of(device.kind)
    return family.native and device.vendor == family.name
